"""Capped exponential backoff with full jitter, bounded by a deadline."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays ``initial * 2**n`` capped at ``cap``, each drawn uniformly from [delay/2, delay]."""

    initial: float = 0.2
    cap: float = 5.0

    def delay(self, attempt: int) -> float:
        full = min(self.cap, self.initial * (2 ** min(attempt, 30)))
        return random.uniform(full / 2, full)

    def wait(self, attempt: int, deadline: float, stop: threading.Event) -> bool:
        """Sleep before retry ``attempt``; False when the deadline passed or ``stop`` was set."""
        remaining = deadline - time.monotonic()
        if remaining <= 0 or stop.is_set():
            return False
        return not stop.wait(min(self.delay(attempt), remaining))
