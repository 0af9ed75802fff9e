"""The action → hook mapping for live recovery, against a recording adapter (no workers needed)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from taskd_core.agent.config import DispatchConfig
from taskd_core.agent.dispatcher import ActionDispatcher
from taskd_core.models import (
    EXTRA_RECOVER_LIVE,
    Action,
    Code,
    FaultRank,
    Signal,
    SignalType,
    WorkerState,
    WorkerStatus,
)
from taskd_core.plugins import hookimpl, load_adapter


class LiveAdapter:
    """Two local workers (global ranks 2 and 3); records every hook call in order."""

    def __init__(self, joins: bool = True, live: bool = True) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.joins = joins
        self.live = live
        self.workers = {
            0: WorkerStatus(0, 2, WorkerState.RUNNING, 100),
            1: WorkerStatus(1, 3, WorkerState.EXITED, 101, -9),
        }

    @hookimpl
    def taskd_strategies(self) -> list[str]:
        return ["recover-live", "recover", "exit"] if self.live else ["recover", "exit"]

    @hookimpl
    def taskd_stop_workers(self, local_ranks: Sequence[int] | None, timeout: float) -> bool:
        self.calls.append(("stop", local_ranks))
        return True

    @hookimpl
    def taskd_restart_all(self) -> bool:
        self.calls.append(("restart_all",))
        return True

    @hookimpl
    def taskd_restart_list(self, local_ranks: Sequence[int]) -> bool:
        self.calls.append(("restart_list", tuple(local_ranks)))
        for r in local_ranks:
            self.workers[r] = WorkerStatus(r, r + 2, WorkerState.RUNNING, self.workers[r].pid + 100)
        return True

    @hookimpl
    def taskd_begin_round(self, round_no: int) -> bool:
        self.calls.append(("begin_round", round_no))
        return True

    @hookimpl
    def taskd_await_round(self, round_no: int, timeout: float) -> bool:
        self.calls.append(("await_round", round_no, timeout))
        return self.joins

    @hookimpl
    def taskd_monitor(self) -> dict[int, WorkerStatus]:
        return dict(self.workers)


class Reports:
    def __init__(self) -> None:
        self.statuses: list[tuple[int, str, str]] = []

    def report_stop_complete(self, code: int, msg: str, fault_ranks: Mapping[int, int]) -> int:
        return 0

    def report_recover_strategy(self, fault_ranks: Mapping[int, int], strategy_list: Iterable[str]) -> int:
        return 0

    def report_recover_status(self, code: int, msg: str, fault_ranks: Mapping[int, int], strategy: str) -> int:
        self.statuses.append((code, msg, strategy))
        return 0


def live_signal(cycle: int = 4) -> Signal:
    return Signal(
        SignalType.CHANGE_STRATEGY,
        actions=(Action.CHANGE_STRATEGY, Action.FAULT_NODES_RESTART),
        fault_ranks=(FaultRank(3),),
        change_strategy="recover",
        extra_params=EXTRA_RECOVER_LIVE,
        cycle=cycle,
    )


def test_recover_live_announces_the_cycle_as_round_then_replaces_only_the_faulty_rank() -> None:
    adapter, reports = LiveAdapter(), Reports()
    dispatcher = ActionDispatcher(load_adapter("live", instance=adapter), reports, DispatchConfig(live_timeout=7.0))

    dispatcher.handle(live_signal())

    assert adapter.calls == [("begin_round", 4), ("stop", (1,)), ("restart_list", (1,)), ("await_round", 4, 7.0)]
    assert [(code, strategy) for code, _, strategy in reports.statuses] == [(Code.OK, "recover")]


def test_workers_that_do_not_join_in_time_fail_the_strategy_without_a_full_restart() -> None:
    adapter, reports = LiveAdapter(joins=False), Reports()
    dispatcher = ActionDispatcher(load_adapter("live", instance=adapter), reports, DispatchConfig(live_timeout=7.0))

    dispatcher.handle(live_signal())

    ((code, msg, _),) = reports.statuses
    assert code == Code.RECOVERABLE_RETRY_ERROR and "did not all join live round 4" in msg
    assert ("restart_all",) not in adapter.calls


def test_a_controller_without_cycle_numbers_cannot_drive_live_recovery() -> None:
    adapter, reports = LiveAdapter(), Reports()
    dispatcher = ActionDispatcher(load_adapter("live", instance=adapter), reports)

    dispatcher.handle(live_signal(cycle=0))

    ((code, msg, _),) = reports.statuses
    assert code == Code.UNRECOVERABLE_RETRY_ERROR and "cycle number" in msg
    assert adapter.calls == []


def stop_train(cycle: int = 4) -> Signal:
    return Signal(SignalType.STOP_TRAIN, actions=(Action.STOP_TRAIN,), fault_ranks=(FaultRank(3),), cycle=cycle)


def test_a_dead_live_worker_is_replaced_early_and_kept_through_stop_train_and_recover_live() -> None:
    adapter, reports = LiveAdapter(), Reports()
    dispatcher = ActionDispatcher(load_adapter("live", instance=adapter), reports, DispatchConfig(live_timeout=7.0))

    dispatcher.start_early([adapter.workers[1]])
    dispatcher.handle(stop_train())
    dispatcher.handle(live_signal())

    assert adapter.calls == [("restart_list", (1,)), ("begin_round", 4), ("await_round", 4, 7.0)]
    assert adapter.workers[1].pid == 201  # the early replacement joined the round
    assert dispatcher.started_cycles() == {1: 4}  # its own fault would be one of cycle 4's workers
    ((code, msg, _),) = reports.statuses
    assert code == Code.OK and "early: [1]" in msg


def test_an_early_replacement_is_restarted_with_the_rest_by_any_other_strategy() -> None:
    adapter, reports = LiveAdapter(), Reports()
    dispatcher = ActionDispatcher(load_adapter("live", instance=adapter), reports, DispatchConfig(live_timeout=7.0))
    dispatcher.start_early([adapter.workers[1]])

    dispatcher.handle(
        Signal(SignalType.CHANGE_STRATEGY, actions=(Action.CHANGE_STRATEGY,), fault_ranks=(FaultRank(3),),
               change_strategy="recover", cycle=4)
    )
    dispatcher.handle(live_signal(cycle=5))  # a later live cycle replaces the rank again

    assert adapter.calls == [("restart_list", (1,)), ("stop", None), ("restart_all",), ("begin_round", 5),
                             ("stop", (1,)), ("restart_list", (1,)), ("await_round", 5, 7.0)]


def test_a_node_whose_workers_are_not_all_live_starts_nothing_early() -> None:
    adapter, reports = LiveAdapter(live=False), Reports()
    dispatcher = ActionDispatcher(load_adapter("live", instance=adapter), reports)

    dispatcher.start_early([adapter.workers[1]])

    assert adapter.calls == []
