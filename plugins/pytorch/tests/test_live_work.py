"""LiveSession's work clock: a step's time less the time its collectives were pending."""

from __future__ import annotations

import pytest

from taskd_pytorch.live._work import WorkClock


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_work_is_the_step_less_its_pending_collectives_counted_once() -> None:
    clock = Clock()
    work = WorkClock(clock)
    work.begin()
    # DDP's buckets overlap: 2..5 and 4..6 cover 4 s of the 10 s step.
    work.pending(2.0, 5.0)
    work.pending(4.0, 6.0)
    clock.now = 10.0
    assert work.commit() == pytest.approx(6.0)


def test_the_time_between_two_steps_is_the_next_ones_work() -> None:
    clock = Clock()
    work = WorkClock(clock)
    work.begin()
    clock.now = 1.0
    assert work.commit() == pytest.approx(1.0)
    clock.now = 3.0  # loading the next batch outside the step's block
    work.begin()
    work.pending(3.5, 4.0)
    clock.now = 4.0
    assert work.commit() == pytest.approx(2.5)


def test_after_a_failed_step_the_next_is_timed_from_its_own_start() -> None:
    clock = Clock()
    work = WorkClock(clock)
    work.begin()
    clock.now = 1.0
    work.commit()
    clock.now = 30.0  # a rebuilt group: no step's work
    work.reset()
    work.begin()
    clock.now = 31.0
    assert work.commit() == pytest.approx(1.0)
    assert work.commit() is None  # no step began since
