"""msrun's scheduler process: found, replaced on a full restart, and ended with the job.

On the master node msrun starts a *scheduler* (the training script run with
``MS_ROLE=MS_SCHED``; MindSpore's meta server, where workers register and look
up each other's addresses) before it hands its main thread to TaskD. msrun
offers no callback for it, so this module finds it among msrun's children
(the process TaskD runs in) by its ``MS_ROLE`` and reads how it was started
from ``/proc``.

What MindSpore 2.10 (CPU) does with it in recovery mode (``MS_ENABLE_RECOVERY=1``,
which msrun sets once TaskD takes over), measured with the example job:

* the scheduler survives the death of its workers and lets restarted workers
  register again (its log says "The node: 0 have been recovered"), and the
  restarted workers' ``init()`` succeeds;
* but their first collective then times out after 30 s ("Ring ReduceScatter
  wait receiving ... failed", ``AllReduceCPUKernelMod launch failed``): the
  surviving scheduler hands out the dead workers' collective endpoints;
* with a *fresh* scheduler started from the same command line and environment,
  the restarted workers build the cluster, resume from their checkpoints and
  finish, and the scheduler exits on its own when the last worker finalizes.

Hence: a full restart (``recover``) replaces the scheduler before the workers
start again; a restart of single ranks (``recover-in-place``) keeps it, since
the surviving workers stay registered with it; and at the end of the job the
scheduler gets a grace period to exit by itself before it is terminated, so
msrun never leaves it behind.

A replacement is started by the ``start`` function given (the MindSpore fork
server's, :class:`taskd_mindspore.warm.WarmStarts`), else by ``exec``. A
forked scheduler is the fork server's child and its ``/proc`` shows the
server's command and environment, so the command read from msrun's first
scheduler is kept for every later replacement, and the scheduler this object
started is known by its process object, never looked up.
"""

from __future__ import annotations

import logging
import os
import signal as signals
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from taskd_core.agent.pidwatch import wait_gone
from taskd_core.forkserver.client import ForkedProcess

logger = logging.getLogger(__name__)

_ROLE = b"MS_ROLE=MS_SCHED"
#: Seconds a SIGKILLed process gets to vanish before it counts as stuck.
_KILL_GRACE = 5.0
#: Seconds a forked scheduler gets to listen before the workers are started anyway.
_LISTEN_WAIT = 3.0
#: ``st`` of a listening socket in /proc/net/tcp.
_TCP_LISTEN = "0A"


@dataclass(frozen=True, slots=True)
class SchedulerCommand:
    """How a running scheduler was started: enough to start an identical one."""

    pid: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    cwd: str
    #: the file its output goes to (msrun's ``<log_dir>/scheduler.log``), if it is one.
    log_path: str | None


def _read_nul_list(path: Path) -> list[bytes]:
    return [item for item in path.read_bytes().split(b"\0") if item]


def _parent_of(proc: Path) -> int:
    # The command name in field 2 may contain spaces and parentheses; the fields after the last ")" do not.
    fields = proc.joinpath("stat").read_text().rpartition(")")[2].split()
    return int(fields[1])


def find_scheduler(parent: int) -> SchedulerCommand | None:
    """The live scheduler among ``parent``'s children, or None when this node runs none."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if _parent_of(proc) != parent:
                continue
            environ = _read_nul_list(proc / "environ")
            if _ROLE not in environ:
                continue
            argv = tuple(os.fsdecode(a) for a in _read_nul_list(proc / "cmdline"))
            cwd = os.readlink(proc / "cwd")
            out = os.readlink(proc / "fd" / "1")
        except (OSError, ValueError, IndexError):
            # The process ended while we looked, or it is not ours to read.
            continue
        if not argv:
            # A zombie: it already exited and only waits to be reaped.
            continue
        env = tuple(
            (os.fsdecode(k), os.fsdecode(v)) for k, _, v in (item.partition(b"=") for item in environ)
        )
        return SchedulerCommand(int(proc.name), argv, env, cwd, out if out.startswith("/") else None)
    return None


#: A started scheduler: ``Popen`` or a forked process with the same interface.
Started = subprocess.Popen[bytes] | ForkedProcess
#: Starts a scheduler from its command, its output to the file given (None: nowhere).
StartScheduler = Callable[[SchedulerCommand, IO[bytes] | None], Started]


def exec_scheduler(command: SchedulerCommand, log: IO[bytes] | None) -> Started:
    """Start ``command`` by exec, as msrun starts its scheduler (msrun's process group)."""
    return subprocess.Popen(
        list(command.argv),
        env=dict(command.env),
        cwd=command.cwd,
        stdout=log if log is not None else subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )


def listening(port: int) -> bool:
    """Whether a TCP socket of this machine listens on ``port`` (read from /proc, no connection made)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == _TCP_LISTEN and int(fields[1].rpartition(":")[2], 16) == port:
                return True
    return False


def _await_listen(process: Started, command: SchedulerCommand) -> None:
    """Wait (bounded) until a freshly forked scheduler listens: a worker that finds no scheduler retries
    its registration only after 0.5 s. An exec'd one imports MindSpore first, as its workers do."""
    port = dict(command.env).get("MS_SCHED_PORT", "")
    if not isinstance(process, ForkedProcess) or not port.isdigit():
        return
    deadline = time.monotonic() + _LISTEN_WAIT
    while not listening(int(port)) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)


def _signal(pid: int, sig: signals.Signals) -> None:
    logger.info("sending %s to scheduler pid %s", sig.name, pid)
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        logger.info("scheduler pid %s already gone", pid)


class Scheduler:
    """The scheduler of the msrun process ``parent`` (this process unless told otherwise).

    msrun's scheduler is a child of ``parent`` and shares its process group
    (msrun does not give it a session of its own), so it is signalled by pid alone.

    :param start: starts a replacement (default: :func:`exec_scheduler`).
    """

    def __init__(self, parent: int | None = None, start: StartScheduler | None = None) -> None:
        self.parent = os.getpid() if parent is None else parent
        self._start = start or exec_scheduler
        #: the scheduler this object started, once it replaced msrun's.
        self._own: Started | None = None
        #: how msrun started the first one, read once from /proc.
        self._command: SchedulerCommand | None = None

    def _running(self) -> tuple[int, SchedulerCommand] | None:
        """The running scheduler's pid and command: the one started here, else msrun's (until one was)."""
        if self._own is not None:
            if self._own.poll() is None and self._command is not None:
                return self._own.pid, self._command
            return None
        found = find_scheduler(self.parent)
        if found is None:
            return None
        if self._command is None:
            self._command = found
        return found.pid, self._command

    def _end(self, pid: int, grace: float, timeout: float) -> None:
        """Let ``pid`` exit on its own for ``grace`` s, then SIGTERM, SIGKILL after ``timeout`` s; reap it."""
        if wait_gone([pid], grace):
            _signal(pid, signals.SIGTERM)
            if wait_gone([pid], timeout):
                self._kill(pid)
                return
        self._reap(pid)

    def _kill(self, pid: int) -> None:
        _signal(pid, signals.SIGKILL)
        if wait_gone([pid], _KILL_GRACE):
            logger.error("scheduler pid %s survived SIGKILL", pid)
            return
        self._reap(pid)

    def _reap(self, pid: int) -> None:
        if self._own is not None and self._own.pid == pid:
            self._own.wait()
            return
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            # Not our child (another parent was given) or already reaped: nothing left to collect.
            logger.debug("scheduler pid %s was reaped elsewhere", pid)

    def restart(self, timeout: float) -> bool:
        """Replace the running scheduler by a fresh one with the same command; False when there is none.

        One this object started that is gone (it died with the fork server it
        was forked from, say) is started again too; msrun's own only while it runs.
        """
        running = self._running()
        if running is not None:
            pid, command = running
            # It is replaced, not asked to finish: it has nothing to save, and its SIGTERM path takes a while.
            self._kill(pid)
        elif self._own is not None and self._command is not None:
            pid, command = self._own.pid, self._command
            logger.warning("scheduler pid %s ended (exit %s); starting a new one", pid, self._own.poll())
        else:
            logger.info("no scheduler runs under pid %s; nothing to restart", self.parent)
            return False
        # Appending keeps the first scheduler's log, which is where its view of the fault is.
        log = open(command.log_path, "ab") if command.log_path else None  # noqa: SIM115 - handed to the child
        try:
            self._own = self._start(command, log)
        finally:
            if log is not None:
                log.close()
        _await_listen(self._own, command)
        logger.warning("scheduler restarted: pid %s replaces %s", self._own.pid, pid)
        return True

    def finish(self, grace: float, timeout: float) -> None:
        """End the scheduler with the job: ``grace`` s to exit by itself, then terminate it."""
        running = self._running()
        if running is not None:
            self._end(running[0], grace, timeout)
        if self._own is not None and self._own.poll() is None:
            self._end(self._own.pid, 0.0, timeout)
