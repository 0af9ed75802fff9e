"""Restart backoff for workers that keep failing right after they start.

Without it a worker that crashes at start is restarted at once, again and
again (51 starts in 5.9 s were measured). The agent holds back the fault
report of a worker that failed within ``healthy_after`` seconds of its start:
the first such failure is reported at once (recovery stays fast), each further
one in a row waits ``initial * 2**(n-2)`` seconds, at most ``cap``. A worker
that lived ``healthy_after`` seconds ends the streak. "In a row" counts
restarts, not ranks: workers of one start that fail together (a rank dies and
its peers' collectives fail with it) are one failure, reported at once, so
that they join the same recovery cycle. The controller's cycle
budget (``max_cycles`` within ``cycle_window``) still bounds the whole loop.
"""

from __future__ import annotations

from collections.abc import Iterable

from taskd_core.agent.config import RestartBackoff
from taskd_core.models import WorkerState, WorkerStatus


class CrashLoop:
    """Watches when workers start and how soon they fail; used by the agent's loop only."""

    def __init__(self, backoff: RestartBackoff) -> None:
        self.backoff = backoff
        self.streak = 0
        #: pid -> when the agent first saw it running (monotonic seconds).
        self._born: dict[int, float] = {}
        #: when the last quick failure was counted (monotonic seconds).
        self._counted_at = float("-inf")

    def seen(self, statuses: Iterable[WorkerStatus], now: float) -> None:
        """Note the running workers' starts; forget pids that are no longer listed."""
        listed = set()
        for s in statuses:
            if s.pid is None:
                continue
            listed.add(s.pid)
            if s.state is WorkerState.RUNNING:
                self._born.setdefault(s.pid, now)
        for pid in set(self._born) - listed:
            del self._born[pid]

    def failed(self, statuses: Iterable[WorkerStatus], now: float) -> float:
        """Workers failed now: seconds to hold back their report."""
        # A worker that died before the agent saw it running lived no time at all.
        born = [self._born.get(s.pid or -1, now) for s in statuses]
        lived = min((now - b for b in born), default=0.0)
        if lived >= self.backoff.healthy_after:
            self.streak = 0
        elif max(born, default=now) > self._counted_at:
            # Started after the last counted failure: a restart that failed again.
            self.streak += 1
            self._counted_at = now
        return self.backoff.delay(self.streak)
