"""The node agent's one decision: which way a view of the node ends the run, in order of precedence."""

from __future__ import annotations

import dataclasses

import pytest

from taskd_core.agent.decision import Ending, Events, Look, Notices, Outcome, View, decide
from taskd_core.agent.hangs import Hang, HangSignal
from taskd_core.models import WorkerState, WorkerStatus

RUNNING = WorkerStatus(0, 0, WorkerState.RUNNING, pid=100)
DONE = WorkerStatus(1, 1, WorkerState.EXITED, pid=101, exit_code=0)
FAILED = WorkerStatus(1, 1, WorkerState.EXITED, pid=101, exit_code=3)
HUNG = Hang(100, 0, 0, HangSignal.STOPPED, "state T", 0.6, 0.5, False, "stack")
#: Everything at once: each notice, a failure and a hang.
EVERYTHING = Notices(stop_signal=15, controller_lost="stream ended", given_up="budget", unreported="code 5")


def view(
    notices: Notices | None = None,
    statuses: tuple[WorkerStatus, ...] = (RUNNING, DONE),
    *,
    recovery: bool = True,
    failed: tuple[WorkerStatus, ...] = (),
    hung: tuple[Hang, ...] = (),
) -> View:
    look = Look(0.0, {s.local_rank: s for s in statuses}, {}, failed=failed, hung=hung)
    return View(recovery, notices or Notices(), look)


def kind(ending: Ending | None) -> Outcome | None:
    return None if ending is None else ending.outcome.kind


def test_running_workers_end_nothing() -> None:
    assert decide(view()) is None
    assert decide(view(Notices(ending=True))) is None


def test_a_stop_signal_wins_over_everything() -> None:
    ending = decide(view(EVERYTHING, (FAILED, RUNNING), recovery=False, failed=(FAILED,), hung=(HUNG,)))
    assert ending is not None
    assert (ending.outcome.kind, ending.outcome.exit_code, ending.stop) == (Outcome.INTERRUPTED, 143, True)
    assert ending.events is Events.DROPPED and ending.farewell == "agent interrupted by signal 15"
    assert decide(view(EVERYTHING)).events is Events.FLUSHED  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("cleared", "expected"),
    [
        (("stop_signal",), Outcome.FAILED),  # the controller is gone: nobody to tell
        (("stop_signal", "controller_lost"), Outcome.GIVEN_UP),
        (("stop_signal", "controller_lost", "given_up"), Outcome.FAILED),  # the fault report it did not take
    ],
)
def test_the_notices_in_order(cleared: tuple[str, ...], expected: Outcome) -> None:
    notices = dataclasses.replace(EVERYTHING, **dict.fromkeys(cleared))
    ending = decide(view(notices, failed=(FAILED,)))
    assert kind(ending) is expected
    assert ending is not None
    if "controller_lost" not in cleared:
        assert ending.farewell is None and ending.events is Events.DROPPED and "controller is gone" in ending.outcome.reason
    elif expected is Outcome.GIVEN_UP:
        # killMaster stopped every worker already; the events up to then are sent, then the farewell.
        assert (ending.stop, ending.events, ending.farewell) == (False, Events.FLUSHED, "the controller gave the job up: budget")
    else:
        assert (ending.stop, ending.farewell) == (True, "code 5")


def test_without_recovery_a_failure_or_a_hang_ends_the_job() -> None:
    failed = decide(view(statuses=(FAILED, RUNNING), recovery=False, failed=(FAILED,), hung=(HUNG,)))
    assert failed is not None and failed.outcome.reason == "ranks [1] failed" and failed.failed == (FAILED,)
    assert failed.kill == () and failed.farewell is None
    hung = decide(view(recovery=False, hung=(HUNG,)))
    assert hung is not None and hung.kill == (HUNG,) and hung.outcome.reason == HUNG.reason
    assert kind(hung) is Outcome.FAILED


def test_with_recovery_failures_and_hangs_are_reported_not_decided() -> None:
    assert decide(view(statuses=(FAILED, RUNNING), failed=(FAILED,), hung=(HUNG,))) is None


def test_every_worker_exiting_0_is_success_unless_the_job_is_being_given_up() -> None:
    ending = decide(view(statuses=(DONE,)))
    assert ending is not None and (ending.outcome.kind, ending.outcome.exit_code) == (Outcome.SUCCEEDED, 0)
    assert (ending.stop, ending.events, ending.farewell) == (False, Events.QUEUED, "every worker exited 0")
    assert decide(view(Notices(ending=True), statuses=(DONE,))) is None
    assert decide(view(statuses=())) is None
