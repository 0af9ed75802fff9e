"""The restart backoff counts failed restarts, not ranks that fail together."""

from __future__ import annotations

from taskd_core.agent.config import RestartBackoff
from taskd_core.agent.crashloop import CrashLoop
from taskd_core.models import WorkerState, WorkerStatus


def running(*pids: int) -> list[WorkerStatus]:
    return [WorkerStatus(i, i, WorkerState.RUNNING, pid) for i, pid in enumerate(pids)]


def failed(pid: int) -> list[WorkerStatus]:
    return [WorkerStatus(0, 0, WorkerState.EXITED, pid, 1)]


def test_ranks_of_one_start_failing_together_are_reported_at_once() -> None:
    loop = CrashLoop(RestartBackoff(initial=1.0, cap=30.0, healthy_after=10.0))
    loop.seen(running(10, 11, 12), now=0.0)
    # One rank raises 4 s after the start; its peers' collectives fail a moment later.
    assert [loop.failed(failed(pid), now) for pid, now in ((10, 4.0), (11, 4.3), (12, 4.6))] == [0.0, 0.0, 0.0]


def test_restarts_that_fail_again_wait_longer_each_time() -> None:
    loop = CrashLoop(RestartBackoff(initial=1.0, cap=30.0, healthy_after=10.0))
    delays, now = [], 0.0
    for generation in range(4):
        pids = (100 * generation + 1, 100 * generation + 2)
        loop.seen(running(*pids), now)
        delays.append(loop.failed(failed(pids[0]), now + 1.0))
        delays.append(loop.failed(failed(pids[1]), now + 1.2))  # its peer, same start: no extra wait
        now += 2.0
    assert delays == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_a_worker_that_lived_long_enough_ends_the_streak() -> None:
    loop = CrashLoop(RestartBackoff(initial=1.0, cap=30.0, healthy_after=10.0))
    loop.seen(running(1), 0.0)
    assert loop.failed(failed(1), 1.0) == 0.0
    loop.seen(running(2), 2.0)
    assert loop.failed(failed(2), 3.0) == 1.0
    loop.seen(running(3), 4.0)
    assert loop.failed(failed(3), 20.0) == 0.0 and loop.streak == 0
