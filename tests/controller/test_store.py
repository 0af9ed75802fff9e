"""The storage interface, the same tests against both implementations: SQLite and a real etcd.

Each test opens the store the way a controller does (``open_election`` then a
campaign), writes through :meth:`StateStore.write`, closes it and opens it
again, and checks what a new controller would load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from taskd_core.controller.access import Claim
from taskd_core.controller.etcd_client import EtcdClient, is_etcd_url, parse_etcd_url, put
from taskd_core.controller.machine import AgentInfo, JournalEntry, Snapshot
from taskd_core.controller.policy import PolicyBook
from taskd_core.controller.replica import open_election
from taskd_core.controller.store import (
    ROTATE_EVERY,
    Commit,
    DropAgents,
    Forget,
    JobRow,
    StateStore,
    snapshot_to_dict,
)
from taskd_core.controller.store_etcd import Layout
from taskd_core.controller.store_sqlite import SqliteState

JOB = "job/with slash"  # ids are free text: a slash must not leak into another job's keys


@contextlib.asynccontextmanager
async def opened(state: str, max_events: int | None = None) -> AsyncIterator[StateStore]:
    election = await open_election(state, "127.0.0.1:1", PolicyBook())
    term = await election.campaign()
    store = term.store
    if max_events is not None:
        # Both stores read the cap on every write; a small one keeps rotation tests short.
        target: Any = store.file if isinstance(store, SqliteState) else store
        target.max_events = max_events
    try:
        yield store
    finally:
        await term.end()
        await election.close()


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


async def raw_put(state: str, key: bytes, value: bytes) -> None:
    client = EtcdClient(parse_etcd_url(state))
    try:
        await client.txn([], [put(key, value)])
    finally:
        await client.close()


def test_jobs_agents_and_the_journal_round_trip(state_url: str) -> None:
    row = JobRow(JOB, True, {"max_cycles": 2}, snapshot_to_dict(Snapshot(cycle=3)), Claim("d1g3st", "launch-1"))
    agent = AgentInfo("n0", "taskd", 0, (0, 1), None, 4.0)
    fenced = AgentInfo("n1", "taskd", 1, (2, 3), None, 4.0, replaced_by="spare-x")

    async def body() -> None:
        async with opened(state_url) as store:
            entries = (JournalEntry("a", 0, {"x": 1}), JournalEntry("b", 1, {}))
            await store.write(Commit(row, entries, (agent, fenced), 5.0))
            await store.write(Commit(row, (JournalEntry("c", 1, {}),), (), 6.0))
            await store.write(Commit(JobRow("other", False, {}, {}), (JournalEntry("o", 0, {}),), (), 7.0))
        async with opened(state_url) as again:
            jobs = {j.row.job_id: j for j in await again.load()}
            assert jobs[JOB].row == row and sorted(jobs[JOB].agents, key=lambda a: a.agent_id) == [agent, fenced]
            assert jobs["other"].agents == ()
            assert [e.kind for e in await again.events(JOB, 2)] == ["b", "c"]
            everything = await again.events(JOB, 100)
            assert [e.kind for e in everything] == ["a", "b", "c"] and json.loads(everything[0].detail) == {"x": 1}
            assert [(e.time, e.cycle, e.job_id) for e in everything] == [(5.0, 0, JOB), (5.0, 1, JOB), (6.0, 1, JOB)]
            seqs = [e.seq for e in everything]
            assert seqs == sorted(set(seqs))
            assert [e.kind for e in await again.events_after(JOB, seqs[0], 1)] == ["b"]
            assert await again.events_after(JOB, seqs[-1], 10) == []
            assert again.journal_size() == 4
            # Numbering goes on after a restart: new entries sort after the old ones.
            await again.write(Commit(row, (JournalEntry("d", 2, {}),), (), 8.0))
            newest = (await again.events(JOB, 1))[0]
            assert newest.kind == "d" and newest.seq > seqs[-1]

    run(body)


def test_dropped_agents_and_forgotten_jobs_stay_gone(state_url: str) -> None:
    async def body() -> None:
        async with opened(state_url) as store:
            for job in ("a", "ab"):
                await store.write(
                    Commit(JobRow(job, True, {}, {}), (JournalEntry("e", 0, {}),), (AgentInfo("n0"),), 1.0)
                )
            await store.write(DropAgents("a"))
            await store.write(Forget("ab"))
        async with opened(state_url) as again:
            (job,) = await again.load()
            assert job.row.job_id == "a" and job.agents == ()
            assert await again.events("ab", 10) == [] and len(await again.events("a", 10)) == 1
            assert again.journal_size() == 1

    run(body)


def test_rotation_keeps_each_job_under_its_cap(state_url: str) -> None:
    async def body() -> None:
        async with opened(state_url, max_events=100) as store:
            row = JobRow(JOB, True, {}, {})
            for n in range(1000):
                store.write(Commit(row, (JournalEntry("e", 0, {"n": n}),), (), float(n)))
            await store.write(Commit(JobRow("other", True, {}, {}), (JournalEntry("e", 0, {}),), (), 0.0))
            kept = await store.events(JOB, 10_000)
            assert 100 <= len(kept) < 100 + ROTATE_EVERY
            assert kept[-1].detail == '{"n": 999}'
            assert len(await store.events("other", 10)) == 1
            assert store.journal_size() == len(kept) + 1
        async with opened(state_url) as again:
            await again.load()
            assert again.journal_size() == len(kept) + 1

    run(body)


def test_many_writes_at_once_keep_their_order(state_url: str) -> None:
    """Writes made without waiting land in order: the last one of each job wins."""

    async def body() -> None:
        async with opened(state_url) as store:
            writes = [
                store.write(Commit(JobRow(f"job-{n % 7}", True, {"n": n}, {}), (JournalEntry("e", 0, {"n": n}),),
                                   (AgentInfo(f"a{n % 3}", last_seen=float(n)),), float(n)))
                for n in range(500)
            ]
            await asyncio.gather(*writes)
        async with opened(state_url) as again:
            jobs = {j.row.job_id: j for j in await again.load()}
            for k in range(7):
                last = max(n for n in range(500) if n % 7 == k)
                assert jobs[f"job-{k}"].row.policy == {"n": last}
                journal = await again.events(f"job-{k}", 1000)
                assert [json.loads(e.detail)["n"] for e in journal] == [n for n in range(500) if n % 7 == k]

    run(body)


def test_a_large_journal_write_is_kept_whole(state_url: str) -> None:
    """One write bigger than one etcd transaction may be (a flood of worker events) still lands whole."""
    entries = tuple(JournalEntry("worker started", 0, {"rank": n, "pad": "x" * 100}) for n in range(9_000))

    async def body() -> None:
        async with opened(state_url) as store:
            await store.write(Commit(JobRow(JOB, True, {}, {}), entries, (), 1.0))
            got = await store.events(JOB, 9_000)
            assert [json.loads(e.detail)["rank"] for e in got] == list(range(9_000))

    run(body)


def test_a_damaged_agent_sets_its_job_aside_and_the_others_load(state_url: str, caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with opened(state_url) as store:
            for job in ("a", "b"):
                await store.write(Commit(JobRow(job, True, {}, {}), (), (AgentInfo("n0", "taskd", 0, (0,)),), 1.0))
            if isinstance(store, SqliteState):
                store.file._db.execute("UPDATE agents SET rank_ids = '[\"x\"]' WHERE job_id = 'a'")
        if is_etcd_url(state_url):
            layout = Layout(parse_etcd_url(state_url).prefix)
            await raw_put(state_url, layout.agent("a", "n0"), b'{"agent_id": "n0", "rank_ids": ["x"]}')
            await raw_put(state_url, layout.job("b2"), b"{not json")
        async with opened(state_url) as again:
            assert [j.row.job_id for j in await again.load()] == ["b"]
        async with opened(state_url) as third:
            assert [j.row.job_id for j in await third.load()] == ["b"]

    run(body)
    lines = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert lines and all("\n" not in line for line in lines) and "job a " in lines[0]
