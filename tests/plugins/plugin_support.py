"""Test support: real (unpacked) distributions with entry points of group ``taskd``, laid out on sys.path."""

from __future__ import annotations

import textwrap
from pathlib import Path


def make_dist(root: Path, name: str, module_source: str, entry: str) -> None:
    (root / f"{name}.py").write_text(textwrap.dedent(module_source))
    info = root / f"{name}-1.2.3.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.2.3\n")
    info.joinpath("entry_points.txt").write_text(f"[taskd]\n{entry}\n")


GOOD = """
from taskd_core.plugins import hookimpl
from taskd_core.models import WorkerStatus, WorkerState

class Adapter:
    @hookimpl
    def taskd_strategies(self):
        return ["recover", "exit", "bogus"]

    @hookimpl
    def taskd_monitor(self):
        return {0: WorkerStatus(0, 4, WorkerState.NOT_STARTED)}
"""
