"""Worker incarnations as events: what started, what ended, when, with which exit code.

The agent's monitor hook only says what each local worker is *now*;
:class:`WorkerLedger` compares successive views and turns the differences
into :class:`~taskd_core.models.WorkerEvent` values, which the agent reports
to the controller's journal (timelines and metrics are drawn from it).
A worker stopped on purpose ends when its stop was asked for: the agent only
looks again once the restart is done, which would put the end after the new start.
An ended worker's event carries the last step it reported (:mod:`taskd_core.agent.hangs.steps`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from taskd_core.models import WorkerEvent, WorkerEventKind, WorkerState, WorkerStatus


@dataclass(slots=True)
class _Incarnation:
    pid: int
    global_rank: int
    ended: bool = False


class WorkerLedger:
    """The known incarnation of each local worker; not thread-safe (the agent holds its lock)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        last_step: Callable[[int], int | None] = lambda pid: None,
    ) -> None:
        self._clock = clock
        self._last_step = last_step
        self._known: dict[int, _Incarnation] = {}
        #: pid -> when the agent asked it to stop.
        self._stopping: dict[int, float] = {}

    def stopping(self, statuses: Iterable[WorkerStatus]) -> None:
        """Workers about to be stopped on purpose: their end is dated now."""
        now = self._clock()
        for s in statuses:
            if s.pid is not None and s.state is WorkerState.RUNNING:
                self._stopping.setdefault(s.pid, now)

    def update(self, statuses: Mapping[int, WorkerStatus]) -> list[WorkerEvent]:
        """Events since the last call, in the order they happened per worker."""
        now = self._clock()
        events: list[WorkerEvent] = []
        for local, s in sorted(statuses.items()):
            known = self._known.get(local)
            if s.pid is not None and (known is None or known.pid != s.pid):
                if known is not None and not known.ended:
                    events.append(self._exit(local, known, None, now))
                known = self._known[local] = _Incarnation(s.pid, s.global_rank)
                events.append(WorkerEvent(WorkerEventKind.STARTED, s.global_rank, local, s.pid, now))
            ended = s.state in (WorkerState.EXITED, WorkerState.GONE)
            if known is not None and ended and not known.ended and known.pid == s.pid:
                events.append(self._exit(local, known, s.exit_code, now))
        return events

    def _exit(self, local: int, known: _Incarnation, code: int | None, now: float) -> WorkerEvent:
        known.ended = True
        at = min(now, self._stopping.pop(known.pid, now))
        return WorkerEvent(
            WorkerEventKind.EXITED,
            known.global_rank,
            local,
            known.pid,
            at,
            exit_code=code,
            step=self._last_step(known.pid),
        )
