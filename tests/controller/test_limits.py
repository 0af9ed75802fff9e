"""Bounded inputs: every limit of the controller tried one past its bound, over real gRPC."""

from __future__ import annotations

import grpc
import pytest

from taskd_core.cli.status import render
from taskd_core.controller.runtime import MAX_JOB_ID, Limits
from taskd_core.controller.service import MAX_QUERY_EVENTS, MAX_RANKS, MAX_STRATEGIES
from taskd_core.models import (
    AgentStatus,
    Code,
    ControllerStatus,
    Credentials,
    JobState,
    JobStatus,
    JournalEvent,
    Strategy,
)
from taskd_core.rpc import recover_pb2 as pb
from taskd_core.rpc.convert import MAX_NAME
from tests.conftest import token_file

JOB = "bounded"


def _info(**fields: object) -> pb.ClientInfo:
    return pb.ClientInfo(**{"jobId": JOB, "role": "r", **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"jobId": "j" * (MAX_JOB_ID + 1)}, "at most 256 characters"),
        ({"agentId": "a" * (MAX_NAME + 1)}, "agentId must be printable and at most 128"),
        ({"role": "r" * (MAX_NAME + 1)}, "role must be printable and at most 128"),
        ({"agentId": "node-\x1b[2J"}, "agentId must be printable"),
        ({"role": "evil\nrole"}, "role must be printable"),
        ({"nodeRank": -1}, "nodeRank must be >= 0"),
        ({"rankIds": ["0"] * (MAX_RANKS + 1)}, "at most 65536"),
    ],
)
def test_client_info_one_past_each_bound_is_409(controller, make_agent, fields, message) -> None:
    agent = make_agent(controller.address, JOB)
    for rpc in (agent.stub.Init, agent.stub.Register):
        reply = rpc(_info(**fields), timeout=10)
        assert reply.code == Code.INVALID_PARAM and message in reply.info, reply
    at_bound = {k: (v[:-1] if isinstance(v, (str, list)) and "\x1b" not in v and "\n" not in v else None)
                for k, v in fields.items()}
    if all(v is not None for v in at_bound.values()) and "jobId" not in fields:
        assert agent.stub.Init(_info(**at_bound), timeout=10).code == 0


def test_report_fields_one_past_their_bounds_are_409(controller, make_agent) -> None:
    agent = make_agent(controller.address, JOB, "node-0", rank_ids=(0, 1)).join()
    stub = agent.stub
    long_uuid = "u" * (MAX_NAME + 1)
    cases = [
        stub.ReportStopComplete(pb.StopCompleteRequest(jobId=JOB, agentId="node-0", uuid=long_uuid), timeout=10),
        stub.ReportRecoverStrategy(
            pb.RecoverStrategyRequest(jobId=JOB, agentId="node-0", strategies=["exit"] * (MAX_STRATEGIES + 1)),
            timeout=10,
        ),
        stub.ReportRecoverStrategy(
            pb.RecoverStrategyRequest(jobId=JOB, agentId="node-0", strategies=["recover", "teleport"]), timeout=10
        ),
        stub.ReportRecoverStatus(pb.RecoverStatusRequest(jobId=JOB, agentId="node-0", strategy="teleport"), timeout=10),
        stub.ReportAgentExit(pb.AgentExitRequest(jobId=JOB, agentId="a" * (MAX_NAME + 1)), timeout=10),
        stub.SetJobPolicy(
            pb.JobPolicyRequest(jobId=JOB, strategies=["exit"] * (MAX_STRATEGIES + 1), maxCycles=-1), timeout=10
        ),
        # No wait of a recovery is longer than a day.
        stub.SetJobPolicy(pb.JobPolicyRequest(jobId=JOB, reportTimeoutSeconds=1e308, maxCycles=-1), timeout=10),
    ]
    for reply in cases:
        assert reply.code == Code.INVALID_PARAM, reply
    assert "unknown strategy 'teleport'" in cases[2].info
    assert "must be at most 86400 seconds (a day)" in cases[-1].info
    # The reference's own strategy names are known (stored, never chosen).
    ok = stub.ReportRecoverStrategy(
        pb.RecoverStrategyRequest(jobId=JOB, agentId="node-0", strategies=["elastic-training", "downgrade"]),
        timeout=10,
    )
    assert ok.code == Code.ORDER_MIX  # no cycle in flight: accepted as input, refused by the state machine


def test_fault_ranks_are_bounded_by_the_jobs_size(controller, make_agent) -> None:
    agent = make_agent(controller.address, JOB, "node-0", rank_ids=(0, 1)).join()
    reply = agent.fault({0: 1, 1: 1, 2: 1})
    assert reply.code == Code.INVALID_PARAM and "3 faulty ranks would exceed the job's 2 ranks" in reply.info
    assert agent.fault({0: 1, 1: 1}).code == 0


def test_unknown_job_size_caps_accumulated_faults_and_signals_stay_sendable(controller_factory, make_agent) -> None:
    ctl = controller_factory(limits=Limits(max_faults=MAX_RANKS), flush_seconds=5.0)
    agent = make_agent(ctl.address, JOB, "node-0").join()
    first = {rank: 1 for rank in range(MAX_RANKS // 2)}
    second = {rank: 1 for rank in range(MAX_RANKS // 2, MAX_RANKS)}
    assert agent.fault(first).code == 0
    assert agent.fault(second).code == 0  # still collecting (flush window)
    reply = agent.fault({MAX_RANKS: 1})
    assert reply.code == Code.INVALID_PARAM and "65537 faulty ranks" in reply.info
    # The biggest signal the job can produce reaches the agent: under the server's send limit.
    stop = agent.next_signal(timeout=60)
    assert stop.signalType == "stopTrain" and len(stop.faultRanks) == MAX_RANKS
    assert stop.ByteSize() < 8 * 1024 * 1024


def test_jobs_created_by_any_rpc_count_against_the_limit(tmp_path, controller_factory, make_agent) -> None:
    token_file(tmp_path / "admin", "adm")
    ctl = controller_factory(limits=Limits(max_jobs=2), admin_token_file=str(tmp_path / "admin"))
    admin = make_agent(ctl.address, "x", credentials=Credentials(token="adm"))
    policy = pb.JobPolicyRequest(jobId="by-policy", recoveryEnabled=True, flushSeconds=-1, maxCycles=-1)
    assert admin.stub.SetJobPolicy(policy, timeout=10).code == 0
    running = make_agent(ctl.address, "job-a", "node-0", credentials=Credentials(token="a")).join()
    third = make_agent(ctl.address, "job-b", "node-0", credentials=Credentials(token="b"))
    reply = third.stub.Init(third.info, timeout=10)
    assert reply.code == Code.OUT_OF_MAX_JOBS and "serves 2 jobs" in reply.info
    policy.jobId = "by-policy-2"
    assert admin.stub.SetJobPolicy(policy, timeout=10).code == Code.OUT_OF_MAX_JOBS
    # A finished job makes room: the oldest ended job is evicted.
    assert running.exited(0).code == 0
    assert third.stub.Init(third.info, timeout=10).code == 0
    listed = [j.jobId for j in admin.stub.QueryStatus(pb.StatusQuery(), timeout=10).jobs]
    assert listed == ["by-policy", "job-b"]


def test_agents_per_job_are_bounded(controller_factory, make_agent) -> None:
    ctl = controller_factory(limits=Limits(max_agents=2))
    for n in range(2):
        make_agent(ctl.address, JOB, f"node-{n}").join()
    extra = make_agent(ctl.address, JOB, "node-2")
    assert extra.stub.Init(extra.info, timeout=10).code == 0
    reply = extra.stub.Register(extra.info, timeout=10)
    assert reply.code == Code.INVALID_PARAM and "already has 2 agents" in reply.info


def test_query_events_and_message_size_are_bounded(controller, make_agent) -> None:
    agent = make_agent(controller.address, JOB, "node-0").join()
    reply = agent.stub.QueryStatus(pb.StatusQuery(jobId=JOB, events=MAX_QUERY_EVENTS + 1), timeout=10)
    assert reply.status.code == Code.INVALID_PARAM and "events must be 0..1000" in reply.status.info
    assert agent.stub.QueryStatus(pb.StatusQuery(jobId=JOB, events=MAX_QUERY_EVENTS), timeout=10).status.code == 0
    huge = pb.ClientInfo(jobId=JOB, role="x" * (4 * 1024 * 1024 + 1))
    with pytest.raises(grpc.RpcError) as raw:
        agent.stub.Init(huge, timeout=10)
    assert raw.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_status_output_escapes_control_characters() -> None:
    job = JobStatus(
        job_id="j\x1b]0;owned\x07", state=JobState.IDLE, cycle=0, strategy=None, faults=(), strategies=(Strategy.EXIT,),
        cycles_used=0, max_cycles=3, outcome="", legacy=True,
        agents=(AgentStatus("a\x1b[2J", "r\r", True, 0, None, 0.0, "t\x1b"),),
        events=(JournalEvent(1, 0.0, "j", 0, "k\x1b", {"x": "\x1b"}),),
    )
    text = render(ControllerStatus((job,)))
    assert "\x1b" not in text and "\r" not in text and "\\x1b[2J" in text
    assert "(legacy: registered without a token)" in text
