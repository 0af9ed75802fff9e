"""Test support of the packaging tests: the three projects, commands with a deadline, fresh virtualenvs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECTS = {"taskd-core": ROOT, "taskd-pytorch": ROOT / "plugins/pytorch", "taskd-mindspore": ROOT / "plugins/mindspore"}
#: Generous: builds and installs on a loaded two-core machine.
STEP_TIMEOUT = 600


def run(argv: list[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT, check=False)


def fresh_checkout(target: Path) -> Path:
    """A copy of this checkout's files (tracked and new, links kept as links), as a fresh clone has them.

    Installing from it leaves no build directories in the working tree and
    sees none left there by earlier builds.
    """
    listed = checked(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]).stdout
    for name in filter(None, listed.split("\0")):
        source, copy = ROOT / name, target / name
        if source.is_symlink() or source.is_file():
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy, follow_symlinks=False)
    return target


def checked(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    done = run(argv, **kwargs)  # type: ignore[arg-type]
    assert done.returncode == 0, f"{argv} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


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
