"""Fixtures of the mindspore adapter's tests; the msrun-like manager itself is in :mod:`ms_support`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from ms_support import FakeMsrun


@pytest.fixture
def msrun_like(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeMsrun]:
    """A fresh msrun-like process manager; every process it or the adapter started is gone afterwards."""
    # The adapter exports the restart counter in this process, as it does in msrun's; undo it afterwards.
    monkeypatch.setenv("TASKD_RESTART_COUNT", "unset")
    fake = FakeMsrun(tmp_path)
    try:
        yield fake
    finally:
        fake.close()
