"""The controller's durable state, whatever holds it: the storage interface and its values.

Two implementations stand behind :class:`StateStore`: SQLite
(:mod:`~taskd_core.controller.store_sqlite`, one controller on one machine, the
default) and etcd (:mod:`~taskd_core.controller.store_etcd`, replicas with a
leader; state that outlives any machine). The runtime sees only this interface,
and the persistence tests run against both.

The runtime's rule is *persist, then send signals, then reply*. A write is
:meth:`StateStore.write`: writes are applied in the order they are made, and
the awaitable it returns is done once that write (and every earlier one) is
durable. SQLite commits on the spot (well under a millisecond, so its
awaitable is already done and awaiting it never yields the event loop);
etcd's writer task sends writes as transactions, several at once when they
queue up, each conditional on the writer still leading. Every write is
encoded when it is made, so later changes to the live objects cannot leak
into it.

Growth is bounded the same way in both: each job keeps its newest
:data:`MAX_EVENTS_PER_JOB` journal entries (older ones are rotated out once
the job has written :data:`ROTATE_EVERY` more), and the service's request
limits bound every stored string and list.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from taskd_core.controller.access import Claim
from taskd_core.controller.machine import AgentInfo, JournalEntry, Snapshot, State
from taskd_core.models import FaultRank, FaultType, Signal

#: Journal entries kept per job: older ones are deleted once the job has written
#: :data:`ROTATE_EVERY` more, so a job holds at most ``max_events + ROTATE_EVERY`` entries.
MAX_EVENTS_PER_JOB = 10_000
ROTATE_EVERY = 64

# --- the JSON codec of snapshots ------------------------------------------------------


def _faults_to_json(faults: Mapping[int, FaultType]) -> dict[str, str]:
    return {str(rank): kind.value for rank, kind in faults.items()}


def _faults_from_json(data: Mapping[str, str]) -> dict[int, FaultType]:
    return {int(rank): FaultType(kind) for rank, kind in data.items()}


def _signal_to_dict(signal: Signal) -> dict[str, Any]:
    return {
        "signal_type": signal.signal_type,
        "job_id": signal.job_id,
        "uuid": signal.uuid,
        "actions": list(signal.actions),
        "fault_ranks": {str(f.rank): f.fault_type.value for f in signal.fault_ranks},
        "change_strategy": signal.change_strategy,
        "timeout": signal.timeout,
        "node_rank_ids": list(signal.node_rank_ids),
        "extra_params": signal.extra_params,
        "seq": signal.seq,
        "cycle": signal.cycle,
    }


def _signal_from_dict(data: Mapping[str, Any]) -> Signal:
    faults = tuple(FaultRank(r, t) for r, t in _faults_from_json(data["fault_ranks"]).items())
    return Signal(
        signal_type=data["signal_type"],
        job_id=data["job_id"],
        uuid=data["uuid"],
        actions=tuple(data["actions"]),
        fault_ranks=faults,
        change_strategy=data["change_strategy"],
        timeout=data["timeout"],
        node_rank_ids=tuple(data["node_rank_ids"]),
        extra_params=data["extra_params"],
        seq=data["seq"],
        cycle=data["cycle"],
    )


def snapshot_to_dict(snap: Snapshot) -> dict[str, Any]:
    """A job's snapshot as JSON-ready data (what both stores keep)."""
    return {
        "state": snap.state.value,
        "cycle": snap.cycle,
        "uuid": snap.uuid,
        "seq": snap.seq,
        "step": snap.step,
        "deadline": snap.deadline,
        "faults": _faults_to_json(snap.faults),
        "pending": _faults_to_json(snap.pending),
        "members": list(snap.members),
        "stops": dict(snap.stops),
        "strategies": {a: list(s) for a, s in snap.strategies.items()},
        "statuses": dict(snap.statuses),
        "strategy": snap.strategy,
        "tried": list(snap.tried),
        "last_signal": _signal_to_dict(snap.last_signal) if snap.last_signal else None,
        "outcome": snap.outcome,
        "cycle_starts": list(snap.cycle_starts),
        "slow_replaced": list(snap.slow_replaced),
        "nodes": snap.nodes,
        "resize": snap.resize,
    }


def snapshot_from_dict(data: Mapping[str, Any]) -> Snapshot:
    """The snapshot :func:`snapshot_to_dict` stored."""
    last = data.get("last_signal")
    return Snapshot(
        state=State(data["state"]),
        cycle=data["cycle"],
        uuid=data["uuid"],
        seq=data["seq"],
        step=data["step"],
        deadline=data["deadline"],
        faults=_faults_from_json(data["faults"]),
        pending=_faults_from_json(data["pending"]),
        members=list(data["members"]),
        stops=dict(data["stops"]),
        strategies={a: list(s) for a, s in data["strategies"].items()},
        statuses=dict(data["statuses"]),
        strategy=data["strategy"],
        tried=list(data["tried"]),
        last_signal=_signal_from_dict(last) if last else None,
        outcome=data["outcome"],
        # Absent from state written before the budget window existed.
        cycle_starts=[float(t) for t in data.get("cycle_starts", ())],
        slow_replaced=[int(r) for r in data.get("slow_replaced", ())],
        # Absent from state written before jobs could shrink.
        nodes=int(data.get("nodes", 0)),
        resize=str(data.get("resize", "")),
    )


def json_object(text: str | bytes) -> dict[str, Any]:
    """A stored JSON object; ValueError/TypeError for anything else (the caller sets the job aside)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise TypeError(f"expected a JSON object, found {type(value).__name__}")
    return value


def journal_detail(entry: JournalEntry) -> str:
    """An entry's detail as both stores keep it (and ``EventRecord.detail`` carries)."""
    return json.dumps(entry.detail, sort_keys=True)


# --- what is stored ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JobRow:
    """A job as stored: policy and snapshot in their JSON-ready forms."""

    job_id: str
    inited: bool
    policy: Mapping[str, Any]
    snapshot: Mapping[str, Any]
    claim: Claim | None = None


@dataclass(frozen=True, slots=True)
class StoredJob:
    row: JobRow
    agents: tuple[AgentInfo, ...]

    @property
    def claim(self) -> Claim | None:
        return self.row.claim


@dataclass(frozen=True, slots=True)
class EventRecord:
    seq: int
    time: float
    job_id: str
    cycle: int
    kind: str
    detail: str


# --- writes -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Commit:
    """A job's row, the agents that changed and the journal entries of one transition, atomically."""

    row: JobRow
    journal: tuple[JournalEntry, ...] = ()
    agents: tuple[AgentInfo, ...] = ()
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class DropAgents:
    """Forget a job's agents (its run is over and the id starts afresh)."""

    job_id: str


@dataclass(frozen=True, slots=True)
class Forget:
    """Delete everything about a job, its journal included (evicted to make room)."""

    job_id: str


Write = Commit | DropAgents | Forget


@dataclass(frozen=True, slots=True)
class WriteBacklog:
    """Writes made but not durable yet (held while the storage refuses them), and failed tries so far."""

    pending: int = 0
    failures: int = 0


class StateStore(Protocol):
    """What the runtime needs of durable state; used from the controller's event loop only."""

    #: where the state lives, for messages ("state file x.db", "etcd://h:2379/taskd").
    description: str

    async def load(self) -> list[StoredJob]:
        """Every stored job; a job whose data cannot be read is set aside (kept for inspection).

        :raises ConfigError: the store itself cannot be read (one line naming it).
        """
        ...

    async def set_aside(self, job_id: str, reason: str) -> None:
        """Move a job the runtime could not restore out of the way, keeping its data for inspection."""
        ...

    def write(self, change: Write) -> Awaitable[None]:
        """Apply ``change`` after every earlier write; the result is done once it is durable.

        :raises LeadershipLostError: (from the awaitable) this replica may no longer write.
        """
        ...

    async def events(self, job_id: str, limit: int) -> list[EventRecord]:
        """The newest ``limit`` journal entries of a job, oldest first."""
        ...

    async def events_after(self, job_id: str, after: int, limit: int) -> list[EventRecord]:
        """At most ``limit`` journal entries of a job with ``seq > after``, oldest first."""
        ...

    def journal_size(self) -> int:
        """Entries in the journal now (rotation deletes old ones)."""
        ...

    def write_backlog(self) -> WriteBacklog:
        """Writes not durable yet and failed tries (the metrics' view of the storage's health)."""
        ...

    async def close(self) -> None:
        """Finish the writes made so far (where the store can) and let go of the storage."""
        ...
