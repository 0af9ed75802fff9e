"""Slow ranks over gRPC: agents' work figures in, a ``slow-rank`` entry, a metric and a status line out."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from taskd_core.cli.status import render
from taskd_core.client.query import QueryClient
from taskd_core.controller.server import EmbeddedController
from taskd_core.rpc import recover_pb2 as pb
from tests.controller.test_metrics import scrape

WAIT = 20.0


@pytest.fixture
def metered() -> Iterator[EmbeddedController]:
    ctl = EmbeddedController(metrics_port=0)
    yield ctl
    ctl.stop()


def work(agent, ranks: dict[int, float], step: int, steps: int = 5) -> pb.Status:
    """``steps`` steps up to ``step`` of each rank's ``seconds`` of work per step."""
    samples = [
        pb.RankWork(rank=r, pid=1000 + r, step=step, steps=steps, busySeconds=seconds * steps)
        for r, seconds in ranks.items()
    ]
    request = pb.WorkerEventsRequest(jobId=agent.job_id, agentId=agent.agent_id, work=samples)
    return agent.stub.ReportWorkerEvents(request, timeout=WAIT)


def two_nodes(ctl, make_agent, job_id: str, slowed: dict[int, float]):
    """Nodes 0 (ranks 0, 1) and 1 (ranks 2, 3) report 100 steps of 0.1 s of work, ``slowed`` ranks that
    many times more from step 40 on; the job's view after them."""
    node0 = make_agent(ctl.address, job_id, "node-0", node_rank=0, rank_ids=(0, 1)).join()
    node1 = make_agent(ctl.address, job_id, "node-1", node_rank=1, rank_ids=(2, 3)).join()
    for step in range(5, 101, 5):
        paces = {r: 0.1 * (slowed.get(r, 1.0) if step > 40 else 1.0) for r in range(4)}
        assert work(node0, {0: paces[0], 1: paces[1]}, step).code == 0
        assert work(node1, {2: paces[2], 3: paces[3]}, step).code == 0
    with QueryClient(ctl.address) as query:
        return query.job(job_id, events=50)


def test_a_rank_slower_than_its_peers_on_another_node_is_journalled_counted_and_shown(metered, make_agent):
    job = two_nodes(metered, make_agent, "job-s", {3: 2.0})
    (event,) = [e for e in job.events if e.kind == "slow-rank"]
    detail = event.detail
    assert detail["ranks"] == [3] and detail["agent"] == "node-1" and detail["policy"] == "warn"
    (evidence,) = detail["evidence"]
    assert evidence["rank"] == 3 and evidence["pid"] == 1003
    assert 40 < evidence["since_step"] <= detail["step"] <= 60
    # Found as its level crossed the bound, from figures of both paces: its evidence says so.
    assert evidence["peers"] == {"0": 0.1, "1": 0.1, "2": 0.1} and evidence["peer_median"] == 0.1
    assert evidence["ratio"] >= 1.6 and evidence["work_per_step"] >= 0.16 and detail["bound"] == 1.6
    # Found before the job's own bound was learned (three windows of steps): on the default.
    assert detail["bound_learned"] is False
    assert len(evidence["figures"]) == 20 and set(evidence["figures"]) == {0.1, 0.2}
    (slow_rank,) = job.slow_ranks
    assert (slow_rank.rank, slow_rank.pid, slow_rank.since_step) == (3, 1003, evidence["since_step"])
    shown = render(query_status(metered))
    assert "slow rank  rank 3 (pid 1003) slow since step" in shown
    # By step 100 the job has learned its bound: the floor, as rank 3's ratios rising to 2 are left out.
    assert "slow bound 1.6 x the peers' median (learned from the job)" in shown
    m = scrape(metered.metrics_port)
    assert m["taskd_slow_ranks_found_total{action=warn}"] == 1 and m["taskd_slow_ranks{}"] == 1


def test_a_slow_node_is_one_event_naming_both_its_ranks(metered, make_agent):
    # Rank 3 a little less slow than rank 2: on its own it would cross the bound steps later.
    job = two_nodes(metered, make_agent, "job-n", {2: 2.5, 3: 2.0})
    (event,) = [e for e in job.events if e.kind == "slow-rank"]
    assert event.detail["ranks"] == [2, 3] and event.detail["agent"] == "node-1"
    assert [(f["rank"], f["pid"]) for f in event.detail["evidence"]] == [(2, 1002), (3, 1003)]
    assert all(f["ratio"] >= 1.6 and f["peer_median"] == 0.1 for f in event.detail["evidence"])
    assert [s.rank for s in job.slow_ranks] == [2, 3]
    m = scrape(metered.metrics_port)
    assert m["taskd_slow_ranks_found_total{action=warn}"] == 2 and m["taskd_slow_ranks{}"] == 2


def query_status(ctl: EmbeddedController):
    with QueryClient(ctl.address) as query:
        return query.status()


def test_a_healthy_job_has_no_slow_rank(metered, make_agent):
    agent = make_agent(metered.address, "job-h", "node-0", node_rank=0, rank_ids=(0, 1, 2, 3)).join()
    for step in range(5, 201, 5):
        # Every rank 4x slower from step 100 on: a job-wide slowdown, no straggler.
        assert work(agent, dict.fromkeys(range(4), 0.1 if step <= 100 else 0.4), step).code == 0
    with QueryClient(metered.address) as query:
        job = query.job("job-h", events=100)
    assert [e for e in job.events if e.kind == "slow-rank"] == [] and job.slow_ranks == ()
    # Its ratios are all 1: it learned the lowest bound (the default's), and status --json says so.
    shown = job.to_json()
    assert (shown["slow_rank_bound"], shown["slow_rank_bound_learned"]) == (1.6, True)


@pytest.mark.parametrize(
    ("sample", "field"),
    [
        (pb.RankWork(rank=-1, pid=1, step=5, steps=1, busySeconds=0.1), "rank"),
        (pb.RankWork(rank=0, pid=1, step=5, steps=0, busySeconds=0.1), "steps"),
        (pb.RankWork(rank=0, pid=1, step=5, steps=9, busySeconds=0.1), "steps"),
        (pb.RankWork(rank=0, pid=1, step=5, steps=1, busySeconds=float("nan")), "busySeconds"),
        (pb.RankWork(rank=0, pid=1, step=5, steps=1, busySeconds=-1.0), "busySeconds"),
    ],
)
def test_malformed_work_is_refused_with_the_field(controller, make_agent, sample, field):
    agent = make_agent(controller.address, "job-bad-work", "node-0").join()
    request = pb.WorkerEventsRequest(jobId=agent.job_id, agentId=agent.agent_id, work=[sample])
    status = agent.stub.ReportWorkerEvents(request, timeout=WAIT)
    assert status.code == 409 and field in status.info
    page = agent.stub.QueryEvents(pb.EventQuery(jobId=agent.job_id), timeout=WAIT)
    assert not [e for e in page.events if e.kind == "slow-rank"]
    assert json.loads(page.events[0].detail) is not None
