"""Local workers, one torch process context per local rank.

torch's ``start_processes`` returns one ``PContext`` for a whole group and
treats it all-or-nothing: its ``close()`` stops every process in it. TaskD
must stop and start single ranks, so :class:`RankProcesses` starts each
local rank in a context of its own, through the same public API
(``start_processes``, ``PContext.wait/pids/close``) torchrun uses.

Log files still follow the user's ``LogsSpecs`` (``--log-dir``,
``--redirects``, ``--tee``): they are laid out once per start of the whole
group, and each rank's context is handed its own slice of that layout.

With a :class:`~taskd_core.forkserver.client.ForkLauncher`, a binary
entrypoint (torchrun's ``python -u script.py``) goes through torch's own
``SubprocessContext`` whose handler forks the worker from the fork server
instead of ``Popen`` (torch's log files, tee threads and prefixes unchanged).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.elastic.multiprocessing import (
    LogsDest,
    LogsSpecs,
    PContext,
    ProcessFailure,
    start_processes,
)
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from taskd_core.errors import ConfigError
from taskd_core.forkserver.client import ForkedProcess, ForkLauncher, start_worker
from taskd_core.forkserver.lifeline import Lifeline
from taskd_core.models import WorkerState
from taskd_pytorch._signals import keep_signal_handlers

logger = logging.getLogger(__name__)

#: The reaping wait after SIGKILL in ``PContext.close`` uses the same timeout
#: as the polite wait; this floor keeps it long enough to reap a killed process.
_MIN_CLOSE_WAIT = 1.0


@dataclass(frozen=True, slots=True)
class Launch:
    """What one local rank runs: torch's entrypoint (binary or function), arguments and environment."""

    entrypoint: str | Callable[..., object]
    args: tuple[object, ...]
    env: Mapping[str, str]
    #: prefix of the rank's tee'd log lines (torch's default is ``[<role><local_rank>]:``).
    log_prefix: str


@dataclass(frozen=True, slots=True)
class RankState:
    """One local rank's process as seen last."""

    state: WorkerState
    pid: int | None = None
    exit_code: int | None = None
    #: torch's failure record (error file, timestamp) when the rank failed.
    failure: ProcessFailure | None = field(default=None, compare=False)


class _OneRankLogs(LogsSpecs):
    """A ``LogsSpecs`` that hands one rank's slice of an already laid out ``LogsDest`` to its context."""

    def __init__(self, dest: LogsDest, local_rank: int, root_log_dir: str) -> None:
        super().__init__(log_dir=root_log_dir)
        self._dest = dest
        self._rank = local_rank

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        def one(paths: Mapping[int, str]) -> dict[int, str]:
            return {0: paths[self._rank]} if self._rank in paths else {}

        return LogsDest(
            stdouts=one(self._dest.stdouts),
            stderrs=one(self._dest.stderrs),
            tee_stdouts=one(self._dest.tee_stdouts),
            tee_stderrs=one(self._dest.tee_stderrs),
            error_files=one(self._dest.error_files),
        )

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)


class _ForkedHandler(SubprocessHandler):
    """torch's handler of one binary worker, started through the fork launcher instead of ``Popen``."""

    def __init__(self, launcher: ForkLauncher, **kwargs: Any) -> None:
        self._taskd_launcher = launcher  # set first: the base class starts the worker in __init__
        super().__init__(**kwargs)

    def _popen(self, args: tuple[str, ...], env: dict[str, str]) -> Any:
        return start_worker(self._taskd_launcher, args, env, stdout=self._stdout, stderr=self._stderr)


class _ForkingContext(SubprocessContext):
    """torch's ``SubprocessContext`` whose workers start through :class:`_ForkedHandler`."""

    def __init__(self, launcher: ForkLauncher, **kwargs: Any) -> None:
        self._taskd_launcher = launcher
        super().__init__(**kwargs)

    def _start(self) -> None:
        self.subprocess_handlers = {
            rank: _ForkedHandler(
                self._taskd_launcher,
                entrypoint=self.entrypoint,
                args=self.args[rank],
                env=self.envs[rank],
                stdout=self.stdouts[rank],
                stderr=self.stderrs[rank],
                local_rank_id=rank,
                numa_options=self._numa_options,
            )
            for rank in range(self.nprocs)
        }


class RankProcesses:
    """Start, stop and observe local workers rank by rank.

    :param name: the workers' role name (torch's ``PContext`` name).
    :param logs_specs: where worker output goes, as torchrun was told.
    :param start_method: multiprocessing start method for function entrypoints.
    :param lifeline: kills the workers should the launcher die.
    :param launcher: forks Python workers from the node's fork server; None starts them by exec.
    """

    def __init__(
        self,
        name: str,
        logs_specs: LogsSpecs,
        start_method: str = "spawn",
        lifeline: Lifeline | None = None,
        launcher: ForkLauncher | None = None,
    ) -> None:
        self.name = name
        self._lifeline = lifeline
        self._launcher = launcher
        self._logs_specs = logs_specs
        self._start_method = start_method
        self._launches: dict[int, Launch] = {}
        self._dest: LogsDest | None = None
        self._contexts: dict[int, PContext] = {}
        self._pids: dict[int, int] = {}
        self._ended: dict[int, RankState] = {}

    # --- starting ------------------------------------------------------------------

    def start_all(self, launches: Mapping[int, Launch]) -> dict[int, int]:
        """Start every rank of ``launches`` (keys ``0..n-1``) with a fresh log layout; returns pids."""
        if sorted(launches) != list(range(len(launches))):
            raise ConfigError(f"local ranks must be 0..n-1, got {sorted(launches)}")
        self.stop(None, timeout=0.0)
        envs = {rank: dict(launch.env) for rank, launch in launches.items()}
        # reify adds each rank's TORCHELASTIC_ERROR_FILE to envs: keep it in the rank's environment.
        self._dest = self._logs_specs.reify(envs)
        self._launches = {
            rank: Launch(launch.entrypoint, launch.args, envs[rank], launch.log_prefix)
            for rank, launch in launches.items()
        }
        self._ended.clear()
        return self.start(sorted(launches))

    def start(self, local_ranks: Iterable[int]) -> dict[int, int]:
        """Start the given ranks again with the same arguments, environment and log files."""
        ranks = sorted(set(local_ranks))
        unknown = [r for r in ranks if r not in self._launches]
        if unknown:
            raise ConfigError(f"local ranks {unknown} were never started; start the whole group first")
        running = [r for r in ranks if self.status(r).state is WorkerState.RUNNING]
        if running:
            logger.warning("local ranks %s are still running; stopping them before the restart", running)
            self.stop(running, timeout=0.0)
        started: dict[int, int] = {}
        for rank in ranks:
            started[rank] = self._start_one(rank)
        return started

    def _start_one(self, rank: int) -> int:
        launch = self._launches[rank]
        if self._dest is None:
            raise ConfigError("no log layout: start the whole group first")
        what: dict[str, Any] = {
            "name": self.name,
            "entrypoint": launch.entrypoint,
            "args": {0: launch.args},
            "envs": {0: dict(launch.env)},
            "logs_specs": _OneRankLogs(self._dest, rank, self._logs_specs.root_log_dir),
            "log_line_prefixes": {0: launch.log_prefix},
        }
        with keep_signal_handlers():
            if self._launcher is not None and isinstance(launch.entrypoint, str):
                context: PContext = _ForkingContext(self._launcher, **what)
                context.start()
            else:
                context = start_processes(**what, start_method=self._start_method)
        pid = context.pids()[0]
        if self._lifeline is not None:
            self._lifeline.adopt(pid)
        self._contexts[rank] = context
        self._pids[rank] = pid
        self._ended.pop(rank, None)
        forked = isinstance(context, _ForkingContext) and isinstance(
            context.subprocess_handlers[0].proc, ForkedProcess
        )
        logger.info("%s %s local rank %s as pid %s", "forked" if forked else "started", self.name, rank, pid)
        return pid

    # --- stopping ------------------------------------------------------------------

    def stop(
        self, local_ranks: Iterable[int] | None, timeout: float, death_sig: signal.Signals = signal.SIGTERM
    ) -> None:
        """Stop the given ranks (all when None): ``death_sig``, then SIGKILL after ``timeout``; reaps them.

        The contexts are closed side by side, so every worker gets the signal
        at once and they share one deadline.
        """
        wanted = self._contexts.keys() if local_ranks is None else set(local_ranks)
        chosen = {rank: ctx for rank, ctx in self._contexts.items() if rank in wanted}
        if not chosen:
            return
        wait = max(timeout, _MIN_CLOSE_WAIT)
        for rank in chosen:
            logger.info(
                "stopping %s local rank %s (pid %s) with %s",
                self.name,
                rank,
                self._pids[rank],
                death_sig.name,
            )
        for rank in chosen:
            # A stopped worker (SIGSTOP, Ctrl-Z) would hold the polite signal until SIGKILL.
            _continue(self._pids[rank])
        with ThreadPoolExecutor(max_workers=len(chosen), thread_name_prefix="taskd-stop") as pool:
            # list() re-raises the first close() failure here instead of losing it.
            list(pool.map(lambda ctx: ctx.close(death_sig, wait), chosen.values()))
        for rank in chosen:
            self._settle(rank)
        if self._lifeline is not None:
            # What they left outside their groups; once no rank runs, whatever of the job is left.
            self._lifeline.sweep([self._pids[rank] for rank in chosen] if self._contexts else None)

    # --- observing -----------------------------------------------------------------

    def status(self, rank: int) -> RankState:
        """The rank's state now; reaps it if it has ended. Cheap enough to call on every worker event."""
        if rank in self._ended:
            return self._ended[rank]
        if rank not in self._contexts:
            return RankState(WorkerState.NOT_STARTED)
        return self._settle(rank)

    def _settle(self, rank: int) -> RankState:
        context = self._contexts[rank]
        result = context.wait(0)
        if result is None:
            return RankState(WorkerState.RUNNING, self._pids[rank])
        failure = result.failures.get(0)
        ended = RankState(WorkerState.EXITED, self._pids[rank], failure.exitcode if failure else 0, failure)
        del self._contexts[rank]
        self._ended[rank] = ended
        if self._lifeline is not None:
            self._lifeline.release(ended.pid or 0)
        logger.info(
            "%s local rank %s (pid %s) ended with exit code %s", self.name, rank, ended.pid, ended.exit_code
        )
        return ended


def _continue(pid: int) -> None:
    """SIGCONT to the worker's process group (torch starts each worker in a session of its own)."""
    try:
        os.killpg(pid, signal.SIGCONT)
    except (ProcessLookupError, PermissionError):
        pass
