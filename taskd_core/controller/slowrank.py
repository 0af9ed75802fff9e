"""Slow ranks: a rank that still makes progress, only slower than its peers (free of I/O).

In synchronous training every rank's step takes the slowest rank's time, so
step times cannot tell a straggler from its peers; the work each rank does
per step can (its steps' time less their waits in collectives, as agents
report it: :class:`~taskd_core.models.RankWork`). A :class:`SlowRankDetector`
holds one job's recent figures, step by step, and on each step that every
active rank has completed compares each rank with its peers:

* a rank's *level* is its mean work per step over the last ``window`` steps,
  its top and bottom tenth left out (a checkpoint or a collection pause on
  one rank, a step or two long, moves it little);
* its *ratio* is its level over the median of its peers' levels (itself
  left out, so two ranks can be told apart);
* a rank whose ratio stays at or above ``bound`` for ``hold`` steps in a row
  is slow: one :class:`SlowRankFound`, with its figures and its peers'. It is
  slow until its ratio has stayed below the bound for a whole window; if it
  gets slow again, it is found again;
* the bound is the job's policy's, or, when the policy gives none, learned from
  the job's own ratios (as the hang watch learns its timeouts): after a warm-up
  of three windows of evaluated steps it is ``LEARN_MARGIN`` x the
  ``LEARN_QUANTILE`` of the ratios seen below :data:`DEFAULT_BOUND`, within
  ``LEARN_FLOOR``..``LEARN_CAP``; :data:`DEFAULT_BOUND` until then. Ratios at
  or above it are not learned from, nor any ratio of a rank found slow during
  the warm-up, so a rank slow from its first step (or getting slow in the
  warm-up) is not taken for the job's noise (and is found on the default bound meanwhile); the
  cap keeps a rank at twice its peers' work found however noisy the others are;
* the ranks of one node (the agent that reports them) are found together: when
  one of them is found, those of its node-mates whose ratio is at or above the
  bound at that step are found with it (a slow node is one finding, not a rank
  now and its peer a step later; the peer median leaves each out, so with half
  the ranks on one slow node the others still set the reference).

What the job then does about a slow rank is :func:`decide`: journal it
(``warn``), or, with the policy ``replace``, drain its node onto a waiting
hot spare through the lost-node path (``Controller.node_lost``), once per
rank: a rank slow again on its replacement is reported, not bounced.

A job-wide slowdown raises every level alike and no ratio; steps whose time
varies (the same on every rank, or independently per rank) move the medians
little. A rank's figures start afresh with a new process (its replacement).
Time is passed in, as the recovery machine's is.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from taskd_core.models import RankWork, SlowRankPolicy, SlowRankStatus

#: Work levels below this many seconds count as this much: ratios of microseconds are noise.
WORK_FLOOR = 0.001
#: The bound until a job's own is learned (and its figures are too few to learn from).
DEFAULT_BOUND = 1.6
#: A learned bound: LEARN_MARGIN x the LEARN_QUANTILE of the warm-up's ratios, in LEARN_FLOOR..LEARN_CAP.
LEARN_QUANTILE = 0.99
LEARN_MARGIN = 1.2
#: Learning only raises the bound: at 1.5 a rank short of CPU on a busy host was named (benchmarks.md §13).
LEARN_FLOOR = DEFAULT_BOUND
#: A rank at 2x its peers' work, its level jittered down a little, still crosses it (issue 27's target).
LEARN_CAP = 1.8
#: Steps one evaluation pass looks at most, when the job's figures jump far ahead at once.
_MAX_EVALUATED = 256


@dataclass(frozen=True, slots=True)
class SlowRankConfig:
    """When a rank counts as slow (the job's policy: ``slow_rank_bound``, ``slow_rank_window``)."""

    #: a rank's work per step over its peers' median, at or above which it is slower than them
    #: (0: learned from the job's own ratios, :data:`DEFAULT_BOUND` until then).
    bound: float = 0.0
    #: steps whose (trimmed) mean work is a rank's level.
    window: int = 20
    #: steps in a row its ratio must stay at or above the bound (0: three tenths of the window).
    hold: int = 0

    @property
    def steps_held(self) -> int:
        return self.hold or max(1, 3 * self.window // 10)

    @property
    def warm_up(self) -> int:
        """Evaluated steps whose ratios a learned bound is drawn from."""
        return 3 * self.window


@dataclass(frozen=True, slots=True)
class SlowRankFound:
    """A rank found slow: the evidence the journal keeps (``slow-rank``, docs/events.md)."""

    rank: int
    pid: int
    #: the agent that reports the rank ("" when not known: then it is found on its own).
    node: str
    #: the step at which it was found, and the first step of the streak that made it slow.
    step: int
    since_step: int
    #: its work level over its peers' median level.
    ratio: float
    #: its work level (seconds per step over the window) and its last ``window`` figures.
    work: float
    figures: tuple[float, ...]
    #: each peer's work level, by rank, and their median.
    peers: Mapping[int, float]
    peer_median: float
    bound: float
    window: int
    #: wall-clock seconds (the controller's) when it was found.
    at: float
    #: the bound was learned from the job's ratios (False: the policy's, or the default before learning).
    bound_learned: bool = False

    def evidence(self) -> dict[str, object]:
        """Its figures in the ``evidence`` of its ``slow-rank`` event."""
        return {
            "rank": self.rank,
            "pid": self.pid,
            "since_step": self.since_step,
            "ratio": round(self.ratio, 3),
            "work_per_step": round(self.work, 6),
            "figures": [round(f, 6) for f in self.figures],
            "peers": {str(r): round(w, 6) for r, w in sorted(self.peers.items())},
            "peer_median": round(self.peer_median, 6),
        }


#: Ranks found slow together (a node's, at one step), by rank: one ``slow-rank`` event.
Finding = tuple[SlowRankFound, ...]


def finding_detail(found: Finding) -> dict[str, object]:
    """The journal detail of the ``slow-rank`` event of ranks found together (one node's, one step)."""
    first = found[0]
    return {
        "ranks": [f.rank for f in found],
        "step": first.step,
        "bound": round(first.bound, 3),
        "bound_learned": first.bound_learned,
        "window": first.window,
        "evidence": [f.evidence() for f in found],
    }


def findings(found: Iterable[SlowRankFound]) -> list[Finding]:
    """``found`` as the findings they make: a node's ranks found at one step together, by rank."""
    groups: dict[tuple[str, int, int], list[SlowRankFound]] = {}
    for each in found:
        # A rank of no known node is a finding of its own.
        key = (each.node, each.step, -1 if each.node else each.rank)
        groups.setdefault(key, []).append(each)
    return [tuple(sorted(g, key=lambda f: f.rank)) for g in groups.values()]


@dataclass(frozen=True, slots=True)
class SlowRankAction:
    """What the job does about ranks found slow: ``replace`` their node (by a spare) or ``warn``, and why."""

    action: SlowRankPolicy
    reason: str
    #: the node (agent) to drain onto a spare (``replace`` only).
    node: str = ""
    #: ``warn`` for now only: the rank is replaced once a spare is ready and no recovery runs.
    transient: bool = False


def decide(
    policy: SlowRankPolicy,
    ranks: Sequence[int],
    node: str | None,
    *,
    replaced_before: bool,
    spare: bool,
    idle: bool,
) -> SlowRankAction:
    """The action for slow ``ranks`` (found together) running on ``node`` (None: no one node of
    the job says it runs them).

    :param replaced_before: a node of one of them was already replaced once for slowness in this job.
    :param spare: a hot spare stands by, ready.
    :param idle: no recovery cycle is in flight (a drain now would disturb it).
    """
    warn = SlowRankPolicy.WARN
    if policy is SlowRankPolicy.WARN:
        return SlowRankAction(warn, "the job's slow_rank policy is warn")
    named = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    if replaced_before:
        return SlowRankAction(warn, f"{named}'s node was replaced once already: reported, not bounced")
    if node is None:
        return SlowRankAction(warn, f"no one node of the job says it runs {named}")
    if not spare:
        return SlowRankAction(warn, "no hot spare stands by (yet)", transient=True)
    if not idle:
        return SlowRankAction(warn, "a recovery is in flight", transient=True)
    return SlowRankAction(SlowRankPolicy.REPLACE, f"node {node} is drained onto a spare", node)


@dataclass(slots=True)
class _Series:
    """One rank's life (one pid): its work per step, by step."""

    pid: int
    node: str = ""
    work: dict[int, float] = field(default_factory=dict)
    last: int = 0
    #: the first step of the current streak at or above the bound (None: no streak).
    streak_from: int | None = None
    #: steps in a row below the bound since it was found slow (a window of them clears it).
    calm: int = 0
    found: SlowRankFound | None = None
    ratio: float = 0.0


class SlowRankDetector:
    """One job's slow-rank detection; feed it every :class:`RankWork` its agents report."""

    def __init__(self, config: SlowRankConfig | None = None) -> None:
        self.config = config or SlowRankConfig()
        self._ranks: dict[int, _Series] = {}
        self._evaluated = 0
        #: the bound now: the policy's, the default while learning, or the learned one.
        self.bound = self.config.bound or DEFAULT_BOUND
        self.bound_learned = False
        #: the warm-up's ratios below the bound, by rank, while it is being learned.
        self._learning: dict[int, list[float]] = {}
        self._warm_steps = 0
        self._slow_in_warm_up: set[int] = set()

    def feed(self, samples: Iterable[RankWork], now: float, node: str = "") -> list[SlowRankFound]:
        """Take figures ``node`` reported; the ranks found slow by them (at most once per streak)."""
        for sample in samples:
            self._record(sample, node)
        return self._evaluate(now)

    def slow(self) -> tuple[SlowRankStatus, ...]:
        """The ranks slow now, by rank."""
        return tuple(
            SlowRankStatus(
                r, s.pid, s.ratio, s.found.work, s.found.peer_median, s.found.since_step, s.found.at
            )
            for r, s in sorted(self._ranks.items())
            if s.found is not None
        )

    def forget(self, rank: int) -> None:
        """Drop a rank's figures (its process ended; its replacement starts afresh)."""
        self._ranks.pop(rank, None)

    def _record(self, sample: RankWork, node: str) -> None:
        series = self._ranks.get(sample.rank)
        if series is None or series.pid != sample.pid:
            series = self._ranks[sample.rank] = _Series(sample.pid, node)
        per_step = sample.busy / sample.steps
        first = max(sample.step - sample.steps + 1, sample.step - self._keep() + 1, 1)
        for step in range(first, sample.step + 1):
            series.work[step] = per_step
        series.last = max(series.last, sample.step)
        horizon = series.last - self._keep()
        if len(series.work) > 2 * self._keep():
            series.work = {s: w for s, w in series.work.items() if s > horizon}

    def _keep(self) -> int:
        return 2 * self.config.window + self.config.steps_held

    def _evaluate(self, now: float) -> list[SlowRankFound]:
        window = self.config.window
        # Ranks silent for a whole window behind the newest one are gone or stopped: not compared.
        newest = max((s.last for s in self._ranks.values()), default=0)
        active = {r: s for r, s in self._ranks.items() if s.last > newest - window}
        if len(active) < 2:
            return []
        frontier = min(s.last for s in active.values())
        found: list[SlowRankFound] = []
        for step in range(max(self._evaluated + 1, frontier - _MAX_EVALUATED + 1), frontier + 1):
            found.extend(self._evaluate_step(active, step, now))
        self._evaluated = max(self._evaluated, frontier)
        return found

    def _evaluate_step(self, active: Mapping[int, _Series], step: int, now: float) -> list[SlowRankFound]:
        config, window = self.config, self.config.window
        figures: dict[int, list[float]] = {}
        for rank, series in active.items():
            values = [series.work[s] for s in range(step - window + 1, step + 1) if s in series.work]
            # Judged on a full window only: a fresh rank's first steps (warm-up) are not its pace.
            if len(values) == window:
                figures[rank] = values
        if len(figures) < 2:
            return []
        levels = {rank: _level(values) for rank, values in figures.items()}
        peers = {rank: {r: v for r, v in levels.items() if r != rank} for rank in levels}
        references = {rank: max(statistics.median(p.values()), WORK_FLOOR) for rank, p in peers.items()}
        for rank, level in levels.items():
            series = active[rank]
            series.ratio = max(level, WORK_FLOOR) / references[rank]
            if series.ratio >= self.bound:
                series.calm = 0
                if series.streak_from is None:
                    series.streak_from = step
            else:
                series.streak_from = None
                series.calm += 1
                if series.found is not None and series.calm >= window:
                    series.found = None
        streaking = {r: s for r in levels if (s := active[r]).found is None and s.streak_from is not None}
        held = {r for r, s in streaking.items() if step - (s.streak_from or step) + 1 >= config.steps_held}
        slow_nodes = {streaking[r].node for r in held} - {""}
        found = []
        for rank, series in sorted(streaking.items()):
            if rank in held or series.node in slow_nodes:
                series.found = SlowRankFound(
                    rank, series.pid, series.node, step, series.streak_from or step, series.ratio,
                    levels[rank], tuple(figures[rank]), peers[rank], references[rank], self.bound,
                    window, now, self.bound_learned,
                )  # fmt: skip
                found.append(series.found)
        self._learn({r: active[r].ratio for r in levels})
        return found

    def _learn(self, ratios: Mapping[int, float]) -> None:
        """Take one evaluated step's ratios, by rank, into the bound being learned."""
        if self.config.bound or self.bound_learned:
            return
        for rank, ratio in ratios.items():
            if ratio < self.bound:
                self._learning.setdefault(rank, []).append(ratio)
        # A rank found slow in the warm-up is left out of it whole: its ratios on the way up to the
        # bound were its slowness, not the job's noise.
        self._slow_in_warm_up |= {r for r, s in self._ranks.items() if s.found is not None}
        self._warm_steps += 1
        if self._warm_steps < self.config.warm_up:
            return
        kept = [x for r, values in self._learning.items() if r not in self._slow_in_warm_up for x in values]
        if not kept:
            return
        ordered = sorted(kept)
        high = ordered[min(len(ordered) - 1, int(LEARN_QUANTILE * len(ordered)))]
        self.bound = min(LEARN_CAP, max(LEARN_FLOOR, LEARN_MARGIN * high))
        self.bound_learned = True
        self._learning = {}


def _level(values: list[float]) -> float:
    """The mean of ``values`` without their top and bottom tenth: a spike of a step or two (a
    checkpoint, a collection pause) moves it little, and it follows the pace more closely than a
    median when steps vary a lot."""
    ordered = sorted(values)
    cut = len(ordered) // 10
    middle = ordered[cut : len(ordered) - cut]
    return sum(middle) / len(middle)
