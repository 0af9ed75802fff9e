"""The one mapping from controller actions to adapter hooks.

============================  ==================================================
signal / action               what the node does, then reports
============================  ==================================================
``stop_train``                stop the faulty ranks of this node
                              → ``ReportStopComplete``
``on_global_rank``            → ``ReportRecoverStrategy`` with the adapter's strategies
``change_strategy`` recover   stop all, restart all → ``ReportRecoverStatus``
recover + resize:...          the job shrank: stop all, take the new node rank
                              (``on_resize``), restart all → ``ReportRecoverStatus``
recover + recover-in-place    restart only this node's faulty ranks → ``ReportRecoverStatus``
recover + recover-live        announce the new round to the running workers,
                              restart this node's faulty ranks (but those started
                              early, see below), wait until every local worker
                              joined the round → ``ReportRecoverStatus``
``change_strategy`` dump      dump signal to every worker, wait the grace period,
                              stop all → ``ReportRecoverStatus``
``change_strategy`` exit      stop all (the controller does not wait for a report)
``killMaster``                stop all; the job is given up
============================  ==================================================

``stop_train`` stops only the faulty ranks because the strategy is not known
yet: with ``recover-in-place`` and ``recover-live`` the healthy workers must
keep running.
When every local worker uses the live API, the agent starts a dead worker's
replacement as soon as it sees the death (:meth:`ActionDispatcher.start_early`),
while the controller still collects the cycle's faults and negotiates: the
replacement waits for the next round, which ``recover-live`` then announces.
``stop_train`` and ``recover-live`` leave such a replacement running; any other
strategy stops it with the rest.
``fault_nodes_exit`` / ``fault_nodes_restart`` only describe the decision that
``change_strategy`` carries, so they need no action of their own.
Adapters never see any of this; they only implement the hooks.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from taskd_core.agent.config import DispatchConfig
from taskd_core.agent.pidwatch import wait_gone
from taskd_core.errors import WorkerControlError
from taskd_core.models import Action, Code, Resize, Signal, SignalType, Strategy, WorkerState, WorkerStatus
from taskd_core.plugins.registry import Adapter
from taskd_core.rpc.convert import fault_dict

logger = logging.getLogger(__name__)

#: A report to send once the lock is released; returns the controller's code.
Report = Callable[[], int]


class Reporter(Protocol):
    """The reports an action is answered with (implemented by ``DLRecoverManager``)."""

    def report_stop_complete(self, code: int, msg: str, fault_ranks: Mapping[int, int]) -> int: ...

    def report_recover_strategy(
        self, fault_ranks: Mapping[int, int], strategy_list: Iterable[str]
    ) -> int: ...

    def report_recover_status(
        self, code: int, msg: str, fault_ranks: Mapping[int, int], strategy: str
    ) -> int: ...


class ActionDispatcher:
    """Carries out signals on one node's workers through its adapter.

    :param on_stopping: told which workers are about to be stopped on
        purpose, so the agent does not report their deaths as faults.
    :param lock: serialises hook calls with the agent's own monitoring.
    :param send: sends one report and returns the controller's code; the agent
        passes its report thread, so an action's report never overtakes a fault
        report queued before it.
    :param on_resize: tells the adapter (and the agent's own identity) this node's place in the
        job's new set of nodes, before the restart that uses it.
    """

    def __init__(
        self,
        adapter: Adapter,
        reporter: Reporter,
        config: DispatchConfig | None = None,
        *,
        on_stopping: Callable[[Iterable[WorkerStatus]], None] | None = None,
        lock: threading.RLock | None = None,
        send: Callable[[Report], int] | None = None,
        on_resize: Callable[[Resize], None] | None = None,
    ) -> None:
        self.adapter = adapter
        self.reporter = reporter
        self._send = send or (lambda report: report())
        self.config = config or DispatchConfig()
        self._on_stopping = on_stopping or (lambda statuses: None)
        self._on_resize = on_resize
        self._lock = lock or threading.RLock()
        self.given_up = threading.Event()
        #: the agent is done with its workers: later signals must not start any.
        self.closed = threading.Event()
        #: the controller chose dump or exit: workers ending now, even with 0, are not a finished job.
        self.ending = threading.Event()
        #: the controller did not take a cycle report (it lost the cycle): the agent reports its
        #: stopped workers as faults again, so a new cycle restarts them instead of nothing happening.
        self.refused = threading.Event()
        #: why the controller gave the job up (its killMaster's extraParams).
        self.give_up_reason = ""
        #: local rank -> the cycle whose strategy last started it (absent: the first start, 0).
        self._started_in: dict[int, int] = {}
        #: replacements started before the controller chose live recovery: {local rank: pid}.
        self._early: dict[int, int] = {}

    def handle(self, signal: Signal) -> None:
        """Carry out ``signal``'s actions under the lock, then send their reports without it.

        A report may retry an unreachable controller for a long time; holding
        the lock meanwhile would stop the agent from watching its workers.
        """
        reports: list[Report] = []
        with self._lock:
            if self.closed.is_set():
                logger.info("agent is ending: %s not carried out", signal.signal_type)
                return
            if signal.signal_type == SignalType.KILL_MASTER:
                self.give_up_reason = signal.extra_params or "no reason given"
                logger.warning(
                    "controller gave the job up (killMaster: %s): stopping every worker", self.give_up_reason
                )
                self.ending.set()
                self._stop_quietly(None)
                self.given_up.set()
                return
            # Order kept, duplicates dropped (the reference's set() lost the order).
            for action in dict.fromkeys(signal.actions):
                if action == Action.STOP_TRAIN:
                    reports.append(self._stop_train(signal))
                elif action == Action.ON_GLOBAL_RANK:
                    reports.append(self._on_global_rank(signal))
                elif action == Action.CHANGE_STRATEGY:
                    reports.extend(self._change_strategy(signal))
                else:
                    logger.debug("action %r needs no work of its own on this node", action)
        for report in reports:
            self._taken(self._send(report))

    def started_cycles(self) -> dict[int, int]:
        """Local rank -> the cycle that last started it (0: the first start); call under the lock."""
        return dict(self._started_in)

    def _started(self, local_ranks: Iterable[int], cycle: int) -> None:
        self._started_in.update(dict.fromkeys(local_ranks, cycle))

    # --- rank bookkeeping -------------------------------------------------------

    def _local_faulty(
        self, signal: Signal, statuses: Mapping[int, WorkerStatus], *, early: bool = True
    ) -> list[int]:
        """This node's faulty local ranks; without ``early``, not those replaced early that still run."""
        faulty = {f.rank for f in signal.fault_ranks}
        return sorted(
            s.local_rank
            for s in statuses.values()
            if s.global_rank in faulty and (early or s.pid is None or self._early.get(s.local_rank) != s.pid)
        )

    def start_early(self, dead: Sequence[WorkerStatus]) -> None:
        """Start ``dead`` workers' replacements now, if every local worker uses the live API.

        They wait for the round the controller's ``recover-live`` announces, so
        their start-up overlaps the controller's flush window and negotiation.
        """
        with self._lock:
            if self.closed.is_set() or self.ending.is_set():
                return
            try:
                if Strategy.RECOVER_LIVE not in self.adapter.strategies():
                    return
                local = sorted(s.local_rank for s in dead)
                self.adapter.restart_list(local)
                statuses = self.adapter.monitor()
            except WorkerControlError:
                logger.exception("starting replacements early failed; the chosen strategy starts them")
                return
            started = {r: statuses[r].pid for r in local if r in statuses}
            self._early.update({r: pid for r, pid in started.items() if pid is not None})
            logger.info("started local ranks %s again early, pids %s", local, started)

    def drop_early(self) -> None:
        """Stop replacements started early (the controller lost the cycle they were started for)."""
        with self._lock:
            early, self._early = self._early, {}
            if early:
                self._stop_quietly(sorted(early))

    def close(self) -> None:
        """Stop every worker and carry out no signal from now on (the agent ends)."""
        with self._lock:
            self.closed.set()
            self.stop(None)

    def stop(self, local_ranks: Sequence[int] | None) -> None:
        """Stop workers on purpose (all when ``local_ranks`` is None)."""
        statuses = self.adapter.monitor()
        chosen = (
            statuses.values() if local_ranks is None else [statuses[r] for r in local_ranks if r in statuses]
        )
        self._on_stopping(chosen)
        self.adapter.stop(local_ranks, self.config.stop_timeout)

    def _stop_quietly(self, local_ranks: Sequence[int] | None) -> None:
        try:
            self.stop(local_ranks)
        except WorkerControlError:
            logger.exception("stopping workers failed")

    # --- actions ---------------------------------------------------------------------

    def _stop_train(self, signal: Signal) -> Report:
        faults = fault_dict(signal.fault_ranks)
        try:
            local = self._local_faulty(signal, self.adapter.monitor(), early=False)
            if local:
                self.stop(local)
            code, msg = Code.OK, f"stopped local ranks {local}"
        except WorkerControlError as exc:
            code, msg = Code.CLIENT_ERROR, str(exc)
        return functools.partial(self.reporter.report_stop_complete, code, msg, faults)

    def _on_global_rank(self, signal: Signal) -> Report:
        try:
            strategies = [s.value for s in self.adapter.strategies()]
        except WorkerControlError:
            logger.exception("adapter could not declare its strategies; offering exit only")
            strategies = [Strategy.EXIT.value]
        return functools.partial(
            self.reporter.report_recover_strategy, fault_dict(signal.fault_ranks), strategies
        )

    def _change_strategy(self, signal: Signal) -> list[Report]:
        """Carry out the chosen strategy; the report to send (none for exit: the controller does not wait)."""
        try:
            return self._carry_out(signal)
        finally:
            # Only the strategy of the cycle they were started for may keep them.
            self._early.clear()

    def _carry_out(self, signal: Signal) -> list[Report]:
        strategy = signal.strategy
        faults = fault_dict(signal.fault_ranks)
        if strategy in (Strategy.DUMP, Strategy.EXIT):
            self.ending.set()
        if strategy is Strategy.EXIT:
            self._stop_quietly(None)
            return []
        try:
            if strategy is Strategy.RECOVER:
                self.stop(None)
                resize = Resize.parse(signal.extra_params)
                if resize is not None:
                    if self._on_resize is None:
                        raise WorkerControlError(
                            self.adapter.name, "change the job's nodes", "not supported here"
                        )
                    self._on_resize(resize)
                self.adapter.restart_all()
                self._started(self.adapter.monitor(), signal.cycle)
                code, msg = Code.OK, "restarted every local worker"
            elif strategy is Strategy.RECOVER_IN_PLACE:
                local = self._local_faulty(signal, self.adapter.monitor())
                if local:
                    self.stop(local)
                    self.adapter.restart_list(local)
                    self._started(local, signal.cycle)
                code, msg = Code.OK, f"restarted local ranks {local}"
            elif strategy is Strategy.RECOVER_LIVE:
                code, msg = self._recover_live(signal)
            elif strategy is Strategy.DUMP:
                code, msg = self._dump()
            else:
                code, msg = (
                    Code.UNRECOVERABLE_RETRY_ERROR,
                    f"strategy {signal.change_strategy!r} is not supported here",
                )
        except WorkerControlError as exc:
            logger.error("%s failed: %s", signal.change_strategy, exc)
            code, msg = Code.CLIENT_ERROR, str(exc)
        # Reported as the controller named it: recover-in-place travels as "recover".
        return [
            functools.partial(self.reporter.report_recover_status, code, msg, faults, signal.change_strategy)
        ]

    def _recover_live(self, signal: Signal) -> tuple[Code, str]:
        # The round is the controller's cycle, the one number every agent of the job shares.
        if signal.cycle <= 0:
            return (
                Code.UNRECOVERABLE_RETRY_ERROR,
                "recover-live needs the cycle number a TaskD controller sends",
            )
        self.adapter.begin_round(signal.cycle)
        local = self._local_faulty(signal, self.adapter.monitor(), early=False)
        if local:
            self.stop(local)
            self.adapter.restart_list(local)
        # Those started early belong to this cycle as much as those started now.
        self._started([*local, *self._early], signal.cycle)
        if not self.adapter.await_round(signal.cycle, self.config.live_timeout):
            return (
                Code.RECOVERABLE_RETRY_ERROR,
                f"local workers did not all join live round {signal.cycle} "
                f"within {self.config.live_timeout}s",
            )
        return (
            Code.OK,
            f"live round {signal.cycle}: replaced local ranks {local} (early: {sorted(self._early)}), "
            "every local worker joined",
        )

    def _taken(self, code: int) -> None:
        if code != Code.OK:
            self.refused.set()

    def _dump(self) -> tuple[Code, str]:
        statuses = self.adapter.monitor()
        running = [s for s in statuses.values() if s.state is WorkerState.RUNNING and s.pid]
        pids = {s.local_rank: s.pid for s in running if s.pid is not None}
        self._on_stopping(running)
        for worker in running:
            logger.info(
                "asking rank %s (pid %s) to save: %s",
                worker.global_rank,
                worker.pid,
                self.config.dump_signal.name,
            )
            try:
                os.kill(pids[worker.local_rank], self.config.dump_signal)
            except ProcessLookupError:
                logger.info("rank %s (pid %s) already gone", worker.global_rank, worker.pid)
        late = wait_gone(pids.values(), self.config.dump_grace)
        self.stop(None)
        after = self.adapter.monitor()
        saved = [s.global_rank for s in after.values() if s.local_rank in pids and s.succeeded]
        if late or len(saved) != len(running):
            return (
                Code.DUMP_ERROR,
                f"saved ranks {sorted(saved)}; {len(late)} worker(s) did not finish "
                f"within {self.config.dump_grace}s",
            )
        return Code.OK, f"saved ranks {sorted(saved)}"
