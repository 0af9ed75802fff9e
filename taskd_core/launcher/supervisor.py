"""Real process control for local workers, modelled on torch elastic's ``PContext``.

Every worker is started with ``subprocess.Popen(start_new_session=True)``: it
leads its own process group, so signalling the group also reaches whatever it
spawned (data loader workers, shell pipelines). Stopping a set of workers is
one escalation with one shared deadline: SIGTERM to every group, wait, SIGKILL
to the groups that still have live members (even when the leader is already
gone: its orphaned children still carry the group id), then reap.

Workers are never forked from the launcher itself (it hosts gRPC, which does
not survive a fork without exec): they are started by ``exec`` (``Popen``) or
forked by the fork server, a separate process
(:mod:`~taskd_core.forkserver.client`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from taskd_core.forkserver.client import ForkedProcess, ForkLauncher, start_worker
from taskd_core.forkserver.lifeline import Lifeline

logger = logging.getLogger(__name__)

#: How often a stop re-checks for live group members while it waits. Leaders
#: are waited for directly; only orphaned grandchildren need this poll.
_GROUP_POLL = 0.05
#: Bound on waiting for a SIGKILLed group to disappear; SIGKILL cannot be
#: caught, so only a process stuck in the kernel (D state) takes longer.
_KILL_GRACE = 10.0


def _group_members(pgid: int) -> list[int] | None:
    """Live (non-zombie) pids of process group ``pgid``, or None when /proc cannot say."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    members = []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:  # the process exited while we looked
            continue
        # The command name may contain spaces and parentheses: parse after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            members.append(int(entry))
    return members


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a live member.

    Zombies do not count: an orphan reparented to an init that is slow to reap
    would otherwise keep a dead group "alive" forever.
    """
    # A group with no process at all, zombies included, is the common case once its
    # leader is reaped; the kernel says so at once, where reading every /proc/PID/stat
    # costs milliseconds per call on a busy node, on the path of every restart.
    try:
        os.killpg(pgid, 0)
        signalable = True
    except ProcessLookupError:
        return False
    except PermissionError:  # macOS answers so for a group of zombies
        signalable = False
    members = _group_members(pgid)
    return signalable if members is None else bool(members)


class WorkerProcess:
    """One worker: a command started in its own session, with its output in a log file.

    :param name: how log lines name this worker (e.g. ``"rank 3"``).
    :param log_path: file that receives stdout and stderr (parents are created);
        ``None`` lets the worker inherit the launcher's streams.
    :param lifeline: kills the worker's group should the launcher die.
    :param launcher: forks Python workers from the job's fork server; None starts by exec.
    """

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        env: Mapping[str, str],
        log_path: Path | None = None,
        cwd: Path | None = None,
        lifeline: Lifeline | None = None,
        launcher: ForkLauncher | None = None,
    ) -> None:
        self.name = name
        self.args = tuple(args)
        self._lifeline = lifeline
        self._log: IO[bytes] | None = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(log_path, "ab")  # noqa: SIM115 - closed when the worker is reaped
        full_env = os.environ.copy()
        full_env.update(env)
        try:
            self._popen: subprocess.Popen[bytes] | ForkedProcess = start_worker(
                launcher,
                self.args,
                full_env,
                cwd=None if cwd is None else str(cwd),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT if self._log is not None else None,
            )
        except BaseException:
            self._close_log()
            raise
        if lifeline is not None:
            lifeline.adopt(self._popen.pid)
        how = "forked" if isinstance(self._popen, ForkedProcess) else "started"
        logger.info("%s %s: pid %s, command %s", how, name, self._popen.pid, " ".join(self.args))

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """Exit code once reaped (negative: killed by that signal), else None."""
        return self._popen.returncode

    def poll(self) -> int | None:
        """Reap the worker if it has exited; its exit code, or None while it runs."""
        code = self._popen.poll()
        if code is not None:
            self._close_log()
        return code

    def wait(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds for the worker to exit; its exit code, or None."""
        try:
            code = self._popen.wait(timeout=max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            return None
        self._close_log()
        return code

    def signal_group(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the worker's whole process group, tolerating a group that is gone."""
        logger.info("sending %s to %s (pid %s, process group)", sig.name, self.name, self.pid)
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            logger.info("%s (pid %s): process group already gone", self.name, self.pid)
        except PermissionError:
            # EPERM on a group whose members are all zombies (macOS does this): nothing left to stop.
            logger.warning("%s (pid %s): not permitted to signal the process group", self.name, self.pid)

    def alive(self) -> bool:
        """Whether the leader runs or any process of its group is still alive."""
        if self.poll() is None or group_alive(self.pid):
            return True
        if self._lifeline is not None:
            self._lifeline.release(self.pid)
            self._lifeline = None
        return False

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def _wait_all(procs: Sequence[WorkerProcess], deadline: float) -> list[WorkerProcess]:
    """Wait until every process group is gone or ``deadline`` passes; the ones still alive."""
    pending = list(procs)
    while pending:
        for proc in pending:
            # Blocking on a leader returns the moment it exits; the group check then covers its orphans.
            proc.wait(deadline - time.monotonic())
        pending = [p for p in pending if p.alive()]
        if not pending or time.monotonic() >= deadline:
            return pending
        time.sleep(min(_GROUP_POLL, max(deadline - time.monotonic(), 0.0)))
    return pending


def stop_processes(procs: Sequence[WorkerProcess], timeout: float) -> None:
    """Stop ``procs`` and everything they spawned: SIGTERM, one deadline, SIGKILL, reap.

    Returns once every leader is reaped and no live process is left in their
    groups, or logs an error naming the ones that outlived SIGKILL's grace.
    """
    live = [p for p in procs if p.alive()]
    if not live:
        return
    for proc in live:
        proc.signal_group(signal.SIGTERM)
    # One deadline for the whole set, so N slow workers cost `timeout`, not N * timeout.
    survivors = _wait_all(live, time.monotonic() + timeout)
    if not survivors:
        return
    # With no grace asked for (a hung rank is killed at once), SIGKILL is the plan, not news.
    level = logging.WARNING if timeout > 0 else logging.INFO
    for proc in survivors:
        logger.log(level, "%s (pid %s) still alive %.1fs after SIGTERM", proc.name, proc.pid, timeout)
        proc.signal_group(signal.SIGKILL)
    stuck = _wait_all(survivors, time.monotonic() + _KILL_GRACE)
    for proc in stuck:
        logger.error("%s (pid %s) survived SIGKILL for %.1fs; left behind", proc.name, proc.pid, _KILL_GRACE)
