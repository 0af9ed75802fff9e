"""Values shared by the controller, the client, the agent and the plugins.

Everything here is a frozen dataclass or a ``str``/``int`` enum, so values log
and serialise cleanly; protobuf messages never leave :mod:`taskd_core.rpc`.
The string values are the reference protocol's wire strings, spaces and case
included.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class Code(enum.IntEnum):
    """Return codes carried in ``Status.code`` (the reference's values)."""

    OK = 0
    #: client -> controller, downgrade: "please make isolateRankIds exit".
    EXIT_ISOLATE_RANKS = 201
    #: a report or fault for a job that was never registered.
    UNREGISTERED = 400
    #: a report that does not belong to the cycle step in flight (stale, stray, out of order).
    ORDER_MIX = 401
    JOB_NOT_EXIST = 402
    #: ``Init`` for a job whose policy turns process recovery off.
    RECOVERY_OFF = 403
    #: a request without the job's token or the admin token (the same wire value: a
    #: reference client stops on it instead of retrying).
    FORBIDDEN = 403
    #: client -> controller in ``ReportStopComplete``: training was not running yet.
    PROCESS_NOT_READY = 404
    RECOVERABLE_RETRY_ERROR = 405
    UNRECOVERABLE_RETRY_ERROR = 406
    DUMP_ERROR = 407
    #: ``Register`` before ``Init``.
    UNINIT = 408
    #: a request field that cannot be right (empty job id, rank "abc", fault type "7", ...).
    INVALID_PARAM = 409
    #: TaskD extension: the caller's node was declared lost and a spare took its place (fenced).
    NODE_REPLACED = 410
    #: client -> controller: generic failure of the requested action.
    CLIENT_ERROR = 499
    OUT_OF_MAX_JOBS = 500
    SERVER_INNER_ERROR = 599


#: Seconds an agent keeps trying to reach its controller before it gives up (its default); the
#: controller counts a silent job as abandoned only well after it (``Limits.abandon_after``).
CONNECT_TIMEOUT = 60.0

#: Words in the ``info`` of a 403 that refuses a caller's credentials; any other 403 from
#: ``Init`` means process recovery is off (the reference's meaning, which its clients keep).
PERMISSION_DENIED_INFO = "permission denied"


class FaultType(str, enum.Enum):
    """Kind of a rank's fault, as the reference encodes it (decimal strings).

    "0".."2" are the reference's values; "3" is TaskD's own: the rank stopped
    making progress (hung) and was killed after its stack was taken.
    """

    ON_CHIP_MEMORY = "0"
    NORMAL = "1"
    NETWORK = "2"
    HANG = "3"

    @property
    def retryable(self) -> bool:
        """Whether an in-process step retry can fix it (not for a dead or hung rank)."""
        return self not in (FaultType.NORMAL, FaultType.HANG)


class Strategy(str, enum.Enum):
    """Recovery strategies, in the order the controller tries them (the ladder)."""

    RETRY = "retry"
    #: healthy ranks keep running; lost ranks are replaced and get the state
    #: from a live replica (workers opt in through a framework's live API).
    RECOVER_LIVE = "recover-live"
    RECOVER_IN_PLACE = "recover-in-place"
    RECOVER = "recover"
    DUMP = "dump"
    EXIT = "exit"


#: The strategy ladder: the controller picks the first allowed, reported rung
#: and moves down on failure.
LADDER: tuple[Strategy, ...] = tuple(Strategy)


class SignalType(str, enum.Enum):
    """``ProcessManageSignal.signalType`` values the controller sends."""

    KEEP_ALIVE = "keep-alive"
    STOP_TRAIN = "stopTrain"
    GLOBAL_FAULT = "globalFault"
    CHANGE_STRATEGY = "changeStrategy"
    KILL_MASTER = "killMaster"


class Action(str, enum.Enum):
    """``ProcessManageSignal.actions`` values the agent acts on."""

    STOP_TRAIN = "stop_train"
    ON_GLOBAL_RANK = "on_global_rank"
    CHANGE_STRATEGY = "change_strategy"
    FAULT_NODES_EXIT = "fault_nodes_exit"
    FAULT_NODES_RESTART = "fault_nodes_restart"


#: ``extraParams`` marking a ``recover`` that restarts only the faulty ranks.
EXTRA_RECOVER_IN_PLACE = "recover-in-place"
#: ``extraParams`` marking a ``recover`` that replaces the faulty ranks while the
#: others keep running and hand them the job's state (live recovery).
EXTRA_RECOVER_LIVE = "recover-live"
#: ``recover`` variants that travel as ``recover`` plus an ``extraParams`` marker.
RECOVER_VARIANTS: dict[str, Strategy] = {
    EXTRA_RECOVER_IN_PLACE: Strategy.RECOVER_IN_PLACE,
    EXTRA_RECOVER_LIVE: Strategy.RECOVER_LIVE,
}
#: ``extraParams`` of the ``exit`` that follows a dump.
EXTRA_DUMP_EXIT = "dump_exit"
#: ``extraParams`` prefix of a ``recover`` that also changes the job's nodes (see :class:`Resize`).
EXTRA_RESIZE = "resize:"


@dataclass(frozen=True, slots=True)
class Resize:
    """A whole-group restart with another set of nodes: the job shrank or grew (``--nnodes=MIN:MAX``).

    Travels as the ``recover`` signal's ``extraParams``: ``resize:``, the node
    ranks the nodes kept had before, in the order of their new node ranks, and
    ``+N`` when N nodes join after them (``resize:0,2``: old node 0 stays node 0,
    old node 2 becomes node 1, the job has two nodes; ``resize:0,1+1``: a third
    node joins as node 2). Every node's global ranks follow its node rank, contiguously.
    """

    #: the node ranks kept, in their new order.
    kept: tuple[int, ...]
    #: nodes that join, numbered after the kept ones (they know their node rank already).
    added: int = 0

    @property
    def nodes(self) -> int:
        return len(self.kept) + self.added

    def encode(self) -> str:
        return EXTRA_RESIZE + ",".join(str(n) for n in self.kept) + (f"+{self.added}" if self.added else "")

    def node_rank(self, old: int) -> int:
        """The new node rank of the node that had node rank ``old`` (a joining node keeps its own).

        :raises ValueError: when that node is neither kept nor joining.
        """
        if old in self.kept:
            return self.kept.index(old)
        if len(self.kept) <= old < self.nodes:
            return old
        raise ValueError(f"node {old} is not one of the job's nodes after the resize {self.encode()!r}")

    @classmethod
    def parse(cls, extra: str) -> Resize | None:
        """The resize an ``extraParams`` carries; None for any other ``extraParams``."""
        if not extra.startswith(EXTRA_RESIZE):
            return None
        kept_text, _, added_text = extra[len(EXTRA_RESIZE) :].partition("+")
        try:
            kept = tuple(int(n) for n in kept_text.split(","))
            added = int(added_text) if added_text else 0
        except ValueError:
            return None
        valid = kept and min(kept) >= 0 and len(set(kept)) == len(kept) and added >= 0
        return cls(kept, added) if valid else None


#: ``ClientInfo.role`` of a spare: a launcher of the job that stands by, with no workers, to take
#: the place of a lost node (docs/node-loss.md).
SPARE_ROLE = "spare"


@dataclass(frozen=True, slots=True)
class FaultRank:
    """One faulty process: its global rank and the kind of fault."""

    rank: int
    fault_type: FaultType = FaultType.NORMAL


@dataclass(frozen=True, slots=True)
class Signal:
    """A ``ProcessManageSignal`` as the client and agent see it."""

    signal_type: str
    job_id: str = ""
    uuid: str = ""
    actions: tuple[str, ...] = ()
    fault_ranks: tuple[FaultRank, ...] = ()
    change_strategy: str = ""
    timeout: int = 0
    node_rank_ids: tuple[str, ...] = ()
    extra_params: str = ""
    #: job-wide sequence number; 0 for keep-alive and for legacy controllers.
    seq: int = 0
    cycle: int = 0

    @property
    def strategy(self) -> Strategy | None:
        """The strategy this signal asks for, with the ``recover`` variants decoded."""
        if self.change_strategy == Strategy.RECOVER and self.extra_params in RECOVER_VARIANTS:
            return RECOVER_VARIANTS[self.extra_params]
        try:
            return Strategy(self.change_strategy)
        except ValueError:
            return None


class WorkerState(str, enum.Enum):
    """What a monitor hook says about one local worker."""

    RUNNING = "running"
    #: exited; ``WorkerStatus.exit_code`` says how (negative: killed by that signal).
    EXITED = "exited"
    NOT_STARTED = "not-started"
    #: the pid vanished without an exit code the adapter could read.
    GONE = "gone"


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One local worker as the adapter's monitor hook reports it."""

    local_rank: int
    global_rank: int
    state: WorkerState
    pid: int | None = None
    exit_code: int | None = None

    @property
    def failed(self) -> bool:
        return self.state is WorkerState.GONE or (self.state is WorkerState.EXITED and self.exit_code != 0)

    @property
    def succeeded(self) -> bool:
        return self.state is WorkerState.EXITED and self.exit_code == 0


class WorkerEventKind(str, enum.Enum):
    """What happened to a worker process, as an agent reports it for the journal."""

    STARTED = "started"
    EXITED = "exited"
    #: training resumed with ``WorkerEvent.step`` steps done (``taskd_core.worker.resumed``).
    RESUMED = "resumed"
    #: the first step after resuming is done; ``WorkerEvent.step`` is the steps done by then.
    STEPPING = "stepping"


@dataclass(frozen=True, slots=True)
class WorkerEvent:
    """One worker incarnation's start, end or resumption (``ReportWorkerEvents``)."""

    kind: WorkerEventKind
    rank: int
    local_rank: int
    pid: int
    #: Unix time by the reporting agent's clock.
    time: float
    exit_code: int | None = None
    step: int | None = None


@dataclass(frozen=True, slots=True)
class RankWork:
    """How long one rank worked over its latest steps (``worker.step(n, busy=...)``, ``LiveSession``).

    Work is a step's time less its waits in collectives: in synchronous
    training every rank's step takes as long as the slowest rank's, and only
    the work tells which rank that is. The controller compares ranks' work per
    step to find a slow rank (``slow-rank`` events).
    """

    rank: int
    pid: int
    #: steps done when the sample ends.
    step: int
    #: how many steps the sample covers (it ends at ``step``).
    steps: int
    #: seconds of work over those steps.
    busy: float


@dataclass(frozen=True, slots=True)
class JournalEvent:
    """One entry of a job's event journal (docs/events.md describes the kinds and details)."""

    seq: int
    time: float
    job_id: str
    cycle: int
    kind: str
    detail: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        """The stable JSON-lines form of ``taskd events --json`` (schema version 1)."""
        return {
            "schema": 1,
            "seq": self.seq,
            "time": self.time,
            "job": self.job_id,
            "cycle": self.cycle,
            "kind": self.kind,
            "detail": dict(self.detail),
        }


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a client shows the controller: TLS files (paths) and the job's secret token.

    Plain values, so settings can carry them without importing gRPC;
    :mod:`taskd_core.rpc.security` turns them into a channel. The token never
    appears in a repr (and so in no log line).
    """

    #: CA bundle that signed the controller's certificate; empty: plaintext.
    tls_ca: str = ""
    #: this client's certificate and key, for controllers that require mutual TLS.
    tls_cert: str = ""
    tls_key: str = ""
    #: the job's token (``TASKD_JOB_TOKEN``) or an admin token; empty: none sent.
    token: str = field(default="", repr=False)
    #: identity of one launch of a job, shared by its nodes; empty: none sent.
    launch: str = ""

    @classmethod
    def from_env(
        cls, env: Mapping[str, str], *, tls_ca: str | None = None, token: str | None = None
    ) -> Credentials:
        """``TASKD_TLS_CA``/``TASKD_TLS_CERT``/``TASKD_TLS_KEY``/``TASKD_JOB_TOKEN``; arguments win."""
        return cls(
            tls_ca=env.get("TASKD_TLS_CA", "").strip() if tls_ca is None else tls_ca,
            tls_cert=env.get("TASKD_TLS_CERT", "").strip(),
            tls_key=env.get("TASKD_TLS_KEY", "").strip(),
            token=env.get("TASKD_JOB_TOKEN", "").strip() if token is None else token,
        )


class SlowRankPolicy(str, enum.Enum):
    """What the controller does with a rank slower than its peers (``slow-rank`` events)."""

    #: journal it, count it, show it; nothing else.
    WARN = "warn"
    #: also drain its node onto a waiting hot spare, as for a lost node (once per rank).
    REPLACE = "replace"


@dataclass(frozen=True, slots=True)
class JobPolicy:
    """How the controller recovers one job."""

    #: chosen only where every agent reports it too, so offering live recovery
    #: by default costs nothing for jobs whose workers do not opt in.
    strategies: tuple[Strategy, ...] = (
        Strategy.RECOVER_LIVE,
        Strategy.RECOVER_IN_PLACE,
        Strategy.RECOVER,
        Strategy.DUMP,
        Strategy.EXIT,
    )
    recovery_enabled: bool = True
    #: deadline of each wait for the agents' reports (the reference waits 15 min).
    report_timeout: float = 900.0
    #: window that collects faults arriving together before the cycle starts. Faults
    #: that come later still join the cycle until its strategy is chosen, so the
    #: window only has to cover near-simultaneous faults (the reference waits 1 s).
    flush_seconds: float = 0.1
    #: recovery cycles allowed within ``cycle_window`` before the job is given up.
    max_cycles: int = 3
    #: seconds over which ``max_cycles`` is counted (a cycle older than this no
    #: longer counts, so a long job is not killed by its 4th fault ever); 0
    #: counts over the job's whole life.
    cycle_window: float = 3600.0
    #: agents the job should have; 0 means whoever registered.
    expected_agents: int = 0
    #: fewest nodes the job may shrink to when a node is lost and no spare stands by
    #: (``taskdrun --nnodes=MIN:MAX``); 0: the job never shrinks.
    min_nodes: int = 0
    #: most nodes the job may grow to when a launcher with its command line comes while it has
    #: fewer (``taskdrun --nnodes=MIN:MAX``); 0: the job never grows (such a launcher stands by as a spare).
    max_nodes: int = 0
    #: seconds without a HealthCheck after which a node's agent counts as lost (its machine
    #: hangs or is cut off) and a waiting spare takes its place (docs/node-loss.md).
    node_lost_timeout: float = 5.0
    #: seconds a lost node's place is kept open for a spare to come when none is ready (0: none:
    #: the node is given up at once); past it the job ends, naming the node.
    spare_wait: float = 0.0
    #: what a slow rank gets (``taskd_core.controller.slowrank``).
    slow_rank: SlowRankPolicy = SlowRankPolicy.WARN
    #: a rank whose work per step is at least this many times its peers' median is slow (0: the
    #: bound is learned from the job's own ratios, 1.6 until then)...
    slow_rank_bound: float = 0.0
    #: ...measured over this many steps (and held for three tenths of them).
    slow_rank_window: int = 20
    extra: dict[str, str] = field(default_factory=dict, compare=False, hash=False)


# --- what a controller answers about its jobs (QueryStatus, QueryEvents) ---------------------


class JobState(str, enum.Enum):
    """Where a job's recovery stands: the controller's state machine's states."""

    IDLE = "idle"
    FLUSHING = "flushing"
    WAIT_STOP = "wait-stop"
    WAIT_STRATEGIES = "wait-strategies"
    WAIT_STATUS = "wait-status"
    FINISHED = "finished"
    GIVEN_UP = "given-up"


@dataclass(frozen=True, slots=True)
class AgentStatus:
    """One agent of a job as its controller sees it."""

    agent_id: str
    role: str
    #: it holds its signal stream now.
    subscribed: bool
    #: None when the agent did not say (a reference-style client).
    node_rank: int | None
    #: what its ``ReportAgentExit`` said (0: every local worker exited 0); None while it runs.
    exit_code: int | None
    #: Unix time of its last contact, by the controller's clock.
    last_seen: float
    #: the hang-detection timeouts in use, as the agent's last HealthCheck described them.
    hang_timeouts: str = ""


@dataclass(frozen=True, slots=True)
class SlowRankStatus:
    """A rank slower than its peers now, as the controller found it (``slow-rank`` events)."""

    rank: int
    pid: int
    #: its work per step over its peers' median, at the latest step compared.
    ratio: float
    #: its work per step when it was found (seconds), and its peers' median then.
    work: float
    peer_work: float
    #: the step from which it was slow, and the controller's Unix time when it was found.
    since_step: int
    since: float

    def describe(self) -> str:
        """One line for ``taskd status``."""
        return (
            f"rank {self.rank} (pid {self.pid}) slow since step {self.since_step}: "
            f"{self.work * 1000:.1f} ms of work per step, its peers {self.peer_work * 1000:.1f} ms "
            f"({self.ratio:.2f}x now)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "pid": self.pid,
            "ratio": self.ratio,
            "work_per_step": self.work,
            "peer_work_per_step": self.peer_work,
            "since_step": self.since_step,
            "since": self.since,
        }


@dataclass(frozen=True, slots=True)
class JobStatus:
    """One job as its controller sees it: state, cycle, policy, agents and newest journal entries."""

    job_id: str
    state: JobState
    #: the recovery cycle in flight, else the last one (0: none yet).
    cycle: int
    #: the strategy in flight; None between cycles.
    strategy: Strategy | None
    #: the faulty ranks of the cycle in flight.
    faults: tuple[FaultRank, ...]
    #: the strategies the job's policy allows, in ladder order.
    strategies: tuple[Strategy, ...]
    cycles_used: int
    max_cycles: int
    agents: tuple[AgentStatus, ...]
    #: the newest journal entries asked for, oldest first.
    events: tuple[JournalEvent, ...]
    #: how the last cycle ended, or what the job waits for now.
    outcome: str
    #: registered without a token (a reference-style client).
    legacy: bool = False
    #: ranks slower than their peers now (``slow-rank`` events), by rank.
    slow_ranks: tuple[SlowRankStatus, ...] = ()
    #: the slow-rank bound the job's detector uses now (0: not known), and whether it was learned
    #: from the job's own ratios (the policy gives none) or is the policy's or, before learning, the default.
    slow_rank_bound: float = 0.0
    slow_rank_bound_learned: bool = False

    def to_json(self) -> dict[str, Any]:
        """The JSON form ``taskd status --json`` prints per job (docs/events.md)."""
        return {
            "job": self.job_id,
            "state": self.state.value,
            "cycle": self.cycle,
            "strategy": None if self.strategy is None else self.strategy.value,
            "faults": [{"rank": f.rank, "fault_type": f.fault_type.value} for f in self.faults],
            "strategies": [s.value for s in self.strategies],
            "cycles_used": self.cycles_used,
            "max_cycles": self.max_cycles,
            "agents": [
                {
                    "agent": a.agent_id,
                    "role": a.role,
                    "subscribed": a.subscribed,
                    "node_rank": a.node_rank,
                    "exit_code": a.exit_code,
                    "last_seen": a.last_seen,
                    "hang_timeouts": a.hang_timeouts,
                }
                for a in self.agents
            ],
            "events": [e.to_json() for e in self.events],
            "outcome": self.outcome,
            "legacy": self.legacy,
            "slow_ranks": [r.to_json() for r in self.slow_ranks],
            "slow_rank_bound": self.slow_rank_bound,
            "slow_rank_bound_learned": self.slow_rank_bound_learned,
        }


@dataclass(frozen=True, slots=True)
class ControllerStatus:
    """A controller's whole answer to a status query: the jobs the caller may see, and who leads.

    ``leader`` is the address of the replica that leads (as it advertises itself) and
    ``leader_generation`` its term's number; a lone controller on SQLite leads for good: 0.
    """

    jobs: tuple[JobStatus, ...]
    leader: str = ""
    leader_generation: int = 0

    def to_json(self) -> dict[str, Any]:
        """What ``taskd status --json`` prints (schema version 1, docs/events.md)."""
        return {
            "schema": 1,
            "leader": self.leader,
            "leader_generation": self.leader_generation,
            "jobs": [job.to_json() for job in self.jobs],
        }


@dataclass(frozen=True, slots=True)
class JournalPage:
    """Entries of a job's journal after a cursor, oldest first, and the job's state when they were read."""

    events: tuple[JournalEvent, ...]
    state: JobState
