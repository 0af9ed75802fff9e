"""How far each worker's training got: the step it resumed from, the last step it reached.

The progress watcher (:mod:`taskd_core.agent.hangs.watcher`) feeds :class:`StepTracker`
with the ``resumed N`` and ``step N`` datagrams of :mod:`taskd_core.worker`;
the tracker turns them into ``resumed`` and ``stepping`` (first step done after
resuming) :class:`~taskd_core.models.WorkerEvent` values for the controller's
journal, and keeps each worker's last step for its ``exited`` event. From these
the controller counts the steps a fault cost and the time from a worker's
death to its rank resuming; ``taskd timeline`` draws the resumed and stepping
phases of a recovery.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container
from dataclasses import dataclass

from taskd_core.models import WorkerEvent, WorkerEventKind
from taskd_core.worker import MAX_STEP

#: The worker datagrams this module reads (``OP STEP``).
STEP_OPS = frozenset({"step", "resumed"})


@dataclass(frozen=True, slots=True)
class WorkerId:
    """A tracked worker process as the agent knows it."""

    pid: int
    local_rank: int
    global_rank: int


def parse_step(text: str) -> int | None:
    """The step count of a datagram, or None when it is not one."""
    if not text.isdigit() or len(text) > 19:
        return None
    value = int(text)
    return value if value <= MAX_STEP else None


class StepTracker:
    """Steps per worker pid; not thread-safe (the watcher calls it with its lock held).

    :param wall: the agent's wall clock; events are dated on it, like the ledger's.
    :param monotonic: the clock workers stamp their datagrams with.
    """

    def __init__(
        self, wall: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self._wall = wall
        self._monotonic = monotonic
        self._last: dict[int, int] = {}
        #: pids that resumed and have not completed a step since.
        self._resuming: set[int] = set()
        self._events: list[WorkerEvent] = []

    def record(self, who: WorkerId, op: str, text: str, sent: float) -> None:
        """A ``resumed`` or ``step`` datagram of ``who`` stamped ``sent`` (monotonic); others are ignored."""
        step = parse_step(text)
        if step is None or op not in STEP_OPS:
            return
        self._last[who.pid] = step
        if op == "resumed":
            self._resuming.add(who.pid)
            self._event(WorkerEventKind.RESUMED, who, step, sent)
        elif who.pid in self._resuming:
            self._resuming.discard(who.pid)
            self._event(WorkerEventKind.STEPPING, who, step, sent)

    def _event(self, kind: WorkerEventKind, who: WorkerId, step: int, sent: float) -> None:
        at = self._wall() - max(0.0, self._monotonic() - sent)
        self._events.append(WorkerEvent(kind, who.global_rank, who.local_rank, who.pid, at, step=step))

    def last_step(self, pid: int) -> int | None:
        """The last step worker ``pid`` reported (resumed from, or reached), if any."""
        return self._last.get(pid)

    def keep(self, pids: Container[int]) -> None:
        """Forget the workers not in ``pids`` (ended, and their end already in the ledger)."""
        for pid in [p for p in self._last if p not in pids]:
            del self._last[pid]
            self._resuming.discard(pid)

    @property
    def pending(self) -> bool:
        """Events wait to be taken."""
        return bool(self._events)

    def take_events(self) -> list[WorkerEvent]:
        """The ``resumed`` / ``stepping`` events since the last call, oldest first."""
        events, self._events = self._events, []
        return events
