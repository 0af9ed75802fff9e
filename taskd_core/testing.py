"""A small toolkit for tests that start real processes and servers: deadline waits, ports, process checks.

For TaskD's own suite and for adapter authors testing their hooks against real
workers; imported by tests only, never by TaskD itself. It imports nothing heavy
(no torch, no gRPC, not even pytest): a failed wait raises :class:`WaitTimeout`,
an :class:`AssertionError` that pytest reports like a failed ``assert``.

Every wait has a deadline (a generous ceiling, never a claim about speed)::

    from taskd_core.testing import descendants, free_port, wait_gone, wait_until

    port = free_port()
    proc = subprocess.Popen([..., "--port", str(port)])
    wait_until(lambda: log.exists() and "ready" in log.read_text(), "the server to be ready",
               unless=lambda: proc.poll() is not None and f"the server exited {proc.returncode}")
    tree = [proc.pid, *descendants(proc.pid)]
    os.killpg(proc.pid, signal.SIGKILL)
    wait_gone(tree, "the server and its workers")
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

#: Default ceiling of a wait, seconds: generous, for a loaded two-core machine.
DEADLINE = 60.0
#: Seconds between two checks of a wait.
INTERVAL = 0.02


class WaitTimeout(AssertionError, TimeoutError):
    """A wait ended without its condition: the deadline passed, or its ``unless`` check gave a reason."""


def wait_until(
    predicate: Callable[[], T],
    what: str = "condition",
    deadline: float = DEADLINE,
    *,
    interval: float = INTERVAL,
    unless: Callable[[], str | bool | None] | None = None,
    explain: Callable[[], str] | None = None,
) -> T:
    """``predicate()``'s first truthy value, checked every ``interval`` seconds for at most ``deadline``.

    :param what: what is waited for, for the error message.
    :param unless: checked before each try; a non-empty string it returns (say, "the agent ended: ...")
        ends the wait at once with that reason, so a test does not sit out its deadline for a
        process that is already gone.
    :param explain: called once the wait failed; its text (the logs of the processes involved)
        is added to the error.
    :raises WaitTimeout: at the deadline or when ``unless`` gave a reason.
    """
    end = time.monotonic() + deadline
    while True:
        reason = unless() if unless is not None else None
        if not reason:
            value = predicate()
            if value:
                return value
            if time.monotonic() > end:
                reason = f"timed out after {deadline:g}s"
        if reason:
            message = f"waiting for {what}: {reason}"
            raise WaitTimeout(f"{message}\n{explain()}" if explain is not None else message)
        time.sleep(interval)


def wait_for_file(path: Path, deadline: float = 30.0) -> str:
    """The content of ``path`` once it exists and is not blank; :class:`WaitTimeout` after ``deadline``."""

    def content() -> str:
        text = path.read_text() if path.exists() else ""
        return text if text.strip() else ""

    return wait_until(content, str(path), deadline)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (bound to port 0, then released).

    Another process may take it before the caller binds it; where a server can bind port 0
    itself and say which port it got, prefer that.
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (0: state, 1: ppid, 2: pgrp); None when gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()


def process_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its parent counts as gone)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def is_unreaped_child(pid: int) -> bool:
    """Whether ``pid`` is a zombie child of this process (exited but never waited for); reaps it if so."""
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return waited == pid


def _live_processes() -> dict[int, list[str]]:
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (fields := _stat(int(name))) is not None and fields[0] != "Z":
            found[int(name)] = fields
    return found


def process_group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (empty once every member ended)."""
    return sorted(pid for pid, fields in _live_processes().items() if int(fields[2]) == pgid)


def descendants(pid: int) -> list[int]:
    """The live children of ``pid``, their children and so on.

    Read it before killing a tree: once a parent is gone its orphans belong to another.
    """
    children: dict[int, list[int]] = {}
    for child, fields in _live_processes().items():
        children.setdefault(int(fields[1]), []).append(child)
    found: list[int] = []
    todo = list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, ()))
    return sorted(found)


def wait_gone(pids: Iterable[int], what: str = "the processes", deadline: float = DEADLINE) -> None:
    """Wait until none of ``pids`` runs; :class:`WaitTimeout` names those left at the deadline."""
    waiting = list(pids)

    def left() -> list[int]:
        return [pid for pid in waiting if process_running(pid)]

    wait_until(lambda: not left(), f"{what} to end", deadline, explain=lambda: f"still running: {left()}")
