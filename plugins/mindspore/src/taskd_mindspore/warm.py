"""Warm msrun restarts: workers (and the scheduler TaskD restarts) forked from a MindSpore fork server.

Where a MindSpore 2.10 restart's time went, measured on the msrun job of
``bench/mindspore_bench.py`` (2 workers, an AllReduce per step, 2 busy cores):

* ``import mindspore`` in every restarted process: 1.4-3 s, more when the
  scheduler and the workers import at once;
* ``communication.init()``: 3-5 s. A worker learns that the cluster is
  complete only from a heartbeat reply, sent every
  ``MS_RETRY_INTERVAL_LOWER``..``UPPER`` s (3..5); then MindSpore's CPU
  collective library looks up its peers' addresses and sleeps a fixed 3 s for
  each one not published yet, which the worker that registered last always
  pays; on a busy machine a registration with the scheduler is also lost and
  retried after 0.5 s, often many times in a row
  (:mod:`taskd_mindspore.forkhooks` explains both);
* compiling the first step: 0.5-3 s (the script's graph).

What this module removes, under msrun's own bookkeeping:

* the heartbeat interval: :func:`quick_heartbeat` sets both bounds to 1 s in
  msrun's environment (which the scheduler and every worker inherit) when the
  user set neither;
* the imports: :class:`WarmStarts` runs a fork server
  (:class:`~taskd_core.forkserver.ForkLauncher`) that imported ``mindspore``
  once and calls MindSpore's own fork hooks (``fork_utils``) around each fork.
  msrun keeps starting its workers itself (its ``_start_single_worker``: its
  environment, ``RANK_ID``/``DEVICE_ID``, log file opened with "w"); only the
  ``subprocess.Popen`` that msrun's ``_ComputeGraphNode.run`` looks up on its
  module is answered by a fork. msrun stores the forked process as it would a
  ``Popen`` (pid, ``poll()`` with the real exit code, its own session for
  ``killpg``), so ``MONITOR`` and ``KILL_WORKER`` work unchanged; the scheduler
  TaskD starts on a full restart is forked the same way;
* the lost registrations and the 3 s sleep, in forked processes: their
  start-up runs as ``SCHED_BATCH``, and the agent wakes each one's main thread
  at :data:`~taskd_mindspore.forkhooks.WAKE_AFTER` with a signal whose handler
  does nothing, which ends that ``sleep()`` early (one not woken still lasts
  its 3 s, so a slow peer costs no more than before).

The first compiled step stays: MindSpore's compile cache would spare it, but
it is the script's to turn on (docs/warm-restarts.md).

Anything that does not fit (another MindSpore than 2.10, ``--bind_core`` /
``--bind_numa``, ``--sim_level``, a worker command that is not a Python
script, callbacks that are not msrun's, ``TASKD_FORK_SERVER=0``) leaves msrun's
own start in place, said once in the log.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from types import ModuleType
from typing import IO, Any

from taskd_core.errors import ConfigError
from taskd_core.forkserver import ForkLauncher, ForkServerSettings
from taskd_core.forkserver.client import ForkedProcess, PythonCommand
from taskd_mindspore.callbacks import MsrunCallbacks
from taskd_mindspore.forkhooks import WAKE_AFTER, WAKE_SIGNAL, end_batch
from taskd_mindspore.scheduler import SchedulerCommand

logger = logging.getLogger(__name__)

#: The heartbeat bounds MindSpore's workers read (integer seconds; 0 would heartbeat in a busy loop).
HEARTBEAT_ENV = ("MS_RETRY_INTERVAL_LOWER", "MS_RETRY_INTERVAL_UPPER")
#: What :func:`quick_heartbeat` sets both bounds to.
QUICK_HEARTBEAT = "1"
#: What msrun tells a process it is (``MS_SCHED``, ``MS_WORKER``).
ROLE_ENV = "MS_ROLE"
#: ``0`` keeps msrun's own worker starts.
FORK_SERVER_ENV = "TASKD_FORK_SERVER"
#: What the MindSpore fork server imports first (it learns the rest from the workers).
MINDSPORE_PRELOAD = ("mindspore", "mindspore.communication", "mindspore.nn", "mindspore.ops")
#: The hook module with MindSpore's own code around a fork after ``import mindspore`` (and, in the child,
#: the start-up workarounds: :mod:`taskd_mindspore.forkhooks`).
MINDSPORE_FORK_HOOKS = ("taskd_mindspore.forkhooks",)
#: The msrun this is built on (its ``_api`` module's layout and callbacks).
TESTED_MINDSPORE = "2.10."
_API = "mindspore.parallel.cluster.process_entity._api"
_UTILS = "mindspore.parallel.cluster.process_entity._utils"
#: tgkill(2)'s system call number by machine.
_TGKILL = {"x86_64": 234, "aarch64": 131}

Process = subprocess.Popen[bytes] | ForkedProcess


def quick_heartbeat(environ: MutableMapping[str, str]) -> bool:
    """Set both heartbeat bounds to 1 s in ``environ`` unless the user set either; whether it did."""
    chosen = {k: environ[k] for k in HEARTBEAT_ENV if environ.get(k, "").strip()}
    if chosen:
        logger.info("keeping the heartbeat interval the user set: %s", chosen)
        return False
    for key in HEARTBEAT_ENV:
        environ[key] = QUICK_HEARTBEAT
    return True


def process_environment() -> dict[str, str]:
    """This process's environment as ``exec`` passes it on: the C library's, not ``os.environ``.

    ``import mindspore`` sets ``OMP_NUM_THREADS=1`` with ``setenv()``, which
    ``os.environ`` never sees; msrun's ``Popen`` (no ``env``) hands it on.
    """
    import ctypes

    entries = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    found: dict[str, str] = {}
    index = 0
    while (entry := entries[index]) is not None:
        key, sep, value = os.fsdecode(entry).partition("=")
        if sep:
            found.setdefault(key, value)
        index += 1
    return found


def why_not(callbacks: MsrunCallbacks, env: Mapping[str, str]) -> str | None:
    """Why msrun's own worker starts must stay, or None when they can be forked.

    :raises ConfigError: for a ``TASKD_FORK_SERVER`` that is neither 0 nor 1.
    """
    switch = env.get(FORK_SERVER_ENV, "").strip() or "1"
    if switch not in ("0", "1"):
        raise ConfigError(f"{FORK_SERVER_ENV}: {switch!r} is neither 0 (msrun's own starts) nor 1 (forked)")
    if switch == "0":
        return f"{FORK_SERVER_ENV}=0"
    mindspore = sys.modules.get("mindspore")
    version = str(getattr(mindspore, "__version__", "not imported"))
    if not version.startswith(TESTED_MINDSPORE):
        return f"MindSpore {version} is not the {TESTED_MINDSPORE}x these warm starts are built on"
    api, utils = sys.modules.get(_API), sys.modules.get(_UTILS)
    manager = getattr(callbacks.start_worker_list, "__self__", None)
    if api is None or utils is None or type(manager).__module__ != _API:
        return "the callbacks are not those of msrun's process manager"
    if getattr(api, "subprocess", None) is not subprocess or not hasattr(api, "_ComputeGraphNode"):
        return f"{_API} does not start workers with subprocess.Popen as 2.10 does"
    if getattr(manager, "bind_core", False) or getattr(manager, "bind_numa", False):
        return "--bind_core/--bind_numa put a binding prefix before the worker command"
    if getattr(manager, "is_simulation", False):
        return "a simulated job (--sim_level) has no scheduler"
    return None


def worker_command(callbacks: MsrunCallbacks) -> list[str]:
    """The command msrun starts local rank 0 with (the others differ only in environment)."""
    manager = callbacks.start_worker_list.__self__  # type: ignore[attr-defined]
    utils = sys.modules[_UTILS]
    command: list[str] = utils._generate_cmd(manager.cmd, manager.cmd_args, 0, manager.binding_context)
    return command


class _ForkingSubprocess:
    """Stands in for the ``subprocess`` module inside msrun's ``_api``: worker starts are forked.

    A call shaped as ``_ComputeGraphNode.run``'s (``preexec_fn=os.setsid``,
    output to the log file msrun opened) goes to :meth:`WarmStarts.start`;
    every other call (``tail -f`` of a log, ``grep`` of the scheduler log) and
    every other name is the real module's.
    """

    def __init__(self, real: ModuleType, starts: WarmStarts) -> None:
        self._real = real
        self._starts = starts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def Popen(self, args: Sequence[str], **kwargs: Any) -> Process:  # noqa: N802 - subprocess's own name
        if set(kwargs) == {"preexec_fn", "stdout", "stderr"} and kwargs["preexec_fn"] is os.setsid:
            if kwargs["stderr"] == subprocess.STDOUT:
                return self._starts.start(args, process_environment(), stdout=kwargs["stdout"])
        popen: Callable[..., Process] = self._real.Popen
        return popen(args, **kwargs)


class WarmStarts:
    """msrun's worker starts, and TaskD's scheduler starts, forked from one MindSpore fork server.

    :param command: the worker command (for the server's interpreter and flags).
    :param settings: the fork server's settings (default: MindSpore's preload and fork hooks).
    :param api: msrun's ``_api`` module, whose ``subprocess`` is answered; None starts only the
        processes given to :meth:`start` (the scheduler), as tests do.
    """

    def __init__(
        self,
        command: Sequence[str],
        settings: ForkServerSettings | None = None,
        api: ModuleType | None = None,
    ) -> None:
        # Started with what msrun's Popen would hand a worker, so that forked and exec'd ones match, but
        # no role: the server is neither a worker nor a scheduler (one is found by MS_ROLE=MS_SCHED).
        self.launcher = ForkLauncher(
            command,
            settings or ForkServerSettings(preload=MINDSPORE_PRELOAD, hooks=MINDSPORE_FORK_HOOKS),
            env={**process_environment(), ROLE_ENV: ""},
        )
        self._api = api
        self._shim: _ForkingSubprocess | None = None
        self._waker = _Waker()
        if api is not None:
            self._shim = _ForkingSubprocess(api.subprocess, self)
            api.subprocess = self._shim  # type: ignore[attr-defined]

    @classmethod
    def install(cls, callbacks: MsrunCallbacks, env: Mapping[str, str]) -> WarmStarts | None:
        """Fork msrun's worker starts from now on; None (said in the log) when they must stay msrun's."""
        reason = why_not(callbacks, env)
        command = worker_command(callbacks) if reason is None else []
        if reason is None and PythonCommand.parse(command, os.getcwd(), env.get("PATH")) is None:
            reason = f"the worker command {' '.join(command[:2])} is not a Python script"
        if reason is not None:
            logger.warning("msrun starts its workers itself (no fork server): %s", reason)
            return None
        logger.info("msrun's workers start forked from a MindSpore fork server: %s", " ".join(command[:2]))
        return cls(command, api=sys.modules[_API])

    @property
    def server_pid(self) -> int | None:
        server = self.launcher.server
        return server.pid if server is not None and server.usable else None

    def start(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None = None,
        stdout: int | IO[Any] | None = None,
    ) -> Process:
        """Start ``argv`` in a session of its own: forked when the server can, else by exec as msrun does."""
        process = self.launcher.start(argv, env, cwd, stdout=stdout, stderr=subprocess.STDOUT)
        if isinstance(process, ForkedProcess):
            self._waker.wake(process.pid)
        return process

    def start_scheduler(self, command: SchedulerCommand, log: IO[bytes] | None) -> Process:
        """A scheduler started forked (the :class:`~taskd_mindspore.scheduler.Scheduler`'s ``start``)."""
        out = log if log is not None else subprocess.DEVNULL
        return self.start(command.argv, dict(command.env), command.cwd, out)

    def close(self) -> None:
        """msrun's own starts again; the server ends (with any forked process still running)."""
        if self._api is not None and self._shim is not None and self._api.subprocess is self._shim:
            self._api.subprocess = self._shim._real  # type: ignore[attr-defined]
        self._waker.close()
        self.launcher.close()


def _tgkill(pid: int, sig: int) -> None:
    """``sig`` to the main thread of ``pid`` only (``os.kill`` may pick any thread of the process)."""
    import ctypes
    import platform

    number = _TGKILL.get(platform.machine())
    if number is None:
        os.kill(pid, sig)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, pid, pid, sig) != 0 and ctypes.get_errno() != 3:  # ESRCH: already gone
        logger.debug("tgkill(%s) failed: errno %s", pid, ctypes.get_errno())


class _Waker:
    """Wakes each forked process's main thread at :data:`WAKE_AFTER` after its start, from one thread;
    at the last wake-up it also ends the process's ``SCHED_BATCH`` start-up."""

    def __init__(self) -> None:
        #: (when, pid, whether it is the last wake-up of that pid)
        self._due: list[tuple[float, int, bool]] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def wake(self, pid: int) -> None:
        now = time.monotonic()
        with self._cond:
            self._due += [(now + after, pid, after == WAKE_AFTER[-1]) for after in WAKE_AFTER]
            self._due.sort()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="taskd-ms-wake", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if not self._due:
                    self._cond.wait()
                    continue
                at, pid, last = self._due[0]
                left = at - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._due.pop(0)
                _tgkill(pid, WAKE_SIGNAL)
                if last:
                    try:
                        end_batch(pid)
                    except FileNotFoundError:
                        pass  # the process is gone

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(5.0)

