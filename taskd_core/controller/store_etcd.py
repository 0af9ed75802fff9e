"""The controller's durable state in etcd: jobs, agents and the journal under one key prefix.

Keys (``P`` is the prefix of ``--state etcd://HOSTS/P``; ids are percent-encoded)::

    P/meta                       what the prefix holds: {"app": "taskd-controller", "schema": 1}
    P/policy                     the replicas' common policy (see :func:`claim_policy`)
    P/leader                     the leading replica, on its lease (taskd_core.controller.election)
    P/seq                        the next journal sequence number
    P/jobs/JOB                   a job: inited, policy, snapshot, claim
    P/agents/JOB/AGENT           one registered agent
    P/events/JOB/SEQ-N           N journal entries ending with sequence number SEQ (16 hex digits)
    P/damaged/JOB/NANOS          a job set aside because it could not be read

Every write is a transaction conditional on the writer's *fence* (its
leader key still being the one it created, the policy the one it loaded),
so a replica that lost its lease changes nothing once another took over.
Writes queue in order; one writer task sends them, as many as fit in one
transaction (etcd's default limits: 128 operations, 1.5 MiB), and each
write's awaitable is done when its transaction is. All writes are puts and
deletes of keys fixed when the write is made, so sending a transaction
again after a lost answer changes nothing; while etcd does not answer the
writer retries until the fence's lease would end, then gives up leading.

Journal entries of one transaction share a key, so a cycle's handful of
entries cost one key, and rotation deletes whole keys: each job keeps at
least ``max_events`` entries and at most that plus one key's worth plus
:data:`~taskd_core.controller.store.ROTATE_EVERY`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from taskd_core.controller.access import Claim
from taskd_core.controller.etcd_client import EtcdClient, created_at, delete, prefix_end, put
from taskd_core.controller.machine import AgentInfo
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
from taskd_core.errors import ConfigError, LeadershipLostError, StateStoreError, StateUnavailableError
from taskd_core.rpc._gen import etcd_v3_pb2 as epb

logger = logging.getLogger(__name__)

APP = "taskd-controller"
SCHEMA = 1
#: Operations and bytes one transaction carries at most (under etcd's defaults: 128 and 1.5 MiB).
TXN_OPS = 120
TXN_BYTES = 1024 * 1024
#: Longest pause between two tries of a write etcd did not take.
RETRY_CAP = 0.5
#: Largest value of one journal key; a bigger write spreads its entries over several keys.
EVENTS_VALUE_BYTES = 256 * 1024


def _quote(name: str) -> bytes:
    return urllib.parse.quote(name, safe="").encode()


class Layout:
    """The keys of one prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        root = prefix.encode() + b"/"
        self.root = root
        self.meta = root + b"meta"
        self.policy = root + b"policy"
        self.leader = root + b"leader"
        self.seq = root + b"seq"
        self.jobs = root + b"jobs/"
        self.all_agents = root + b"agents/"
        self.all_events = root + b"events/"
        self.all_damaged = root + b"damaged/"

    def job(self, job_id: str) -> bytes:
        return self.jobs + _quote(job_id)

    def agents(self, job_id: str) -> bytes:
        return self.all_agents + _quote(job_id) + b"/"

    def agent(self, job_id: str, agent_id: str) -> bytes:
        return self.agents(job_id) + _quote(agent_id)

    def events(self, job_id: str) -> bytes:
        return self.all_events + _quote(job_id) + b"/"

    def events_from(self, job_id: str, seq: int) -> bytes:
        """Where the keys holding entries numbered ``seq`` or more start."""
        return self.events(job_id) + f"{seq:016x}".encode()

    def event_key(self, job_id: str, last: int, count: int) -> bytes:
        return self.events_from(job_id, last) + f"-{count}".encode()

    def damaged(self, job_id: str) -> bytes:
        return self.all_damaged + _quote(job_id) + f"/{time.time_ns()}".encode()

    @staticmethod
    def parse_event_key(key: bytes) -> tuple[str, int, int]:
        """(job id, last seq, count) of an event key (the part after ``events/``)."""
        job, _, name = key.rpartition(b"/")
        last, _, count = name.partition(b"-")
        return urllib.parse.unquote(job.rpartition(b"/")[2].decode()), int(last, 16), int(count)


def _dumps(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


# --- what a prefix holds: the schema, and the replicas' policy ------------------------------


async def check_prefix(client: EtcdClient, layout: Layout) -> None:
    """Make sure the prefix holds TaskD's state of this schema, or nothing (then mark it).

    :raises ConfigError: someone else's data, or another schema version.
    """
    where = client.target.url
    for _ in range(3):  # replicas starting together: the mark another one just wrote is looked at again
        meta = await client.range(layout.meta)
        if meta.kvs:
            _check_meta(where, layout, meta.kvs[0].value)
            return
        found = await client.range(layout.root, prefix_end(layout.root), limit=3, keys_only=True)
        if any(kv.key == layout.meta for kv in found.kvs):
            continue
        if found.kvs:
            keys = ", ".join(repr(kv.key.decode(errors="replace")) for kv in found.kvs)
            raise ConfigError(
                f"{where}: the prefix holds {found.count} key(s) that are not a TaskD controller's state "
                f"(e.g. {keys}); give the controller a prefix of its own"
            )
        value = _dumps({"app": APP, "schema": SCHEMA, "created": time.time()})
        await client.txn([created_at(layout.meta, 0)], [put(layout.meta, value)])
    raise StateStoreError(where, "the prefix kept changing while this replica looked at it")


def _check_meta(where: str, layout: Layout, value: bytes) -> None:
    try:
        data = json_object(value)
        app, schema = data.get("app"), data.get("schema")
    except (ValueError, TypeError):
        app, schema = None, None
    if app != APP:
        raise ConfigError(
            f"{where}: {layout.meta.decode()} does not describe a TaskD controller's state; "
            "the prefix belongs to something else: give the controller a prefix of its own"
        )
    if schema != SCHEMA:
        raise ConfigError(
            f"{where}: the state there is of schema version {schema}, this controller reads version "
            f"{SCHEMA}; run the TaskD version that wrote it, or give this one a new prefix"
        )


def _differences(ours: Mapping[str, Any], theirs: Mapping[str, Any], path: str = "") -> list[str]:
    found = []
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key), theirs.get(key)
        where = f"{path}{key}"
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            found += _differences(a, b, where + ".")
        elif a != b:
            found.append(f"{where}: {a!r} here, {b!r} there")
    return found


async def claim_policy(
    client: EtcdClient, layout: Layout, policy: Mapping[str, Any], who: str, *, replace: bool = False
) -> int:
    """Check this replica's policy against the one the prefix holds; the policy key's revision.

    The first replica on a prefix stores its policy; every other must bring the
    same one, unless ``replace`` makes its policy the stored one (the replicas
    with the old one then refuse to lead: see the fence).

    :raises ConfigError: the policies differ (the message lists how).
    """
    value = _dumps({"policy": policy, "by": who, "at": time.time()})
    for _ in range(3):  # a race with another replica storing its own is settled on the next look
        stored = await client.range(layout.policy)
        if not stored.kvs:
            done = await client.txn([created_at(layout.policy, 0)], [put(layout.policy, value)])
            if done.succeeded:
                return done.header.revision
            continue
        kv = stored.kvs[0]
        try:
            theirs = json_object(kv.value)
        except (ValueError, TypeError):
            theirs = {}
        if theirs.get("policy") == policy:
            return kv.mod_revision
        if replace:
            done = await client.txn(
                [
                    epb.Compare(
                        result=epb.Compare.EQUAL,
                        target=epb.Compare.MOD,
                        key=layout.policy,
                        mod_revision=kv.mod_revision,
                    )
                ],
                [put(layout.policy, value)],
            )
            if done.succeeded:
                logger.warning(
                    "%s: this replica's policy replaces the one %s stored",
                    client.target.url,
                    theirs.get("by"),
                )
                return done.header.revision
            continue
        diff = "; ".join(_differences(policy, theirs.get("policy") or {})[:4]) or "unreadable stored policy"
        raise ConfigError(
            f"{client.target.url}: this replica's policy differs from the one the other replicas use "
            f"(stored by {theirs.get('by', '?')}): {diff}; start every replica with the same --policy "
            "file and policy flags, or give this one --replace-policy"
        )
    raise StateStoreError(client.target.url, "the policy key kept changing while this replica read it")


# --- the store -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fence:
    """What makes a leader's writes its own: the condition of every transaction, and its lease."""

    compare: tuple[epb.Compare, ...]
    #: ``time.monotonic()`` until which a write may still be retried (the lease's end).
    until: Callable[[], float]
    #: told (once) when a write finds the condition broken or etcd gone for the rest of the lease.
    lost: Callable[[str], None]


@dataclass(slots=True)
class _Pending:
    """One write, encoded: its operations in order, and who waits for it."""

    ops: list[epb.RequestOp]
    next_seq: int
    done: asyncio.Future[None]
    size: int = 0


def _op_key(op: epb.RequestOp) -> tuple[bytes, bytes]:
    return op.request_delete_range.key, op.request_delete_range.range_end


def _overlaps(a: tuple[bytes, bytes], b: tuple[bytes, bytes]) -> bool:
    """Whether two keys or ranges ``(key, range_end)`` share a key (range_end empty: one key)."""
    a_end = a[1] or a[0] + b"\0"
    b_end = b[1] or b[0] + b"\0"
    return a[0] < b_end and b[0] < a_end


class EtcdStore:
    """One leader's view of the state under a prefix; use from one event loop."""

    def __init__(
        self,
        client: EtcdClient,
        layout: Layout,
        fence: Fence,
        max_events: int = MAX_EVENTS_PER_JOB,
    ) -> None:
        self.description = client.target.url
        self._client = client
        self._layout = layout
        self._fence = fence
        self.max_events = max_events
        self._queue: collections.deque[_Pending] = collections.deque()
        #: the batch the writer is sending now.
        self._inflight: list[_Pending] = []
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._broken = ""
        #: writes etcd did not take (each retried while the lease lasts).
        self._failures = 0
        self._next_seq = 1
        #: per job, oldest first: (last seq, entries) of each journal key.
        self._keys: dict[str, collections.deque[tuple[int, int]]] = {}
        self._counts: dict[str, int] = {}
        self._unrotated: dict[str, int] = {}
        self._entries = 0

    # --- loading -------------------------------------------------------------------

    async def load(self) -> list[StoredJob]:
        layout = self._layout
        seq = await self._client.range(layout.seq)
        if seq.kvs:
            self._next_seq = max(self._next_seq, int(seq.kvs[0].value))
        async for kv in self._client.scan(layout.all_events, keys_only=True):
            try:
                job_id, last, count = Layout.parse_event_key(kv.key)
            except ValueError:
                logger.warning("%s: ignoring journal key %r", self.description, kv.key)
                continue
            self._keys.setdefault(job_id, collections.deque()).append((last, count))
            self._counts[job_id] = self._counts.get(job_id, 0) + count
            self._entries += count
            self._next_seq = max(self._next_seq, last + 1)
        agents: dict[str, list[AgentInfo]] = {}
        damaged: dict[str, str] = {}
        async for kv in self._client.scan(layout.all_agents):
            job_id = urllib.parse.unquote(kv.key[len(layout.all_agents) :].partition(b"/")[0].decode())
            try:
                a = json_object(kv.value)
                ranks = tuple(int(r) for r in a["rank_ids"])
                agents.setdefault(job_id, []).append(
                    AgentInfo(
                        str(a["agent_id"]),
                        str(a["role"]),
                        a["node_rank"],
                        ranks,
                        a["exit_code"],
                        float(a["last_seen"]),
                        # Absent from agents written before replaced nodes were kept.
                        replaced_by=str(a.get("replaced_by", "")),
                    )
                )
            except (ValueError, TypeError, KeyError) as exc:
                damaged[job_id] = (
                    f"agent key {kv.key.decode(errors='replace')!r}: {type(exc).__name__}: {exc}"
                )
        jobs = []
        async for kv in self._client.scan(layout.jobs):
            job_id = urllib.parse.unquote(kv.key[len(layout.jobs) :].decode())
            if job_id in damaged:
                await self.set_aside(job_id, damaged[job_id])
                continue
            try:
                data = json_object(kv.value)
                claim = data["claim"]
                row = JobRow(
                    job_id,
                    bool(data["inited"]),
                    dict(data["policy"]),
                    dict(data["snapshot"]),
                    # A claim written before claims had a start has two fields.
                    Claim(str(claim[0]), str(claim[1]), float(claim[2]) if len(claim) > 2 else 0.0)
                    if claim
                    else None,
                )
            except (ValueError, TypeError, KeyError, IndexError) as exc:
                await self.set_aside(job_id, f"{type(exc).__name__}: {exc}")
                continue
            jobs.append(StoredJob(row, tuple(agents.get(job_id, ()))))
        logger.info(
            "%s: %d job(s), %d agent(s), %d journal entries",
            self.description,
            len(jobs),
            sum(map(len, agents.values())),
            self._entries,
        )
        return jobs

    async def set_aside(self, job_id: str, reason: str) -> None:
        logger.error(
            "%s: job %s is damaged (%s); set aside under %s, the other jobs load",
            self.description,
            job_id,
            reason,
            self._layout.all_damaged.decode(),
        )
        found = await self._client.range(self._layout.job(job_id))
        row = found.kvs[0].value.decode(errors="replace") if found.kvs else None
        agents = self._layout.agents(job_id)
        await self._enqueue(
            [
                put(self._layout.damaged(job_id), _dumps({"reason": reason, "row": row, "at": time.time()})),
                delete(self._layout.job(job_id)),
                delete(agents, prefix_end(agents)),
            ]
        )

    # --- writing ---------------------------------------------------------------------

    def write(self, change: Write) -> Awaitable[None]:
        match change:
            case Commit(row, journal, agents, now):
                ops = self._journal_ops(
                    row.job_id, [(e.cycle, e.kind, journal_detail(e)) for e in journal], now
                )
                ops += [put(self._layout.agent(row.job_id, a.agent_id), self._agent_value(a)) for a in agents]
                ops.append(put(self._layout.job(row.job_id), self._job_value(row, now)))
            case DropAgents(job_id):
                prefix = self._layout.agents(job_id)
                ops = [delete(prefix, prefix_end(prefix))]
            case Forget(job_id):
                ops = [delete(self._layout.job(job_id))]
                for prefix in (self._layout.agents(job_id), self._layout.events(job_id)):
                    ops.append(delete(prefix, prefix_end(prefix)))
                self._entries -= self._counts.pop(job_id, 0)
                self._keys.pop(job_id, None)
                self._unrotated.pop(job_id, None)
        return self._enqueue(ops)

    def _enqueue(self, ops: list[epb.RequestOp]) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._broken:
            done.set_exception(LeadershipLostError(self._broken))
            return done
        pending = _Pending(ops, self._next_seq, done, sum(op.ByteSize() for op in ops))
        self._queue.append(pending)
        self._wake.set()
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(
                self._write_loop(), name="taskd-etcd-writer"
            )
        return done

    @staticmethod
    def _agent_value(a: AgentInfo) -> bytes:
        return _dumps(
            {
                "agent_id": a.agent_id,
                "role": a.role,
                "node_rank": a.node_rank,
                "rank_ids": list(a.rank_ids),
                "exit_code": a.exit_code,
                "last_seen": a.last_seen,
                "replaced_by": a.replaced_by,
            }
        )

    @staticmethod
    def _job_value(row: JobRow, now: float) -> bytes:
        claim = [row.claim.token_digest, row.claim.launch, row.claim.since] if row.claim is not None else None
        return _dumps(
            {
                "job_id": row.job_id,
                "inited": row.inited,
                "policy": row.policy,
                "snapshot": row.snapshot,
                "claim": claim,
                "updated": now,
            }
        )

    def _journal_ops(
        self, job_id: str, entries: Sequence[tuple[int, str, str]], now: float
    ) -> list[epb.RequestOp]:
        """Keys for new entries (numbered now), then the deletes that rotation asks for."""
        ops: list[epb.RequestOp] = []
        chunk: list[list[Any]] = []
        size = 0
        keys = self._keys.setdefault(job_id, collections.deque())

        def flush() -> None:
            nonlocal chunk, size
            last = chunk[-1][0]
            ops.append(put(self._layout.event_key(job_id, last, len(chunk)), _dumps(chunk)))
            keys.append((last, len(chunk)))
            chunk, size = [], 0

        for cycle, kind, detail in entries:
            entry = [self._next_seq, now, cycle, kind, detail]
            self._next_seq += 1
            size += len(detail) + len(kind) + 48
            chunk.append(entry)
            if size >= EVENTS_VALUE_BYTES:
                flush()
        if chunk:
            flush()
        added = len(entries)
        self._entries += added
        total = self._counts[job_id] = self._counts.get(job_id, 0) + added
        written = self._unrotated.get(job_id, 0) + added
        if written >= ROTATE_EVERY:
            written = 0
            rotated = False
            while len(keys) > 1 and total - keys[0][1] >= self.max_events:
                total -= keys.popleft()[1]
                rotated = True
            if rotated:
                self._entries -= self._counts[job_id] - total
                ops.append(delete(self._layout.events(job_id), self._layout.events_from(job_id, keys[0][0])))
            self._counts[job_id] = total
        self._unrotated[job_id] = written
        return ops

    async def _write_loop(self) -> None:
        while not self._broken:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch, ops = self._next_batch()
            self._inflight = batch
            try:
                await self._send(ops, max(p.next_seq for p in batch))
            except (LeadershipLostError, StateStoreError) as exc:
                self._break(str(exc), batch)
                return
            self._inflight = []
            for pending in batch:
                if not pending.done.done():
                    pending.done.set_result(None)

    def _next_batch(self) -> tuple[list[_Pending], list[epb.RequestOp]]:
        """Writes from the queue's head that fit in one transaction (at least the first, whole).

        etcd refuses a transaction that puts one key twice or puts a key it also
        deletes: a later put of the same key replaces the earlier one, and a write
        whose keys meet a range deleted in the batch (or the other way) waits for the next.
        """
        batch: list[_Pending] = []
        ops: list[epb.RequestOp] = []
        puts: dict[bytes, int] = {}
        ranges: list[tuple[bytes, bytes]] = []
        size = 0
        while self._queue:
            pending = self._queue[0]
            new_puts = [op.request_put.key for op in pending.ops if op.HasField("request_put")]
            new_ranges = [_op_key(op) for op in pending.ops if op.HasField("request_delete_range")]
            if batch:
                clash = (
                    any(_overlaps(r, (k, b"")) for r in ranges for k in new_puts)
                    or any(_overlaps(r, (k, b"")) for r in new_ranges for k in puts)
                    or any(_overlaps(r, q) for r in new_ranges for q in ranges)
                )
                count = len(ops) + len(set(new_puts) - puts.keys()) + len(new_ranges)
                if clash or count > TXN_OPS or size + pending.size > TXN_BYTES:
                    break
            self._queue.popleft()
            batch.append(pending)
            size += pending.size
            ranges += new_ranges
            for op in pending.ops:
                key = op.request_put.key if op.HasField("request_put") else None
                if key is not None and key in puts:
                    ops[puts[key]] = op
                    continue
                if key is not None:
                    puts[key] = len(ops)
                ops.append(op)
        return batch, ops

    async def _send(self, ops: list[epb.RequestOp], next_seq: int) -> None:
        """The operations in as many fenced transactions as their size needs, each retried for the lease."""
        seq = put(self._layout.seq, str(next_seq).encode())
        parts: list[list[epb.RequestOp]] = [[]]
        size = 0
        for op in ops:
            if parts[-1] and (len(parts[-1]) >= TXN_OPS - 1 or size + op.ByteSize() > TXN_BYTES):
                parts.append([])
                size = 0
            parts[-1].append(op)
            size += op.ByteSize()
        if len(parts) > 1:
            logger.info(
                "%s: one write spans %d transactions (its journal is large)", self.description, len(parts)
            )
        for part in parts:
            await self._send_one([*part, seq])

    async def _send_one(self, ops: list[epb.RequestOp]) -> None:
        attempt = 0
        while True:
            try:
                done = await self._client.txn(self._fence.compare, ops)
            except StateUnavailableError as exc:
                self._failures += 1
                left = self._fence.until() - time.monotonic()
                if left <= 0:
                    raise LeadershipLostError(
                        f"etcd did not take a write before the lease ended: {exc}"
                    ) from None
                logger.warning(
                    "%s: write not taken (%s); retrying while the lease lasts", self.description, exc
                )
                await asyncio.sleep(min(left, RETRY_CAP, 0.05 * 2 ** min(attempt, 10)))
                attempt += 1
                continue
            if not done.succeeded:
                raise LeadershipLostError(
                    f"{self.description}: a write found another replica leading (or the policy replaced)"
                )
            return

    def _break(self, reason: str, batch: Iterable[_Pending]) -> None:
        self._broken = reason
        error = LeadershipLostError(reason)
        for pending in [*batch, *self._queue]:
            if not pending.done.done():
                pending.done.set_exception(error)
        self._queue.clear()
        self._fence.lost(reason)

    # --- reading -------------------------------------------------------------------------

    @staticmethod
    def _records(job_id: str, kvs: Iterable[epb.KeyValue]) -> list[EventRecord]:
        records = []
        for kv in kvs:
            for seq, at, cycle, kind, detail in json.loads(kv.value):
                records.append(EventRecord(seq, at, job_id, cycle, kind, detail))
        records.sort(key=lambda r: r.seq)
        return records

    async def events(self, job_id: str, limit: int) -> list[EventRecord]:
        if limit <= 0:
            return []
        prefix = self._layout.events(job_id)
        page = await self._client.range(prefix, prefix_end(prefix), limit=limit, descending=True)
        return self._records(job_id, page.kvs)[-limit:]

    async def events_after(self, job_id: str, after: int, limit: int) -> list[EventRecord]:
        if limit <= 0:
            return []
        prefix = self._layout.events(job_id)
        page = await self._client.range(
            self._layout.events_from(job_id, after + 1), prefix_end(prefix), limit=limit
        )
        return [r for r in self._records(job_id, page.kvs) if r.seq > after][:limit]

    def journal_size(self) -> int:
        return self._entries

    def write_backlog(self) -> WriteBacklog:
        return WriteBacklog(len(self._queue) + len(self._inflight), self._failures)

    async def close(self) -> None:
        """Let the writes made so far land while the lease lasts, then stop; what is left fails."""
        waiting = [*self._inflight, *self._queue]
        left = self._fence.until() - time.monotonic()
        if waiting and not self._broken and left > 0:
            await asyncio.wait([asyncio.shield(waiting[-1].done)], timeout=left)
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
        if not self._broken:
            self._broken = "the store is closed"
        error = LeadershipLostError(self._broken)
        for pending in [*self._inflight, *self._queue]:
            if not pending.done.done():
                pending.done.set_exception(error)
        self._inflight = []
        self._queue.clear()
