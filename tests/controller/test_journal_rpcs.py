"""The journal extensions: ReportWorkerEvents journals an agent's workers, QueryEvents pages the journal."""

from __future__ import annotations

import json

import pytest

from taskd_core.rpc import recover_pb2 as pb

WAIT = 20.0


def worker_event(**fields: object) -> pb.WorkerEvent:
    base: dict[str, object] = {"kind": "started", "rank": 1, "localRank": 1, "pid": 4242, "time": 1.5e9}
    return pb.WorkerEvent(**{**base, **fields})


def report(agent, *events: pb.WorkerEvent, job_id: str | None = None) -> pb.Status:
    request = pb.WorkerEventsRequest(jobId=job_id or agent.job_id, agentId=agent.agent_id, events=list(events))
    return agent.stub.ReportWorkerEvents(request, timeout=WAIT)


def query(agent, after: int = 0, limit: int = 0, job_id: str | None = None) -> pb.EventPage:
    request = pb.EventQuery(jobId=agent.job_id if job_id is None else job_id, afterSeq=after, limit=limit)
    return agent.stub.QueryEvents(request, timeout=WAIT)


def test_worker_events_are_journalled_and_paged_after_a_cursor(controller, make_agent):
    agent = make_agent(controller.address, "job-w", "node-0", node_rank=0, rank_ids=(0, 1)).join()
    status = report(
        agent,
        worker_event(),
        worker_event(kind="exited", exitCode=-9, step=57, time=1.5e9 + 2),
        worker_event(kind="resumed", step=50, pid=4343),
    )
    assert status.code == 0, status.info
    page = query(agent)
    assert page.status.code == 0 and page.state == "idle"
    workers = [(e.kind, json.loads(e.detail)) for e in page.events if e.kind.startswith("worker")]
    assert workers == [
        ("worker started", {"agent": "node-0", "rank": 1, "local_rank": 1, "pid": 4242, "at": 1.5e9}),
        (
            "worker exited",
            {"agent": "node-0", "rank": 1, "local_rank": 1, "pid": 4242, "at": 1.5e9 + 2, "exit_code": -9, "step": 57},
        ),
        ("worker resumed", {"agent": "node-0", "rank": 1, "local_rank": 1, "pid": 4343, "at": 1.5e9, "step": 50}),
    ]
    seqs = [e.seq for e in page.events]
    assert seqs == sorted(seqs)
    two = query(agent, after=seqs[0], limit=2)
    assert [e.seq for e in two.events] == seqs[1:3]
    assert list(query(agent, after=seqs[-1]).events) == []


@pytest.mark.parametrize(
    ("event", "field"),
    [
        (worker_event(kind="born"), "kind"),
        (worker_event(rank=-1), "rank"),
        (worker_event(rank=10**9), "rank"),
        (worker_event(pid=-5), "pid"),
        (worker_event(time=float("nan")), "time"),
        (worker_event(kind="exited", step=-1), "step"),
        (worker_event(kind="resumed"), "step"),
        (worker_event(kind="stepping"), "step"),
    ],
)
def test_a_malformed_worker_event_is_refused_and_nothing_is_journalled(controller, make_agent, event, field):
    agent = make_agent(controller.address, "job-bad", "node-0").join()
    before = len(query(agent).events)
    status = report(agent, worker_event(), event)
    assert status.code == 409 and field in status.info
    assert len(query(agent).events) == before


def test_worker_events_of_an_unknown_job_or_agent_are_refused(controller, make_agent):
    agent = make_agent(controller.address, "job-x", "node-0").join()
    assert report(agent, worker_event(), job_id="nobody").code == 400
    stranger = pb.WorkerEventsRequest(jobId="job-x", agentId="node-9", events=[worker_event()])
    assert agent.stub.ReportWorkerEvents(stranger, timeout=WAIT).code == 400


def test_events_of_an_unknown_or_empty_job_id_are_refused(controller, make_agent):
    agent = make_agent(controller.address, "job-q", "node-0").join()
    unknown = query(agent, job_id="nobody")
    assert unknown.status.code == 400 and "not known" in unknown.status.info
    assert query(agent, job_id="").status.code == 409
