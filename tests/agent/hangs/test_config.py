"""The hang watch's bounds, refused when they cannot work, and the timeouts it learns."""

from __future__ import annotations

import pytest

from taskd_core.agent.hangs import ProgressConfig
from taskd_core.agent.hangs.config import LearnedTimeout
from taskd_core.errors import ConfigError


def test_learned_timeout_follows_the_samples() -> None:
    config = ProgressConfig(floor=1.0, ceiling=100.0, multiplier=5.0, min_samples=3, window=10)
    learned = LearnedTimeout(config)
    assert learned.value == 100.0 and "learning: 0/3" in learned.describe()
    for _ in range(10):
        learned.add(0.01)
    assert learned.value == 1.0  # the floor
    learned.add(4.0)  # one slow step in a window of 10 is above its p99
    assert learned.value == 20.0
    for _ in range(10):
        learned.add(0.5)  # the slow sample left the window
    assert learned.value == 2.5
    learned.add(1000.0)
    assert learned.value == 100.0  # the ceiling


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"floor": 0.0}, "floor must be a positive number"),
        ({"stopped_bound": float("nan")}, "stopped bound"),
        ({"floor": 10.0, "ceiling": 5.0}, "above ceiling"),
        ({"heartbeat_timeout": -1.0}, "heartbeat timeout must be a positive number"),
        ({"min_samples": 50, "window": 10}, "min samples"),
    ],
)
def test_bad_bounds_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ProgressConfig(**kwargs)  # type: ignore[arg-type]


