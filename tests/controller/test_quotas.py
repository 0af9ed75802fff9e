"""Quotas per job token and per host, over real gRPC: a noisy tenant meets its own limits, others go on.

Every refusal is gRPC ``RESOURCE_EXHAUSTED`` naming the limit's flag. The flood
of the last test comes from another process, as another local user's would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import grpc
import pytest

from taskd_core.controller.quotas import Quotas
from taskd_core.controller.runtime import Limits
from taskd_core.models import Code, Credentials
from taskd_core.rpc import recover_pb2 as pb
from tests.conftest import RawAgent


def _exhausted(call, *args, **kwargs) -> str:
    with pytest.raises(grpc.RpcError) as refused:
        call(*args, timeout=10, **kwargs)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    return refused.value.details() or ""


def test_one_noisy_token_cannot_keep_others_from_registering(controller_factory, make_agent) -> None:
    ctl = controller_factory(limits=Limits(max_jobs=12), quotas=Quotas(jobs_per_token=4, agents_per_token=6))
    noisy = Credentials(token="noisy")
    joined = 0
    for n in range(12):  # on a controller without quotas these would take every one of its 12 jobs
        agent = make_agent(ctl.address, f"noisy-{n}", "node-0", credentials=noisy)
        try:
            agent.join()
            joined += 1
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-jobs-per-token" in (exc.details() or "")
    assert joined == 4
    first = make_agent(ctl.address, "noisy-0", "node-0", credentials=noisy)
    for n in (1, 2):
        assert first.stub.Register(pb.ClientInfo(jobId="noisy-0", role="r", agentId=f"extra-{n}"), timeout=10).code == 0
    details = _exhausted(first.stub.Register, pb.ClientInfo(jobId="noisy-0", role="r", agentId="extra-3"))
    assert "--max-agents-per-token" in details and "6 agents" in details
    victim = make_agent(ctl.address, "victim", "node-0", credentials=Credentials(token="victim")).join()
    assert victim.fault({0: 1}).code == 0
    victim.expect("stopTrain", cycle=1)


def test_requests_and_journal_bytes_are_limited_per_token(controller_factory, make_agent) -> None:
    ctl = controller_factory(quotas=Quotas(requests_per_second=20, journal_bytes_per_second=50))
    noisy = make_agent(ctl.address, "noisy", "node-0", credentials=Credentials(token="noisy")).join()
    victim = make_agent(ctl.address, "victim", "node-0", credentials=Credentials(token="victim")).join()
    big = [pb.WorkerEvent(kind="started", rank=r, pid=1000 + r, time=1.0) for r in range(40)]
    request = pb.WorkerEventsRequest(jobId="noisy", agentId="node-0", events=big)
    for _ in range(100):  # ~5 KB journalled each: the 3.2 KB burst is gone after the first
        try:
            assert noisy.stub.ReportWorkerEvents(request, timeout=10).code == 0
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-journal-bytes-per-second" in (exc.details() or "")
            break
    else:
        pytest.fail("the journal quota never refused")
    refusal = ""
    for _ in range(1000):  # far past the burst of 200 requests
        try:
            noisy.stub.HealthCheck(noisy.info, timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            refusal = exc.details() or ""
            break
    assert "--max-journal-bytes-per-second" in refusal or "--max-requests-per-second" in refusal
    assert victim.fault({0: 1}).code == 0  # the other token's requests still pass
    victim.expect("stopTrain", cycle=1)


def test_one_host_may_claim_only_so_many_jobs(controller_factory, make_agent) -> None:
    ctl = controller_factory(quotas=Quotas(jobs_per_peer=3))
    for n in range(3):
        make_agent(ctl.address, f"job-{n}", "node-0", credentials=Credentials(token=f"t{n}")).join()
    late = make_agent(ctl.address, "job-3", "node-0", credentials=Credentials(token="t3"))
    details = _exhausted(late.stub.Init, late.info)
    assert "--max-jobs-per-peer" in details and "127.0.0.1" in details


def test_one_host_may_register_only_so_many_agents(controller_factory, make_agent) -> None:
    ctl = controller_factory(quotas=Quotas(agents_per_peer=3))
    for n, agent_id in ((0, "node-0"), (0, "node-1"), (1, "node-0")):
        make_agent(ctl.address, f"job-{n}", agent_id, credentials=Credentials(token=f"t{n}")).join()
    late = make_agent(ctl.address, "job-1", "node-1", credentials=Credentials(token="t1"))
    details = _exhausted(late.stub.Register, late.info)
    assert "--max-agents-per-peer" in details and "host 127.0.0.1" in details


def test_an_embedded_controller_serves_its_own_launch_token_only(controller_factory, make_agent) -> None:
    ctl = controller_factory(job_token="the-launch")
    for creds in (Credentials(), Credentials(token="another")):
        other = make_agent(ctl.address, "other", "node-0", credentials=creds)
        reply = other.stub.Init(other.info, timeout=10)
        assert reply.code == Code.FORBIDDEN and "embedded in one launch" in reply.info, reply
    make_agent(ctl.address, "mine", "node-0", credentials=Credentials(token="the-launch")).join()


FLOOD = textwrap.dedent(
    """
    import json, sys, threading, time
    from pathlib import Path
    import grpc
    from taskd_core.rpc import recover_pb2 as pb, recover_pb2_grpc

    address, stop = sys.argv[1], Path(sys.argv[2])
    codes = {}
    lock = threading.Lock()

    def flood(n):
        with grpc.insecure_channel(address) as channel:
            stub = recover_pb2_grpc.RecoverStub(channel)
            end = time.monotonic() + 120
            i = 0
            while not stop.exists() and time.monotonic() < end:
                i += 1
                try:
                    stub.Init(pb.ClientInfo(jobId=f"flood-{n}-{i}", role="ref"), timeout=10)
                    code = "answered"
                except grpc.RpcError as exc:
                    code = exc.code().name
                with lock:
                    codes[code] = codes.get(code, 0) + 1
                    if code == "RESOURCE_EXHAUSTED" and codes[code] == 1:
                        print("limited", flush=True)

    threads = [threading.Thread(target=flood, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(codes), flush=True)
    """
)


def test_a_flood_from_another_process_does_not_starve_a_recovery(tmp_path, controller_factory, make_agent) -> None:
    """Valid legacy calls as fast as four threads send them: limited by host, the job's token is not."""
    ctl = controller_factory(job_token="the-launch", quotas=Quotas(requests_per_second=100))
    agent: RawAgent = make_agent(ctl.address, "job", "node-0", credentials=Credentials(token="the-launch")).join()
    stop = tmp_path / "stop"
    flood = subprocess.Popen(
        [sys.executable, "-c", FLOOD, ctl.address, str(stop)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert flood.stdout is not None
        assert flood.stdout.readline().strip() == "limited"  # the flood is being refused now
        agent.recover(1)
        agent.recover(2)
    finally:
        stop.touch()
        out, _ = flood.communicate(timeout=60)
    codes = json.loads(out.strip().splitlines()[-1])
    assert codes.get("RESOURCE_EXHAUSTED", 0) > 0, codes
    assert agent.job().cycle == 2
