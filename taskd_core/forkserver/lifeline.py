"""Workers die with their launcher, however the launcher dies.

A SIGKILLed launcher runs no cleanup, so its workers would be re-parented to
init and keep running, holding their devices. :class:`Lifeline` starts one
tiny guard process per launcher whose stdin is a pipe from the launcher; the
kernel closes that pipe when the launcher's last thread is gone, for any
cause, and the guard then SIGKILLs every worker process group the launcher
had registered with :meth:`Lifeline.adopt`. Each worker leads its own
process group, so whatever it spawned goes with it. Measured in
``tests/forkserver/test_lifeline.py``: no worker left 1 s after SIGKILL.

Why not ``PR_SET_PDEATHSIG`` in each exec'd worker: setting it needs code
between fork and exec (``preexec_fn``, unsafe beside gRPC's threads) or an
extra interpreter start per worker; it fires when the *thread* that started
the worker ends, not the launcher; and it reaches the worker but not its
children. A process TaskD forks without exec (a fork server's worker) sets
PR_SET_PDEATHSIG itself (``taskd_core.forkserver._server``): it has no exec to survive.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import IO, Self

logger = logging.getLogger(__name__)

_GUARD = Path(__file__).with_name("_lifeline_guard.py")


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
