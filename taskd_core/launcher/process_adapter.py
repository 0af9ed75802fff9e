"""The built-in ``process`` adapter: N local copies of one plain command.

It implements the five hooks of :mod:`taskd_core.plugins.hookspecs` over
:mod:`taskd_core.launcher.supervisor`; ``taskd run`` builds one from a
:class:`~taskd_core.launcher.spec.LaunchSpec` and hands it to the node agent.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from taskd_core.errors import ConfigError
from taskd_core.forkserver.client import ForkLauncher
from taskd_core.forkserver.lifeline import Lifeline
from taskd_core.launcher.spec import LaunchSpec
from taskd_core.launcher.supervisor import WorkerProcess, stop_processes
from taskd_core.models import Strategy, WorkerState, WorkerStatus
from taskd_core.plugins import hookimpl

logger = logging.getLogger(__name__)


class ProcessAdapter:
    """Starts, stops and watches the workers of one node as plain subprocesses.

    :param spec: what to launch. ``None`` makes an adapter that can only
        declare its strategies (what ``taskd plugins`` needs); worker control
        hooks then raise :class:`~taskd_core.errors.ConfigError`.
    :param lifeline: kills the workers should the launcher die.
    :param launcher: forks Python workers from a fork server; None starts every worker by exec.
        The adapter does not own it: whoever made it closes it.
    """

    def __init__(
        self,
        spec: LaunchSpec | None = None,
        lifeline: Lifeline | None = None,
        launcher: ForkLauncher | None = None,
    ) -> None:
        self.spec = spec
        self._lifeline = lifeline
        self.launcher = launcher
        self._workers: dict[int, WorkerProcess] = {}
        self._restarts: dict[int, int] = {}
        # Hooks come from the agent's control thread, but monitor may also be
        # called from its watcher thread: one lock keeps the worker table whole.
        self._lock = threading.RLock()

    def _spec(self) -> LaunchSpec:
        if self.spec is None:
            raise ConfigError(
                "the process adapter was created without a LaunchSpec; it cannot control workers"
            )
        return self.spec

    def _check_ranks(self, local_ranks: Sequence[int]) -> None:
        nproc = self._spec().nproc
        bad = [r for r in local_ranks if not 0 <= r < nproc]
        if bad:
            raise ConfigError(f"local ranks {bad} are outside 0..{nproc - 1}")

    def _start(self, local_rank: int) -> None:
        spec = self._spec()
        count = self._restarts[local_rank]
        self._workers[local_rank] = WorkerProcess(
            name=f"rank {spec.global_rank(local_rank)} (local {local_rank})",
            args=spec.command,
            env=spec.worker_env(local_rank, count),
            log_path=spec.log_path(local_rank, count),
            cwd=spec.cwd,
            lifeline=self._lifeline,
            launcher=self.launcher,
        )

    def _sweep(self, stopped: Sequence[WorkerProcess]) -> None:
        """End what the ``stopped`` workers left outside their groups; all of the job's once none runs."""
        if self._lifeline is None:
            return
        if any(worker.alive() for worker in self._workers.values()):
            self._lifeline.sweep([worker.pid for worker in stopped])
        else:
            self._lifeline.sweep()

    @hookimpl
    def taskd_strategies(self) -> list[str]:
        independent = self.spec is not None and self.spec.independent_workers
        # A DDP job's healthy ranks die with a restarted peer's broken collectives,
        # so restarting only the faulty ranks is offered only for independent workers.
        offered = [Strategy.RECOVER_IN_PLACE] if independent else []
        offered += [Strategy.RECOVER, Strategy.DUMP, Strategy.EXIT]
        return [s.value for s in offered]

    @hookimpl
    def taskd_stop_workers(self, local_ranks: Sequence[int] | None, timeout: float) -> bool:
        with self._lock:
            if local_ranks is None:
                targets = list(self._workers.values())
            else:
                self._check_ranks(local_ranks)
                targets = [self._workers[r] for r in local_ranks if r in self._workers]
            stop_processes(targets, timeout)
            self._sweep(targets)
        return True

    @hookimpl
    def taskd_restart_all(self) -> bool:
        with self._lock:
            spec = self._spec()
            stop_processes(list(self._workers.values()), spec.stop_timeout)
            self._sweep(list(self._workers.values()))
            # One counter for the node (torchrun's TORCHELASTIC_RESTART_COUNT): the first start is 0.
            count = max(self._restarts.values()) + 1 if self._restarts else 0
            for local_rank in range(spec.nproc):
                self._restarts[local_rank] = count
                self._start(local_rank)
        return True

    @hookimpl
    def taskd_restart_list(self, local_ranks: Sequence[int]) -> bool:
        with self._lock:
            self._check_ranks(local_ranks)
            leftovers = [self._workers[r] for r in local_ranks if r in self._workers]
            stop_processes(leftovers, self._spec().stop_timeout)
            self._sweep(leftovers)
            for local_rank in local_ranks:
                self._restarts[local_rank] = self._restarts.get(local_rank, -1) + 1
                self._start(local_rank)
        return True

    @hookimpl
    def taskd_monitor(self) -> dict[int, WorkerStatus]:
        with self._lock:
            spec = self._spec()
            out = {}
            for local_rank in range(spec.nproc):
                global_rank = spec.global_rank(local_rank)
                worker = self._workers.get(local_rank)
                if worker is None:
                    out[local_rank] = WorkerStatus(local_rank, global_rank, WorkerState.NOT_STARTED)
                    continue
                code = worker.poll()
                state = WorkerState.RUNNING if code is None else WorkerState.EXITED
                out[local_rank] = WorkerStatus(local_rank, global_rank, state, worker.pid, code)
            return out
