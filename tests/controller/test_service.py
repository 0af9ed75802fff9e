"""The Recover RPCs over real gRPC on loopback: codes, cycles, escalations, streams."""

from __future__ import annotations

import re

import grpc
import pytest

from taskd_core.models import Code, Credentials
from taskd_core.rpc import recover_pb2 as pb
from tests.conftest import token_file

JOB = "job-1"


def _healthy(agent) -> None:
    """The controller still serves after whatever the test threw at it."""
    reply = agent.stub.HealthCheck(pb.ClientInfo(jobId="probe"), timeout=10)
    assert (reply.code, reply.info) == (0, "jobId=probe, receive HeathCheck")
    assert agent.stub.Init(pb.ClientInfo(jobId="probe-job", role="x"), timeout=10).code == 0


def _to_decision(agents, faults=None, reported=("recover", "dump", "exit"), status_timeout=None):
    """Fault -> stopTrain -> stopped -> globalFault -> strategies; returns the changeStrategy signals.

    ``status_timeout`` shortens only the wait for the recovery results, so the
    earlier waits cannot time out on a busy machine.
    """
    assert agents[0].fault(faults).code == 0
    for a in agents:
        a.expect("stopTrain", actions=["stop_train"])
    for a in agents:
        assert a.stopped().code == 0
    for a in agents:
        a.expect("globalFault")
    if status_timeout is not None:
        agents[0].set_report_timeout(status_timeout)
    for a in agents:
        assert a.strategies(list(reported)).code == 0
    return [a.expect("changeStrategy") for a in agents]


# --- the plain RPCs ------------------------------------------------------------------


def test_health_check_answers_any_job_with_the_reference_text(controller, make_agent):
    agent = make_agent(controller.address, "never-inited")
    reply = agent.stub.HealthCheck(pb.ClientInfo(jobId="never-inited"))
    assert (reply.code, reply.info) == (0, "jobId=never-inited, receive HeathCheck")


def test_grpc_health_service_serves(controller):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(controller.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "Recover"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_init_is_idempotent_and_register_needs_it(controller, make_agent):
    agent = make_agent(controller.address, JOB)
    reply = agent.stub.Register(agent.info)
    assert reply.code == Code.UNINIT and "not inited" in reply.info
    first, again = agent.stub.Init(agent.info), agent.stub.Init(agent.info)
    assert (first.code, again.code) == (0, 0) and first.info == f"job(uid={JOB}) init success"
    assert agent.stub.Register(agent.info).info == "register success"
    assert agent.stub.Register(agent.info).code == 0


def test_init_answers_403_when_the_policy_turns_recovery_off(controller_factory, make_agent):
    ctl = controller_factory(recovery_enabled=False)
    agent = make_agent(ctl.address, JOB)
    assert agent.stub.Init(agent.info).code == Code.RECOVERY_OFF


def test_set_job_policy_turns_recovery_off_and_validates(tmp_path, controller_factory, make_agent):
    # Setting the policy of a job nobody registered yet takes the admin token.
    token_file(tmp_path / "admin", "admin-token")
    controller = controller_factory(admin_token_file=str(tmp_path / "admin"))
    agent = make_agent(controller.address, JOB, credentials=Credentials(token="admin-token"))
    ok = agent.stub.SetJobPolicy(
        pb.JobPolicyRequest(
            jobId=JOB, strategies=["recover", "exit"], recoveryEnabled=False, flushSeconds=-1, maxCycles=-1
        )
    )
    assert ok.code == 0, ok
    assert agent.stub.Init(agent.info).code == Code.RECOVERY_OFF
    bad = agent.stub.SetJobPolicy(pb.JobPolicyRequest(jobId=JOB, strategies=["teleport"], maxCycles=-1))
    assert bad.code == Code.INVALID_PARAM and "teleport" in bad.info
    bad = agent.stub.SetJobPolicy(pb.JobPolicyRequest(jobId=JOB, reportTimeoutSeconds=-3, maxCycles=-1))
    assert bad.code == Code.INVALID_PARAM and "report_timeout" in bad.info
    agent.stub.SetJobPolicy(pb.JobPolicyRequest(jobId=JOB, recoveryEnabled=True, maxCycles=7))
    view = agent.job()
    assert view.maxCycles == 7 and list(view.strategies) == ["recover", "exit"]


def test_set_job_policy_changes_only_the_fields_given(controller, make_agent):
    """A client that sets only strategies neither turns recovery off nor zeroes the budget or the waits."""
    agent = make_agent(controller.address, JOB).join()
    before = agent.job()
    assert agent.stub.SetJobPolicy(pb.JobPolicyRequest(jobId=JOB, strategies=["exit"])).code == Code.OK
    after = agent.job()
    assert list(after.strategies) == ["exit"]
    assert after.maxCycles == before.maxCycles
    assert agent.stub.Init(agent.info).code == Code.OK  # recovery still on
    # Explicit values still change, zero included.
    assert agent.stub.SetJobPolicy(pb.JobPolicyRequest(jobId=JOB, maxCycles=0, recoveryEnabled=False)).code == 0
    assert agent.job().maxCycles == 0
    assert agent.stub.Init(agent.info).code == Code.RECOVERY_OFF


@pytest.mark.parametrize(
    "rpc",
    [
        "ReportStopComplete",
        "ReportRecoverStrategy",
        "ReportRecoverStatus",
        "ReportProcessFault",
        "ReportAgentExit",
    ],
)
def test_reports_for_an_unregistered_job_answer_400(controller, make_agent, rpc):
    agent = make_agent(controller.address, "ghost")
    request = {
        "ReportStopComplete": pb.StopCompleteRequest(jobId="ghost"),
        "ReportRecoverStrategy": pb.RecoverStrategyRequest(jobId="ghost", strategies=["exit"]),
        "ReportRecoverStatus": pb.RecoverStatusRequest(jobId="ghost"),
        "ReportProcessFault": pb.ProcessFaultRequest(
            jobId="ghost", faultRanks=[pb.FaultRank(rankId="0", faultType="1")]
        ),
        "ReportAgentExit": pb.AgentExitRequest(jobId="ghost", role="taskd"),
    }[rpc]
    reply = getattr(agent.stub, rpc)(request)
    assert reply.code == Code.UNREGISTERED and "ghost" in reply.info
    _healthy(agent)


def test_subscribe_to_an_unregistered_job_is_not_found(controller, make_agent):
    agent = make_agent(controller.address, "ghost")
    agent.subscribe()
    err = agent.stream_end()
    assert err.code() == grpc.StatusCode.NOT_FOUND and "ghost" in err.details()
    _healthy(agent)


def test_second_subscriber_with_the_same_role_is_refused(controller, make_agent):
    first = make_agent(controller.address, JOB, role="master agent").join()
    second = make_agent(controller.address, JOB, role="master agent")
    second.subscribe()
    err = second.stream_end()
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert JOB in err.details() and "master agent" in err.details() and "agentId" in err.details()
    _healthy(second)
    assert first.fault().code == 0
    first.expect("stopTrain")  # the first stream still works


# --- bad input ---------------------------------------------------------------------


@pytest.mark.parametrize("job_id", ["", "x" * 10_000, "bad\njob"])
def test_bad_job_ids_answer_409(controller, make_agent, job_id):
    agent = make_agent(controller.address, job_id)
    for rpc in (agent.stub.Init, agent.stub.Register):
        reply = rpc(agent.info)
        assert reply.code == Code.INVALID_PARAM and "jobId" in reply.info
        assert len(reply.info) < 400
    _healthy(agent)


@pytest.mark.parametrize(
    ("faults", "field"),
    [
        ([pb.FaultRank(rankId="abc", faultType="1")], "rankId"),
        ([pb.FaultRank(rankId="1", faultType="7")], "faultType"),
        ([pb.FaultRank(rankId=str(i), faultType="1") for i in range(100_000)], "faultRanks"),
        ([], "faultRanks"),
    ],
)
def test_bad_fault_reports_answer_409(controller, make_agent, faults, field):
    agent = make_agent(controller.address, JOB).join()
    reply = agent.stub.ReportProcessFault(pb.ProcessFaultRequest(jobId=JOB, faultRanks=faults))
    assert reply.code == Code.INVALID_PARAM and field in reply.info
    _healthy(agent)
    assert agent.job().state == "idle"


@pytest.mark.parametrize(
    "codes",
    [{"abc": "1"}, {"1": "\x1b[2J"}, {"1": "a", "2": "b"}],
    ids=["rank-text", "code-escape", "more-codes-than-faults"],
)
def test_bad_fault_codes_answer_409(controller, make_agent, codes):
    agent = make_agent(controller.address, JOB).join()
    request = pb.ProcessFaultRequest(jobId=JOB, faultRanks=[pb.FaultRank(rankId="1", faultType="1")], faultCodes=codes)
    reply = agent.stub.ReportProcessFault(request)
    assert reply.code == Code.INVALID_PARAM and "faultCodes" in reply.info
    assert agent.job().state == "idle"


def test_a_negative_started_cycle_answers_409(controller, make_agent):
    agent = make_agent(controller.address, JOB).join()
    request = pb.ProcessFaultRequest(
        jobId=JOB, faultRanks=[pb.FaultRank(rankId="1", faultType="1")], startedCycle=-1
    )
    reply = agent.stub.ReportProcessFault(request)
    assert reply.code == Code.INVALID_PARAM and "startedCycle" in reply.info
    assert agent.job().state == "idle"


def test_bad_rank_ids_in_register_answer_409(controller, make_agent):
    agent = make_agent(controller.address, JOB)
    agent.stub.Init(agent.info)
    agent.info.rankIds.append("abc")
    assert agent.stub.Register(agent.info).code == Code.INVALID_PARAM


def test_reports_out_of_order_answer_401_with_what_is_expected(controller, make_agent):
    agent = make_agent(controller.address, JOB).join()
    reply = agent.stopped()
    assert reply.code == Code.ORDER_MIX and "no recovery cycle" in reply.info
    agent.fault()
    stop = agent.expect("stopTrain")
    reply = agent.strategies(["recover"])
    assert reply.code == Code.ORDER_MIX and "expects ReportStopComplete" in reply.info
    reply = agent.stopped(uuid="1-stale")
    assert reply.code == Code.ORDER_MIX and "stale uuid" in reply.info
    assert agent.stopped(uuid=stop.uuid).code == 0
    assert agent.stopped().code == Code.ORDER_MIX  # the step has moved on
    agent.expect("globalFault")
    _healthy(agent)


def test_multi_agent_reports_need_an_agent_id(controller, make_agent):
    a = make_agent(controller.address, JOB, "node-0").join()
    make_agent(controller.address, JOB, "node-1").join()
    anonymous = make_agent(controller.address, JOB)  # no agentId, same job
    assert a.fault().code == 0
    reply = anonymous.stopped()
    assert reply.code == Code.INVALID_PARAM and "agentId" in reply.info
    stranger = make_agent(controller.address, JOB, "node-9")
    assert stranger.stopped().code == Code.UNREGISTERED


# --- full cycles --------------------------------------------------------------------


def test_signals_carry_uuid_seq_cycle_and_fault_nodes(controller, make_agent):
    a = make_agent(controller.address, JOB, "n0", node_rank=0, rank_ids=(0, 1)).join()
    b = make_agent(controller.address, JOB, "n1", node_rank=1, rank_ids=(2, 3)).join()
    a.fault({3: 1})
    stops = [x.expect("stopTrain") for x in (a, b)]
    assert stops[0].uuid == stops[1].uuid and re.fullmatch(r"[0-9a-f]+-[0-9a-f]{32}", stops[0].uuid)
    assert (stops[0].signalSeq, stops[0].cycle) == (1, 1)
    for x in (a, b):
        x.stopped()
    glob = a.expect("globalFault", actions=["on_global_rank", "fault_nodes_exit"], nodeRankIds=["1"])
    assert glob.signalSeq == 2 and [(f.rankId, f.faultType) for f in glob.faultRanks] == [("3", "1")]
    keepalive = a.next_signal(keepalive=True)
    while keepalive.signalType != "keep-alive":
        keepalive = a.next_signal(keepalive=True)
    assert (keepalive.signalSeq, list(keepalive.actions)) == (0, [])


@pytest.mark.parametrize(
    ("faults", "reported", "wire"),
    [
        ({0: 0}, ["retry", "recover", "exit"], ("retry", "", ["change_strategy"])),
        (
            {0: 1},
            ["recover-in-place", "recover", "exit"],
            ("recover", "recover-in-place", ["change_strategy", "fault_nodes_restart"]),
        ),
        ({0: 1}, ["recover", "exit"], ("recover", "", ["change_strategy"])),
    ],
)
def test_a_successful_cycle_per_strategy(controller, make_agent, faults, reported, wire):
    agent = make_agent(controller.address, JOB).join()
    (change,) = _to_decision([agent], faults, reported)
    assert (change.changeStrategy, change.extraParams, list(change.actions)) == wire
    reply = agent.status(0, wire[1] or wire[0], uuid=change.uuid)
    assert reply.code == 0
    view = agent.job(events=50)
    assert view.state == "idle" and "cycle succeeded" in [e.kind for e in view.events]


def test_dump_then_exit_with_dump_exit_and_kill_master(controller, make_agent):
    agent = make_agent(controller.address, JOB).join()
    (change,) = _to_decision([agent], reported=["dump", "exit"])
    assert change.changeStrategy == "dump"
    assert agent.status(0, "dump").code == 0
    agent.expect("changeStrategy", changeStrategy="exit", extraParams="dump_exit")
    agent.expect("killMaster")
    assert agent.job().state == "given-up"


def test_exit_when_nothing_else_is_reported(controller, make_agent):
    agent = make_agent(controller.address, JOB).join()
    (change,) = _to_decision([agent], reported=["exit"])
    assert change.changeStrategy == "exit"
    agent.expect("killMaster")
    assert agent.fault().code == Code.ORDER_MIX  # a given-up job takes no more faults


def test_retry_failure_escalates_to_recover(controller_factory, make_agent):
    ctl = controller_factory(strategies=("retry", "recover", "exit"))
    agent = make_agent(ctl.address, JOB).join()
    (change,) = _to_decision([agent], {0: 2}, ["retry", "recover", "exit"])
    assert change.changeStrategy == "retry"
    assert agent.status(Code.UNRECOVERABLE_RETRY_ERROR, "retry").code == 0
    agent.expect("changeStrategy", changeStrategy="recover")
    assert agent.status(0, "recover").code == 0
    assert agent.job().state == "idle"


def test_recover_failure_escalates_to_dump_then_exit(controller, make_agent):
    agent = make_agent(controller.address, JOB).join()
    (change,) = _to_decision([agent])
    assert change.changeStrategy == "recover"
    agent.status(Code.CLIENT_ERROR, "recover")
    agent.expect("changeStrategy", changeStrategy="dump")
    agent.status(Code.DUMP_ERROR, "dump")
    agent.expect("changeStrategy", changeStrategy="exit", extraParams="dump_exit")
    agent.expect("killMaster")


def test_a_status_deadline_escalates(controller, make_agent):
    agent = make_agent(controller.address, JOB).join()
    (change,) = _to_decision([agent], status_timeout=0.3)
    assert change.changeStrategy == "recover"
    # no status report: the deadline counts the agent as failed
    agent.expect("changeStrategy", changeStrategy="dump")
    view = agent.job(events=50)
    assert "deadline" in [e.kind for e in view.events]


def test_a_stop_deadline_gives_up(controller_factory, make_agent):
    ctl = controller_factory(report_timeout=0.3)
    agent = make_agent(ctl.address, JOB).join()
    agent.fault()
    agent.expect("stopTrain")
    agent.expect("changeStrategy", changeStrategy="exit")
    agent.expect("killMaster")


def test_stop_status_404_gives_up(controller, make_agent):
    agent = make_agent(controller.address, JOB).join()
    agent.fault()
    agent.expect("stopTrain")
    agent.stopped(Code.PROCESS_NOT_READY)
    agent.expect("changeStrategy", changeStrategy="exit")
    agent.expect("killMaster")


def test_the_cycle_budget_runs_out(controller_factory, make_agent):
    ctl = controller_factory(max_cycles=1)
    agent = make_agent(ctl.address, JOB).join()
    (change,) = _to_decision([agent])
    agent.status(0, "recover")
    assert agent.fault().code == 0
    agent.expect("killMaster")
    view = agent.job(events=5)
    assert view.state == "given-up" and "budget" in view.outcome


def test_a_fault_during_wait_status_starts_the_next_cycle(controller, make_agent):
    agent = make_agent(controller.address, JOB).join()
    (change,) = _to_decision([agent])
    assert agent.fault({5: 1}).code == 0
    agent.status(0, "recover")
    nxt = agent.expect("stopTrain")
    assert nxt.cycle == 2 and nxt.uuid != change.uuid and [f.rankId for f in nxt.faultRanks] == ["5"]


def test_two_agents_one_silent_the_deadline_escalates(controller, make_agent):
    a = make_agent(controller.address, JOB, "n0").join()
    b = make_agent(controller.address, JOB, "n1").join()
    changes = _to_decision([a, b], status_timeout=0.5)
    assert [c.changeStrategy for c in changes] == ["recover", "recover"]
    assert a.status(0, "recover").code == 0  # b never answers
    for x in (a, b):
        x.expect("changeStrategy", changeStrategy="dump")
    deadline = [e for e in a.job(events=50).events if e.kind == "deadline"]
    assert deadline and '"n1"' in deadline[-1].detail


def test_a_cut_stream_resubscribes_and_the_cycle_completes(controller, make_agent):
    a = make_agent(controller.address, JOB, "n0").join()
    b = make_agent(controller.address, JOB, "n1").join()
    a.fault()
    for x in (a, b):
        x.expect("stopTrain")
        x.stopped()
    glob = b.expect("globalFault")
    b.cut()
    b.resubscribe()
    again = b.next_signal()
    assert (again.signalType, again.signalSeq, again.uuid) == ("globalFault", glob.signalSeq, glob.uuid)
    a.expect("globalFault")
    for x in (a, b):
        x.strategies(["recover", "exit"])
    for x in (a, b):
        x.expect("changeStrategy", changeStrategy="recover")
        assert x.status(0, "recover").code == 0
    assert a.job().state == "idle"


def test_every_agent_exiting_zero_finishes_the_job(controller, make_agent):
    a = make_agent(controller.address, JOB, "n0").join()
    b = make_agent(controller.address, JOB, "n1").join()
    assert a.exited(0).code == 0
    assert a.job().state == "idle"
    assert b.exited(0).code == 0
    view = a.job(events=3)
    assert view.state == "finished" and view.events[-1].kind == "job finished"


def test_query_status_of_an_unknown_job(controller, make_agent):
    agent = make_agent(controller.address, JOB)
    reply = agent.stub.QueryStatus(pb.StatusQuery(jobId="nope"))
    assert reply.status.code == Code.UNREGISTERED and not reply.jobs


def test_stopping_the_controller_ends_streams(controller_factory, make_agent):
    ctl = controller_factory()
    agent = make_agent(ctl.address, JOB).join()
    ctl.stop()
    end = agent.stream_end()
    assert end is None or end.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
