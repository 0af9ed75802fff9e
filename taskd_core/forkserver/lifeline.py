"""Workers die with their launcher, however the launcher dies.

A SIGKILLed launcher runs no cleanup, so its workers would be re-parented to
init and keep running, holding their devices. :class:`Lifeline` starts one
tiny guard process per launcher whose stdin is a pipe from the launcher; the
kernel closes that pipe when the launcher's last thread is gone, for any
cause, and the guard then SIGKILLs every worker process group the launcher
had registered with :meth:`Lifeline.adopt`, then every process of the job's
:class:`~taskd_core.forkserver.jobscope.JobScope` (its cgroup, its environment
marker: what left the groups with ``setsid()``), and removes the launcher's
temporary directories (:mod:`taskd_core.scratch`). Measured in
``tests/forkserver/test_lifeline.py``: no worker left 1 s after SIGKILL.

While the launcher lives, :meth:`Lifeline.sweep` ends what stopped workers left
outside their groups, and :meth:`Lifeline.close` (the job's end) whatever of the
job still runs.

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
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from taskd_core.forkserver import _wire as wire
from taskd_core.forkserver.jobscope import JobScope
from taskd_core.scratch import scratch_pattern

logger = logging.getLogger(__name__)

_GUARD = Path(__file__).with_name("_lifeline_guard.py")


class Lifeline:
    """The launcher's end of the guard process, and the job's scope; thread-safe. Use as a context manager.

    Making one marks every process this launcher starts afterwards as the job's
    (:meth:`JobScope.install`); :meth:`close` (normal exit) ends what of the job still
    runs and lets the guard go: a launcher that ends in order stopped its workers itself.

    :param cgroup: track the job in a cgroup where the machine allows one; False tracks it by the
        environment marker alone.
    """

    def __init__(self, cgroup: bool = True) -> None:
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
        # After the guard started: it is not the job's.
        self.scope = JobScope(wire.SCOPE_CGROUP_ENV, cgroup)
        self.scope.install()
        self._send(f"m{self.scope.token}")
        if self.scope.cgroup is not None:
            self._send(f"c{self.scope.cgroup}")
        scratch = scratch_pattern()
        if scratch is not None:
            self._send(f"t{scratch}")

    @property
    def guard_pid(self) -> int:
        return self._guard.pid

    def adopt(self, pid: int) -> None:
        """Kill process group ``pid`` (or process ``pid``) if the launcher dies; track what it starts."""
        self.scope.enter(pid)
        self._send(f"+{pid}")

    def sweep(self, pids: Iterable[int] | None = None) -> list[int]:
        """End what stopped workers ``pids`` (all of the job's when None) left outside their groups."""
        return self.scope.sweep(pids)

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
        """End what of the job still runs, then the guard, which kills nothing more."""
        self.scope.close()
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
