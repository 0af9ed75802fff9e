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
"""

from __future__ import annotations

import logging
import os
import signal as signals
import subprocess
from dataclasses import dataclass
from pathlib import Path

from taskd_core.agent.pidwatch import wait_gone

logger = logging.getLogger(__name__)

_ROLE = b"MS_ROLE=MS_SCHED"
#: Seconds a SIGKILLed process gets to vanish before it counts as stuck.
_KILL_GRACE = 5.0


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


def _signal(pid: int, sig: signals.Signals) -> None:
    logger.info("sending %s to scheduler pid %s", sig.name, pid)
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        logger.info("scheduler pid %s already gone", pid)


class Scheduler:
    """The scheduler of the msrun process ``parent`` (this process unless told otherwise).

    The scheduler is a child of ``parent`` and shares its process group (msrun
    does not give it a session of its own), so it is signalled by pid alone.
    """

    def __init__(self, parent: int | None = None) -> None:
        self.parent = os.getpid() if parent is None else parent
        #: the scheduler this object started, once it replaced msrun's.
        self._own: subprocess.Popen[bytes] | None = None

    def _end(self, pid: int, grace: float, timeout: float) -> None:
        """Let ``pid`` exit on its own for ``grace`` s, then SIGTERM, SIGKILL after ``timeout`` s; reap it."""
        if wait_gone([pid], grace):
            _signal(pid, signals.SIGTERM)
            if wait_gone([pid], timeout):
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
        """Replace the running scheduler by a fresh one with the same command; False when there is none."""
        current = find_scheduler(self.parent)
        if current is None:
            logger.info("no scheduler runs under pid %s; nothing to restart", self.parent)
            return False
        self._end(current.pid, 0.0, timeout)
        # Appending keeps the first scheduler's log, which is where its view of the fault is.
        log = open(current.log_path, "ab") if current.log_path else None  # noqa: SIM115 - handed to the child
        try:
            self._own = subprocess.Popen(
                list(current.argv),
                env=dict(current.env),
                cwd=current.cwd,
                stdout=log if log is not None else subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        finally:
            if log is not None:
                log.close()
        logger.warning("scheduler restarted: pid %s replaces %s", self._own.pid, current.pid)
        return True

    def finish(self, grace: float, timeout: float) -> None:
        """End the scheduler with the job: ``grace`` s to exit by itself, then terminate it."""
        current = find_scheduler(self.parent)
        if current is not None:
            self._end(current.pid, grace, timeout)
        if self._own is not None and self._own.poll() is None:
            self._end(self._own.pid, 0.0, timeout)
