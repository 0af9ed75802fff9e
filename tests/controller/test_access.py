"""Per-job authorisation: the six attacks from outside, the admin token, legacy clients, job identity.

The victim is a job registered with a token; the attacker reaches the same
controller without a token, with a wrong one, or (mutual TLS) without a
client certificate. Every attack is refused and the victim's next recovery
cycle runs as if nothing happened.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from taskd_core.models import Code, Credentials
from taskd_core.rpc import recover_pb2 as pb
from tests.conftest import RawAgent, token_file

JOB = "victim"
TOKEN = "victim-token"
LAUNCH = "launch-1"


@dataclass
class Setup:
    address: str
    victim: RawAgent
    attacker: RawAgent
    admin: RawAgent | None = None


def _victim_cycle(victim: RawAgent) -> None:
    """The victim still recovers: fault -> stop -> strategies -> recover -> idle, from cycle 1."""
    assert victim.fault({0: 1}).code == 0
    stop = victim.expect("stopTrain", cycle=1)
    assert victim.stopped(uuid=stop.uuid).code == 0
    victim.expect("globalFault")
    assert victim.strategies(["recover", "exit"], uuid=stop.uuid).code == 0
    victim.expect("changeStrategy", changeStrategy="recover")
    assert victim.status(0, "recover", uuid=stop.uuid).code == 0
    job = victim.job()
    assert (job.state, job.cycle, [a.agentId for a in job.agents]) == ("idle", 1, ["node-0"])
    assert not job.legacy


MODES = ("no-token", "wrong-token", "mtls-no-cert")


@pytest.fixture(params=MODES)
def setup(request, controller_factory, make_agent, pki) -> Setup:
    mode = request.param
    mutual = mode == "mtls-no-cert"
    ctl = controller_factory(tls=pki.server(mutual=True) if mutual else None)
    own = pki.client(TOKEN, launch=LAUNCH) if mutual else Credentials(token=TOKEN, launch=LAUNCH)
    victim = make_agent(ctl.address, JOB, "node-0", rank_ids=(0, 1), credentials=own)
    attacker_creds = {
        "no-token": Credentials(),
        "wrong-token": Credentials(token="guess", launch=LAUNCH),
        "mtls-no-cert": pki.client(TOKEN, cert=False),
    }[mode]
    attacker = make_agent(ctl.address, JOB, "node-0", credentials=attacker_creds)
    return Setup(ctl.address, victim, attacker)


def _refused(call: Callable[[], Any]) -> None:
    """Refused: the 403 in Status, or (no certificate) no connection at all."""
    try:
        reply = call()
    except grpc.RpcError as exc:
        assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.PERMISSION_DENIED), exc
        return
    status = reply.status if isinstance(reply, (pb.ControllerStatus, pb.EventPage)) else reply
    assert status.code == Code.FORBIDDEN and "permission denied" in status.info, status


def test_attack_list_every_job(setup: Setup) -> None:
    setup.victim.join()
    try:
        reply = setup.attacker.stub.QueryStatus(pb.StatusQuery(), timeout=10)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE
    else:
        assert JOB not in [j.jobId for j in reply.jobs]
    _refused(lambda: setup.attacker.stub.QueryStatus(pb.StatusQuery(jobId=JOB), timeout=10))
    _victim_cycle(setup.victim)


def test_attack_read_or_forge_the_journal(setup: Setup) -> None:
    setup.victim.join()
    _refused(lambda: setup.attacker.stub.QueryEvents(pb.EventQuery(jobId=JOB), timeout=10))
    forged = pb.WorkerEvent(kind="exited", rank=0, pid=1, time=1.0, exitCode=-9)
    request = pb.WorkerEventsRequest(jobId=JOB, agentId="node-0", events=[forged])
    _refused(lambda: setup.attacker.stub.ReportWorkerEvents(request, timeout=10))
    page = setup.victim.stub.QueryEvents(pb.EventQuery(jobId=JOB), timeout=10)
    assert page.status.code == 0 and not [e for e in page.events if e.kind.startswith("worker")]
    _victim_cycle(setup.victim)


def test_attack_restart_healthy_workers(setup: Setup) -> None:
    setup.victim.join()
    _refused(lambda: setup.attacker.fault({0: 1}))
    _victim_cycle(setup.victim)  # its first signal is its own cycle's stopTrain


def test_attack_kill_the_job_with_two_calls(setup: Setup) -> None:
    setup.victim.join()
    _refused(lambda: setup.attacker.fault({0: 1}))
    _refused(lambda: setup.attacker.stopped(Code.CLIENT_ERROR))
    _victim_cycle(setup.victim)


def test_attack_hang_with_a_fake_exit_report(setup: Setup) -> None:
    setup.victim.join()
    _refused(lambda: setup.attacker.exited(0))
    _victim_cycle(setup.victim)


def test_attack_register_a_fake_agent(setup: Setup) -> None:
    setup.victim.join()
    fake = pb.ClientInfo(jobId=JOB, role="fake", agentId="node-9")
    _refused(lambda: setup.attacker.stub.Init(fake, timeout=10))
    _refused(lambda: setup.attacker.stub.Register(fake, timeout=10))
    with pytest.raises(grpc.RpcError) as raw:
        next(iter(setup.attacker.stub.SubscribeProcessManageSignal(fake, timeout=10)))
    assert raw.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE)
    _victim_cycle(setup.victim)


def test_attack_turn_recovery_off_before_the_owner_starts(setup: Setup) -> None:
    request = pb.JobPolicyRequest(jobId=JOB, recoveryEnabled=False, flushSeconds=-1, maxCycles=-1)
    _refused(lambda: setup.attacker.stub.SetJobPolicy(request, timeout=10))
    setup.victim.join()  # Init answers 0, not 403 (recovery off)
    _victim_cycle(setup.victim)


def test_refusals_are_journalled(controller, make_agent) -> None:
    victim = make_agent(controller.address, JOB, "node-0", credentials=Credentials(token=TOKEN)).join()
    attacker = make_agent(controller.address, JOB, "node-0", credentials=Credentials(token="guess"))
    assert attacker.fault().code == Code.FORBIDDEN
    kinds = [e.kind for e in victim.job(events=20).events]
    assert "access denied" in kinds


# --- the admin token -------------------------------------------------------------------------


def test_admin_token_gates_listing_and_policy(tmp_path, controller_factory, make_agent) -> None:
    admin_file = tmp_path / "admin-token"
    token_file(admin_file, "the-admin")
    ctl = controller_factory(admin_token_file=str(admin_file))
    make_agent(ctl.address, JOB, "node-0", credentials=Credentials(token=TOKEN)).join()
    make_agent(ctl.address, "legacy-job", "node-0").join()
    admin = make_agent(ctl.address, "x", credentials=Credentials(token="the-admin"))
    nobody = make_agent(ctl.address, "x")
    assert sorted(j.jobId for j in admin.stub.QueryStatus(pb.StatusQuery(), timeout=10).jobs) == ["legacy-job", JOB]
    listed = [(j.jobId, j.legacy) for j in nobody.stub.QueryStatus(pb.StatusQuery(), timeout=10).jobs]
    assert listed == [("legacy-job", True)]
    policy = pb.JobPolicyRequest(jobId="later-job", recoveryEnabled=False, flushSeconds=-1, maxCycles=-1)
    assert nobody.stub.SetJobPolicy(policy, timeout=10).code == Code.FORBIDDEN
    # With an admin token configured, even legacy jobs need it.
    legacy_policy = pb.JobPolicyRequest(jobId="legacy-job", recoveryEnabled=True, flushSeconds=-1, maxCycles=-1)
    assert nobody.stub.SetJobPolicy(legacy_policy, timeout=10).code == Code.FORBIDDEN
    assert admin.stub.SetJobPolicy(policy, timeout=10).code == Code.OK
    owner = make_agent(ctl.address, "later-job", "node-0", credentials=Credentials(token="t2"))
    assert owner.stub.Init(owner.info, timeout=10).code == Code.RECOVERY_OFF


def test_a_job_token_may_change_its_own_policy_only(controller, make_agent) -> None:
    victim = make_agent(controller.address, JOB, "node-0", credentials=Credentials(token=TOKEN)).join()
    victim.set_report_timeout(5.0)
    other = make_agent(controller.address, "other", "node-0", credentials=Credentials(token="other-token")).join()
    request = pb.JobPolicyRequest(jobId=JOB, recoveryEnabled=False, flushSeconds=-1, maxCycles=-1)
    assert other.stub.SetJobPolicy(request, timeout=10).code == Code.FORBIDDEN


# --- legacy (reference-style) clients ---------------------------------------------------------------


def test_reference_client_without_token_works_on_loopback(controller, make_agent) -> None:
    agent = make_agent(controller.address, "ref-job", role="ref").join()
    assert agent.job().legacy
    assert agent.fault({0: 1}).code == 0
    agent.expect("stopTrain")


def test_every_loopback_address_is_loopback_to_the_controller(controller_factory, make_agent) -> None:
    """127.0.0.2 is loopback (Linux routes all of 127/8 to lo): plaintext and legacy clients as on 127.0.0.1."""
    ctl = controller_factory(listen="127.0.0.2:0")
    assert ctl.address.startswith("127.0.0.2:")
    assert make_agent(ctl.address, "ref-job", role="ref").join().job().legacy


def test_reference_client_is_refused_beyond_loopback_without_allow_legacy(
    controller_factory, make_agent, outside_host
) -> None:
    ctl = controller_factory(listen=f"{outside_host}:0", insecure=True)
    agent = make_agent(ctl.address, "ref-job", role="ref")
    reply = agent.stub.Init(agent.info, timeout=10)
    assert reply.code == Code.FORBIDDEN and "TASKD_JOB_TOKEN" in reply.info
    token_agent = make_agent(ctl.address, "tok-job", "node-0", credentials=Credentials(token=TOKEN)).join()
    assert not token_agent.job().legacy
    allowing = controller_factory(listen=f"{outside_host}:0", insecure=True, allow_legacy=True)
    assert make_agent(allowing.address, "ref-job", role="ref").join().job().legacy


# --- job identity --------------------------------------------------------------------------------------


def _finish(agent: RawAgent) -> None:
    assert agent.exited(0).code == 0
    assert agent.job().state == "finished"


def test_job_id_reuse_after_finish_starts_fresh(controller, make_agent) -> None:
    first = make_agent(controller.address, JOB, "node-0", credentials=Credentials(token="t1", launch="L1")).join()
    _finish(first)
    second = make_agent(controller.address, JOB, "node-0", credentials=Credentials(token="t2", launch="L2")).join()
    job = second.job(events=50)
    assert (job.state, job.cycle) == ("idle", 0)
    assert "job retired" in [e.kind for e in job.events]
    assert second.fault({0: 1}).code == 0
    second.expect("stopTrain", cycle=1)  # the new run recovers instead of hanging
    assert first.fault({0: 1}).code == Code.FORBIDDEN  # the old launch's token no longer works


def test_job_id_reuse_after_give_up_is_not_killed(controller, make_agent) -> None:
    first = make_agent(controller.address, JOB, "node-0", credentials=Credentials(token="t1", launch="L1")).join()
    assert first.fault({0: 1}).code == 0
    stop = first.expect("stopTrain")
    assert first.stopped(Code.CLIENT_ERROR, uuid=stop.uuid).code == 0
    first.expect("changeStrategy", changeStrategy="exit")
    first.expect("killMaster")
    second = make_agent(controller.address, JOB, "node-0", credentials=Credentials(token="t2", launch="L2")).join()
    assert second.fault({0: 1}).code == 0
    assert second.expect("stopTrain").signalType == "stopTrain"  # no killMaster replayed
    assert second.job().state == "wait-stop"


def test_second_live_launch_with_the_same_id_is_refused(controller, make_agent) -> None:
    owner = make_agent(controller.address, JOB, "node-0", credentials=Credentials(token="t1", launch="L1")).join()
    for creds, why in (
        (Credentials(token="t2", launch="L2"), "job token does not match"),
        (Credentials(token="t1", launch="L2"), "in use by another live launch"),
        (Credentials(), "no job token was sent"),
    ):
        intruder = make_agent(controller.address, JOB, "node-0", credentials=creds)
        reply = intruder.stub.Init(intruder.info, timeout=10)
        assert reply.code == Code.FORBIDDEN and why in reply.info, reply
    # Another node of the owner's launch joins normally.
    make_agent(controller.address, JOB, "node-1", credentials=Credentials(token="t1", launch="L1")).join()
    assert [a.agentId for a in owner.job().agents] == ["node-0", "node-1"]
