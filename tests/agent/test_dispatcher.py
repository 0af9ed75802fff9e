"""The action dispatcher carries an action out under the agent's lock and reports without it."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping

import pytest

from taskd_core.agent.dispatcher import ActionDispatcher
from taskd_core.launcher.process_adapter import ProcessAdapter
from taskd_core.launcher.spec import LaunchSpec
from taskd_core.models import Action, FaultRank, FaultType, Signal, SignalType, WorkerState
from taskd_core.plugins import load_adapter


class SlowReporter:
    """A controller that does not answer: each report waits until released."""

    def __init__(self) -> None:
        self.reporting = threading.Event()
        self.release = threading.Event()
        self.stops: list[int] = []

    def report_stop_complete(self, code: int, msg: str, fault_ranks: Mapping[int, int]) -> int:
        self.stops.append(code)
        self.reporting.set()
        self.release.wait(120)
        return 0

    def report_recover_strategy(self, fault_ranks: Mapping[int, int], strategy_list: Iterable[str]) -> int:
        return 0

    def report_recover_status(self, code: int, msg: str, fault_ranks: Mapping[int, int], strategy: str) -> int:
        return 0


@pytest.fixture
def adapter() -> Iterator[ProcessAdapter]:
    spec = LaunchSpec(command=(sys.executable, "-c", "import time; time.sleep(120)"), nproc=2, stop_timeout=5.0)
    workers = ProcessAdapter(spec)
    workers.taskd_restart_all()
    yield workers
    workers.taskd_stop_workers(None, 5.0)


def test_the_lock_is_free_while_a_report_waits(adapter: ProcessAdapter) -> None:
    """stopTrain stops rank 1 under the lock; while its report hangs, the agent can still take the lock."""
    reporter, lock = SlowReporter(), threading.RLock()
    dispatcher = ActionDispatcher(load_adapter("process", instance=adapter), reporter, lock=lock)
    stop = Signal(
        signal_type=SignalType.STOP_TRAIN.value, job_id="default", actions=(Action.STOP_TRAIN.value,),
        fault_ranks=(FaultRank(1, FaultType.NORMAL),),
    )
    handler = threading.Thread(target=dispatcher.handle, args=(stop,), daemon=True)
    handler.start()
    try:
        assert reporter.reporting.wait(60)
        assert lock.acquire(timeout=60), "the dispatcher held the agent's lock while reporting"
        lock.release()
        states = {rank: s.state for rank, s in adapter.taskd_monitor().items()}
        assert states == {0: WorkerState.RUNNING, 1: WorkerState.EXITED}
    finally:
        reporter.release.set()
        handler.join(timeout=60)
    assert reporter.stops == [0]


class Reporter(SlowReporter):
    """A controller that answers every report at once."""

    def report_stop_complete(self, code: int, msg: str, fault_ranks: Mapping[int, int]) -> int:
        return 0


def change_strategy(strategy: str, cycle: int, extra: str = "") -> Signal:
    return Signal(
        signal_type=SignalType.CHANGE_STRATEGY.value, job_id="default", actions=(Action.CHANGE_STRATEGY.value,),
        fault_ranks=(FaultRank(1, FaultType.NORMAL),), change_strategy=strategy, extra_params=extra, cycle=cycle,
    )


def test_each_rank_remembers_the_cycle_that_last_started_it(adapter: ProcessAdapter) -> None:
    """The agent sends it with a fault, so the controller can tell a replaced incarnation's end from a new fault."""
    sent: list[str] = []

    def send(report: Callable[[], int]) -> int:
        sent.append("report")
        return report()

    dispatcher = ActionDispatcher(load_adapter("process", instance=adapter), Reporter(), send=send)
    assert dispatcher.started_cycles() == {}
    dispatcher.handle(change_strategy("recover", 3))
    assert dispatcher.started_cycles() == {0: 3, 1: 3}
    dispatcher.handle(change_strategy("recover", 4, extra="recover-in-place"))
    assert dispatcher.started_cycles() == {0: 3, 1: 4}
    assert sent == ["report", "report"]
