"""Each rank's work per step, as its workers report it, gathered for the controller.

A ``step N BUSY K`` datagram of :mod:`taskd_core.worker` says that the
``K`` steps up to ``N`` worked ``BUSY`` seconds on that rank (the reporter
folds the steps it held back by its beat gap into one datagram). The watcher
hands them to :class:`WorkSamples`, which keeps them as
:class:`~taskd_core.models.RankWork` until the agent takes them for its next
``ReportWorkerEvents``; the controller compares ranks
(:mod:`taskd_core.controller.slowrank`).
"""

from __future__ import annotations

import math
from collections import deque

from taskd_core.models import RankWork

#: Seconds between the agent's reports of work: the controller needs steps, not a stream.
REPORT_EVERY = 0.5
#: Samples kept while the agent does not take them (a controller outage): the newest count.
MAX_SAMPLES = 4096
#: Most steps one sample may cover, and most seconds of work per step it may claim.
_MAX_STEPS = 1_000_000
_MAX_BUSY_PER_STEP = 86_400.0


def parse_work(busy: str, steps: str) -> tuple[float, int] | None:
    """The ``BUSY K`` of a step datagram, or None when they are not seconds and a step count."""
    try:
        seconds, count = float(busy), int(steps)
    except ValueError:
        return None
    if not (
        math.isfinite(seconds) and 0 < count <= _MAX_STEPS and 0 <= seconds <= count * _MAX_BUSY_PER_STEP
    ):
        return None
    return seconds, count


class WorkSamples:
    """The work samples of one node's workers since the agent last took them; not thread-safe."""

    def __init__(self, report_every: float = REPORT_EVERY) -> None:
        self._report_every = report_every
        self._samples: deque[RankWork] = deque(maxlen=MAX_SAMPLES)
        self._taken = -math.inf

    def record(self, rank: int, pid: int, step: int, busy: float, steps: int) -> None:
        self._samples.append(RankWork(rank, pid, step, steps, busy))

    def due(self, now: float) -> bool:
        """Samples wait and the last report is at least :data:`REPORT_EVERY` old (monotonic ``now``)."""
        return bool(self._samples) and now - self._taken >= self._report_every

    def take(self, now: float) -> list[RankWork]:
        """The samples kept, oldest first; ``now`` dates the report."""
        samples = list(self._samples)
        self._samples.clear()
        if samples:
            self._taken = now
        return samples
