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
resumed  → the last faulty rank runs again (or resumed, where reported)
======== ===========================================================

The time lost by a fault is its worker's end to its rank resuming training, where an adapter
reports that (``worker resumed``), else to its rank's next process start.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from taskd_core.controller.machine import State
from taskd_core.models import JournalEvent

PHASES = ("detect", "stop", "strategy", "restart", "resumed")


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
    exits: dict[int, list[tuple[float, int | None]]] = {}
    starts: dict[int, list[float]] = {}
    resumes: dict[int, list[float]] = {}
    signals: list[SignalMark] = []
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
            exits.setdefault(rank, []).append((at, None if code is None else int(code)))
        elif e.kind == "worker resumed":
            resumes.setdefault(int(d["rank"]), []).append(float(d["at"]) - origin)
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
    end = max([e.time - origin for e in events] + [s for _, s in open_runs.values()] + [0.0])
    runs.extend(Incarnation(rank, pid, start) for rank, (pid, start) in open_runs.items())
    faults = tuple(_fault(rank, t, kind, exits, starts, resumes) for rank, t, kind in fault_marks)
    ranks = sorted({r.rank for r in runs} | {f.rank for f in faults})
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
    )


def _close(
    open_runs: dict[int, tuple[int, float]], runs: list[Incarnation], rank: int, at: float, code: int | None
) -> None:
    if rank in open_runs:
        pid, start = open_runs.pop(rank)
        runs.append(Incarnation(rank, pid, start, max(start, at), code))


def _first_after(times: Iterable[float], after: float) -> float | None:
    later = [t for t in times if t >= after]
    return min(later) if later else None


def _fault(
    rank: int,
    journalled: float,
    kind: str,
    exits: dict[int, list[tuple[float, int | None]]],
    starts: dict[int, list[float]],
    resumes: dict[int, list[float]],
) -> Fault:
    # The worker's end precedes the report; take the latest end before it (agents' clocks may
    # lead by a little).
    ended = [(t, code) for t, code in exits.get(rank, []) if t <= journalled + 1.0]
    at, code = max(ended, key=lambda e: e[0]) if ended else (journalled, None)
    resumed = _first_after(resumes.get(rank, []), at)
    back = resumed if resumed is not None else _first_after(starts.get(rank, []), at)
    how = "resumed" if resumed is not None else "restarted"
    return Fault(rank, at, kind, None if back is None else back - at, code, how)


def _phases(c: _CycleMarks, faults: Sequence[Fault]) -> list[Phase]:
    mine = [f for f in faults if f.rank in c.ranks and f.time <= c.started]
    back = [f.time + f.lost for f in mine if f.lost is not None]
    # Each phase runs from its mark to the next one; a missing mark drops the phases around it.
    marks: list[float | None] = [
        min((f.time for f in mine), default=c.fault_at),
        c.fault_at,
        c.stopped,
        c.decided,
        c.ended,
        max(back) if back and c.ended is not None else None,
    ]
    phases: list[Phase] = []
    for name, start, stop in zip(PHASES, marks, marks[1:], strict=False):
        if start is not None and stop is not None and stop > start:
            phases.append(Phase(c.number, name, start, stop))
    return phases
