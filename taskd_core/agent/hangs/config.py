"""The bounds of the hang watch, and the timeouts it learns from the job.

:class:`ProgressConfig` holds every bound the watcher applies (the ``/proc``
states' bounds, a heartbeat timeout or how to learn one, how often to look,
the stack budget). A timeout not given is a :class:`LearnedTimeout`: a
multiple of the p99 of one signal's recent durations, clamped to a floor and
a ceiling; the ceiling applies until enough samples exist.
"""

from __future__ import annotations

import bisect
import collections
import math
from dataclasses import dataclass

from taskd_core.errors import ConfigError
from taskd_core.values import check_seconds


@dataclass(frozen=True, slots=True)
class ProgressConfig:
    """Bounds of the progress watch; every value in seconds unless named otherwise."""

    enabled: bool = True
    #: a worker in state ``T`` longer than this is hung.
    stopped_bound: float = 0.5
    #: a worker in state ``D`` longer than this is hung.
    disk_sleep_bound: float = 60.0
    #: explicit heartbeat timeout; None learns it from the job's beat intervals.
    heartbeat_timeout: float | None = None
    #: learned timeout = multiplier x p99 of the recent intervals, within floor..ceiling.
    multiplier: float = 5.0
    floor: float = 3.0
    ceiling: float = 300.0
    #: samples needed before a learned value replaces the ceiling, and how many recent ones count.
    min_samples: int = 10
    window: int = 200
    #: how often /proc and the deadlines are checked.
    poll: float = 0.2
    #: bound on taking one worker's stack (py-spy, then the faulthandler dump, share it): the
    #: hung rank is killed, and the job recovers, only after its stack is taken.
    stack_timeout: float = 2.0

    def __post_init__(self) -> None:
        for name in ("stopped_bound", "disk_sleep_bound", "floor", "ceiling", "poll", "stack_timeout"):
            check_seconds(getattr(self, name), f"hang detection: {name.replace('_', ' ')}", positive=True)
        if not (math.isfinite(self.multiplier) and self.multiplier > 0):
            raise ConfigError(f"hang detection: multiplier must be a positive number, not {self.multiplier}")
        if self.heartbeat_timeout is not None:
            check_seconds(self.heartbeat_timeout, "hang detection: heartbeat timeout", positive=True)
        if self.floor > self.ceiling:
            raise ConfigError(f"hang detection: floor {self.floor}s is above ceiling {self.ceiling}s")
        if self.min_samples < 1 or self.window < self.min_samples:
            raise ConfigError(
                f"hang detection: need 1 <= min samples ({self.min_samples}) <= window ({self.window})"
            )


class LearnedTimeout:
    """A timeout that follows the observed durations of one signal (p99 x multiplier, clamped)."""

    def __init__(self, config: ProgressConfig) -> None:
        self._config = config
        self._recent: collections.deque[float] = collections.deque(maxlen=config.window)
        self._sorted: list[float] = []

    def add(self, seconds: float) -> None:
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(seconds)
        bisect.insort(self._sorted, seconds)

    @property
    def p99(self) -> float | None:
        if len(self._sorted) < self._config.min_samples:
            return None
        return self._sorted[max(0, math.ceil(0.99 * len(self._sorted)) - 1)]

    @property
    def value(self) -> float:
        p99 = self.p99
        if p99 is None:
            return self._config.ceiling
        return min(self._config.ceiling, max(self._config.floor, self._config.multiplier * p99))

    def describe(self) -> str:
        p99 = self.p99
        if p99 is None:
            return f"{self.value:.1f}s (learning: {len(self._sorted)}/{self._config.min_samples} samples)"
        return f"{self.value:.1f}s (learned: p99 {p99:.3f}s of {len(self._sorted)})"
