"""The controller's durable state in SQLite: jobs, agents and the event journal.

Each state-machine transition is written with its journal entries in one
transaction, so a controller killed at any moment restarts either before or
after a transition, never half-way, and the journal holds every event once.
WAL with ``synchronous=NORMAL`` survives a killed process (not a power cut)
and keeps commits cheap enough to run on the event loop. ``":memory:"`` gives
a throw-away store.

Growth is bounded: each job keeps its newest :data:`MAX_EVENTS_PER_JOB`
journal entries (older ones are rotated out), and the request limits of the
service bound every stored string and list.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from taskd_core.controller.access import Claim
from taskd_core.controller.machine import AgentInfo, JournalEntry, Snapshot, State
from taskd_core.errors import ConfigError
from taskd_core.models import FaultRank, FaultType, Signal

logger = logging.getLogger(__name__)

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
    """A job's snapshot as JSON-ready data (what the ``jobs`` table stores)."""
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
        # Absent from state files written before the budget window existed.
        cycle_starts=[float(t) for t in data.get("cycle_starts", ())],
    )


_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id   TEXT PRIMARY KEY,
    inited   INTEGER NOT NULL,
    policy   TEXT NOT NULL,
    snapshot TEXT NOT NULL,
    updated  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS agents (
    job_id    TEXT NOT NULL,
    agent_id  TEXT NOT NULL,
    role      TEXT NOT NULL,
    node_rank INTEGER,
    rank_ids  TEXT NOT NULL,
    exit_code INTEGER,
    last_seen REAL NOT NULL,
    PRIMARY KEY (job_id, agent_id)
);
CREATE TABLE IF NOT EXISTS events (
    seq    INTEGER PRIMARY KEY AUTOINCREMENT,
    time   REAL NOT NULL,
    job_id TEXT NOT NULL,
    cycle  INTEGER NOT NULL,
    kind   TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_job ON events (job_id, seq);
CREATE TABLE IF NOT EXISTS claims (
    job_id       TEXT PRIMARY KEY,
    token_digest TEXT NOT NULL,
    launch       TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS damaged_jobs (
    job_id   TEXT NOT NULL,
    reason   TEXT NOT NULL,
    row      TEXT NOT NULL,
    set_aside REAL NOT NULL
);
"""


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


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise TypeError(f"expected a JSON object, found {type(value).__name__}")
    return value


class Store:
    """One SQLite database; use from one thread (the controller's event loop)."""

    def __init__(self, path: str, max_events: int = MAX_EVENTS_PER_JOB, *, readonly: bool = False) -> None:
        """Open (or create) the store; ``readonly`` reads an existing file, even a live controller's."""
        self.path = path
        self.max_events = max_events
        #: journal entries written per job since its last rotation.
        self._unrotated: dict[str, int] = {}
        try:
            if readonly:
                if path == ":memory:" or not Path(path).is_file():
                    raise ConfigError(f"state file {path}: no such file; give a controller's --state file")
                self._db = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True)
                self._db.execute("SELECT 1 FROM events LIMIT 1")
                return
            self._db = sqlite3.connect(path, isolation_level=None)
            if path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            # Counted once; commits keep it up to date (a count(*) per scrape would grow with the journal).
            self._entries: int = self._db.execute("SELECT count(*) FROM events").fetchone()[0]
        except sqlite3.Error as exc:
            if getattr(exc, "sqlite_errorname", "").startswith("SQLITE_READONLY"):
                raise ConfigError(
                    f"state file {path}: read-only for this process, and the controller writes every "
                    "transition there; make the file and its directory writable, or give another --state"
                ) from None
            raise ConfigError(f"state file {path}: cannot open it as SQLite ({exc}); check --state") from None

    def load(self) -> list[StoredJob]:
        """Every stored job; a job whose rows cannot be read is set aside (see :meth:`set_aside`).

        :raises ConfigError: the file itself is damaged (one line naming it).
        """
        try:
            return self._load()
        except sqlite3.Error as exc:
            raise ConfigError(
                f"state file {self.path} is damaged ({exc}); move it away to start with an empty state"
            ) from None

    def _load(self) -> list[StoredJob]:
        agents: dict[str, list[AgentInfo]] = {}
        damaged: dict[str, str] = {}
        for job_id, agent_id, role, node_rank, rank_ids, exit_code, last_seen in self._db.execute(
            "SELECT job_id, agent_id, role, node_rank, rank_ids, exit_code, last_seen FROM agents"
        ):
            try:
                ranks = tuple(int(r) for r in json.loads(rank_ids))
                agents.setdefault(job_id, []).append(
                    AgentInfo(str(agent_id), str(role), node_rank, ranks, exit_code, float(last_seen))
                )
            except (ValueError, TypeError) as exc:
                damaged[job_id] = f"agent {agent_id!r}: {exc}"
        claims = {
            job_id: Claim(digest, launch)
            for job_id, digest, launch in self._db.execute("SELECT job_id, token_digest, launch FROM claims")
        }
        jobs = []
        for job_id, inited, policy, snapshot in self._db.execute(
            "SELECT job_id, inited, policy, snapshot FROM jobs ORDER BY job_id"
        ).fetchall():
            if job_id in damaged:
                self.set_aside(job_id, damaged[job_id])
                continue
            try:
                row = JobRow(
                    job_id, bool(inited), _json_object(policy), _json_object(snapshot), claims.get(job_id)
                )
            except (ValueError, TypeError) as exc:
                self.set_aside(job_id, str(exc))
                continue
            jobs.append(StoredJob(row, tuple(agents.get(job_id, ()))))
        logger.info(
            "state file %s: %d job(s), %d agent(s)", self.path, len(jobs), sum(map(len, agents.values()))
        )
        return jobs

    def set_aside(self, job_id: str, reason: str) -> None:
        """Move a job that cannot be loaded out of the way, keeping its row for inspection.

        The controller starts without it (an agent of that job registers it
        afresh); the row stays in table ``damaged_jobs``.
        """
        logger.error(
            "state file %s: job %s is damaged (%s); set aside in table damaged_jobs, the other jobs load",
            self.path,
            job_id,
            reason,
        )
        with self._transaction():
            found = self._db.execute(
                "SELECT inited, policy, snapshot FROM jobs WHERE job_id = ?", (job_id,)
            ).fetchone()
            self._db.execute(
                "INSERT INTO damaged_jobs (job_id, reason, row, set_aside) VALUES (?, ?, ?, ?)",
                (job_id, reason, json.dumps(found, default=str), time.time()),
            )
            self._db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))
            self._db.execute("DELETE FROM agents WHERE job_id = ?", (job_id,))

    def commit(
        self,
        row: JobRow,
        journal: Sequence[JournalEntry] = (),
        agents: Iterable[AgentInfo] = (),
        *,
        now: float,
    ) -> None:
        """Write the job, changed agents and new journal entries atomically."""
        with self._transaction():
            self._db.execute(
                "INSERT OR REPLACE INTO jobs (job_id, inited, policy, snapshot, updated)"
                " VALUES (?, ?, ?, ?, ?)",
                (
                    row.job_id,
                    int(row.inited),
                    json.dumps(row.policy),
                    json.dumps(row.snapshot, separators=(",", ":")),
                    now,
                ),
            )
            self._db.executemany(
                "INSERT OR REPLACE INTO agents"
                " (job_id, agent_id, role, node_rank, rank_ids, exit_code, last_seen)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        row.job_id,
                        a.agent_id,
                        a.role,
                        a.node_rank,
                        json.dumps(list(a.rank_ids)),
                        a.exit_code,
                        a.last_seen,
                    )
                    for a in agents
                ],
            )
            if row.claim is not None:
                self._db.execute(
                    "INSERT OR REPLACE INTO claims (job_id, token_digest, launch) VALUES (?, ?, ?)",
                    (row.job_id, row.claim.token_digest, row.claim.launch),
                )
            self._db.executemany(
                "INSERT INTO events (time, job_id, cycle, kind, detail) VALUES (?, ?, ?, ?, ?)",
                [(now, row.job_id, e.cycle, e.kind, json.dumps(e.detail, sort_keys=True)) for e in journal],
            )
            self._entries += len(journal)
            written = self._unrotated.get(row.job_id, 0) + len(journal)
            if written >= ROTATE_EVERY:
                self._entries -= self._db.execute(
                    "DELETE FROM events WHERE job_id = ? AND seq <= ("
                    " SELECT seq FROM events WHERE job_id = ? ORDER BY seq DESC LIMIT 1 OFFSET ?)",
                    (row.job_id, row.job_id, self.max_events),
                ).rowcount
                written = 0
            self._unrotated[row.job_id] = written

    def drop_agents(self, job_id: str) -> None:
        """Forget a job's agents (its run is over and the id starts afresh)."""
        with self._transaction():
            self._db.execute("DELETE FROM agents WHERE job_id = ?", (job_id,))

    def forget(self, job_id: str) -> None:
        """Delete everything about a job, its journal included (evicted to make room for new jobs)."""
        with self._transaction():
            self._unrotated.pop(job_id, None)
            for table in ("jobs", "agents", "claims", "events"):
                deleted = self._db.execute(f"DELETE FROM {table} WHERE job_id = ?", (job_id,)).rowcount
                if table == "events":
                    self._entries -= deleted

    def _transaction(self) -> sqlite3.Connection:
        # isolation_level=None leaves transactions to us; the context manager commits or rolls back.
        self._db.execute("BEGIN")
        return self._db

    def events(self, job_id: str, limit: int) -> list[EventRecord]:
        """The newest ``limit`` journal entries of a job, oldest first."""
        rows = self._db.execute(
            "SELECT seq, time, job_id, cycle, kind, detail FROM events"
            " WHERE job_id = ? ORDER BY seq DESC LIMIT ?",
            (job_id, limit),
        ).fetchall()
        return [EventRecord(*r) for r in reversed(rows)]

    def events_after(self, job_id: str, after: int, limit: int) -> list[EventRecord]:
        """At most ``limit`` journal entries of a job with ``seq > after``, oldest first."""
        rows = self._db.execute(
            "SELECT seq, time, job_id, cycle, kind, detail FROM events"
            " WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
            (job_id, after, limit),
        ).fetchall()
        return [EventRecord(*r) for r in rows]

    def has_job(self, job_id: str) -> bool:
        return self._db.execute("SELECT 1 FROM jobs WHERE job_id = ?", (job_id,)).fetchone() is not None

    def journal_size(self) -> int:
        """Entries in the journal now (rotation deletes old ones)."""
        return self._entries

    def close(self) -> None:
        self._db.close()
