"""``QueryClient``: what a controller knows, as model values, over TLS and with job and admin tokens."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from taskd_core.client.query import QueryClient
from taskd_core.errors import ControllerUnavailableError, ProtocolError, QueryRefusedError
from taskd_core.models import (
    AgentStatus,
    Credentials,
    FaultRank,
    FaultType,
    JobState,
    JobStatus,
    JournalEvent,
    Strategy,
)
from taskd_core.rpc import recover_pb2 as pb
from taskd_core.rpc.convert import (
    detail_of,
    job_status_from_pb,
    job_status_to_pb,
    journal_event_to_pb,
    journal_page_from_pb,
)
from taskd_core.testing import free_port
from tests.conftest import TEST_POLICY, token_file

TOKEN = "the-job-token"


def test_a_job_in_a_cycle_reads_as_typed_values(controller, make_agent) -> None:
    agent = make_agent(controller.address, "job-q", "node-0", node_rank=0, rank_ids=(0, 1)).join()
    assert agent.stub.HealthCheck(pb.ClientInfo(jobId="job-q", agentId="node-0", progress="stopped 0.5s"), timeout=10).code == 0
    agent.fault({1: 1})
    stop = agent.expect("stopTrain")
    assert agent.stopped(uuid=stop.uuid).code == 0
    agent.expect("globalFault")
    assert agent.strategies(["recover", "exit"], uuid=stop.uuid).code == 0
    agent.expect("changeStrategy")
    with QueryClient(controller.address) as query:
        job = query.job("job-q", events=100)
        (listed,) = query.status().jobs
    assert listed == dataclasses.replace(job, events=(), agents=listed.agents)  # no events asked for
    assert (job.state, job.cycle, job.strategy, job.cycles_used) == (JobState.WAIT_STATUS, 1, Strategy.RECOVER, 1)
    assert job.faults == (FaultRank(1, FaultType.NORMAL),)
    assert job.strategies == TEST_POLICY.strategies and job.max_cycles == TEST_POLICY.max_cycles
    assert job.outcome == "waiting for ReportRecoverStatus for strategy 'recover'" and job.legacy
    (node,) = job.agents
    assert node == AgentStatus("node-0", "taskd", True, 0, None, node.last_seen, "stopped 0.5s")
    assert all(isinstance(e, JournalEvent) and e.job_id == "job-q" for e in job.events)
    fault = next(e for e in job.events if e.kind == "fault")
    assert fault.detail["ranks"] == {"1": "1"}  # an object, not the wire's JSON text
    assert [e.kind for e in job.events].count("strategy chosen") == 1


def test_an_ended_agent_reads_as_its_exit_code(controller, make_agent) -> None:
    agent = make_agent(controller.address, "job-x", "node-0").join()
    with QueryClient(controller.address) as query:
        assert query.ended_agents("job-x") == 0
        assert agent.exited(3).code == 0
        assert query.job("job-x").agents[0].exit_code == 3 and query.ended_agents("job-x") == 1
        assert query.job("job-x").agents[0].node_rank is None  # it did not say


def test_the_journal_reads_page_by_page_after_a_cursor(controller, make_agent) -> None:
    agent = make_agent(controller.address, "job-j", "node-0").join()
    agent.fault({0: 1})
    agent.expect("stopTrain")
    with QueryClient(controller.address) as query:
        whole = query.events("job-j")
        first = query.events("job-j", limit=2)
        rest = query.events("job-j", after=first.events[-1].seq)
    assert whole.state is JobState.WAIT_STOP
    assert len(first.events) == 2 and first.events + rest.events == whole.events
    assert [e.seq for e in whole.events] == sorted(e.seq for e in whole.events)


def test_the_job_token_and_the_admin_token_decide_what_is_seen(tmp_path, controller_factory, make_agent, monkeypatch) -> None:
    admin_file = tmp_path / "admin-token"
    token_file(admin_file, "the-admin")
    ctl = controller_factory(admin_token_file=str(admin_file))
    make_agent(ctl.address, "mine", "node-0", credentials=Credentials(token=TOKEN)).join()
    with QueryClient(ctl.address, Credentials()) as nobody:
        assert nobody.status().jobs == ()
        with pytest.raises(QueryRefusedError, match=r"refused QueryStatus \(403: .*TASKD_JOB_TOKEN") as refused:
            nobody.job("mine")
        assert refused.value.code == 403
        with pytest.raises(QueryRefusedError, match="refused QueryEvents"):
            nobody.events("mine")
    with QueryClient(ctl.address, Credentials(token="the-admin")) as admin:
        assert [j.job_id for j in admin.status().jobs] == ["mine"]
    # By default the client presents what the environment says, as DLRecoverManager does.
    monkeypatch.setenv("TASKD_JOB_TOKEN", TOKEN)
    with QueryClient(ctl.address) as owner:
        assert owner.job("mine").agents[0].agent_id == "node-0" and not owner.job("mine").legacy


def test_tls_with_a_client_certificate(controller_factory, make_agent, pki) -> None:
    ctl = controller_factory(tls=pki.server(mutual=True))
    make_agent(ctl.address, "tls-job", "node-0", credentials=pki.client(TOKEN)).join()
    with QueryClient(ctl.address, pki.client(TOKEN)) as query:
        assert query.job("tls-job").state is JobState.IDLE
    with QueryClient(ctl.address, pki.client(TOKEN, cert=False), timeout=2) as query, pytest.raises(ControllerUnavailableError):
        query.status()


def test_an_unknown_job_an_absent_controller_and_a_server_that_is_no_controller(controller) -> None:
    with QueryClient(controller.address) as query:
        with pytest.raises(QueryRefusedError, match=r"\(400: jobId=nope is not known to this controller\); .*taskd status") as unknown:
            query.job("nope")
        assert unknown.value.code == 400
        with pytest.raises(QueryRefusedError, match="400"):
            query.events("nope")
        with pytest.raises(QueryRefusedError, match=r"\(409: events must be 0\.\.1000"):
            query.status(events=5000)
    with QueryClient(f"127.0.0.1:{free_port()}", timeout=0.5) as query, pytest.raises(ControllerUnavailableError, match="unreachable"):
        query.status()
    bare = grpc.server(ThreadPoolExecutor(1))
    port = bare.add_insecure_port("127.0.0.1:0")
    bare.start()
    try:
        with QueryClient(f"127.0.0.1:{port}") as query, pytest.raises(QueryRefusedError, match="UNIMPLEMENTED.*not a TaskD"):
            query.status()
    finally:
        bare.stop(None)


def test_status_converts_to_the_wire_and_back_unchanged() -> None:
    job = JobStatus(
        job_id="j",
        state=JobState.WAIT_STRATEGIES,
        cycle=2,
        strategy=None,
        faults=(FaultRank(3, FaultType.HANG),),
        strategies=(Strategy.RECOVER, Strategy.EXIT),
        cycles_used=2,
        max_cycles=5,
        agents=(AgentStatus("a", "r", False, None, -9, 12.5, "t"), AgentStatus("b", "r", True, 1, None, 13.0)),
        events=(JournalEvent(7, 1.5, "j", 2, "fault", {"ranks": {"3": "3"}, "evidence": "stack\nline"}),),
        outcome="cycle 1 recovered by recover",
        legacy=True,
    )
    assert job_status_from_pb(job_status_to_pb(job)) == job


@pytest.mark.parametrize(
    ("view", "field"),
    [
        (pb.JobView(jobId="j", state="dancing"), "state"),
        (pb.JobView(jobId="j", state="idle", strategy="teleport"), "strategy"),
        (pb.JobView(jobId="j", state="idle", strategies=["recover", "x"]), "strategies"),
        (pb.JobView(jobId="j", state="idle", agents=[pb.AgentView(exitState="gone")]), "exitState"),
        (pb.JobView(jobId="j", state="idle", faultRanks=[pb.FaultRank(rankId="x", faultType="1")]), "rankId"),
    ],
)
def test_an_answer_no_controller_sends_is_a_protocol_error_naming_the_field(view: pb.JobView, field: str) -> None:
    with pytest.raises(ProtocolError) as bad:
        job_status_from_pb(view)
    assert bad.value.field == field


def test_a_journal_detail_that_is_not_a_json_object_is_kept_as_text() -> None:
    page = pb.EventPage(state="idle", events=[pb.EventView(seq=1, kind="k", detail="not json"), pb.EventView(seq=2, detail="[1]")])
    assert [e.detail for e in journal_page_from_pb("j", page).events] == [{"text": "not json"}, {"text": "[1]"}]
    with pytest.raises(ProtocolError, match="state must be one of"):
        journal_page_from_pb("j", pb.EventPage(state="?"))


def test_a_stored_detail_goes_out_as_stored_and_reads_as_an_object() -> None:
    stored = '{"b": 1, "a": [2]}'  # not in sorted order: proves the text is passed, not rewritten
    event = JournalEvent(1, 0.0, "j", 0, "k", detail_of(stored))
    assert journal_event_to_pb(event).detail == stored
    assert event.detail == {"b": 1, "a": [2]} and event.to_json()["detail"] == {"b": 1, "a": [2]}
    assert journal_event_to_pb(JournalEvent(1, 0.0, "j", 0, "k", {"b": 1, "a": 2})).detail == '{"a": 2, "b": 1}'
