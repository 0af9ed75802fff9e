"""What CI relies on: the frameworks are installed (a missing one fails, never skips) and the
checks of scripts/checks.sh catch what they are configured to catch."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.mark.parametrize(("dist", "version"), [("torch", "2.13.0"), ("mindspore", "2.10.0")])
def test_the_real_frameworks_are_installed(dist: str, version: str) -> None:
    """scripts/env.sh installs both; without them the slow tests would prove nothing."""
    assert metadata.version(dist).split("+")[0] == version


def test_ruff_catches_bugbear_and_long_lines(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f(seen: list[int] = []) -> list[int]:\n"
        f"    return seen  # {'x' * 100}\n"
    )
    done = subprocess.run(
        [BIN / "ruff", "check", "--config", ROOT / "pyproject.toml", "--output-format", "concise", bad],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1
    assert "B006" in done.stdout and "E501" in done.stdout


def test_mypy_is_strict(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f(x):\n    return x\n")
    done = subprocess.run(
        [BIN / "mypy", "--config-file", ROOT / "pyproject.toml", "--no-incremental", bad],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 1
    assert "Function is missing a type annotation" in done.stdout
