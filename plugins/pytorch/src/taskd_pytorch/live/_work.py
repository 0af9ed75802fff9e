"""How long a rank *works* in each step: its wall time less the time its collectives were pending.

In synchronous data parallelism every rank's step takes the same wall time:
a slow rank makes the others wait inside the step's collectives. What tells
them apart is the rest of the step, the work (compute, data loading) done
before each collective is joined: the slow rank works longest and waits least.
:class:`WorkClock` measures it with no help from the script, from the
collectives :class:`~taskd_pytorch.live.LiveSession` runs (its ``all_reduce``
and DDP's buckets through its comm hook); the session reports it with each
committed step (``taskd_core.worker.step(n, busy=...)``) and the controller
compares ranks (``slow-rank`` events).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class WorkClock:
    """One rank's step clock: when the step began and the spans its collectives were pending.

    A step begins where the previous one was committed, so the time between
    two ``with step`` blocks (a data loader's, a checkpoint's) counts as the
    work of the next one; after a failed step or a rebuilt group, it begins
    when its block is entered. Spans may come from another thread (DDP's
    collectives are waited for on the session's own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._began: float | None = None
        self._committed: float | None = None
        self._spans: list[tuple[float, float]] = []

    def now(self) -> float:
        return self._clock()

    def begin(self) -> None:
        """A step's block is entered."""
        now = self._clock()
        with self._lock:
            self._began = self._committed if self._committed is not None else now
            # Spans of an earlier step that ended late belong to no step that is measured.
            self._spans = [s for s in self._spans if s[1] > self._began]

    def pending(self, launched: float, completed: float) -> None:
        """A collective launched at ``launched`` completed at ``completed`` (this clock's times)."""
        with self._lock:
            self._spans.append((launched, completed))

    def commit(self) -> float | None:
        """The step is committed: the seconds it worked (None: no step began since the last reset)."""
        now = self._clock()
        with self._lock:
            began, spans = self._began, self._spans
            self._began, self._committed, self._spans = None, now, []
        if began is None:
            return None
        return max(0.0, now - began - _covered(spans, began, now))

    def reset(self) -> None:
        """The step failed or the group was rebuilt: the next step is timed from its own start."""
        with self._lock:
            self._began = self._committed = None
            self._spans = []


def _covered(spans: list[tuple[float, float]], low: float, high: float) -> float:
    """Seconds of ``[low, high]`` that at least one span covers (DDP's buckets overlap)."""
    total, reach = 0.0, low
    for start, end in sorted(spans):
        start, end = max(start, reach), min(end, high)
        if end > start:
            total += end - start
            reach = end
    return total
