"""Fixtures of the end-to-end tests: a :class:`Cluster` of ``taskd run`` processes per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import Cluster, cluster_fixture


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """Nodes of one job; every process they started is gone after the test."""
    yield from cluster_fixture(tmp_path, request.node.name.replace("[", "-").rstrip("]"))
