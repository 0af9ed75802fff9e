"""Fixtures of the packaging tests: the three distributions built once, and fresh virtualenvs.

``dist`` builds sdists and wheels as users do (``python -m build``: the wheel
from the sdist); ``wheelhouse`` holds the third-party wheels the fresh
environments need (see :mod:`wheelhouse`); ``fresh_venv(name, *requirements)``
makes a virtualenv without torch or MindSpore and installs into it with pip
and ``--no-index``, so nothing reaches for the network.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from collections.abc import Callable
from pathlib import Path

import pytest
from wheelhouse import repack, requirement_closure

ROOT = Path(__file__).resolve().parents[2]
PROJECTS = {"taskd-core": ROOT, "taskd-pytorch": ROOT / "plugins/pytorch", "taskd-mindspore": ROOT / "plugins/mindspore"}
#: Generous: builds and installs on a loaded two-core machine.
STEP_TIMEOUT = 600


def run(argv: list[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT, check=False)


def checked(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    done = run(argv, **kwargs)  # type: ignore[arg-type]
    assert done.returncode == 0, f"{argv} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    for project in PROJECTS.values():
        # --no-isolation: the build tools are this environment's (test extra), so no index is needed.
        checked([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(project)])
    return out


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheelhouse")
    # setuptools too: installing from a checkout builds in an isolated environment that needs it.
    for name in requirement_closure(["grpcio", "grpcio-health-checking", "protobuf", "pluggy", "setuptools"]):
        repack(name, out)
    return out


class FreshVenv:
    """A virtualenv with nothing but what was installed into it, and a way to run its commands."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.bin = path / "bin"
        # The fresh environment's own PATH first, and none of this suite's packages leaking in.
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.env["PATH"] = f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"
        self.env["PYTHONNOUSERSITE"] = "1"

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return run([str(self.bin / argv[0]), *argv[1:]], cwd=self.path, env=self.env)

    def python(self, code: str) -> subprocess.CompletedProcess[str]:
        return self.run("python", "-c", code)


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
