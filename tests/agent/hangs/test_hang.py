"""A declared hang as the journal gets it: the reason, how long the stack took, the stack, cut to fit."""

from __future__ import annotations

from taskd_core.agent.hangs import Hang, HangSignal
from taskd_core.agent.hangs.hang import MAX_STACK


def hang(stack: str, learned: bool = True) -> Hang:
    return Hang(41, 1, 3, HangSignal.HEARTBEAT, "heartbeat", 12.34, 6.0, learned, stack, stack_seconds=0.25)


def test_the_reason_says_who_what_and_which_timeout() -> None:
    assert hang("s").reason == (
        "rank 3 (pid 41) hung: heartbeat 'heartbeat', no progress for 12.3s (timeout 6.0s, learned)"
    )
    assert hang("s", learned=False).reason.endswith("(timeout 6.0s, configured)")


def test_the_evidence_keeps_a_short_stack_whole_and_cuts_a_long_one() -> None:
    assert hang("Thread 1\n  spin\n").evidence() == f"{hang('').reason}\nstack taken in 0.25s\nThread 1\n  spin\n"
    long = hang("x" * (2 * MAX_STACK)).evidence()
    assert len(long) <= MAX_STACK and long.endswith("\n... (cut)\n")
