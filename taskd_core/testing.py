"""Helpers for tests that start real child processes: deadline waits and process checks.

For TaskD's own suite and for adapter authors testing their hooks against real workers;
imported by tests only, never by TaskD itself.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def process_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def is_unreaped_child(pid: int) -> bool:
    """Whether ``pid`` is a zombie child of this process (exited but never waited for)."""
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return waited == pid


def wait_for_file(path: Path, deadline: float = 30.0) -> str:
    """The content of ``path`` once it exists and is non-empty; fails the test after ``deadline`` seconds."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        time.sleep(0.02)
    raise AssertionError(f"{path} did not appear within {deadline}s")


def wait_until(predicate: Callable[[], T], what: str = "condition", deadline: float = 60.0) -> T:
    """``predicate()`` once it is truthy; fails the test after ``deadline`` seconds."""
    end = time.monotonic() + deadline
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline}s waiting for {what}")
        time.sleep(0.02)
