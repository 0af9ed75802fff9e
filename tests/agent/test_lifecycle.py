"""WorkerLedger: successive monitor views become worker started / exited events."""

from __future__ import annotations

from taskd_core.agent.lifecycle import WorkerLedger
from taskd_core.models import WorkerEvent, WorkerEventKind, WorkerState, WorkerStatus

STARTED, EXITED = WorkerEventKind.STARTED, WorkerEventKind.EXITED


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def running(local: int, pid: int) -> WorkerStatus:
    return WorkerStatus(local, 10 + local, WorkerState.RUNNING, pid)


def exited(local: int, pid: int, code: int) -> WorkerStatus:
    return WorkerStatus(local, 10 + local, WorkerState.EXITED, pid, code)


def test_starts_exits_and_restarts_are_reported_once_each():
    clock = Clock()
    ledger = WorkerLedger(clock)
    assert ledger.update({0: WorkerStatus(0, 10, WorkerState.NOT_STARTED)}) == []
    assert ledger.update({0: running(0, 7), 1: running(1, 8)}) == [
        WorkerEvent(STARTED, 10, 0, 7, 100.0),
        WorkerEvent(STARTED, 11, 1, 8, 100.0),
    ]
    assert ledger.update({0: running(0, 7), 1: running(1, 8)}) == []
    clock.now = 101.0
    assert ledger.update({0: running(0, 7), 1: exited(1, 8, -9)}) == [
        WorkerEvent(EXITED, 11, 1, 8, 101.0, exit_code=-9)
    ]
    assert ledger.update({0: running(0, 7), 1: exited(1, 8, -9)}) == []
    clock.now = 102.0
    assert ledger.update({0: running(0, 7), 1: running(1, 9)}) == [WorkerEvent(STARTED, 11, 1, 9, 102.0)]


def test_a_worker_stopped_on_purpose_ends_when_its_stop_was_asked_for():
    clock = Clock()
    ledger = WorkerLedger(clock)
    ledger.update({0: running(0, 7)})
    clock.now = 105.0
    ledger.stopping([running(0, 7)])
    clock.now = 109.0  # the agent looks again only after the restart: the old pid is already replaced
    assert ledger.update({0: running(0, 12)}) == [
        WorkerEvent(EXITED, 10, 0, 7, 105.0),
        WorkerEvent(STARTED, 10, 0, 12, 109.0),
    ]


def test_an_ended_worker_carries_the_last_step_it_reported():
    steps = {7: 57}
    ledger = WorkerLedger(Clock(), last_step=steps.get)
    ledger.update({0: running(0, 7), 1: running(1, 8)})
    assert ledger.update({0: exited(0, 7, -9), 1: exited(1, 8, 0)}) == [
        WorkerEvent(EXITED, 10, 0, 7, 100.0, exit_code=-9, step=57),
        WorkerEvent(EXITED, 11, 1, 8, 100.0, exit_code=0),  # it never reported a step
    ]
