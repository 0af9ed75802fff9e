"""Waiting on processes that are not necessarily our children, through pidfds.

A pidfd becomes readable the moment its process terminates, so the agent
learns of a worker's death without a polling interval, whichever launcher
(msrun, torch elastic, our own) is the worker's parent.
"""

from __future__ import annotations

import logging
import os
import select
import time
from collections.abc import Iterable

logger = logging.getLogger(__name__)


class PidWatch:
    """A set of pidfds to wait on, plus a wake-up pipe other threads can poke."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def watch(self, pids: Iterable[int]) -> set[int]:
        """Watch exactly ``pids``; returns the ones already gone (no pidfd could be opened)."""
        wanted = set(pids)
        for pid in list(self._fds):
            if pid not in wanted:
                os.close(self._fds.pop(pid))
        gone = set()
        for pid in wanted - self._fds.keys():
            try:
                self._fds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                gone.add(pid)
        return gone

    def wait(self, timeout: float) -> set[int]:
        """Block until a watched process ends, :meth:`wake` is called, or ``timeout``; the ended pids."""
        by_fd = {fd: pid for pid, fd in self._fds.items()}
        poller = select.poll()
        for fd in (*by_fd, self._wake_r):
            poller.register(fd, select.POLLIN)
        ready = poller.poll(max(0, int(timeout * 1000)))
        ended = {by_fd[fd] for fd, _ in ready if fd in by_fd}
        if any(fd == self._wake_r for fd, _ in ready):
            self._drain()
        return ended

    def wake(self) -> None:
        """Make a concurrent :meth:`wait` return now (safe from signal handlers and other threads)."""
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full, so a wake-up is already pending

    def _drain(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)


def wait_gone(pids: Iterable[int], timeout: float) -> set[int]:
    """Wait until every pid has ended or ``timeout`` passed; returns those still alive."""
    watch = PidWatch()
    try:
        alive = set(pids) - watch.watch(pids)
        deadline = time.monotonic() + timeout
        while alive:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            alive -= watch.wait(remaining)
            watch.watch(alive)
        return alive
    finally:
        watch.close()
