"""Hang reports on the wire: fault type "3" with its evidence in the journal, the agents' timeouts in status."""

from __future__ import annotations

import json

from taskd_core.cli.status import render
from taskd_core.client.query import QueryClient
from taskd_core.models import Code
from taskd_core.rpc import recover_pb2 as pb

JOB = "hang-job"


def _fault(agent, fault_type: str, detail: str) -> pb.Status:
    return agent.stub.ReportProcessFault(
        pb.ProcessFaultRequest(
            jobId=JOB, agentId=agent.agent_id, detail=detail,
            faultRanks=[pb.FaultRank(rankId="1", faultType=fault_type)],
        ),
        timeout=10,
    )


def _status(agent) -> pb.JobView:
    return agent.stub.QueryStatus(pb.StatusQuery(jobId=JOB, events=50), timeout=10).jobs[0]


def test_a_hang_starts_a_cycle_and_its_stack_is_journalled(controller, make_agent):
    agent = make_agent(controller.address, JOB, agent_id="node-0").join()
    evidence = "rank 1 (pid 42) hung: heartbeat\nThread 42 (active+gil)\n    spin (train.py:7)\n"
    assert _fault(agent, "3", evidence).code == Code.OK
    agent.expect("stopTrain", actions=["stop_train"])
    faults = [json.loads(e.detail) for e in _status(agent).events if e.kind == "fault"]
    assert faults == [{"agent": "node-0", "pending": False, "ranks": {"1": "3"}, "evidence": evidence}]


def test_a_hang_is_never_retried_in_process(controller, make_agent):
    """retry fits retryable faults only; a hung (killed) rank needs a restart like a dead one."""
    agent = make_agent(controller.address, JOB, agent_id="node-0").join()
    assert _fault(agent, "3", "").code == Code.OK
    agent.expect("stopTrain")
    assert agent.stopped().code == Code.OK
    agent.expect("globalFault")
    assert agent.strategies(["retry", "recover", "exit"]).code == Code.OK
    assert agent.expect("changeStrategy").changeStrategy == "recover"


def test_bad_fault_type_and_oversized_evidence_are_refused(controller, make_agent):
    agent = make_agent(controller.address, JOB, agent_id="node-0").join()
    reply = _fault(agent, "4", "")
    assert reply.code == Code.INVALID_PARAM and "'3'" in reply.info
    reply = _fault(agent, "3", "x" * 70_000)
    assert reply.code == Code.INVALID_PARAM and "detail" in reply.info
    assert [e.kind for e in _status(agent).events if e.kind == "fault"] == []


def test_health_check_carries_the_agents_hang_timeouts(controller, make_agent):
    agent = make_agent(controller.address, JOB, agent_id="node-0").join()
    info = pb.ClientInfo(jobId=JOB, agentId="node-0", progress="stopped 0.5s; heartbeat 3.0s (learned)")
    assert agent.stub.HealthCheck(info, timeout=10).code == Code.OK
    assert [a.progress for a in _status(agent).agents] == ["stopped 0.5s; heartbeat 3.0s (learned)"]
    # Unknown jobs and agents are answered as ever, and change nothing.
    for stray in (pb.ClientInfo(jobId="nobody", agentId="x", progress="p"), pb.ClientInfo(jobId=JOB, agentId="x", progress="p")):
        assert agent.stub.HealthCheck(stray, timeout=10).code == Code.OK
    assert [a.agentId for a in _status(agent).agents] == ["node-0"]
    long = pb.ClientInfo(jobId=JOB, agentId="node-0", progress="y" * 5000)
    assert agent.stub.HealthCheck(long, timeout=10).code == Code.OK  # cut, not refused: HealthCheck always answers OK
    assert len(_status(agent).agents[0].progress) == 1000


def test_taskd_status_shows_the_timeouts_and_keeps_a_stack_to_one_line(controller, make_agent):
    agent = make_agent(controller.address, JOB, agent_id="node-0").join()
    info = pb.ClientInfo(jobId=JOB, agentId="node-0", progress="stopped 0.5s; heartbeat 3.0s (learned)")
    assert agent.stub.HealthCheck(info, timeout=10).code == Code.OK
    stack = "rank 1 (pid 42) hung: heartbeat\n" + "    frame (train.py:7)\n" * 200
    assert _fault(agent, "3", stack).code == Code.OK
    with QueryClient(controller.address) as query:
        text = render(query.status(JOB, events=50))
    assert "hang timeouts: stopped 0.5s; heartbeat 3.0s (learned)" in text
    fault_line = next(line for line in text.splitlines() if " fault " in line)
    assert "hung: heartbeat | " in fault_line and fault_line.endswith("...") and len(fault_line) < 400
