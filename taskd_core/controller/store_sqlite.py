"""The controller's durable state in SQLite: jobs, agents and the event journal, in one file.

Each state-machine transition is written with its journal entries in one
transaction, so a controller killed at any moment restarts either before or
after a transition, never half-way, and the journal holds every event once.
WAL with ``synchronous=NORMAL`` survives a killed process (not a power cut)
and keeps commits cheap enough to run on the event loop. ``":memory:"`` gives
a throw-away store.

:class:`SqliteStore` is the file itself, synchronous (``taskd events --state``
reads one with it); :class:`SqliteState` is the same file behind the
controller's :class:`~taskd_core.controller.store.StateStore` interface.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import sqlite3
import stat
import time
from collections.abc import Awaitable, Iterable, Iterator, Sequence
from pathlib import Path

from taskd_core.controller.access import Claim
from taskd_core.controller.machine import AgentInfo, JournalEntry
from taskd_core.controller.store import (
    MAX_EVENTS_PER_JOB,
    ROTATE_EVERY,
    Commit,
    DropAgents,
    EventRecord,
    Forget,
    JobRow,
    StoredJob,
    Write,
    WriteBacklog,
    journal_detail,
    json_object,
)
from taskd_core.errors import ConfigError

logger = logging.getLogger(__name__)

#: Seconds between tries of writes the state file did not take.
RETRY_INTERVAL = 1.0
#: Writes held at most while the state file takes none.
MAX_HELD = 100_000

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
    replaced_by TEXT NOT NULL DEFAULT '',
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
    launch       TEXT NOT NULL,
    since        REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS damaged_jobs (
    job_id   TEXT NOT NULL,
    reason   TEXT NOT NULL,
    row      TEXT NOT NULL,
    set_aside REAL NOT NULL
);
"""


class SqliteStore:
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
            if path != ":memory:":
                private_file(Path(path))
            self._db = sqlite3.connect(path, isolation_level=None)
            if path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(claims)")}
            if "since" not in columns:  # a state file written before claims had a start
                self._db.execute("ALTER TABLE claims ADD COLUMN since REAL NOT NULL DEFAULT 0")
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(agents)")}
            if "replaced_by" not in columns:  # a state file written before replaced nodes were kept
                self._db.execute("ALTER TABLE agents ADD COLUMN replaced_by TEXT NOT NULL DEFAULT ''")
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
        for (
            job_id,
            agent_id,
            role,
            node_rank,
            rank_ids,
            exit_code,
            last_seen,
            replaced_by,
        ) in self._db.execute(
            "SELECT job_id, agent_id, role, node_rank, rank_ids, exit_code, last_seen, replaced_by"
            " FROM agents"
        ):
            try:
                ranks = tuple(int(r) for r in json.loads(rank_ids))
                agents.setdefault(job_id, []).append(
                    AgentInfo(
                        str(agent_id),
                        str(role),
                        node_rank,
                        ranks,
                        exit_code,
                        float(last_seen),
                        replaced_by=str(replaced_by),
                    )
                )
            except (ValueError, TypeError) as exc:
                damaged[job_id] = f"agent {agent_id!r}: {exc}"
        claims = {
            job_id: Claim(digest, launch, float(since))
            for job_id, digest, launch, since in self._db.execute(
                "SELECT job_id, token_digest, launch, since FROM claims"
            )
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
                    job_id, bool(inited), json_object(policy), json_object(snapshot), claims.get(job_id)
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
                " (job_id, agent_id, role, node_rank, rank_ids, exit_code, last_seen, replaced_by)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        row.job_id,
                        a.agent_id,
                        a.role,
                        a.node_rank,
                        json.dumps(list(a.rank_ids)),
                        a.exit_code,
                        a.last_seen,
                        a.replaced_by,
                    )
                    for a in agents
                ],
            )
            if row.claim is not None:
                self._db.execute(
                    "INSERT OR REPLACE INTO claims (job_id, token_digest, launch, since) VALUES (?, ?, ?, ?)",
                    (row.job_id, row.claim.token_digest, row.claim.launch, row.claim.since),
                )
            self._db.executemany(
                "INSERT INTO events (time, job_id, cycle, kind, detail) VALUES (?, ?, ?, ?, ?)",
                [(now, row.job_id, e.cycle, e.kind, journal_detail(e)) for e in journal],
            )
            rotated = 0
            written = self._unrotated.get(row.job_id, 0) + len(journal)
            if written >= ROTATE_EVERY:
                rotated = self._db.execute(
                    "DELETE FROM events WHERE job_id = ? AND seq <= ("
                    " SELECT seq FROM events WHERE job_id = ? ORDER BY seq DESC LIMIT 1 OFFSET ?)",
                    (row.job_id, row.job_id, self.max_events),
                ).rowcount
                written = 0
        # Counted once committed: a commit that failed was rolled back whole and changes nothing.
        self._entries += len(journal) - rotated
        self._unrotated[row.job_id] = written

    def drop_agents(self, job_id: str) -> None:
        """Forget a job's agents (its run is over and the id starts afresh)."""
        with self._transaction():
            self._db.execute("DELETE FROM agents WHERE job_id = ?", (job_id,))

    def forget(self, job_id: str) -> None:
        """Delete everything about a job, its journal included (evicted to make room for new jobs)."""
        with self._transaction():
            for table in ("jobs", "agents", "claims"):
                self._db.execute(f"DELETE FROM {table} WHERE job_id = ?", (job_id,))
            gone = self._db.execute("DELETE FROM events WHERE job_id = ?", (job_id,)).rowcount
        self._unrotated.pop(job_id, None)
        self._entries -= gone

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One transaction: committed whole, or (any error, the commit's own included) rolled back whole."""
        # isolation_level=None leaves transactions to us.
        self._db.execute("BEGIN")
        try:
            yield self._db
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise

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


def private_file(path: Path) -> None:
    """Make ``path`` readable by its owner alone (0600), creating it empty when missing.

    The state holds token digests and the journal (hang evidence, stacks): no
    other user may read it. SQLite gives the WAL and shared-memory files it
    creates next to it the same mode.
    """
    try:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            logger.warning("state file %s was readable by other users (mode %04o): now 0600", path, mode)
            for name in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
                if name.exists():
                    name.chmod(0o600)
    except OSError:
        return  # connecting says what is wrong with the path, in the caller's words


def storage_problem(exc: sqlite3.Error) -> str:
    """What a failed write of the state file means, in words (SQLite's own say "readonly database")."""
    name = getattr(exc, "sqlite_errorname", "")
    if name == "SQLITE_FULL":
        return "the disk is full"
    if name.startswith("SQLITE_READONLY"):
        return "the file or its directory is read-only for this process (permissions, or a read-only mount)"
    if name.startswith("SQLITE_IOERR"):
        return f"an I/O error ({exc})"
    return str(exc)


class SqliteState:
    """A :class:`SqliteStore` as the controller's :class:`~taskd_core.controller.store.StateStore`.

    Every write commits before :meth:`write` returns, so its awaitable is
    already done: awaiting it never yields the event loop, and the runtime
    keeps the order of a synchronous store.

    A write the file does not take (a full disk, a file gone read-only, an
    I/O error) is rolled back whole and *held*: the controller goes on
    deciding from memory, the held writes are retried in order every
    :data:`RETRY_INTERVAL` seconds (and before every later write), one ERROR
    says what is wrong and the ``taskd_state_writes_held`` gauge how much
    waits. At most :data:`MAX_HELD` writes are held; beyond, the oldest go
    (each job's later row holds its whole state; only journal entries are lost).
    """

    def __init__(self, path: str, max_events: int = MAX_EVENTS_PER_JOB) -> None:
        self.file = SqliteStore(path, max_events)
        self.description = f"state file {path}"
        self._held: collections.deque[Write] = collections.deque()
        self._failures = 0
        self._dropped = 0
        self._problem = ""
        self._retry: asyncio.TimerHandle | None = None

    async def load(self) -> list[StoredJob]:
        return self.file.load()

    async def set_aside(self, job_id: str, reason: str) -> None:
        self.file.set_aside(job_id, reason)

    def write(self, change: Write) -> Awaitable[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._held.append(change)
        if len(self._held) > MAX_HELD:
            self._held.popleft()
            self._dropped += 1
        self._flush()
        done.set_result(None)
        return done

    def write_backlog(self) -> WriteBacklog:
        return WriteBacklog(len(self._held), self._failures)

    def _apply(self, change: Write) -> None:
        match change:
            case Commit(row, journal, agents, now):
                self.file.commit(row, journal, agents, now=now)
            case DropAgents(job_id):
                self.file.drop_agents(job_id)
            case Forget(job_id):
                self.file.forget(job_id)

    def _flush(self) -> None:
        """Write the held writes in order, stopping at the first the file does not take."""
        while self._held:
            try:
                self._apply(self._held[0])
            except sqlite3.OperationalError as exc:
                self._failed(exc)
                return
            self._held.popleft()
        if self._problem:
            logger.warning(
                "%s: writes resumed; every held write is written%s",
                self.description,
                f" but the oldest {self._dropped} (held past {MAX_HELD})" if self._dropped else "",
            )
            self._problem = ""
            self._dropped = 0

    def _failed(self, exc: sqlite3.OperationalError) -> None:
        self._failures += 1
        problem = storage_problem(exc)
        if not self._problem:
            logger.error(
                "%s: cannot write it: %s; the controller goes on from memory and retries every %.0f s "
                "(metric taskd_state_writes_held); free space or fix the file, or a restart loses what waits",
                self.description,
                problem,
                RETRY_INTERVAL,
            )
        else:
            logger.debug("%s: write held again: %s", self.description, problem)
        self._problem = problem
        if self._retry is None:
            self._retry = asyncio.get_running_loop().call_later(RETRY_INTERVAL, self._retry_held)

    def _retry_held(self) -> None:
        self._retry = None
        self._flush()

    async def events(self, job_id: str, limit: int) -> list[EventRecord]:
        return self.file.events(job_id, limit)

    async def events_after(self, job_id: str, after: int, limit: int) -> list[EventRecord]:
        return self.file.events_after(job_id, after, limit)

    def journal_size(self) -> int:
        return self.file.journal_size()

    async def close(self) -> None:
        # Every write not held was committed when it was made; closing checkpoints the WAL.
        if self._retry is not None:
            self._retry.cancel()
        self._flush()
        if self._held:
            logger.error(
                "%s: %d write(s) could not be written (%s) and are lost with this controller",
                self.description,
                len(self._held),
                self._problem,
            )
        self.file.close()
