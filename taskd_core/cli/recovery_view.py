"""A job's journal as a picture's contents: worker incarnations per rank, faults, signals, recovery phases.

:func:`build` reads journal entries (docs/events.md) and returns a
:class:`JobTimeline` of plain values; ``taskd timeline`` draws it. Times are
seconds since the job's first entry. Worker starts and ends are the agents'
clocks; everything else is the controller's.

Phases of one recovery cycle, each from the previous mark to the next:

======== ===========================================================
detect   the faulty worker ended → the controller journalled the fault
stop     → every agent stopped the faulty ranks (``stopTrain`` answered)
strategy → the controller chose a strategy (``globalFault`` answered)
restart  → every agent reported the strategy's result
resumed  → the last faulty rank runs again (or resumed, where its worker reports that)
stepping → that rank completed its first step after resuming (where reported)
======== ===========================================================

The time lost by a fault is its worker's end to its rank resuming training, where the
worker reports that (``worker resumed``, :func:`taskd_core.worker.resumed`), else to its
rank's next process start; the steps it lost are the last step its worker reached minus
the step its rank resumed from, where both are reported.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from taskd_core.controller.machine import State
from taskd_core.models import JournalEvent

PHASES = ("detect", "stop", "strategy", "restart", "resumed", "stepping")


@dataclass(frozen=True, slots=True)
class Incarnation:
    rank: int
    pid: int
    start: float
    #: None: still running at the end of the journal.
    end: float | None = None
    exit_code: int | None = None


@dataclass(frozen=True, slots=True)
class Fault:
    rank: int
    #: when the worker ended (or, if no agent said, when the fault was journalled).
    time: float
    fault_type: str
    #: seconds until the rank ran again (see ``back``); None if it never did.
    lost: float | None = None
    #: the faulty worker's exit code, where its agent reported it.
    exit_code: int | None = None
    #: how ``lost`` ends: "resumed" (training resumed, where reported) or "restarted" (a new process).
    back: str = "restarted"
    #: steps redone: the faulty worker's last step minus the step its rank resumed from (where reported).
    steps_lost: int | None = None
    #: seconds from the worker's end to its rank's first step after resuming (where reported).
    stepping: float | None = None


@dataclass(frozen=True, slots=True)
class SlowMark:
    """A rank found slower than its peers (a ``slow-rank`` entry)."""

    rank: int
    time: float
    #: its work per step over its peers' median, and the step it was found at.
    ratio: float
    step: int


@dataclass(frozen=True, slots=True)
class SignalMark:
    time: float
    signal_type: str
    strategy: str = ""


@dataclass(frozen=True, slots=True)
class Phase:
    cycle: int
    name: str
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Cycle:
    number: int
    start: float
    end: float | None
    strategy: str
    outcome: str


@dataclass(frozen=True, slots=True)
class JobTimeline:
    job_id: str
    #: Unix time of the job's first journal entry (x = 0).
    origin: float
    duration: float
    ranks: tuple[int, ...]
    incarnations: tuple[Incarnation, ...]
    faults: tuple[Fault, ...]
    signals: tuple[SignalMark, ...]
    phases: tuple[Phase, ...]
    cycles: tuple[Cycle, ...]
    outcome: str = ""
    slow: tuple[SlowMark, ...] = ()


@dataclass(slots=True)
class _CycleMarks:
    number: int
    fault_at: float
    started: float = 0.0
    stopped: float | None = None
    decided: float | None = None
    strategy: str = ""
    ended: float | None = None
    outcome: str = ""
    ranks: set[int] = field(default_factory=set)


def build(job_id: str, events: Sequence[JournalEvent]) -> JobTimeline:
    """The timeline of ``events`` (one job's journal, oldest first)."""
    if not events:
        return JobTimeline(job_id, 0.0, 0.0, (), (), (), (), (), ())
    origin = min(e.time for e in events)
    open_runs: dict[int, tuple[int, float]] = {}
    runs: list[Incarnation] = []
    fault_marks: list[tuple[int, float, str]] = []
    exits: dict[int, list[_Exit]] = {}
    starts: dict[int, list[float]] = {}
    resumes: dict[int, list[_Mark]] = {}
    steppings: dict[int, list[_Mark]] = {}
    signals: list[SignalMark] = []
    slow: list[SlowMark] = []
    cycles: list[_CycleMarks] = []
    pending_fault: float | None = None
    outcome = ""
    for e in events:
        t, d = e.time - origin, e.detail
        if e.kind == "worker started":
            rank, at = int(d["rank"]), float(d["at"]) - origin
            _close(open_runs, runs, rank, at, None)
            open_runs[rank] = (int(d["pid"]), at)
            starts.setdefault(rank, []).append(at)
        elif e.kind == "worker exited":
            rank, at = int(d["rank"]), float(d["at"]) - origin
            code = d.get("exit_code")
            _close(open_runs, runs, rank, at, code)
            exits.setdefault(rank, []).append(_Exit(at, None if code is None else int(code), _step(d)))
        elif e.kind in ("worker resumed", "worker stepping"):
            reported = resumes if e.kind == "worker resumed" else steppings
            reported.setdefault(int(d["rank"]), []).append(_Mark(float(d["at"]) - origin, _step(d)))
        elif e.kind == "fault":
            for rank, kind in dict(d.get("ranks", {})).items():
                fault_marks.append((int(rank), t, str(kind)))
            if "covered" not in d:
                pending_fault = t if pending_fault is None else pending_fault
        elif e.kind == "cycle started":
            marks = _CycleMarks(e.cycle, pending_fault if pending_fault is not None else t, started=t)
            marks.ranks = {int(r) for r in dict(d.get("faults", {}))}
            cycles.append(marks)
            pending_fault = None
        elif e.kind == "transition" and cycles and d.get("target") == State.WAIT_STRATEGIES.value:
            cycles[-1].stopped = t
        elif e.kind == "strategy chosen" and cycles:
            if cycles[-1].decided is None:
                cycles[-1].decided = t
            cycles[-1].strategy = str(d.get("strategy", ""))
        elif e.kind == "cycle succeeded" and cycles:
            cycles[-1].ended, cycles[-1].outcome = t, "recovered"
        elif e.kind == "job given up":
            outcome = f"given up: {d.get('reason', '')}"
            if cycles and cycles[-1].ended is None:
                cycles[-1].ended, cycles[-1].outcome = t, "given up"
        elif e.kind == "job finished":
            outcome = "finished"
        elif e.kind == "signal":
            signals.append(SignalMark(t, str(d.get("type", "")), str(d.get("strategy", ""))))
        elif e.kind == "slow-rank":
            step = int(d.get("step", 0))
            evidence = d.get("evidence", ())
            slow.extend(SlowMark(int(f["rank"]), t, float(f.get("ratio", 0.0)), step) for f in evidence)
    end = max([e.time - origin for e in events] + [s for _, s in open_runs.values()] + [0.0])
    runs.extend(Incarnation(rank, pid, start) for rank, (pid, start) in open_runs.items())
    faults = tuple(
        _fault(
            rank,
            t,
            kind,
            exits.get(rank, []),
            starts.get(rank, []),
            resumes.get(rank, []),
            steppings.get(rank, []),
        )
        for rank, t, kind in fault_marks
    )
    ranks = sorted({r.rank for r in runs} | {f.rank for f in faults} | {m.rank for m in slow})
    phases = tuple(p for c in cycles for p in _phases(c, faults))
    return JobTimeline(
        job_id=job_id,
        origin=origin,
        duration=end,
        ranks=tuple(ranks),
        incarnations=tuple(sorted(runs, key=lambda r: (r.rank, r.start))),
        faults=faults,
        signals=tuple(signals),
        phases=phases,
        cycles=tuple(
            Cycle(c.number, c.fault_at, c.ended, c.strategy, c.outcome or "in flight") for c in cycles
        ),
        outcome=outcome,
        slow=tuple(slow),
    )


def _close(
    open_runs: dict[int, tuple[int, float]], runs: list[Incarnation], rank: int, at: float, code: int | None
) -> None:
    if rank in open_runs:
        pid, start = open_runs.pop(rank)
        runs.append(Incarnation(rank, pid, start, max(start, at), code))


@dataclass(frozen=True, slots=True)
class _Exit:
    time: float
    code: int | None
    step: int | None


@dataclass(frozen=True, slots=True)
class _Mark:
    time: float
    step: int | None


def _step(detail: Mapping[str, Any]) -> int | None:
    return None if detail.get("step") is None else int(detail["step"])


def _first_after(times: Iterable[float], after: float) -> float | None:
    later = [t for t in times if t >= after]
    return min(later) if later else None


def _first_mark_after(marks: Sequence[_Mark], after: float) -> _Mark | None:
    later = [m for m in marks if m.time >= after]
    return min(later, key=lambda m: m.time) if later else None


def _fault(
    rank: int,
    journalled: float,
    kind: str,
    exits: Sequence[_Exit],
    starts: Sequence[float],
    resumes: Sequence[_Mark],
    steppings: Sequence[_Mark],
) -> Fault:
    # The worker's end precedes the report; take the latest end before it (agents' clocks may
    # lead by a little).
    ended = [e for e in exits if e.time <= journalled + 1.0]
    end = max(ended, key=lambda e: e.time) if ended else _Exit(journalled, None, None)
    resumed = _first_mark_after(resumes, end.time)
    back = resumed.time if resumed is not None else _first_after(starts, end.time)
    stepping = _first_mark_after(steppings, resumed.time) if resumed is not None else None
    lost_steps = None
    if resumed is not None and resumed.step is not None and end.step is not None:
        lost_steps = max(0, end.step - resumed.step)
    return Fault(
        rank,
        end.time,
        kind,
        None if back is None else back - end.time,
        end.code,
        "resumed" if resumed is not None else "restarted",
        lost_steps,
        None if stepping is None else stepping.time - end.time,
    )


def _phases(c: _CycleMarks, faults: Sequence[Fault]) -> list[Phase]:
    mine = [f for f in faults if f.rank in c.ranks and f.time <= c.started]
    back = [f.time + f.lost for f in mine if f.lost is not None]
    stepping = [f.time + f.stepping for f in mine if f.stepping is not None]
    # Each phase runs from its mark to the next one; a missing mark drops the phases around it.
    marks: list[float | None] = [
        min((f.time for f in mine), default=c.fault_at),
        c.fault_at,
        c.stopped,
        c.decided,
        c.ended,
        max(back) if back and c.ended is not None else None,
        max(stepping) if stepping and c.ended is not None else None,
    ]
    phases: list[Phase] = []
    for name, start, stop in zip(PHASES, marks, marks[1:], strict=False):
        if start is not None and stop is not None and stop > start:
            phases.append(Phase(c.number, name, start, stop))
    return phases
