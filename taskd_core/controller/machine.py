"""The per-job recovery state machine (SPEC §5), free of I/O.

A :class:`JobMachine` owns one job's :class:`Snapshot` and reacts to events
(:class:`FaultReported`, :class:`StopReported`, ...) through one transition
table ``{(State, event type): handler}``. A handler mutates the snapshot and
returns what the runtime must do: the reply, the signals to send and the
journal entries to store (in one transaction with the new snapshot). Time is
passed in, deadlines are absolute wall-clock seconds, so a restarted
controller re-arms its timers from the stored snapshot.

States (every transition the machine makes; ``_TARGETS`` declares the same
edges per handler, ``_enter`` refuses any other, and a test holds this
diagram against it)::

    IDLE --fault--> FLUSHING                                    (a flush window collects faults)
    IDLE --fault, no flush window--> WAIT_STOP                  (stopTrain sent)
    IDLE --fault, cycle budget used--> GIVEN_UP                 (killMaster sent)
    IDLE --node lost, a spare takes its place--> FLUSHING / WAIT_STOP / GIVEN_UP   (as a fault)
    IDLE --a spare comes, the job below MAX nodes--> FLUSHING / WAIT_STOP / GIVEN_UP   (it grows)
    WAIT_STATUS --node lost in a live round, a spare ready--> FLUSHING / WAIT_STOP / GIVEN_UP   (a new round)
    FLUSHING --flush deadline--> WAIT_STOP                      (stopTrain sent)
    WAIT_STOP --all stopped--> WAIT_STRATEGIES                  (globalFault sent)
    WAIT_STRATEGIES --all reported / deadline--> WAIT_STATUS    (changeStrategy sent)
    WAIT_STATUS --all 0--> IDLE
    WAIT_STATUS --all 0, faults came meanwhile--> FLUSHING / WAIT_STOP / GIVEN_UP   (as from IDLE)
    WAIT_STATUS --failure / deadline--> WAIT_STATUS             (the next rung)
    WAIT_STOP / WAIT_STRATEGIES / WAIT_STATUS --failure that leaves only exit--> GIVEN_UP
    (an agent that exits, or whose stream ends for good, during a wait counts as a failed answer;
    once a member is gone the cycle's next rung is one its nodes need not all take part in:
    dump, or exit; unless a spare stands by: then the spare takes the lost node's seat and
    answers in its place, see :mod:`~taskd_core.controller.membership`)
    IDLE --every agent exited 0--> FINISHED

A report that does not fit the state, the cycle's uuid or the cycle's members
gets ``Code.ORDER_MIX`` with an info saying what the controller expects.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from taskd_core.controller.membership import (
    SHRUNK,
    NodeLossKind,
    decide_node_loss,
    growing_spare,
    grown_layout,
    is_node,
    live_nodes,
    shrunk_layout,
)
from taskd_core.errors import IllegalTransition
from taskd_core.models import (
    EXTRA_DUMP_EXIT,
    LADDER,
    RECOVER_VARIANTS,
    Action,
    Code,
    FaultRank,
    FaultType,
    JobPolicy,
    JobState,
    Resize,
    Signal,
    SignalType,
    Strategy,
)

#: The machine's states are a model value: ``taskd status`` and the query client show them.
State = JobState


#: What each state waits for, for ORDER_MIX answers and ``taskd status``.
EXPECTS = {
    State.IDLE: "no report: no recovery cycle is in flight",
    State.FLUSHING: "no report yet: the controller is collecting faults before it stops training",
    State.WAIT_STOP: "ReportStopComplete",
    State.WAIT_STRATEGIES: "ReportRecoverStrategy",
    State.WAIT_STATUS: "ReportRecoverStatus",
    State.FINISHED: "nothing: the job finished",
    State.GIVEN_UP: "nothing: the job was given up (killMaster sent)",
}


@dataclass(frozen=True, slots=True)
class Reply:
    """The ``Status`` an RPC answers with."""

    code: Code = Code.OK
    info: str = ""


@dataclass(frozen=True, slots=True)
class JournalEntry:
    kind: str
    cycle: int
    detail: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Reaction:
    """What handling one event asks the runtime to do, in this order:
    persist (if ``persist``), then send ``signals``, then answer ``reply``."""

    reply: Reply
    signals: tuple[Signal, ...] = ()
    journal: tuple[JournalEntry, ...] = ()
    persist: bool = False


@dataclass(slots=True)
class AgentInfo:
    """One registered agent of a job (mutable: exit code and last contact change)."""

    agent_id: str
    role: str = ""
    #: node rank, known only when the agent said which ranks it supervises.
    node_rank: int | None = None
    rank_ids: tuple[int, ...] = ()
    exit_code: int | None = None
    last_seen: float = 0.0
    #: hang-detection timeouts the agent last reported (not persisted: the next HealthCheck resends it).
    progress: str = ""
    #: the spare that took this lost node's place; the agent is fenced from then on (persisted, so
    #: a restarted controller or a new leader fences it too).
    replaced_by: str = ""


# --- events -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FaultReported:
    agent: str
    faults: tuple[FaultRank, ...]
    #: evidence for the journal (a hung rank's reason and stack); empty for most faults.
    detail: str = ""
    #: the seed API's fault codes, ``(rank, code)``, for the journal.
    codes: tuple[tuple[int, str], ...] = ()
    #: the cycle whose strategy started the failed workers (0: the first start); None: unknown.
    started_cycle: int | None = None


@dataclass(frozen=True, slots=True)
class StopReported:
    agent: str
    code: int
    uuid: str = ""


@dataclass(frozen=True, slots=True)
class StrategiesReported:
    agent: str
    strategies: tuple[str, ...]
    uuid: str = ""


@dataclass(frozen=True, slots=True)
class StatusReported:
    agent: str
    code: int
    strategy: str = ""
    uuid: str = ""


@dataclass(frozen=True, slots=True)
class DeadlinePassed:
    #: the snapshot's ``step`` when the timer was armed; a later step makes it stale.
    step: int


@dataclass(frozen=True, slots=True)
class AgentExited:
    agent: str
    code: int


@dataclass(frozen=True, slots=True)
class AgentLost:
    """The agent's node is lost: its signal stream ended and it did not subscribe again within the
    runtime's grace, or it sent no HealthCheck for the policy's ``node_lost_timeout``."""

    agent: str
    #: how the loss was found, for the journal.
    why: str = "its signal stream ended"


@dataclass(frozen=True, slots=True)
class SpareJoined:
    """A spare registered: a job with fewer than its policy's ``max_nodes`` nodes takes it as a new node."""

    agent: str


Event = (
    FaultReported
    | StopReported
    | StrategiesReported
    | StatusReported
    | DeadlinePassed
    | AgentExited
    | AgentLost
    | SpareJoined
)
Report = StopReported | StrategiesReported | StatusReported

_EVENT_NAMES: dict[type, str] = {
    FaultReported: "ReportProcessFault",
    StopReported: "ReportStopComplete",
    StrategiesReported: "ReportRecoverStrategy",
    StatusReported: "ReportRecoverStatus",
    DeadlinePassed: "deadline",
    AgentExited: "ReportAgentExit",
    AgentLost: "stream lost",
    SpareJoined: "a spare registered",
}


def new_cycle_uuid() -> str:
    """``HEX(unix-nanos)-<32 hex>``, the reference's event id format."""
    return f"{time.time_ns():x}-{secrets.token_hex(16)}"


@dataclass(slots=True)
class Snapshot:
    """Everything about a job's recovery that must survive a controller restart."""

    state: State = State.IDLE
    #: number of the cycle in flight or last run; also the cycles used so far.
    cycle: int = 0
    uuid: str = ""
    #: job-wide sequence number of the last non-keep-alive signal.
    seq: int = 0
    #: bumped on every state entry; deadline timers carry it to detect staleness.
    step: int = 0
    #: absolute wall-clock end of the current flush window or wait.
    deadline: float | None = None
    faults: dict[int, FaultType] = field(default_factory=dict)
    #: faults that arrived while waiting for recovery results: the next cycle's.
    pending: dict[int, FaultType] = field(default_factory=dict)
    #: agents that must answer in this cycle (those registered when it started).
    members: list[str] = field(default_factory=list)
    stops: dict[str, int] = field(default_factory=dict)
    strategies: dict[str, list[str]] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    #: strategy in flight (a Strategy value) and those tried in this cycle.
    strategy: str = ""
    tried: list[str] = field(default_factory=list)
    last_signal: Signal | None = None
    outcome: str = ""
    #: wall-clock starts of the cycles that still count against the budget.
    cycle_starts: list[float] = field(default_factory=list)
    #: ranks whose node was replaced for slowness (once per rank: slow again, they are only reported).
    slow_replaced: list[int] = field(default_factory=list)
    #: the job's nodes since it last shrank (0: it never did; the policy's ``expected_agents`` count).
    nodes: int = 0
    #: the :class:`~taskd_core.models.Resize` the cycle's ``recover`` carries (encoded), until it succeeds.
    resize: str = ""


def brief(names: Iterable[str], most: int = 5) -> str:
    """A readable list of agent names for messages, cut short for big jobs."""
    items = list(names)
    more = f" ... ({len(items)} in all)" if len(items) > most else ""
    return ", ".join(items[:most]) + more


def merge_faults(into: dict[int, FaultType], faults: Iterable[FaultRank]) -> None:
    """Add faults; a rank once seen with a non-retryable fault (death, hang) keeps that kind."""
    for fault in faults:
        known = into.get(fault.rank)
        if known is None or known.retryable:
            into[fault.rank] = fault.fault_type


class _Effects:
    """Collects what one handler does, then becomes a :class:`Reaction`."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.signals: list[Signal] = []
        self.journal: list[JournalEntry] = []


Handler = Callable[["JobMachine", Any, _Effects], Reply]


class JobMachine:
    """One job's recovery cycle. ``agents`` is the runtime's live agent table."""

    def __init__(
        self,
        job_id: str,
        policy: JobPolicy,
        agents: Mapping[str, AgentInfo],
        snapshot: Snapshot | None = None,
    ) -> None:
        self.job_id = job_id
        self.policy = policy
        self.agents = agents
        self.snap = snapshot or Snapshot()
        # Membership is checked on every report; a set keeps that O(1) for big jobs.
        self._members_of: list[str] | None = None
        self._member_set: frozenset[str] = frozenset()
        #: (state, event type) of the handler running: what _enter checks a transition against.
        self._handling: tuple[State, type] = (self.snap.state, type(None))
        #: members whose stream ended for good during the cycle in flight. Not persisted: after a
        #: controller restart every agent gets the grace again, and one still gone is lost again.
        self._lost: set[str] = set()
        #: lost nodes whose place waits for a spare, and since when (not persisted either).
        self._awaiting: dict[str, float] = {}

    @property
    def state(self) -> State:
        return self.snap.state

    def expects(self) -> str:
        if self.snap.state is State.WAIT_STATUS:
            return f"ReportRecoverStatus for strategy {self.snap.strategy!r}"
        return EXPECTS[self.snap.state]

    def handle(self, event: Event, now: float) -> Reaction:
        handler = _TABLE.get((self.snap.state, type(event)))
        if handler is None:
            if isinstance(event, (DeadlinePassed, AgentLost, SpareJoined)):
                return Reaction(Reply())
            return Reaction(self._order_mix(f"{_EVENT_NAMES[type(event)]} does not fit the job's state"))
        fx = _Effects(now)
        self._handling = (self.snap.state, type(event))
        reply = handler(self, event, fx)
        return Reaction(reply, tuple(fx.signals), tuple(fx.journal), persist=True)

    # --- helpers ------------------------------------------------------------

    def _order_mix(self, what: str) -> Reply:
        s = self.snap
        cycle = f" (cycle {s.cycle}, uuid {s.uuid})" if s.uuid else ""
        return Reply(
            Code.ORDER_MIX,
            f"jobId={self.job_id}: {what} {s.state.value}{cycle}; the controller expects {self.expects()}",
        )

    def _journal(self, fx: _Effects, kind: str, **detail: Any) -> None:
        fx.journal.append(JournalEntry(kind, self.snap.cycle, detail))

    def _enter(self, fx: _Effects, state: State, timeout: float | None) -> None:
        s = self.snap
        if state not in _TARGETS.get(self._handling, frozenset()):
            source, event = self._handling
            raise IllegalTransition(
                f"job {self.job_id}: {event.__name__} in {source.value} may not lead to {state.value}; "
                "declare the edge in machine._TARGETS (and the module's diagram) if it is meant"
            )
        self._journal(fx, "transition", source=s.state.value, target=state.value)
        s.state = state
        s.step += 1
        s.deadline = None if timeout is None else fx.now + timeout

    def _send(
        self,
        fx: _Effects,
        signal_type: SignalType,
        actions: Iterable[Action] = (),
        *,
        strategy: str = "",
        extra: str = "",
        with_faults: bool = True,
    ) -> None:
        s = self.snap
        s.seq += 1
        signal = Signal(
            signal_type=signal_type.value,
            job_id=self.job_id,
            uuid=s.uuid,
            actions=tuple(a.value for a in actions),
            fault_ranks=tuple(FaultRank(r, t) for r, t in sorted(s.faults.items())) if with_faults else (),
            change_strategy=strategy,
            node_rank_ids=self._fault_nodes() if with_faults else (),
            extra_params=extra,
            seq=s.seq,
            cycle=s.cycle,
        )
        s.last_signal = signal
        fx.signals.append(signal)
        self._journal(
            fx,
            "signal",
            type=signal.signal_type,
            seq=signal.seq,
            actions=list(signal.actions),
            strategy=strategy,
            extra=extra,
        )

    def _fault_nodes(self) -> tuple[str, ...]:
        """Node ranks of the agents that host a faulty rank, where agents said so."""
        nodes = {
            info.node_rank
            for info in self.agents.values()
            if info.node_rank is not None and not set(info.rank_ids).isdisjoint(self.snap.faults)
        }
        return tuple(str(n) for n in sorted(n for n in nodes if n is not None))

    def _silent(self, answers: Mapping[str, object]) -> list[str]:
        return [m for m in self.snap.members if m not in answers]

    def _complete(self, answers: Mapping[str, object]) -> bool:
        # Only members' answers are recorded, so counting is enough.
        return len(answers) >= max(len(self.snap.members), self._expected())

    def _expected(self) -> int:
        """The agents the job should have now: the policy's, or as many as are left after a shrink."""
        return self.snap.nodes or self.policy.expected_agents

    def _is_member(self, agent: str) -> bool:
        if self._members_of is not self.snap.members:
            self._members_of, self._member_set = self.snap.members, frozenset(self.snap.members)
        return agent in self._member_set

    def _shortfall(self, answers: Mapping[str, object]) -> list[str]:
        """Who failed to answer; a missing expected agent counts as one more."""
        missing = self._silent(answers)
        absent = self._expected() - len(self.snap.members)
        return missing + [f"<expected agent #{i + 1} never registered>" for i in range(max(0, absent))]

    def _check_report(self, event: Report) -> Reply | None:
        s = self.snap
        if event.uuid and event.uuid != s.uuid:
            return self._order_mix(f"stale uuid {event.uuid!r}: the report belongs to another cycle; state")
        if not self._is_member(event.agent):
            return self._order_mix(
                f"agent {event.agent!r} is not part of the cycle in flight "
                f"(members: {brief(s.members)}); state"
            )
        return None

    def _accepted(self, event: Report, answers: Mapping[str, object]) -> Reply | None:
        """None when the report is new; otherwise the reply to a rejected or repeated one."""
        bad = self._check_report(event)
        if bad is not None:
            return bad
        if event.agent in answers:
            return Reply(Code.OK, f"jobId={self.job_id}, uuid={self.snap.uuid}: repeated report ignored")
        return None

    def _receipt(self, event: Report) -> Reply:
        name = _EVENT_NAMES[type(event)]
        return Reply(Code.OK, f"jobId={self.job_id}, uuid={self.snap.uuid}, receive {name}")

    # --- faults and cycle start ---------------------------------------------

    def _fault_accepted(self, event: FaultReported, fx: _Effects, *, pending: bool = False) -> Reply:
        merge_faults(self.snap.pending if pending else self.snap.faults, event.faults)
        self._journal(
            fx,
            "fault",
            agent=event.agent,
            pending=pending,
            ranks={str(f.rank): f.fault_type.value for f in event.faults},
            **({"evidence": event.detail} if event.detail else {}),
            **({"codes": {str(rank): code for rank, code in event.codes}} if event.codes else {}),
        )
        return Reply(Code.OK, f"jobId={self.job_id}, receive ReportProcessFault")

    def _on_fault_idle(self, event: FaultReported, fx: _Effects) -> Reply:
        reply = self._fault_accepted(event, fx)
        self._begin(fx)
        return reply

    def _begin(self, fx: _Effects) -> None:
        """Faults are known and no cycle runs: flush, start, or give up."""
        used = self._cycles_counted(fx.now)
        if used >= self.policy.max_cycles:
            self._give_up(fx, self._budget_spent(used))
        elif self.policy.flush_seconds > 0:
            self._enter(fx, State.FLUSHING, self.policy.flush_seconds)
        else:
            self._start_cycle(fx)

    def _on_fault_merge(self, event: FaultReported, fx: _Effects) -> Reply:
        return self._fault_accepted(event, fx)

    def _on_fault_pending(self, event: FaultReported, fx: _Effects) -> Reply:
        covered = self._restarted_by_cycle(event)
        if not covered:
            return self._fault_accepted(event, fx, pending=True)
        # The peers of a dead rank fail their collective a moment later; when the report of
        # that arrives after the strategy went out, the cycle in flight has already replaced
        # them, and a second cycle would only restart the fresh workers again.
        self._journal(
            fx,
            "fault",
            agent=event.agent,
            pending=False,
            covered=self.snap.cycle,
            ranks={str(f.rank): f.fault_type.value for f in covered},
        )
        rest = tuple(f for f in event.faults if f not in covered)
        if rest:
            return self._fault_accepted(replace(event, faults=rest), fx, pending=True)
        cycle = self.snap.cycle
        return Reply(Code.OK, f"jobId={self.job_id}, receive ReportProcessFault (covered by cycle {cycle})")

    def _restarted_by_cycle(self, event: FaultReported) -> tuple[FaultRank, ...]:
        """The reported ranks the strategy in flight restarts, when they died as workers older than it."""
        if event.started_cycle is None or event.started_cycle >= self.snap.cycle:
            return ()
        strategy = Strategy(self.snap.strategy)
        if strategy is Strategy.RECOVER:
            return event.faults
        if strategy in (Strategy.RECOVER_IN_PLACE, Strategy.RECOVER_LIVE):
            return tuple(f for f in event.faults if f.rank in self.snap.faults)
        return ()

    def _on_flush_end(self, event: DeadlinePassed, fx: _Effects) -> Reply:
        if event.step == self.snap.step:
            self._start_cycle(fx)
        return Reply()

    def _cycles_counted(self, now: float) -> int:
        """Cycles that count against the budget now: those within the window (or all)."""
        window = self.policy.cycle_window
        if window <= 0:
            return self.snap.cycle
        return sum(1 for t in self.snap.cycle_starts if now - t < window)

    def _budget_spent(self, used: int) -> str:
        window, most = self.policy.cycle_window, self.policy.max_cycles
        if window <= 0:
            return (
                f"recovery cycle budget used up: {used} of {most} cycles over the job's life "
                "(policy max_cycles, cycle_window 0)"
            )
        return (
            f"recovery cycle budget used up: {used} cycles within the last {window:g} s, "
            f"budget {most} per {window:g} s (policy max_cycles, cycle_window)"
        )

    def _start_cycle(self, fx: _Effects) -> None:
        s = self.snap
        s.cycle += 1
        if self.policy.cycle_window > 0:
            # Only the starts still inside the window matter: the list stays short.
            s.cycle_starts = [t for t in s.cycle_starts if fx.now - t < self.policy.cycle_window] + [fx.now]
        s.uuid = new_cycle_uuid()
        s.members = sorted(a for a, info in self.agents.items() if info.exit_code is None and is_node(info))
        self._lost = set()
        s.stops, s.strategies, s.statuses = {}, {}, {}
        s.strategy, s.tried = "", []
        self._journal(
            fx,
            "cycle started",
            uuid=s.uuid,
            members=s.members,
            faults={str(rank): kind.value for rank, kind in s.faults.items()},
        )
        self._send(fx, SignalType.STOP_TRAIN, [Action.STOP_TRAIN])
        self._enter(fx, State.WAIT_STOP, self.policy.report_timeout)

    # --- waits ----------------------------------------------------------------

    def _on_deadline(self, event: DeadlinePassed, fx: _Effects) -> Reply:
        if event.step != self.snap.step:
            return Reply()
        waits: dict[State, Mapping[str, object]] = {
            State.WAIT_STOP: self.snap.stops,
            State.WAIT_STRATEGIES: self.snap.strategies,
            State.WAIT_STATUS: self.snap.statuses,
        }
        answers = waits[self.snap.state]
        self._journal(fx, "deadline", state=self.snap.state.value, silent=self._shortfall(answers))
        _CONCLUDE[self.snap.state](self, fx)
        return Reply()

    def _take(
        self, event: Report, fx: _Effects, answers: dict[str, Any], value: object, **detail: Any
    ) -> Reply:
        """Record one agent's answer; the last one concludes the wait."""
        early = self._accepted(event, answers)
        if early is not None:
            return early
        answers[event.agent] = value
        self._journal(fx, "report", agent=event.agent, **detail)
        receipt = self._receipt(event)
        if self._complete(answers):
            _CONCLUDE[self.snap.state](self, fx)
        return receipt

    def _on_stop(self, event: StopReported, fx: _Effects) -> Reply:
        return self._take(event, fx, self.snap.stops, event.code, step="stop", code=event.code)

    def _conclude_stop(self, fx: _Effects) -> None:
        s = self.snap
        failed = self._shortfall(s.stops) + [a for a, code in s.stops.items() if code != Code.OK]
        if failed:
            self._exit(fx, f"training could not be stopped on agent(s) {', '.join(failed)}")
            return
        actions = [Action.ON_GLOBAL_RANK]
        if self._fault_nodes() and not self._retryable():
            actions.append(Action.FAULT_NODES_EXIT)
        self._send(fx, SignalType.GLOBAL_FAULT, actions)
        self._enter(fx, State.WAIT_STRATEGIES, self.policy.report_timeout)

    def _on_strategies(self, event: StrategiesReported, fx: _Effects) -> Reply:
        names = list(event.strategies)
        return self._take(event, fx, self.snap.strategies, names, step="strategies", strategies=names)

    def _conclude_strategies(self, fx: _Effects) -> None:
        self._decide(fx, after=None)

    def _on_status(self, event: StatusReported, fx: _Effects) -> Reply:
        if not _same_strategy(event.strategy, self.snap.strategy):
            return self._order_mix(f"a result for strategy {event.strategy!r} does not fit state")
        return self._take(
            event, fx, self.snap.statuses, event.code, step="status", code=event.code, strategy=event.strategy
        )

    def _conclude_status(self, fx: _Effects) -> None:
        s = self.snap
        strategy = Strategy(s.strategy)
        failed = self._shortfall(s.statuses) + [a for a, code in s.statuses.items() if code != Code.OK]
        if strategy is Strategy.DUMP:
            self._journal(fx, "strategy result", strategy=strategy.value, failed=failed)
            self._send(
                fx,
                SignalType.CHANGE_STRATEGY,
                [Action.CHANGE_STRATEGY],
                strategy=Strategy.EXIT.value,
                extra=EXTRA_DUMP_EXIT,
            )
            departed = self._departed()
            why = f": {self._departed_reason(departed)}" if departed else ""
            self._give_up(fx, f"dump {'failed' if failed else 'done'}, job exits{why}")
        elif failed:
            self._journal(fx, "strategy failed", strategy=strategy.value, failed=failed)
            self._decide(fx, after=strategy)
        else:
            self._journal(fx, "cycle succeeded", strategy=strategy.value, uuid=s.uuid)
            self._enter(fx, State.IDLE, None)
            s.uuid, s.strategy, s.last_signal, s.faults = "", "", None, {}
            s.outcome = f"cycle {s.cycle} recovered by {strategy.value}"
            if s.resize:
                s.outcome += f" on {s.nodes} nodes"
                s.resize = ""
            # A spare that registered while this cycle ran was not offered growth then: now it is.
            grown = self._grow(fx)
            if s.pending:
                s.faults, s.pending = s.pending, {}
            if grown or s.faults:
                self._begin(fx)

    # --- strategy choice and the end of the road --------------------------------

    def _retryable(self) -> bool:
        """Retry fits only faults that are all retryable and all of one kind."""
        kinds = set(self.snap.faults.values())
        return len(kinds) == 1 and next(iter(kinds)).retryable

    def _common_strategies(self) -> set[str]:
        s = self.snap
        if self._shortfall(s.strategies):
            return set()
        sets = [set(s.strategies[m]) for m in s.members]
        return set.intersection(*sets) if sets else set()

    def _departed(self) -> list[str]:
        """Members that can no longer take part in the cycle: they exited, or their stream ended for good."""
        return [
            m
            for m in self.snap.members
            if m in self._lost or (info := self.agents.get(m)) is None or info.exit_code is not None
        ]

    def _decide(self, fx: _Effects, after: Strategy | None) -> None:
        s = self.snap
        common = self._common_strategies()
        start = LADDER.index(after) + 1 if after is not None else 0
        departed = self._departed()
        choice = Strategy.EXIT
        for rung in LADDER[start:]:
            if (
                rung in self.policy.strategies
                # A job that changes its nodes restarts whole: its ranks and world size change.
                and (not s.resize or rung in _RESIZING)
                and rung.value in common
                and rung.value not in s.tried
                and (rung is not Strategy.RETRY or self._retryable())
                # A restart of any kind needs every node's agent: the job's ranks are fixed.
                and (not departed or rung in _WITHOUT_EVERY_NODE)
            ):
                choice = rung
                break
        self._journal(
            fx,
            "strategy chosen",
            strategy=choice.value,
            reported=sorted(common),
            after=after.value if after else "",
            **({"departed": departed} if departed else {}),
        )
        if choice is Strategy.EXIT:
            if departed:
                reason = f"exit chosen: {self._departed_reason(departed)}"
            else:
                reason = "exit chosen: no allowed strategy was left to try" if s.tried else "exit chosen"
            self._exit(fx, reason)
            return
        s.strategy = choice.value
        s.tried.append(choice.value)
        s.statuses = {}
        variant = _VARIANT_EXTRA.get(choice)
        if variant is not None:
            self._send(
                fx,
                SignalType.CHANGE_STRATEGY,
                [Action.CHANGE_STRATEGY, Action.FAULT_NODES_RESTART],
                strategy=Strategy.RECOVER.value,
                extra=variant,
            )
        else:
            extra = s.resize if choice is Strategy.RECOVER else ""
            self._send(
                fx, SignalType.CHANGE_STRATEGY, [Action.CHANGE_STRATEGY], strategy=choice.value, extra=extra
            )
        self._enter(fx, State.WAIT_STATUS, self.policy.report_timeout)
        # The departed cannot answer this wait either: settled at once, not at its deadline.
        for agent in departed:
            s.statuses[agent] = int(Code.CLIENT_ERROR)
            self._journal(fx, "report", agent=agent, step=State.WAIT_STATUS.value, gone=True)
        if departed and self._complete(s.statuses):
            self._conclude_status(fx)

    def _departed_reason(self, departed: list[str]) -> str:
        return (
            f"agent(s) {brief(departed)} left the job during recovery cycle {self.snap.cycle} (exited, or "
            "their signal stream ended and did not come back): every restart needs all of the job's nodes, "
            "so the job ends; start it again"
        )

    def _exit(self, fx: _Effects, reason: str) -> None:
        self._send(fx, SignalType.CHANGE_STRATEGY, [Action.CHANGE_STRATEGY], strategy=Strategy.EXIT.value)
        self._give_up(fx, reason)

    def _give_up(self, fx: _Effects, reason: str) -> None:
        # extraParams carries the reason, so the agents can say why they end.
        self._send(fx, SignalType.KILL_MASTER, extra=reason, with_faults=False)
        self._enter(fx, State.GIVEN_UP, None)
        self.snap.outcome = reason
        self._journal(fx, "job given up", reason=reason)

    # --- agents -----------------------------------------------------------------

    def _on_agent_exit(self, event: AgentExited, fx: _Effects) -> Reply:
        self._journal(fx, "agent exit", agent=event.agent, code=event.code)
        if self.snap.state in _CONCLUDE:
            self._settle_gone(event.agent, fx)
        # Spares never ran a rank, and a replaced node's place is its spare's: only the nodes count.
        nodes = [info for info in self.agents.values() if is_node(info)]
        if (
            self.snap.state is State.IDLE
            and len(nodes) >= self._expected()
            and all(info.exit_code == Code.OK for info in nodes)
        ):
            self._enter(fx, State.FINISHED, None)
            self.snap.outcome = "job finished"
            self._journal(fx, "job finished", agents=sorted(self.agents))
        return Reply(Code.OK, f"jobId={self.job_id}, receive ReportAgentExit")

    def _on_agent_lost(self, event: AgentLost, fx: _Effects) -> Reply:
        """A node is lost: :func:`~taskd_core.controller.membership.decide_node_loss` says what follows.

        Replaced, the node's ranks count as faulty and a cycle runs (one starts
        when none is in flight: the survivors' ranks may wait for the lost node in
        a collective); given up, a wait in flight settles its answer as failed.
        """
        s = self.snap
        lost = self.agents.get(event.agent)
        if event.agent in self._lost:
            return Reply()  # given up in this cycle already
        self._journal(fx, "agent lost", agent=event.agent, why=event.why)
        if lost is None or not is_node(lost) or lost.exit_code is not None:
            return Reply()
        since = self._awaiting.get(event.agent, fx.now)
        decision = decide_node_loss(event.agent, self.agents, fx.now, self.policy, fx.now - since)
        if decision.kind is NodeLossKind.WAIT:
            if event.agent not in self._awaiting:
                self._awaiting[event.agent] = fx.now
                self._journal(fx, "node waits for a spare", agent=event.agent, reason=decision.reason)
            return Reply()
        self._awaiting.pop(event.agent, None)
        if decision.kind in (NodeLossKind.REPLACE, NodeLossKind.SHRINK):
            ranks = [FaultRank(rank, FaultType.NORMAL) for rank in lost.rank_ids]
            if decision.kind is NodeLossKind.SHRINK:
                in_flight = s.state is State.WAIT_STATUS
                if in_flight:
                    # The restart in flight has the old world size: the next cycle resizes.
                    merge_faults(s.pending, ranks)
                self._shrink(event.agent, decision.reason, fx)
                if in_flight:
                    return Reply()
            else:
                self._replace(event.agent, decision.spare, fx)
            if s.state is State.WAIT_STATUS and s.strategy != Strategy.RECOVER_LIVE.value:
                # The strategy in flight restarts every rank (the spare joins its restart):
                # the lost ranks are already covered by it.
                return Reply()
            merge_faults(s.faults, ranks)
            if s.state is State.WAIT_STATUS:
                # The live round in flight has the lost node's ranks in it and cannot form (its
                # state hand-over may have been under way): the next cycle's round, with the spare.
                self._journal(fx, "strategy failed", strategy=s.strategy, failed=[event.agent])
                self._enter(fx, State.IDLE, None)
                s.uuid, s.strategy, s.last_signal = "", "", None
                self._begin(fx)
                return Reply()
            if s.state is State.IDLE:
                self._begin(fx)
            return Reply()
        self._journal(fx, "node given up", agent=event.agent, reason=decision.reason)
        if s.state in _CONCLUDE:
            self._lost.add(event.agent)
            self._settle_gone(event.agent, fx)
        return Reply()

    def _on_spare_joined(self, event: SpareJoined, fx: _Effects) -> Reply:
        """A job below its ``max_nodes`` grows by a ready spare: a whole restart with one more node."""
        if self._grow(fx):
            self._begin(fx)
        return Reply()

    def _grow(self, fx: _Effects) -> bool:
        """Give the spare that grows the job (if any) the next node rank; the next cycle's ``recover``
        carries the layout. Only between cycles: no recover in flight has the old layout."""
        s = self.snap
        spare = growing_spare(self.agents, fx.now, self.policy)
        if spare is None:
            return False
        kept = tuple(range(len(live_nodes(self.agents))))
        node_rank, rank_ids = grown_layout(self.agents)
        self.agents[spare].node_rank, self.agents[spare].rank_ids = node_rank, rank_ids
        s.nodes, s.resize = len(kept) + 1, Resize(kept, added=1).encode()
        self._journal(fx, "job grown", agent=spare, nodes=s.nodes, node_rank=node_rank, ranks=list(rank_ids))
        return True

    def awaiting_spare(self) -> dict[str, float]:
        """Lost nodes whose place waits for a spare, and since when (the runtime offers them new spares)."""
        return dict(self._awaiting)

    def _replace(self, lost: str, spare: str, fx: _Effects) -> None:
        """``spare`` takes node ``lost``'s node rank, ranks and seat in the cycle in flight."""
        s = self.snap
        old, new = self.agents[lost], self.agents[spare]
        new.node_rank, new.rank_ids = old.node_rank, old.rank_ids
        old.replaced_by = spare
        if s.state in _CONCLUDE:
            s.members = sorted(spare if m == lost else m for m in s.members)
            for answers in (s.stops, s.strategies, s.statuses):
                answers.pop(lost, None)
        self._journal(
            fx, "node replaced", lost=lost, spare=spare, node_rank=old.node_rank, ranks=list(old.rank_ids)
        )

    def _shrink(self, lost: str, reason: str, fx: _Effects) -> None:
        """Drop node ``lost``: the others close up their node ranks and global ranks, and the cycle's
        ``recover`` carries the new layout (:class:`~taskd_core.models.Resize`)."""
        s = self.snap
        layout = shrunk_layout(lost, self.agents)
        by_new_rank = sorted(layout, key=lambda agent: layout[agent][0])
        kept = tuple(self.agents[agent].node_rank or 0 for agent in by_new_rank)
        previous = Resize.parse(s.resize)
        if previous is not None:
            # Shrunk again before the workers were restarted: their node ranks are still the first ones.
            kept = tuple(previous.kept[rank] for rank in kept)
        for agent, (node_rank, rank_ids) in layout.items():
            self.agents[agent].node_rank, self.agents[agent].rank_ids = node_rank, rank_ids
        # Fenced, and counted as ended: the job's end waits for the nodes left only.
        self.agents[lost].replaced_by, self.agents[lost].exit_code = SHRUNK, int(Code.NODE_REPLACED)
        s.nodes, s.resize = len(layout), Resize(kept).encode()
        self._journal(
            fx,
            "job shrunk",
            lost=lost,
            nodes=s.nodes,
            node_ranks={agent: layout[agent][0] for agent in by_new_rank},
            reason=reason,
        )
        if s.state in _CONCLUDE:
            s.members = [m for m in s.members if m != lost]
            waits: dict[State, dict[str, Any]] = {
                State.WAIT_STOP: s.stops,
                State.WAIT_STRATEGIES: s.strategies,
                State.WAIT_STATUS: s.statuses,
            }
            answers = waits[s.state]
            answers.pop(lost, None)
            if answers and self._complete(answers):
                _CONCLUDE[s.state](self, fx)

    def _settle_gone(self, agent: str, fx: _Effects) -> None:
        """A member that can no longer answer the wait in flight counts as having answered it failed.

        Waiting out the report timeout for it would change nothing but the delay: a failed stop
        or status moves down the ladder, no strategies leave only exit.
        """
        s = self.snap
        waits: dict[State, tuple[dict[str, Any], object]] = {
            State.WAIT_STOP: (s.stops, int(Code.CLIENT_ERROR)),
            State.WAIT_STRATEGIES: (s.strategies, []),
            State.WAIT_STATUS: (s.statuses, int(Code.CLIENT_ERROR)),
        }
        answers, failed = waits[s.state]
        if not self._is_member(agent) or agent in answers:
            return
        answers[agent] = failed
        self._journal(fx, "report", agent=agent, step=s.state.value, gone=True)
        if self._complete(answers):
            _CONCLUDE[s.state](self, fx)


#: The rungs a job that changes its nodes may take.
_RESIZING = frozenset({Strategy.RECOVER, Strategy.DUMP, Strategy.EXIT})

#: The rungs the agents still there can carry out once a member is gone.
_WITHOUT_EVERY_NODE = frozenset({Strategy.DUMP, Strategy.EXIT})

#: The ``recover`` variants and the ``extraParams`` each travels with.
_VARIANT_EXTRA = {strategy: extra for extra, strategy in RECOVER_VARIANTS.items()}


def _same_strategy(reported: str, decided: str) -> bool:
    """Agents report a ``recover`` variant as either name; empty means 'the one you sent'."""
    if not reported or reported == decided:
        return True
    return reported == Strategy.RECOVER.value and decided in {s.value for s in _VARIANT_EXTRA}


_CONCLUDE: dict[State, Callable[[JobMachine, _Effects], None]] = {
    State.WAIT_STOP: JobMachine._conclude_stop,
    State.WAIT_STRATEGIES: JobMachine._conclude_strategies,
    State.WAIT_STATUS: JobMachine._conclude_status,
}

_TABLE: dict[tuple[State, type], Handler] = {
    (State.IDLE, FaultReported): JobMachine._on_fault_idle,
    (State.FLUSHING, FaultReported): JobMachine._on_fault_merge,
    (State.FLUSHING, DeadlinePassed): JobMachine._on_flush_end,
    (State.WAIT_STOP, FaultReported): JobMachine._on_fault_merge,
    (State.WAIT_STOP, StopReported): JobMachine._on_stop,
    (State.WAIT_STOP, DeadlinePassed): JobMachine._on_deadline,
    (State.WAIT_STRATEGIES, FaultReported): JobMachine._on_fault_merge,
    (State.WAIT_STRATEGIES, StrategiesReported): JobMachine._on_strategies,
    (State.WAIT_STRATEGIES, DeadlinePassed): JobMachine._on_deadline,
    (State.WAIT_STATUS, FaultReported): JobMachine._on_fault_pending,
    (State.WAIT_STATUS, StatusReported): JobMachine._on_status,
    (State.WAIT_STATUS, DeadlinePassed): JobMachine._on_deadline,
    **{(state, AgentExited): JobMachine._on_agent_exit for state in State},
    **{(state, AgentLost): JobMachine._on_agent_lost for state in (State.IDLE, State.FLUSHING, *_CONCLUDE)},
    (State.IDLE, SpareJoined): JobMachine._on_spare_joined,
}

_CYCLE_START = frozenset({State.FLUSHING, State.WAIT_STOP, State.GIVEN_UP})
_AFTER_STOP = frozenset({State.WAIT_STRATEGIES, State.GIVEN_UP})
_AFTER_STRATEGIES = frozenset({State.WAIT_STATUS, State.GIVEN_UP})
_AFTER_STATUS = frozenset({State.IDLE, State.WAIT_STATUS}) | _CYCLE_START

#: The states each handler of :data:`_TABLE` may enter, through any chain of steps (a
#: recovered cycle enters IDLE and then the next cycle's first state); none for the others.
_TARGETS: dict[tuple[State, type], frozenset[State]] = {
    (State.IDLE, FaultReported): _CYCLE_START,
    (State.FLUSHING, DeadlinePassed): frozenset({State.WAIT_STOP}),
    (State.WAIT_STOP, StopReported): _AFTER_STOP,
    (State.WAIT_STOP, DeadlinePassed): _AFTER_STOP,
    (State.WAIT_STRATEGIES, StrategiesReported): _AFTER_STRATEGIES,
    (State.WAIT_STRATEGIES, DeadlinePassed): _AFTER_STRATEGIES,
    (State.WAIT_STATUS, StatusReported): _AFTER_STATUS,
    (State.WAIT_STATUS, DeadlinePassed): _AFTER_STATUS,
    (State.IDLE, AgentExited): frozenset({State.FINISHED}),
    # A node replaced by a spare while no cycle runs starts one; so does a spare the job grows by.
    (State.IDLE, AgentLost): _CYCLE_START,
    (State.IDLE, SpareJoined): _CYCLE_START,
    # An agent gone during a wait settles its answer, which may end the wait.
    **{
        (wait, gone): targets
        for wait, targets in (
            (State.WAIT_STOP, _AFTER_STOP),
            (State.WAIT_STRATEGIES, _AFTER_STRATEGIES),
            (State.WAIT_STATUS, _AFTER_STATUS),
        )
        for gone in (AgentExited, AgentLost)
    },
}
