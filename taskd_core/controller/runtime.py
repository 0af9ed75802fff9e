"""The controller's runtime: jobs, their agents and streams, timers and persistence.

Every method runs on the controller's event loop thread, which is the only
thread that touches job state, so nothing here takes a lock. A transition
changes the job's machine at once, then *awaits* its write
(:meth:`~taskd_core.controller.store.StateStore.write`) before its signals go
out and its reply is given: writes are applied in the order they are made,
so signals leave in transition order too, and an agent is never sent (nor,
subscribing, re-sent) a signal that is not durable. A write that fails
because this replica lost its lease raises
:class:`~taskd_core.errors.LeadershipLostError`; the replica then drops this
controller and its state (:mod:`~taskd_core.controller.replica`).
Requests come in as :mod:`taskd_core.models` values from the service layer;
refusals are raised as :class:`~taskd_core.errors.RequestRejected` carrying
the wire code, and the service turns them into ``Status`` or gRPC errors.

Each job carries its :class:`~taskd_core.controller.access.Claim` (token
digest, launch identity, start); every RPC for a job is checked against it
before it touches the job. A job that ended is retired when a new launch
registers its id; one that has not ended only when a new launch *of the same
token* registers it after the job was silent for ``Limits.abandon_after`` (its
agents have given up by then), or when the admin token does. Jobs and their
inputs are bounded by :class:`Limits`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from taskd_core.controller.access import (
    AccessRules,
    Claim,
    check_claim,
    check_new_claim,
    check_policy_change,
    forbidden,
    journal_since,
    may_see,
)
from taskd_core.controller.machine import (
    AgentExited,
    AgentInfo,
    AgentLost,
    DeadlinePassed,
    Event,
    FaultReported,
    JobMachine,
    JournalEntry,
    Reply,
    Snapshot,
    SpareJoined,
    State,
    brief,
)
from taskd_core.controller.membership import SHRUNK, can_shrink, is_node, is_spare, ready_spares
from taskd_core.controller.policy import PolicyBook, policy_from_dict, policy_to_dict, updated_policy
from taskd_core.controller.quotas import Quotas, RateLimits
from taskd_core.controller.slowrank import (
    Finding,
    SlowRankAction,
    SlowRankConfig,
    SlowRankDetector,
    SlowRankFound,
    finding_detail,
    findings,
)
from taskd_core.controller.slowrank import decide as decide_slow_rank
from taskd_core.controller.store import (
    Commit,
    DropAgents,
    EventRecord,
    Forget,
    JobRow,
    StateStore,
    StoredJob,
    Write,
    journal_detail,
    snapshot_from_dict,
    snapshot_to_dict,
)
from taskd_core.controller.subscriber import Subscriber
from taskd_core.errors import (
    DuplicateSubscriberError,
    LeadershipLostError,
    QuotaExceededError,
    RequestRejected,
    TaskdError,
)
from taskd_core.models import (
    CONNECT_TIMEOUT,
    SPARE_ROLE,
    AgentStatus,
    Code,
    FaultRank,
    JobPolicy,
    JobStatus,
    JournalEvent,
    JournalPage,
    RankWork,
    Signal,
    SignalType,
    SlowRankPolicy,
    Strategy,
    WorkerEvent,
)
from taskd_core.rpc.convert import detail_of
from taskd_core.rpc.security import Caller, token_digest

logger = logging.getLogger(__name__)

MAX_JOB_ID = 256
#: Seconds an agent whose signal stream ended has to subscribe again before the wait in flight
#: counts it as a failed answer.
LIVE_GRACE = 30.0
#: Seconds past the agents' own connect timeout before a silent job counts as abandoned: an agent
#: frozen (a GC pause, a partition) for less comes back to its job, never to an id taken over.
ABANDON_MARGIN = 30.0
#: Least seconds between two journal entries about refused requests of one job (log floods stay out).
DENIAL_JOURNAL_INTERVAL = 1.0
#: Journal entries one QueryEvents answer carries at most.
EVENTS_PAGE = 1000
_TERMINAL = (State.FINISHED, State.GIVEN_UP)
#: Seconds a node's closed signal stream may take to come back while a spare stands by: a
#: client re-subscribes within its first backoff step, a machine that died does not at all.
STREAM_CLOSED_GRACE = 0.5
#: Seconds a node loaded from the state (a new leader took over) has to subscribe while a spare
#: stands by: its agent retries a standby at most 0.25 s apart (``client.manager.FOLLOW_CAP``) and
#: follows the leader it names at once (three RPCs: Init, Register, Subscribe), so four of those
#: gaps leave room for a loaded machine; one lost with the previous leader never comes.
TAKEOVER_GRACE = 1.0
#: How often the runtime looks for nodes whose HealthChecks stopped (a hung or cut-off machine).
NODE_WATCH_INTERVAL = 0.25
_ANONYMOUS = Caller()


class JournalObserver(Protocol):
    """Told about every journal entry as it is committed (the metrics hook); runs on the loop."""

    def journalled(self, job_id: str, entries: Sequence[JournalEntry], now: float) -> None: ...


@dataclass(frozen=True, slots=True)
class Limits:
    """How much one controller keeps, so that no client can exhaust it."""

    #: jobs one controller serves (the reference's limit), counting every job any RPC created;
    #: when full, the oldest ended or abandoned job is evicted to make room.
    max_jobs: int = 10_000
    #: agents one job may register.
    max_agents: int = 4096
    #: distinct faulty ranks one job may hold when its agents did not say how many ranks it has.
    max_faults: int = 65_536
    #: seconds a job whose agents hold no signal stream still counts as live after their last
    #: contact; only then may a new launch of the same token take its id over.
    abandon_after: float = CONNECT_TIMEOUT + ABANDON_MARGIN


@dataclass(frozen=True, slots=True)
class AgentIdentity:
    """Who calls: a job's agent as its ``ClientInfo`` describes it."""

    job_id: str
    role: str = ""
    agent_id: str = ""
    node_rank: int | None = None
    rank_ids: tuple[int, ...] = ()

    @property
    def key(self) -> str:
        """The agent's name in its job: agentId, else (legacy clients) the role."""
        return self.agent_id or self.role or "agent"


@dataclass(frozen=True, slots=True)
class ControllerGauges:
    """What a metrics scrape reads from the live controller."""

    jobs_by_state: Mapping[State, int]
    agents_registered: int
    agents_connected: int
    journal_entries: int
    #: writes made but not durable yet (held while the storage refuses them).
    writes_held: int = 0
    #: writes the storage refused so far (each try counts).
    write_failures: int = 0
    #: ranks slower than their peers now, over every job.
    slow_ranks: int = 0


def worker_detail(agent: str, event: WorkerEvent) -> dict[str, object]:
    """A worker event as its journal detail (the ``worker *`` kinds of docs/events.md)."""
    detail: dict[str, object] = {
        "agent": agent,
        "rank": event.rank,
        "local_rank": event.local_rank,
        "pid": event.pid,
        "at": event.time,
    }
    if event.exit_code is not None:
        detail["exit_code"] = event.exit_code
    if event.step is not None:
        detail["step"] = event.step
    return detail


def slow_rank_config(policy: JobPolicy) -> SlowRankConfig:
    """The slow-rank detection a job's policy asks for."""
    return SlowRankConfig(bound=policy.slow_rank_bound, window=policy.slow_rank_window)


def journal_event(record: EventRecord) -> JournalEvent:
    """A stored journal entry as the model value the query RPCs answer with."""
    detail = detail_of(record.detail)
    return JournalEvent(record.seq, record.time, record.job_id, record.cycle, record.kind, detail)


def check_job_id(job_id: str) -> str:
    if not job_id:
        raise RequestRejected(
            Code.INVALID_PARAM, "jobId is empty; set ClientInfo.jobId to the job's unique id"
        )
    if len(job_id) > MAX_JOB_ID or not job_id.isprintable():
        raise RequestRejected(
            Code.INVALID_PARAM,
            f"jobId {job_id[:40]!r}... must be printable and at most {MAX_JOB_ID} characters",
        )
    return job_id


class _Job:
    """A job's live state: the machine plus what only exists while running."""

    __slots__ = (
        "agents",
        "claim",
        "denied_at",
        "inited",
        "lost",
        "machine",
        "had_spares",
        "peer",
        "sent",
        "slow",
        "slow_waiting",
        "subscribers",
        "timer",
        "timer_step",
    )

    def __init__(self, job_id: str, policy: JobPolicy, snapshot: Snapshot | None = None) -> None:
        self.agents: dict[str, AgentInfo] = {}
        #: a spare registered for this job once: silent nodes are watched during its cycles too.
        self.had_spares = False
        #: who registered the job; None until its first Init (a job SetJobPolicy created).
        self.claim: Claim | None = None
        #: the host whose Init claimed the job ("" when unknown: restored, or created by SetJobPolicy).
        self.peer = ""
        self.denied_at = float("-inf")
        self.inited = False
        self.machine = JobMachine(job_id, policy, self.agents, snapshot)
        self.subscribers: dict[str, Subscriber] = {}
        #: the job's slow-rank detection, from its ranks' work per step (not persisted: a window of
        #: fresh reports rebuilds it; the ranks replaced for slowness are: ``snap.slow_replaced``).
        self.slow = SlowRankDetector(slow_rank_config(policy))
        #: findings the replace policy left for now (no spare ready, a recovery in flight).
        self.slow_waiting: list[Finding] = []
        self.timer: asyncio.TimerHandle | None = None
        self.timer_step = -1
        #: agents whose stream ended: when each counts as lost for good unless it subscribes again.
        self.lost: dict[str, asyncio.TimerHandle] = {}
        #: the newest signal whose transition is durable: what a (re-)subscribing agent is sent.
        self.sent: Signal | None = self.machine.snap.last_signal

    @property
    def job_id(self) -> str:
        return self.machine.job_id


def _changed_by_loss(job: _Job, lost: AgentInfo) -> Iterator[AgentInfo]:
    """The agents a node loss changes, written with it: the fenced node and the spare in its place.

    A generator on purpose: :meth:`Controller._apply` reads it only once the machine decided.
    Persisting the fence is what keeps a replaced node refused by a restarted controller or a new
    leader.
    """
    yield lost
    spare = job.agents.get(lost.replaced_by) if lost.replaced_by else None
    if spare is not None:
        yield spare


class Controller:
    """All jobs of one controller. Create, :meth:`start` and :meth:`close` on its loop."""

    def __init__(
        self,
        store: StateStore,
        policies: PolicyBook,
        *,
        keepalive_interval: float = 5.0,
        stream_grace: float = LIVE_GRACE,
        limits: Limits | None = None,
        clock: Callable[[], float] = time.time,
        access: AccessRules | None = None,
        observer: JournalObserver | None = None,
        quotas: Quotas | None = None,
    ) -> None:
        self._store = store
        self._access = access or AccessRules()
        self._observer = observer
        self._policies = policies
        self._keepalive_interval = keepalive_interval
        self._stream_grace = stream_grace
        self._limits = limits or Limits()
        self._clock = clock
        self._jobs: dict[str, _Job] = {}
        self._quotas = quotas or Quotas()
        self._rates = RateLimits(self._quotas)
        #: ids of the jobs each token digest holds, and each host claimed (the quotas count them).
        self._by_token: dict[str, set[str]] = {}
        self._by_peer: dict[str, set[str]] = {}
        #: agents of every job together.
        self._agent_count = 0
        self._keepalive_task: asyncio.Task[None] | None = None
        self._node_watch_task: asyncio.Task[None] | None = None
        #: transitions started by timers (deadlines, lost streams), until they are done.
        self._tasks: set[asyncio.Task[None]] = set()

    # --- life cycle -------------------------------------------------------------

    async def start(self, departed: Collection[str] = ()) -> None:
        """Load stored jobs, re-arm their deadlines and start keep-alives.

        ``departed``: agents known to have ended with the previous leader's process (they ran in
        it); with a spare ready they are declared lost at once instead of after the takeover grace.
        """
        for stored in await self._store.load():
            try:
                job = self._restore(stored, departed)
            except (TaskdError, KeyError, ValueError, TypeError, AttributeError) as exc:
                self._jobs.pop(stored.row.job_id, None)
                await self._store.set_aside(stored.row.job_id, f"{type(exc).__name__}: {exc}")
                continue
            if job.machine.state not in (State.IDLE, State.FINISHED, State.GIVEN_UP):
                logger.info(
                    "job %s resumes in state %s (cycle %d)",
                    job.job_id,
                    job.machine.state.value,
                    job.machine.snap.cycle,
                )
        self._keepalive_task = asyncio.get_running_loop().create_task(self._keepalive())
        self._node_watch_task = asyncio.get_running_loop().create_task(self._watch_nodes())

    def _restore(self, stored: StoredJob, departed: Collection[str] = ()) -> _Job:
        row = stored.row
        job = _Job(row.job_id, policy_from_dict(row.policy), snapshot_from_dict(row.snapshot))
        job.inited = row.inited
        job.claim = stored.claim
        job.agents.update((a.agent_id, a) for a in stored.agents)
        self._agent_count += len(job.agents)
        self._index(job)
        # Agents get a full grace period to come back before their job counts as abandoned.
        for agent in job.agents.values():
            agent.last_seen = max(agent.last_seen, self._clock())
        # Their streams were with the controller before this one (or none): one that does not
        # subscribe here within the grace is lost as if its stream had ended here, the way a node
        # lost together with the previous leader would otherwise be waited for forever. With a
        # spare standing by (or room to shrink), a surviving agent follows the new leader within a second.
        replaceable = self._node_replaceable(job)
        grace = min(self._stream_grace, TAKEOVER_GRACE) if replaceable else self._stream_grace
        loop = asyncio.get_running_loop()
        for agent in job.agents.values():
            # A spare standing by holds no stream (its HealthChecks say it is there); a timer of its
            # own would fire on it once promoted, before it could subscribe as the node.
            if agent.exit_code is not None or is_spare(agent):
                continue
            if replaceable and agent.agent_id in departed:
                why = "it ran in the previous leader's process, which a standby found gone"
                loop.call_soon(self.node_lost, job.job_id, agent.agent_id, why)
                continue
            job.lost[agent.agent_id] = loop.call_later(
                grace, self._on_stream_lost, job, agent.agent_id, grace
            )
        self._jobs[row.job_id] = job
        self._arm(job)
        return job

    def end_streams(self) -> None:
        """End every signal stream (agents re-subscribe to another controller)."""
        for job in self._jobs.values():
            for sub in job.subscribers.values():
                sub.close()
            job.subscribers.clear()

    async def close(self) -> None:
        for loop_task in (self._keepalive_task, self._node_watch_task):
            if loop_task is not None:
                loop_task.cancel()
                await asyncio.gather(loop_task, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for job in self._jobs.values():
            if job.timer is not None:
                job.timer.cancel()
            for handle in job.lost.values():
                handle.cancel()
        self.end_streams()

    # --- the reference's RPCs ---------------------------------------------------------

    async def init(self, who: AgentIdentity, caller: Caller = _ANONYMOUS) -> Reply:
        self.admit(caller)
        job_id = check_job_id(who.job_id)
        job = self._jobs.get(job_id)
        journal: list[JournalEntry] = []
        if job is not None and self._replaceable(job, caller):
            journal.append(self._retire(job))
            job = None
        if job is not None and job.claim is not None:
            self._authorise(job, caller, "Init")
        policy = job.machine.policy if job else self._policies.for_job(job_id)
        if not policy.recovery_enabled:
            return Reply(Code.RECOVERY_OFF, f"jobId={job_id}: process recovery is off in the job's policy")
        if job is None:
            check_new_claim(job_id, self._access, caller)
            self._check_job_quota(caller)
            if not self._make_room():
                return Reply(
                    Code.OUT_OF_MAX_JOBS,
                    f"jobId={job_id}: the controller serves {self._limits.max_jobs} jobs",
                )
            job = self._jobs[job_id] = _Job(job_id, policy)
        if job.claim is None:
            check_new_claim(job_id, self._access, caller)
            self._check_job_quota(caller)
            job.claim = Claim.of(caller, self._clock())
            job.peer = caller.peer
            self._index(job)
            journal.append(
                JournalEntry(
                    "job claimed",
                    job.machine.snap.cycle,
                    {"legacy": job.claim.legacy, "launch": caller.launch},
                )
            )
        if not job.inited:
            job.inited = True
            journal.append(JournalEntry("job initialised", job.machine.snap.cycle, {"role": who.role}))
        if journal:
            await self._save(job, journal)
        return Reply(Code.OK, f"job(uid={job_id}) init success")

    async def register(self, who: AgentIdentity, caller: Caller = _ANONYMOUS) -> Reply:
        self.admit(caller)
        job_id = check_job_id(who.job_id)
        job = self._jobs.get(job_id)
        if job is None or not job.inited:
            return Reply(Code.UNINIT, f"jobId={job_id} not inited; call Init before Register")
        self._authorise(job, caller, "Register")
        agent = job.agents.get(who.key)
        if agent is not None:
            self._check_fence(job, agent)
        if agent is None and len(job.agents) >= self._limits.max_agents:
            raise RequestRejected(
                Code.INVALID_PARAM,
                f"jobId={job_id} already has {self._limits.max_agents} agents, the most one job may have",
            )
        if agent is None:
            self._check_agent_quota(job)
        fresh = AgentInfo(who.key, who.role, who.node_rank, who.rank_ids, None, self._clock())
        job.had_spares |= who.role == SPARE_ROLE
        if who.role == SPARE_ROLE:
            # A lost node's place that waits for a spare is offered this one (once it is registered).
            for waiting in job.machine.awaiting_spare():
                asyncio.get_running_loop().call_soon(
                    self.node_lost, job.job_id, waiting, "a spare registered"
                )
            # A job below its most nodes (--nnodes=MIN:MAX) may grow by it instead.
            asyncio.get_running_loop().call_soon(self._offer_spare, job, who.key)
        if agent is None or (agent.role, agent.node_rank, agent.rank_ids, agent.exit_code) != (
            fresh.role,
            fresh.node_rank,
            fresh.rank_ids,
            None,
        ):
            kind = "agent registered" if agent is None or agent.exit_code is not None else "agent updated"
            self._agent_count += agent is None
            job.agents[who.key] = fresh
            detail = {"agent": who.key, "role": who.role, "node_rank": who.node_rank}
            await self._save(job, [JournalEntry(kind, job.machine.snap.cycle, detail)], [fresh])
        else:
            agent.last_seen = fresh.last_seen
        return Reply(Code.OK, "register success")

    def subscribe(self, who: AgentIdentity, caller: Caller = _ANONYMOUS) -> Subscriber:
        self.admit(caller)
        job = self._registered(who.job_id, caller, "SubscribeProcessManageSignal")
        if who.key not in job.agents:
            raise RequestRejected(
                Code.UNREGISTERED,
                f"jobId={job.job_id}: agent {who.key!r} did not Register; "
                "call Register with the same ClientInfo",
            )
        if who.key in job.subscribers:
            raise DuplicateSubscriberError(
                Code.INVALID_PARAM,
                f"jobId={job.job_id}: agent {who.key!r} already has a live signal stream; every agent of a "
                "job needs its own identity: set ClientInfo.agentId (e.g. to the node rank)",
            )
        self._check_fence(job, job.agents[who.key])
        sub = job.subscribers[who.key] = Subscriber(job.job_id, who.key)
        lost = job.lost.pop(who.key, None)
        if lost is not None:
            lost.cancel()
        job.agents[who.key].last_seen = self._clock()
        last = job.sent
        if last is not None:
            logger.info(
                "job %s: re-sending signal %s (seq %d) to agent %s",
                job.job_id,
                last.signal_type,
                last.seq,
                who.key,
            )
            sub.offer(last)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        job = self._jobs.get(sub.job_id)
        if job is not None and job.subscribers.get(sub.agent_id) is sub:
            del job.subscribers[sub.agent_id]
            logger.info("job %s: agent %s stream ended", sub.job_id, sub.agent_id)
            # A wait must not sit out its report timeout for an agent that is gone; one that
            # comes back within the grace rejoins the cycle instead. With a spare standing by,
            # a node whose stream closed is replaced unless it re-subscribes at once (and so is a
            # job that can shrink without it).
            if sub.agent_id not in job.lost:
                grace = self._stream_grace
                if self._node_replaceable(job) or _in_live_round(job):
                    # In a live round, too: its processes are in the round, which cannot form without
                    # them; an agent that came back later would only start new ones.
                    grace = min(grace, STREAM_CLOSED_GRACE)
                job.lost[sub.agent_id] = asyncio.get_running_loop().call_later(
                    grace, self._on_stream_lost, job, sub.agent_id, grace
                )
        sub.close()

    async def report(
        self, job_id: str, agent_id: str, make_event: Callable[[str], Event], caller: Caller = _ANONYMOUS
    ) -> Reply:
        """A Report* RPC: attribute it to an agent, then feed it to the job's machine."""
        self.admit(caller)
        job = self._registered(job_id, caller, "report")
        return await self._apply(job, make_event(self._attribute(job, agent_id)))

    async def process_fault(
        self,
        job_id: str,
        agent_id: str,
        faults: tuple[FaultRank, ...],
        caller: Caller = _ANONYMOUS,
        detail: str = "",
        codes: tuple[tuple[int, str], ...] = (),
        started_cycle: int | None = None,
    ) -> Reply:
        self.admit(caller)
        job = self._registered(job_id, caller, "ReportProcessFault")
        self._check_fault_count(job, faults)
        # A fault is never dropped for want of a reporter: ambiguous ones stay anonymous.
        agent = self._attribute(job, agent_id) if agent_id or len(job.agents) == 1 else ""
        return await self._apply(job, FaultReported(agent, faults, detail, codes, started_cycle))

    def health(self, job_id: str, agent_id: str, progress: str, caller: Caller = _ANONYMOUS) -> None:
        """A HealthCheck of a known agent: it is alive, and uses these hang timeouts; others are ignored.

        HealthCheck always answers OK (as the reference does), so a caller the
        job does not authorise changes nothing, silently; only a used-up quota
        is an error (:class:`~taskd_core.errors.QuotaExceededError`).
        """
        self.admit(caller)
        job = self._jobs.get(job_id)
        agent = job.agents.get(agent_id) if job is not None else None
        if job is None or agent is None or agent.replaced_by:
            return
        try:
            self._authorise(job, caller, "HealthCheck")
        except RequestRejected:
            return
        agent.last_seen = self._clock()
        agent.progress = progress

    # --- extensions -----------------------------------------------------------------

    async def agent_exit(self, who: AgentIdentity, code: int, caller: Caller = _ANONYMOUS) -> Reply:
        self.admit(caller)
        job = self._registered(who.job_id, caller, "ReportAgentExit")
        agent = job.agents[self._attribute(job, who.agent_id or who.role)]
        agent.exit_code = code
        return await self._apply(job, AgentExited(agent.agent_id, code), [agent])

    async def set_policy(self, job_id: str, changes: dict[str, object], caller: Caller = _ANONYMOUS) -> Reply:
        """Change a job's policy (ConfigError for invalid values); known or not yet."""
        self.admit(caller)
        job_id = check_job_id(job_id)
        job = self._jobs.get(job_id)
        check_policy_change(job_id, self._access, job.claim if job else None, job is not None, caller)
        base = job.machine.policy if job else self._policies.for_job(job_id)
        policy = updated_policy(base, changes)
        if job is None:
            if not self._make_room():
                return Reply(
                    Code.OUT_OF_MAX_JOBS,
                    f"jobId={job_id}: the controller serves {self._limits.max_jobs} jobs",
                )
            job = self._jobs[job_id] = _Job(job_id, policy)
        job.machine.policy = policy
        if slow_rank_config(policy) != job.slow.config:
            job.slow = SlowRankDetector(slow_rank_config(policy))
        await self._save(job, [JournalEntry("policy set", job.machine.snap.cycle, policy_to_dict(policy))])
        return Reply(Code.OK, f"jobId={job_id}: policy set")

    async def worker_events(
        self,
        job_id: str,
        agent_id: str,
        events: Sequence[WorkerEvent],
        caller: Caller = _ANONYMOUS,
        work: Sequence[RankWork] = (),
    ) -> Reply:
        """Journal an agent's worker starts, exits and resumptions (for timelines and metrics),
        and compare its ranks' work per step with their peers' (``slow-rank`` entries)."""
        self.admit(caller)
        job = self._registered(job_id, caller, "ReportWorkerEvents")
        agent = self._attribute(job, agent_id)
        cycle = job.machine.snap.cycle
        entries = [JournalEntry(f"worker {e.kind.value}", cycle, worker_detail(agent, e)) for e in events]
        found_now = job.slow.feed(work, self._clock(), agent)
        drains = self._slow_ranks(job, agent, found_now, entries)
        if entries:
            await self._save(job, entries)
        for node, why in drains:
            # The lost-node path: a spare takes the node's place and the node is fenced for good.
            self.node_lost(job.job_id, node, why)
        return Reply(Code.OK, f"jobId={job_id}: {len(entries)} worker event(s) journalled")

    async def events_after(
        self, job_id: str, after: int, limit: int, caller: Caller = _ANONYMOUS
    ) -> JournalPage:
        """A job's journal entries after ``after``, oldest first, and the job's state now (who may see it)."""
        self.admit(caller)
        job = self._jobs.get(check_job_id(job_id))
        if job is None:
            raise RequestRejected(
                Code.UNREGISTERED, f"jobId={job_id[:MAX_JOB_ID]} is not known to this controller"
            )
        if not may_see(self._access, job.claim, caller):
            raise forbidden(
                job_id, "reading this job's journal needs its token (TASKD_JOB_TOKEN) or the admin token"
            )
        page = min(limit, EVENTS_PAGE) if limit > 0 else EVENTS_PAGE
        state = job.machine.state
        since = journal_since(self._access, job.claim, caller)
        while True:
            records = await self._store.events_after(job.job_id, max(0, after), page)
            mine = [r for r in records if r.time >= since]
            # Entries of an earlier claim come first; skip whole pages of them (the journal is bounded).
            if mine or len(records) < page:
                return JournalPage(tuple(journal_event(r) for r in mine), state)
            after = records[-1].seq

    def gauges(self) -> ControllerGauges:
        """Counts over every job for a metrics scrape (cheap: one pass, no I/O)."""
        states: dict[State, int] = dict.fromkeys(State, 0)
        registered = connected = slow = 0
        for job in self._jobs.values():
            states[job.machine.snap.state] += 1
            registered += sum(1 for a in job.agents.values() if a.exit_code is None)
            connected += len(job.subscribers)
            slow += len(job.slow.slow())
        backlog = self._store.write_backlog()
        return ControllerGauges(
            states, registered, connected, self._store.journal_size(), backlog.pending, backlog.failures, slow
        )

    async def status(
        self, job_id: str = "", events: int = 10, caller: Caller = _ANONYMOUS
    ) -> list[JobStatus]:
        """One job (its token or the admin token), or every job the caller may see."""
        self.admit(caller)
        if job_id and job_id not in self._jobs:
            raise RequestRejected(
                Code.UNREGISTERED, f"jobId={job_id[:MAX_JOB_ID]} is not known to this controller"
            )
        if job_id and not may_see(self._access, self._jobs[job_id].claim, caller):
            raise forbidden(job_id, "showing this job needs its token (TASKD_JOB_TOKEN) or the admin token")
        jobs = [self._jobs[job_id]] if job_id else [self._jobs[j] for j in sorted(self._jobs)]
        visible = [job for job in jobs if may_see(self._access, job.claim, caller)]
        views = [self._job_status(job) for job in visible]
        if events > 0:
            # Read after the views are taken: each job's journal is at least as new as its view.
            journals = await asyncio.gather(*(self._store.events(v.job_id, events) for v in views))
            starts = [journal_since(self._access, job.claim, caller) for job in visible]
            views = [
                replace(v, events=tuple(journal_event(r) for r in j if r.time >= since))
                for v, j, since in zip(views, journals, starts, strict=True)
            ]
        return views

    def _job_status(self, job: _Job) -> JobStatus:
        snap = job.machine.snap
        agents = tuple(
            AgentStatus(
                a.agent_id,
                a.role,
                a.agent_id in job.subscribers,
                a.node_rank,
                a.exit_code,
                a.last_seen,
                a.progress,
            )
            for a in sorted(job.agents.values(), key=lambda a: a.agent_id)
        )
        policy = job.machine.policy
        return JobStatus(
            job_id=job.job_id,
            state=snap.state,
            cycle=snap.cycle,
            strategy=Strategy(snap.strategy) if snap.strategy else None,
            faults=tuple(FaultRank(r, t) for r, t in sorted(snap.faults.items())),
            strategies=policy.strategies,
            cycles_used=snap.cycle,
            max_cycles=policy.max_cycles,
            agents=agents,
            events=(),
            outcome=snap.outcome or f"waiting for {job.machine.expects()}",
            legacy=job.claim is not None and job.claim.legacy,
            slow_ranks=job.slow.slow(),
            slow_rank_bound=round(job.slow.bound, 3),
            slow_rank_bound_learned=job.slow.bound_learned,
        )

    # --- internals ---------------------------------------------------------------------

    def _registered(self, job_id: str, caller: Caller, rpc: str) -> _Job:
        job = self._jobs.get(check_job_id(job_id))
        if job is None or not job.agents:
            raise RequestRejected(
                Code.UNREGISTERED, f"jobId={job_id} not registed; call Init and Register first"
            )
        self._authorise(job, caller, rpc)
        return job

    # --- identity and limits ------------------------------------------------------------

    def _authorise(self, job: _Job, caller: Caller, rpc: str) -> None:
        if job.claim is None:
            return
        try:
            check_claim(job.job_id, job.claim, caller)
        except RequestRejected as exc:
            now = self._clock()
            # Refusals are journalled and logged at most once a second per job, so a flood of
            # them cannot rotate the job's real history out of the journal.
            if now - job.denied_at >= DENIAL_JOURNAL_INTERVAL:
                job.denied_at = now
                logger.warning("job %s: %s refused: %s", job.job_id, rpc, exc)
                # Nobody waits for this entry: the refusal goes out whether or not it is durable.
                self._save(
                    job,
                    [JournalEntry("access denied", job.machine.snap.cycle, {"rpc": rpc, "reason": str(exc)})],
                    charge=False,
                ).add_done_callback(_consume)
            raise

    def admit(self, caller: Caller) -> None:
        """Take one request from the caller's tenant: its token once a job holds it, else its host.

        :raises QuotaExceededError: the tenant sent too much.
        """
        digest = token_digest(caller.token) if caller.token else ""
        now = self._clock()
        if digest and (digest in self._by_token or digest == self._access.only_digest):
            self._rates.admit(digest, "this job token", now, journals=True)
        elif digest and self._access.is_admin(caller):
            self._rates.admit(digest, "the admin token", now, journals=False)
        else:
            self._rates.admit(f"peer:{caller.peer}", f"host {caller.peer or '?'}", now, journals=True)

    @staticmethod
    def _tenant(job: _Job) -> str:
        """Who pays for a job's journal: its token, else (a legacy job) the host that claimed it."""
        if job.claim is not None and job.claim.token_digest:
            return job.claim.token_digest
        return f"peer:{job.peer}" if job.peer else ""

    def _index(self, job: _Job) -> None:
        if job.claim is not None and job.claim.token_digest:
            self._by_token.setdefault(job.claim.token_digest, set()).add(job.job_id)
        if job.peer:
            self._by_peer.setdefault(job.peer, set()).add(job.job_id)

    def _unindex(self, job: _Job) -> None:
        digest = job.claim.token_digest if job.claim is not None else ""
        for index, key in ((self._by_token, digest), (self._by_peer, job.peer)):
            ids = index.get(key)
            if ids is not None:
                ids.discard(job.job_id)
                if not ids:
                    del index[key]

    def _running(self, ids: Iterable[str]) -> int:
        """How many of these jobs have not ended (ended ones make room by themselves: see _make_room)."""
        return sum(1 for j in ids if self._jobs[j].machine.state not in _TERMINAL)

    def _check_job_quota(self, caller: Caller) -> None:
        quotas = self._quotas
        digest = token_digest(caller.token) if caller.token else ""
        if digest and self._running(self._by_token.get(digest, ())) >= quotas.jobs_per_token:
            raise QuotaExceededError(
                f"this job token already holds {quotas.jobs_per_token} jobs that have not ended, the most "
                "one token may hold (the controller's --max-jobs-per-token); let some end first",
                limit="--max-jobs-per-token",
            )
        if self._running(self._by_peer.get(caller.peer, ())) >= quotas.jobs_per_peer:
            raise QuotaExceededError(
                f"host {caller.peer or '?'} already claimed {quotas.jobs_per_peer} jobs that have not ended, "
                "the most one host may claim (the controller's --max-jobs-per-peer); let some end first",
                limit="--max-jobs-per-peer",
            )

    def _check_agent_quota(self, job: _Job) -> None:
        quotas = self._quotas
        if self._agent_count >= quotas.agents:
            raise QuotaExceededError(
                f"the controller serves {quotas.agents} agents, the most it takes (its --max-agents); "
                "use another controller or let jobs end first",
                limit="--max-agents",
            )
        digest = job.claim.token_digest if job.claim is not None else ""
        for index, key, most, whose, flag in (
            (self._by_token, digest, quotas.agents_per_token, "this token", "--max-agents-per-token"),
            (self._by_peer, job.peer, quotas.agents_per_peer, f"host {job.peer}", "--max-agents-per-peer"),
        ):
            if key and sum(len(self._jobs[j].agents) for j in index.get(key, ())) >= most:
                raise QuotaExceededError(
                    f"jobId={job.job_id}: the jobs {whose} claimed already have {most} agents, the most "
                    f"it may register (the controller's {flag})",
                    limit=flag,
                )

    def _live(self, job: _Job) -> bool:
        """Some agent of the job holds a signal stream or was heard from within ``abandon_after``."""
        if job.machine.state in _TERMINAL:
            return False
        if job.subscribers:
            return True
        now = self._clock()
        patience = self._limits.abandon_after
        return any(a.exit_code is None and now - a.last_seen < patience for a in job.agents.values())

    def _replaceable(self, job: _Job, caller: Caller) -> bool:
        """Init starts the job afresh: it ended (a new launch reuses its id), or it was abandoned.

        A job that has not ended is never taken by another token (the admin
        token excepted): only a new launch holding the job's own token
        replaces it, once the job was silent for ``abandon_after``.
        """
        claim = job.claim
        if claim is None:
            return False
        if job.machine.state in _TERMINAL:
            return not (caller.launch and caller.launch == claim.launch)
        try:
            check_claim(job.job_id, claim, caller)
        except RequestRejected:
            if self._access.is_admin(caller):
                return True
            return claim.owned_by(caller) and not self._live(job)
        return False  # the caller belongs to the run in progress

    def _retire(self, job: _Job) -> JournalEntry:
        """Forget a job's run (its journal stays); the caller starts the id afresh."""
        for sub in job.subscribers.values():
            sub.close()
        if job.timer is not None:
            job.timer.cancel()
        del self._jobs[job.job_id]
        self._agent_count -= len(job.agents)
        self._unindex(job)
        self._write_soon(DropAgents(job.job_id))
        snap = job.machine.snap
        logger.info(
            "job %s: previous run (%s, cycle %d) retired; starting afresh",
            job.job_id,
            snap.state.value,
            snap.cycle,
        )
        return JournalEntry(
            "job retired", 0, {"state": snap.state.value, "cycles": snap.cycle, "outcome": snap.outcome}
        )

    def _make_room(self) -> bool:
        """Whether one more job fits, evicting the oldest ended or abandoned job when full."""
        if len(self._jobs) < self._limits.max_jobs:
            return True
        idle = [job for job in self._jobs.values() if job.claim is not None and not self._live(job)]
        if not idle:
            return False
        oldest = min(idle, key=lambda j: max((a.last_seen for a in j.agents.values()), default=0.0))
        self._retire(oldest)
        self._write_soon(Forget(oldest.job_id))
        return True

    def _check_fault_count(self, job: _Job, faults: tuple[FaultRank, ...]) -> None:
        """A job holds at most as many faulty ranks as it has ranks (``max_faults`` when unknown)."""
        size = sum(len(a.rank_ids) for a in job.agents.values()) or self._limits.max_faults
        snap = job.machine.snap
        known = snap.faults.keys() | snap.pending.keys()
        total = len(known | {f.rank for f in faults})
        if total > size:
            raise RequestRejected(
                Code.INVALID_PARAM,
                f"jobId={job.job_id}: {total} faulty ranks would exceed the job's {size} ranks; "
                "report only ranks of this job",
            )

    def _attribute(self, job: _Job, agent_id: str) -> str:
        """The agent a report comes from; see the package docstring for the rule."""
        if agent_id:
            if agent_id not in job.agents:
                raise RequestRejected(
                    Code.UNREGISTERED, f"jobId={job.job_id}: agent {agent_id!r} did not Register"
                )
            self._check_fence(job, job.agents[agent_id])
            return agent_id
        if len(job.agents) == 1:
            return next(iter(job.agents))
        raise RequestRejected(
            Code.INVALID_PARAM,
            f"jobId={job.job_id} has {len(job.agents)} agents ({brief(sorted(job.agents))}); "
            "set agentId (field 100) in the report so the controller knows which agent answers",
        )

    async def _apply(self, job: _Job, event: Event, agents: Iterable[AgentInfo] = ()) -> Reply:
        reaction = job.machine.handle(event, self._clock())
        last = job.machine.snap.last_signal
        if reaction.persist:
            await self._save(job, reaction.journal, agents)
            job.sent = last
        for signal in reaction.signals:
            logger.info(
                "job %s: signal %s seq %d %s%s to %d agent(s)",
                job.job_id,
                signal.signal_type,
                signal.seq,
                signal.change_strategy,
                list(signal.actions),
                len(job.subscribers),
            )
            self._broadcast(job, signal)
        self._arm(job)
        if reaction.reply.code != Code.OK:
            logger.warning("job %s: %s", job.job_id, reaction.reply.info)
        return reaction.reply

    def _save(
        self,
        job: _Job,
        journal: Iterable[JournalEntry],
        agents: Iterable[AgentInfo] = (),
        *,
        charge: bool = True,
    ) -> asyncio.Future[None]:
        """Write the job as it is now; done once durable (what it says is fixed here, not then).

        The entries' bytes are charged to the job's token (``charge``), except
        for the refusals others cause, which must not use up the job's quota.
        """
        row = JobRow(
            job.job_id,
            job.inited,
            policy_to_dict(job.machine.policy),
            snapshot_to_dict(job.machine.snap),
            job.claim,
        )
        entries = tuple(journal)
        now = self._clock()
        tenant = self._tenant(job)
        if charge and tenant and entries:
            size = sum(len(e.kind) + len(journal_detail(e)) for e in entries)
            self._rates.journalled(tenant, size, now)
        # Agents are live objects: the write keeps copies.
        written = asyncio.ensure_future(
            self._store.write(Commit(row, entries, tuple(replace(a) for a in agents), now))
        )
        if self._observer is not None and entries:
            observer = self._observer

            def observe(done: asyncio.Future[None]) -> None:
                # Scheduled after the writer's own callbacks, so signals go out first.
                if not done.cancelled() and done.exception() is None:
                    asyncio.get_running_loop().call_soon(observer.journalled, job.job_id, entries, now)

            written.add_done_callback(observe)
        return written

    def _write_soon(self, change: Write) -> None:
        """A write nobody waits for; it still lands before every later one."""
        asyncio.ensure_future(self._store.write(change)).add_done_callback(_consume)

    def _spawn(self, transition: Coroutine[object, object, Reply]) -> None:
        """Run a transition a timer started; a lost lease ends it quietly (the replica steps down)."""
        task = asyncio.get_running_loop().create_task(self._settle(transition))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _settle(transition: Awaitable[Reply]) -> None:
        try:
            await transition
        except LeadershipLostError as exc:
            logger.info("timer's transition not written: %s", exc)

    def _broadcast(self, job: _Job, signal: Signal) -> None:
        for sub in list(job.subscribers.values()):
            if not sub.offer(signal):
                self.unsubscribe(sub)

    def _arm(self, job: _Job) -> None:
        """Keep one timer per job on the snapshot's deadline."""
        snap = job.machine.snap
        if job.timer is not None and job.timer_step == snap.step:
            return
        if job.timer is not None:
            job.timer.cancel()
            job.timer = None
        if snap.deadline is None:
            return
        delay = max(0.0, snap.deadline - self._clock())
        job.timer = asyncio.get_running_loop().call_later(delay, self._on_deadline, job, snap.step)
        job.timer_step = snap.step

    def _on_stream_lost(self, job: _Job, agent_id: str, grace: float) -> None:
        job.lost.pop(agent_id, None)
        if agent_id not in job.subscribers and self._jobs.get(job.job_id) is job:
            logger.warning(
                "job %s: agent %s did not subscribe again within %.1fs", job.job_id, agent_id, grace
            )
            self.node_lost(
                job.job_id, agent_id, f"its signal stream ended and did not come back within {grace:.1f}s"
            )

    # --- lost nodes -----------------------------------------------------------------------

    def _offer_spare(self, job: _Job, agent_id: str) -> None:
        if self._jobs.get(job.job_id) is job and agent_id in job.agents:
            self._spawn(self._apply(job, SpareJoined(agent_id)))

    def node_lost(self, job_id: str, agent_id: str, why: str) -> None:
        """Declare node ``agent_id`` of ``job_id`` lost, whatever found it (the one way a node is replaced).

        Its signal stream is closed (a hung agent still holds one), and the job's
        machine decides (:func:`~taskd_core.controller.membership.decide_node_loss`):
        a spare takes the node's place, or the node is given up.
        """
        job = self._jobs.get(job_id)
        agent = job.agents.get(agent_id) if job is not None else None
        if job is None or agent is None or not is_node(agent) or agent.exit_code is not None:
            return
        logger.warning("job %s: node %s (node rank %s) lost: %s", job_id, agent_id, agent.node_rank, why)
        pending = job.lost.pop(agent_id, None)
        if pending is not None:
            pending.cancel()
        sub = job.subscribers.pop(agent_id, None)
        if sub is not None:
            sub.close()
        self._spawn(self._apply(job, AgentLost(agent_id, why), _changed_by_loss(job, agent)))

    def _slow_ranks(
        self, job: _Job, agent: str, found: Sequence[SlowRankFound], entries: list[JournalEntry]
    ) -> list[tuple[str, str]]:
        """Journal the ranks just found slow, with what the policy does; the nodes to drain, and why.

        Ranks of one node found together are one event. A finding left slow for want of a spare
        (or during a recovery) is looked at again with every report, and replaced once a spare is
        ready; its ranks no longer slow (or in new processes) drop out of it.
        """
        current = {(s.rank, s.pid) for s in job.slow.slow()}
        still = (tuple(r for r in f if (r.rank, r.pid) in current) for f in job.slow_waiting)
        waiting = [f for f in still if f]
        job.slow_waiting = []
        drains = []
        for each in [*waiting, *findings(found)]:
            ranks = [f.rank for f in each]
            act = self._slow_rank_action(job, ranks)
            if each in waiting and act.action is SlowRankPolicy.WARN:
                job.slow_waiting.append(each)  # still no spare: nothing new to journal
                continue
            logger.warning(
                "job %s: rank(s) %s slow since step %s: %s ms of work per step, %sx their peers' median; "
                "%s: %s",
                job.job_id,
                ranks,
                min(f.since_step for f in each),
                [round(f.work * 1000, 1) for f in each],
                [round(f.ratio, 2) for f in each],
                act.action.value,
                act.reason,
            )
            detail = {
                "agent": agent,
                "policy": job.machine.policy.slow_rank.value,
                "action": act.action.value,
                "reason": act.reason,
                **finding_detail(each),
            }
            if act.node:
                detail["node"] = act.node
                job.machine.snap.slow_replaced.extend(ranks)
                worst = max(f.ratio for f in each)
                drains.append((act.node, f"rank(s) {ranks} are {worst:.2f}x slower than their peers"))
            elif act.transient:
                job.slow_waiting.append(each)
            entries.append(JournalEntry("slow-rank", job.machine.snap.cycle, detail))
        return drains

    def _slow_rank_action(self, job: _Job, ranks: Sequence[int]) -> SlowRankAction:
        """What the job's policy does about slow ``ranks`` (see :func:`~.slowrank.decide`)."""
        nodes = {
            a.agent_id
            for a in job.agents.values()
            if is_node(a) and a.exit_code is None and set(ranks) & set(a.rank_ids)
        }
        return decide_slow_rank(
            job.machine.policy.slow_rank,
            ranks,
            next(iter(nodes)) if len(nodes) == 1 else None,
            replaced_before=bool(set(ranks) & set(job.machine.snap.slow_replaced)),
            spare=self._spare_ready(job),
            idle=job.machine.state is State.IDLE,
        )

    def _spare_ready(self, job: _Job) -> bool:
        return bool(ready_spares(job.agents, self._clock(), job.machine.policy.node_lost_timeout))

    def _node_replaceable(self, job: _Job) -> bool:
        """A lost node of the job would not end it: a spare takes its place, or the job shrinks."""
        return self._spare_ready(job) or can_shrink(job.agents, job.machine.policy)

    @staticmethod
    def _check_fence(job: _Job, agent: AgentInfo) -> None:
        """Refuse a node a spare replaced: it must neither train nor steer the job any more."""
        if agent.replaced_by:
            taken = (
                "the job shrank without it"
                if agent.replaced_by == SHRUNK
                else f"spare {agent.replaced_by!r} took its place"
            )
            raise RequestRejected(
                Code.NODE_REPLACED,
                f"jobId={job.job_id}: agent {agent.agent_id!r} (node rank {agent.node_rank}) was declared "
                f"lost and {taken}; this node must stop its workers "
                "and end (start it again with the job's command line to stand by as a spare)",
            )

    async def _watch_nodes(self) -> None:
        """Declare lost the nodes whose HealthChecks stopped for the policy's ``node_lost_timeout``.

        While a spare stands by, which is what such a node is replaced by; and
        during a recovery cycle of a job that had spares (a promoted spare that
        died while it started, a second node lost with no spare left): the cycle
        then ends at once with the reason instead of waiting out its report
        timeout. Otherwise a node that comes back still rejoins its job. Runs
        until close() cancels it.
        """
        while True:
            await asyncio.sleep(NODE_WATCH_INTERVAL)
            now = self._clock()
            for job in list(self._jobs.values()):
                state = job.machine.state
                if state in _TERMINAL:
                    continue
                policy = job.machine.policy
                waiting = job.machine.awaiting_spare()
                for agent_id, since in waiting.items():
                    if now - since >= policy.spare_wait:
                        self.node_lost(job.job_id, agent_id, f"no spare came within {policy.spare_wait:g}s")
                in_cycle = state in (State.WAIT_STOP, State.WAIT_STRATEGIES, State.WAIT_STATUS)
                if not (self._node_replaceable(job) or (in_cycle and job.had_spares)):
                    continue
                timeout = policy.node_lost_timeout
                for agent in list(job.agents.values()):
                    if agent.agent_id in waiting:
                        continue
                    silent = now - agent.last_seen
                    if is_node(agent) and agent.exit_code is None and silent > timeout:
                        self.node_lost(job.job_id, agent.agent_id, f"no HealthCheck for {silent:.1f}s")
                        break  # one replacement at a time: the spare pool changed

    def _on_deadline(self, job: _Job, step: int) -> None:
        job.timer = None
        self._spawn(self._apply(job, DeadlinePassed(step)))

    async def _keepalive(self) -> None:
        # Runs until close() cancels it.
        while True:
            await asyncio.sleep(self._keepalive_interval)
            for job in list(self._jobs.values()):
                if job.subscribers:
                    self._broadcast(job, Signal(SignalType.KEEP_ALIVE.value, job_id=job.job_id))


def _in_live_round(job: _Job) -> bool:
    """The job's agents carry out ``recover-live``: every node's workers are forming one live round."""
    snap = job.machine.snap
    return snap.state is State.WAIT_STATUS and snap.strategy == Strategy.RECOVER_LIVE.value


def _consume(done: asyncio.Future[None]) -> None:
    """Retrieve a write's outcome nobody awaits (a lost lease is handled by the replica)."""
    if not done.cancelled() and done.exception() is not None:
        logger.debug("write not done: %s", done.exception())


def policy_changes(
    strategies: Iterable[str],
    recovery_enabled: bool | None,
    report_timeout: float | None,
    flush_seconds: float | None,
    max_cycles: int | None,
    expected_agents: int | None,
) -> dict[str, object]:
    """A ``SetJobPolicy`` request's fields as policy changes.

    None (the field was left out) keeps the current value, and so do the
    "keep" values older clients send: no strategies, a report timeout of 0, a
    negative flush window or cycle budget.
    """
    changes: dict[str, object] = {}
    names = list(strategies)
    if names:
        changes["strategies"] = names
    if recovery_enabled is not None:
        changes["recovery_enabled"] = recovery_enabled
    if report_timeout is not None and report_timeout != 0:
        changes["report_timeout"] = report_timeout
    if flush_seconds is not None and flush_seconds >= 0:
        changes["flush_seconds"] = flush_seconds
    if max_cycles is not None and max_cycles >= 0:
        changes["max_cycles"] = max_cycles
    if expected_agents is not None:
        changes["expected_agents"] = expected_agents
    return changes
