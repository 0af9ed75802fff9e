"""Slow-rank detection on synthetic series: jitter and job-wide slowdowns pass, a straggler is named."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable

import pytest

from taskd_core.controller.slowrank import (
    DEFAULT_BOUND,
    LEARN_CAP,
    LEARN_FLOOR,
    SlowRankConfig,
    SlowRankDetector,
    SlowRankFound,
    decide,
    finding_detail,
    findings,
)
from taskd_core.models import RankWork, SlowRankPolicy

#: Work per step of a healthy rank, seconds.
BASE = 0.1
Pace = Callable[[int, int], float]


def run(
    pace: Pace,
    *,
    ranks: int = 4,
    steps: int = 1000,
    per_report: int = 1,
    pids: Callable[[int, int], int] = lambda r, s: 100 + r,
    detector: SlowRankDetector | None = None,
    per_node: int = 0,
) -> list[SlowRankFound]:  # noqa: E501
    """Feed ``steps`` steps of ``pace(rank, step)`` seconds of work, ``per_report`` steps per sample;
    with ``per_node``, each node of that many ranks reports its own (node 0 first), as agents do."""
    detector = detector or SlowRankDetector()
    found = []
    for end in range(per_report, steps + 1, per_report):
        samples = [
            RankWork(
                r,
                pids(r, end),
                end,
                per_report,
                sum(pace(r, s) for s in range(end - per_report + 1, end + 1)),
            )
            for r in range(ranks)
        ]
        if not per_node:
            found += detector.feed(samples, float(end))
            continue
        for first in range(0, ranks, per_node):
            found += detector.feed(samples[first : first + per_node], float(end), f"node-{first // per_node}")
    return found


def jittery(seed: int, spread: float = 5.0) -> Pace:
    """Each rank's steps vary on their own between 1x and ``spread`` x."""
    rng = random.Random(seed)
    table: dict[tuple[int, int], float] = {}
    return lambda r, s: table.setdefault((r, s), BASE * rng.uniform(1.0, spread))


@pytest.mark.parametrize("seed", range(10))
def test_no_false_positive_over_1000_steps_with_5x_jitter_per_rank(seed: int) -> None:
    assert run(jittery(seed)) == []


def test_no_false_positive_when_every_rank_varies_together_by_5x() -> None:
    rng = random.Random(7)
    common = {s: rng.uniform(1.0, 5.0) for s in range(1, 1001)}
    assert run(lambda r, s: BASE * common[s]) == []


@pytest.mark.parametrize("seed", range(5))
def test_a_job_wide_slowdown_is_no_straggler(seed: int) -> None:
    noise = jittery(seed, 1.5)
    assert run(lambda r, s: noise(r, s) * (2.0 if s >= 300 else 1.0)) == []


def test_a_checkpoint_on_one_rank_every_few_steps_is_no_straggler() -> None:
    # Rank 0 saves every 10 steps, a save 20x a step: a spike, not a pace.
    assert run(lambda r, s: BASE * (20.0 if r == 0 and s % 10 == 0 else 1.0)) == []


@pytest.mark.parametrize("seed", range(10))
def test_one_rank_at_2x_work_is_named_within_20_steps_with_its_evidence(seed: int) -> None:
    noise = jittery(seed, 1.5)
    (found,) = run(lambda r, s: noise(r, s) * (2.0 if r == 2 and s > 100 else 1.0), steps=200)
    assert (found.rank, found.pid) == (2, 102)
    assert found.step - 100 <= 20 and found.since_step > 100
    assert found.ratio >= 1.6 and found.work >= 1.6 * found.peer_median
    assert sorted(found.peers) == [0, 1, 3] and len(found.figures) == 20
    detail = finding_detail((found,))
    assert detail["ranks"] == [2] and detail["step"] == found.step
    (evidence,) = detail["evidence"]  # type: ignore[misc]
    assert evidence["pid"] == 102 and set(evidence["peers"]) == {"0", "1", "3"}


@pytest.mark.parametrize("seed", range(10))
def test_a_slow_node_is_one_finding_of_both_its_ranks(seed: int) -> None:
    # Node 1 holds ranks 2 and 3; both work 2x from step 100 on, each with its own jitter.
    noise = jittery(seed, 1.5)
    found = run(lambda r, s: noise(r, s) * (2.0 if r >= 2 and s > 100 else 1.0), steps=200, per_node=2)
    (finding,) = findings(found)
    assert [(f.rank, f.node) for f in finding] == [(2, "node-1"), (3, "node-1")]
    assert all(f.since_step > 100 and f.step - 100 <= 20 and f.ratio >= 1.6 for f in finding)
    # Each is compared with the other ranks, its node-mate among them (the median is the healthy ones').
    assert [sorted(f.peers) for f in finding] == [[0, 1, 3], [0, 1, 2]]


def test_a_slow_ranks_healthy_node_mate_is_not_named_with_it() -> None:
    found = run(lambda r, s: BASE * (2.0 if r == 3 and s > 100 else 1.0), steps=200, per_node=2)
    assert [[f.rank for f in g] for g in findings(found)] == [[3]]


def test_a_straggler_among_5x_jitter_is_still_named() -> None:
    noise = jittery(3)
    found = run(lambda r, s: noise(r, s) * (2.0 if r == 1 and s > 100 else 1.0), steps=300)
    assert [f.rank for f in found] == [1]


def test_figures_reported_several_steps_at_a_time_are_spread_over_their_steps() -> None:
    found = run(lambda r, s: BASE * (3.0 if r == 0 and s > 50 else 1.0), steps=150, per_report=7)
    assert [f.rank for f in found] == [0]
    assert found[0].step - 50 <= 20 + 7


def test_of_two_ranks_the_slower_one_is_named() -> None:
    assert [f.rank for f in run(lambda r, s: BASE * (2.0 if r == 1 else 1.0), ranks=2, steps=100)] == [1]


def test_a_slow_rank_is_named_once_per_streak_and_again_on_its_replacement() -> None:
    detector = SlowRankDetector()
    slow = lambda r, s: BASE * (2.0 if r == 3 and (s <= 200 or s > 300) else 1.0)  # noqa: E731
    # Rank 3's process is replaced at step 250 (a new pid): its figures start afresh.
    found = run(slow, steps=400, pids=lambda r, s: 500 if r == 3 and s > 250 else r, detector=detector)
    assert [(f.rank, f.pid) for f in found] == [(3, 3), (3, 500)]
    assert [(v.rank, v.pid) for v in detector.slow()] == [(3, 500)]


def test_a_rank_that_recovers_is_slow_no_more() -> None:
    detector = SlowRankDetector()
    found = run(lambda r, s: BASE * (2.0 if r == 0 and s <= 100 else 1.0), steps=200, detector=detector)
    assert [f.rank for f in found] == [0] and detector.slow() == ()


def test_the_bound_and_window_are_the_jobs() -> None:
    mild = lambda r, s: BASE * (1.3 if r == 0 and s > 50 else 1.0)  # noqa: E731
    assert run(mild, steps=200) == []
    found = run(mild, steps=200, detector=SlowRankDetector(SlowRankConfig(bound=1.2, window=8)))
    assert [f.rank for f in found] == [0] and found[0].window == 8 and found[0].bound == 1.2


def test_a_rank_that_stopped_reporting_is_not_compared() -> None:
    # Rank 1 ends at step 50 (its figures stop); the others go on without a false alarm or a stall.
    detector = SlowRankDetector()
    found = []
    for s in range(1, 200):
        ranks = range(3) if s <= 50 else (0, 2)
        found += detector.feed(
            [RankWork(r, r, s, 1, BASE * (2.0 if r == 2 and s > 100 else 1.0)) for r in ranks], s
        )
    assert [f.rank for f in found] == [2]


@pytest.mark.parametrize(
    ("policy", "node", "before", "spare", "idle", "action", "reason"),
    [
        (SlowRankPolicy.WARN, "n1", False, True, True, SlowRankPolicy.WARN, "policy is warn"),
        (SlowRankPolicy.REPLACE, "n1", False, True, True, SlowRankPolicy.REPLACE, "node n1 is drained"),
        (SlowRankPolicy.REPLACE, "n1", True, True, True, SlowRankPolicy.WARN, "reported, not bounced"),
        (SlowRankPolicy.REPLACE, None, False, True, True, SlowRankPolicy.WARN, "no one node of the job"),
        (SlowRankPolicy.REPLACE, "n1", False, False, True, SlowRankPolicy.WARN, "no hot spare"),
        (SlowRankPolicy.REPLACE, "n1", False, True, False, SlowRankPolicy.WARN, "recovery is in flight"),
    ],
)
def test_what_a_slow_rank_gets(policy, node, before, spare, idle, action, reason) -> None:
    act = decide(policy, [3], node, replaced_before=before, spare=spare, idle=idle)
    assert act.action is action and reason in act.reason
    assert act.node == (node if action is SlowRankPolicy.REPLACE else "")
    assert act.transient == (reason in ("no hot spare", "recovery is in flight"))


def lognormal(seed: int, sigma: float) -> Pace:
    """Each rank's steps on their own, log-normally about BASE: now and then a run of long ones."""
    rng = random.Random(seed)
    table: dict[tuple[int, int], float] = {}
    return lambda r, s: table.setdefault((r, s), BASE * rng.lognormvariate(0.0, sigma))


def test_a_noisy_healthy_job_learns_a_higher_bound_and_raises_no_alarm_the_default_would() -> None:
    detector = SlowRankDetector()
    assert run(lognormal(1, 0.6), detector=detector) == []
    assert detector.bound_learned and LEARN_CAP >= detector.bound > DEFAULT_BOUND
    fixed = run(lognormal(1, 0.6), detector=SlowRankDetector(SlowRankConfig(bound=DEFAULT_BOUND)))
    assert fixed != [] and all(not f.bound_learned and f.bound == DEFAULT_BOUND for f in fixed)


def test_a_quiet_job_learns_the_floor() -> None:
    detector = SlowRankDetector()
    assert run(jittery(0, 1.2), steps=200, detector=detector) == []
    assert detector.bound_learned and detector.bound == LEARN_FLOOR


def test_a_rank_slow_from_its_first_step_is_found_and_not_learned_from() -> None:
    noise = jittery(4, 1.5)
    detector = SlowRankDetector()
    found = run(lambda r, s: noise(r, s) * (2.0 if r == 2 else 1.0), steps=300, detector=detector)
    # Found on the default bound within its first window and hold; its ratios did not raise the bound.
    assert [(f.rank, f.bound, f.bound_learned) for f in found] == [(2, DEFAULT_BOUND, False)]
    assert found[0].step <= 20 + 6
    assert detector.bound_learned and detector.bound == LEARN_FLOOR
    assert [v.rank for v in detector.slow()] == [2]


def test_a_2x_straggler_after_the_warm_up_is_found_on_the_learned_bound_of_a_noisy_job() -> None:
    latencies = []
    for seed in range(10):
        noise = lognormal(seed, 0.6)
        found = run(lambda r, s, n=noise: n(r, s) * (2.0 if r == 2 and s > 100 else 1.0), steps=200)
        first = next(f for f in found if f.step > 100)
        assert first.rank == 2 and first.bound_learned and first.since_step > 100
        latencies.append(first.step - 100)
    # Issue 27's target (p50 within 20 steps), under noise that makes the default bound raise alarms.
    assert statistics.median(latencies) <= 20
    detail = finding_detail((first,))
    assert detail["bound_learned"] is True and detail["bound"] == round(first.bound, 3)


def test_a_bound_the_policy_gives_is_not_learned() -> None:
    detector = SlowRankDetector(SlowRankConfig(bound=1.7))
    assert run(jittery(0, 1.2), steps=300, detector=detector) == []
    assert (detector.bound, detector.bound_learned) == (1.7, False)


def test_a_rank_getting_slow_during_the_warm_up_does_not_raise_the_bound() -> None:
    # Rank 1 works 2x from step 40: its ratio climbs through 1.0-1.6 as its window fills, then it is found.
    detector = SlowRankDetector()
    found = run(lambda r, s: BASE * (2.0 if r == 1 and s > 40 else 1.0), steps=200, detector=detector)
    assert [(f.rank, f.bound_learned) for f in found] == [(1, False)]
    assert detector.bound_learned and detector.bound == LEARN_FLOOR
