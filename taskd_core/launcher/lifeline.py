"""Workers die with their launcher, however the launcher dies.

A SIGKILLed launcher runs no cleanup, so its workers would be re-parented to
init and keep running, holding their devices. :class:`Lifeline` starts one
tiny guard process per launcher whose stdin is a pipe from the launcher; the
kernel closes that pipe when the launcher's last thread is gone, for any
cause, and the guard then SIGKILLs every worker process group the launcher
had registered with :meth:`Lifeline.adopt`. Each worker leads its own
process group, so whatever it spawned goes with it. Measured in
``tests/launcher/test_lifeline.py``: no worker left 1 s after SIGKILL.

Why not ``PR_SET_PDEATHSIG`` in each exec'd worker: setting it needs code
between fork and exec (``preexec_fn``, unsafe beside gRPC's threads) or an
extra interpreter start per worker; it fires when the *thread* that started
the worker ends, not the launcher; and it reaches the worker but not its
children. :func:`die_with_parent` is still the tool for a process TaskD forks
without exec (a fork server and its children): it has no exec to survive.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import IO, Self

logger = logging.getLogger(__name__)

_GUARD = Path(__file__).with_name("_lifeline_guard.py")
#: ``<linux/prctl.h>``: deliver a signal to this process when its parent thread ends.
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Make the calling process receive ``sig`` when ``parent_pid`` (its parent) ends.

    For processes forked without exec: call it first thing in the child.
    The "parent" is the thread that forked, so fork from a thread that lives
    as long as the child should. If the parent is already gone, ``sig``
    arrives at once.

    :raises OSError: ``prctl`` failed (not Linux).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


class Lifeline:
    """The launcher's end of the guard process; thread-safe. Use as a context manager.

    :meth:`close` (normal exit) lets the guard go without killing anything:
    a launcher that ends in order stops its workers itself.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._guard = subprocess.Popen(
            [sys.executable, "-I", "-S", str(_GUARD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            # Outside the launcher's session: Ctrl-C and group signals are the launcher's to handle.
            start_new_session=True,
        )
        self._pipe: IO[bytes] | None = self._guard.stdin
        logger.debug("lifeline guard started: pid %s", self._guard.pid)

    @property
    def guard_pid(self) -> int:
        return self._guard.pid

    def adopt(self, pid: int) -> None:
        """Kill process group ``pid`` (or process ``pid``) if the launcher dies."""
        self._send(f"+{pid}")

    def release(self, pid: int) -> None:
        """``pid`` is gone: forget it, so a later process reusing the number is never hit."""
        self._send(f"-{pid}")

    def _send(self, line: str) -> None:
        with self._lock:
            if self._pipe is None:
                return
            try:
                self._pipe.write(f"{line}\n".encode())
                self._pipe.flush()
            except (BrokenPipeError, ValueError):
                logger.warning(
                    "lifeline guard (pid %s) is gone: workers will not die with this launcher",
                    self._guard.pid,
                )
                self._pipe = None

    def close(self) -> None:
        """End the guard without killing anything (the launcher stopped its workers)."""
        self._send("q")
        with self._lock:
            if self._pipe is not None:
                self._pipe.close()
                self._pipe = None
        try:
            self._guard.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self._guard.kill()
            self._guard.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
