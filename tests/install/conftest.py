"""Fixtures of the packaging tests: the three distributions built once, and fresh virtualenvs.

``dist`` builds sdists and wheels as users do (``python -m build``: the wheel
from the sdist), from ``checkout``, a copy of the checkout's files; ``wheelhouse`` holds the third-party wheels the fresh
environments need (see :mod:`wheelhouse`); ``fresh_venv(name, *requirements)``
makes a virtualenv without torch or MindSpore and installs into it with pip
and ``--no-index``, so nothing reaches for the network.
"""

from __future__ import annotations

import sys
import tomllib
import venv
from collections.abc import Callable
from pathlib import Path

import pytest
from install_support import PROJECTS, ROOT, FreshVenv, checked, fresh_checkout
from packaging.requirements import Requirement
from wheelhouse import repack, requirement_closure


@pytest.fixture(scope="session")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout's files as a fresh clone has them (see :func:`fresh_checkout`)."""
    return fresh_checkout(tmp_path_factory.mktemp("checkout"))


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory, checkout: Path) -> Path:
    out = tmp_path_factory.mktemp("dist")
    for project in PROJECTS.values():
        # --no-isolation: the build tools are this environment's (test extra), so no index is needed.
        source = checkout / project.relative_to(ROOT)
        checked([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)])
    return out


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheelhouse")
    # The core's own requirements, read from its pyproject.toml so a new one cannot be forgotten here;
    # setuptools too: installing from a checkout builds in an isolated environment that needs it.
    core = tomllib.loads((PROJECTS["taskd-core"] / "pyproject.toml").read_text())["project"]["dependencies"]
    for name in requirement_closure([*(Requirement(r).name for r in core), "setuptools"]):
        repack(name, out)
    return out


@pytest.fixture(scope="session")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory, wheelhouse: Path) -> Callable[..., FreshVenv]:
    def make(name: str, *requirements: str, find_links: tuple[Path, ...] = ()) -> FreshVenv:
        path = tmp_path_factory.mktemp(name)
        venv.create(path, with_pip=False)
        env = FreshVenv(path)
        links = [arg for link in (wheelhouse, *find_links) for arg in ("--find-links", str(link))]
        # This environment's pip installs into the fresh one (--python), so the fresh one needs no pip of its own.
        checked(
            [sys.executable, "-m", "pip", "--python", str(env.bin / "python"), "install", "--quiet",
             "--disable-pip-version-check", "--no-index", *links, *requirements],
            env={**env.env, "PIP_CONSTRAINT": "", "PIP_FIND_LINKS": ""},
        )
        return env

    return make
