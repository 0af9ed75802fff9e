"""How a node agent's run ends: one ordered decision over one view of the node.

Each pass of the agent's loop (:meth:`~taskd_core.agent.node_agent.NodeAgent.run`:
monitor → decide → report → wait, the shape of torch elastic's
``SimpleElasticAgent._invoke_run``) starts with a :class:`View`: the
:class:`Notices` the agent's other threads left (a stop signal, the controller
gone or giving the job up, a fault report it did not take) and one
:class:`Look` at the workers. :func:`decide` runs the checks of :data:`CHECKS`
on it in order; the first that finds an end says how the run ends
(:class:`Ending`). No end: the agent reports what it saw and waits.

The order is the precedence. A stop signal ends the run whatever else
happened; a controller that is gone can neither give the job up nor hear a
fault; a fault report the controller did not take ends the job before any new
failure is looked at; without recovery a failure or a hang ends it; and a job
is finished only when nothing else applies. A new way to end is one more
check in :data:`CHECKS` (with one more field of :class:`Notices` when another
thread brings the news), never a flag the loop tests.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from taskd_core.agent.hangs import Hang
from taskd_core.models import WorkerStatus


class Outcome(str, enum.Enum):
    SUCCEEDED = "succeeded"
    GIVEN_UP = "given-up"
    INTERRUPTED = "interrupted"
    #: recovery was impossible here (controller unreachable, recovery off and a worker failed).
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class AgentOutcome:
    """How the agent's run ended, and the exit code a launcher should use."""

    kind: Outcome
    exit_code: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Notices:
    """What the agent's other threads have said, read once per pass so one decision sees one set.

    Each is written by one thread: the launcher's stop signal, the signal
    stream (the controller's killMaster, dump or exit, or its loss), the
    report thread (a fault report refused).
    """

    #: the stop signal the launcher passed on.
    stop_signal: int | None = None
    #: why the signal stream ended for good: the controller cannot be reached any more.
    controller_lost: str | None = None
    #: why the controller gave the job up (its killMaster).
    given_up: str | None = None
    #: why the agent must end the job itself: a fault report the controller did not take.
    unreported: str | None = None
    #: the controller chose dump or exit: workers ending now, even with 0, are not a finished job.
    ending: bool = False


@dataclass(frozen=True, slots=True)
class Look:
    """What one look at the node's workers found (the monitor step)."""

    #: when, on the monotonic clock.
    at: float
    statuses: Mapping[int, WorkerStatus]
    #: local rank -> the cycle that last started it (0: the first start).
    started: Mapping[int, int]
    #: workers whose failure is news: not stopped on purpose, not reported yet.
    failed: tuple[WorkerStatus, ...] = ()
    #: the controller lost the cycle a report was for: ``failed`` holds every stopped worker,
    #: reported again at once, so a new cycle restarts them.
    resync: bool = False
    #: hangs declared since the last look whose worker still runs and is not being stopped.
    hung: tuple[Hang, ...] = ()

    @property
    def finished(self) -> bool:
        """Every worker exited 0."""
        return bool(self.statuses) and all(s.succeeded for s in self.statuses.values())


@dataclass(frozen=True, slots=True)
class View:
    """One pass's view of the node: what :func:`decide` reads."""

    #: the controller recovers this job (False: recovery is off, a failed worker ends the job).
    recovery: bool
    notices: Notices
    look: Look


class Events(str, enum.Enum):
    """What becomes of the worker events not reported yet when the run ends."""

    #: not sent: recovery is off, or nobody is left to take them.
    DROPPED = "dropped"
    #: sent behind the reports still queued, as during the run (the workers ended on their own).
    QUEUED = "queued"
    #: sent at once, with the ends of the workers the agent stops as it ends.
    FLUSHED = "flushed"


@dataclass(frozen=True, slots=True)
class Ending:
    """How the run ends: its outcome, and what the agent does with its workers and the controller first."""

    outcome: AgentOutcome
    #: stop every worker; False when none is left to stop (they ended, or killMaster stopped them).
    stop: bool = True
    #: hung workers killed at once before the rest are stopped: a stopped process ignores SIGTERM.
    kill: tuple[Hang, ...] = ()
    #: failed workers whose failure ends the run, logged with their exit codes.
    failed: tuple[WorkerStatus, ...] = ()
    events: Events = Events.DROPPED
    #: what the agent tells the controller as it ends (with the outcome's exit code); None: nothing.
    farewell: str | None = None


#: One check: the run's end it finds in a view, or None.
Check = Callable[[View], Ending | None]


def interrupted(view: View) -> Ending | None:
    """A stop signal came: every worker is stopped, whatever else happened."""
    signum = view.notices.stop_signal
    if signum is None:
        return None
    return Ending(
        AgentOutcome(Outcome.INTERRUPTED, 128 + signum, f"signal {signum}"),
        events=Events.FLUSHED if view.recovery else Events.DROPPED,
        farewell=f"agent interrupted by signal {signum}",
    )


def controller_gone(view: View) -> Ending | None:
    """The controller cannot be reached any more: nobody is left to recover the job, or to tell."""
    lost = view.notices.controller_lost
    if lost is None:
        return None
    return Ending(
        AgentOutcome(
            Outcome.FAILED,
            1,
            f"the job's controller is gone ({lost}); when the node hosting it was lost, the job cannot "
            "recover: start it again",
        )
    )


def given_up(view: View) -> Ending | None:
    """The controller gave the job up; its killMaster stopped every worker already."""
    if view.notices.given_up is None:
        return None
    reason = f"the controller gave the job up: {view.notices.given_up}"
    return Ending(
        AgentOutcome(Outcome.GIVEN_UP, 1, reason), stop=False, events=Events.FLUSHED, farewell=reason
    )


def fault_unreported(view: View) -> Ending | None:
    """The controller did not take a fault report: without it the job cannot recover, so it ends here."""
    reason = view.notices.unreported
    if reason is None:
        return None
    return Ending(AgentOutcome(Outcome.FAILED, 1, reason), farewell=reason)


def failed_without_recovery(view: View) -> Ending | None:
    """Recovery is off and a worker failed."""
    failed = view.look.failed
    if view.recovery or not failed:
        return None
    ranks = [s.global_rank for s in failed]
    return Ending(AgentOutcome(Outcome.FAILED, 1, f"ranks {ranks} failed"), failed=failed)


def hung_without_recovery(view: View) -> Ending | None:
    """Recovery is off and a worker hangs: it is killed at once, the rest stopped."""
    hung = view.look.hung
    if view.recovery or not hung:
        return None
    return Ending(AgentOutcome(Outcome.FAILED, 1, hung[0].reason), kill=hung)


def succeeded(view: View) -> Ending | None:
    """Every worker exited 0.

    Not after the controller chose dump or exit: the workers may end with 0
    then, but the job is being given up, and the agent waits for killMaster.
    """
    if view.notices.ending or not view.look.finished:
        return None
    return Ending(
        AgentOutcome(Outcome.SUCCEEDED, 0), stop=False, events=Events.QUEUED, farewell="every worker exited 0"
    )


#: Every way a run ends, in order of precedence.
CHECKS: tuple[Check, ...] = (
    interrupted,
    controller_gone,
    given_up,
    fault_unreported,
    failed_without_recovery,
    hung_without_recovery,
    succeeded,
)


def decide(view: View) -> Ending | None:
    """How the run ends, if ``view`` ends it: the first of :data:`CHECKS` that finds an end."""
    for check in CHECKS:
        ending = check(view)
        if ending is not None:
            return ending
    return None
