"""Controller replicas on a real etcd: one leads, the others stand by and take over; fencing; bad starts.

In-process replicas (``EmbeddedController(state="etcd://...")``) for the
election and hand-over; real ``taskd controller`` processes where a process
must be frozen (SIGSTOP) or killed; the store-level fence test shows that a
leader whose lease was taken over can write nothing at all.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from taskd_core.cli import main
from taskd_core.controller.etcd_client import EtcdClient, EtcdTls, parse_etcd_url, put
from taskd_core.controller.machine import JournalEntry
from taskd_core.controller.policy import PolicyBook
from taskd_core.controller.replica import open_election
from taskd_core.controller.runtime import TAKEOVER_GRACE
from taskd_core.controller.server import REPLICA_HEALTH, EmbeddedController
from taskd_core.controller.store import Commit, JobRow
from taskd_core.controller.store_etcd import Layout
from taskd_core.errors import LeadershipLostError
from taskd_core.models import SPARE_ROLE, JobPolicy, Strategy
from taskd_core.rpc import LEADER_METADATA
from taskd_core.rpc import recover_pb2 as pb
from taskd_core.testing import free_port, wait_until
from tests.conftest import ROOT, TEST_POLICY, WAIT, ControllerProcess
from tests.etcd_server import EtcdServer

JOB = "job-r"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=WAIT).status)


@pytest.fixture
def replicas(etcd: EtcdServer) -> Iterator[Callable[..., EmbeddedController]]:
    """``replicas(state, **kw)`` starts an in-process replica on ``state``; all are stopped at teardown."""
    started: list[EmbeddedController] = []

    def start(state: str, **kw: Any) -> EmbeddedController:
        kw.setdefault("defaults", TEST_POLICY)
        ctl = EmbeddedController(state=state, keepalive_interval=0.5, **kw)
        started.append(ctl)
        return ctl

    yield start
    for ctl in started:
        ctl.stop()


def leader_of(group: list[EmbeddedController]) -> EmbeddedController:
    (leader,) = wait_until(lambda: [c for c in group if c.leading] or None, what="one replica to lead")
    return leader


def test_one_replica_leads_and_the_standbys_name_it(replicas, etcd, make_agent) -> None:
    state = etcd.url()
    group = [replicas(state) for _ in range(3)]
    leader = leader_of(group)
    standbys = [c for c in group if c is not leader]
    assert sum(c.leading for c in group) == 1
    assert health(leader.address) == SERVING
    assert [health(c.address) for c in standbys] == [NOT_SERVING, NOT_SERVING]
    # Alive, all of them: what a liveness probe asks.
    assert [health(c.address, REPLICA_HEALTH) for c in group] == [SERVING] * 3
    assert all(c.leader == leader.address for c in standbys)

    refused = make_agent(standbys[0].address, JOB, "n0")
    with pytest.raises(grpc.RpcError) as answer:
        refused.stub.Init(refused.info, timeout=WAIT)
    assert answer.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dict(answer.value.trailing_metadata())[LEADER_METADATA] == leader.address
    assert f"the leader is at {leader.address}" in answer.value.details()

    agent = make_agent(leader.address, JOB, "n0").join()
    reply = agent.stub.QueryStatus(pb.StatusQuery(), timeout=WAIT)
    assert reply.leader == leader.address and reply.leaderGeneration == leader.generation > 0


def test_a_standby_takes_over_the_open_cycle_where_the_leader_left_it(replicas, etcd, make_agent) -> None:
    """No cycle restarts, no signal is lost or numbered twice: the new leader goes on from etcd."""
    state = etcd.url()
    group = [replicas(state) for _ in range(2)]
    first = leader_of(group)
    agents = [make_agent(first.address, JOB, f"n{i}").join() for i in range(2)]
    agents[0].fault({1: 1})
    stops = [a.expect("stopTrain") for a in agents]
    for a in agents:
        assert a.stopped().code == 0
    glob = [a.expect("globalFault") for a in agents][0]
    first.stop()

    (second,) = [c for c in group if c is not first]
    assert second.wait_leading(WAIT) and second.generation > first.generation
    agents = [make_agent(second.address, JOB, f"n{i}").join() for i in range(2)]
    for a in agents:
        again = a.next_signal()
        assert (again.signalType, again.signalSeq, again.uuid) == ("globalFault", glob.signalSeq, glob.uuid)
        assert a.strategies(["recover", "exit"]).code == 0
    for a in agents:
        change = a.expect("changeStrategy", changeStrategy="recover", uuid=glob.uuid)
        assert change.signalSeq == glob.signalSeq + 1
        assert a.status(0, "recover").code == 0
    view = agents[0].job(events=1000)
    assert (view.state, view.cycle) == ("idle", 1) and stops[0].uuid == glob.uuid
    kinds = collections.Counter(e.kind for e in view.events)
    assert kinds["cycle started"] == 1 and kinds["cycle succeeded"] == 1 and kinds["fault"] == 1
    assert [json.loads(e.detail)["seq"] for e in view.events if e.kind == "signal"] == [1, 2, 3]


def test_a_write_of_a_leader_whose_lease_was_taken_over_changes_nothing(etcd) -> None:
    """The fence: A believes it leads, B has taken over; every write of A fails and etcd keeps B's state."""
    state = etcd.url()

    async def body() -> None:
        a_election = await open_election(state, "a:1", PolicyBook())
        b_election = await open_election(state, "b:1", PolicyBook())
        a_term = await a_election.campaign()
        # A's lease goes (as when A is frozen past it); B takes over and writes.
        client = EtcdClient(parse_etcd_url(state))
        leader = await client.range(Layout(parse_etcd_url(state).prefix).leader)
        await client.revoke(leader.kvs[0].lease)
        b_term = await asyncio.wait_for(b_election.campaign(), WAIT)
        await b_term.store.write(Commit(JobRow(JOB, True, {"by": "b"}, {}), (JournalEntry("b", 0, {}),)))
        with pytest.raises(LeadershipLostError):
            await a_term.store.write(Commit(JobRow(JOB, True, {"by": "a"}, {}), (JournalEntry("a", 0, {}),)))
        # Everything A still has queued fails too, and A's term is over.
        with pytest.raises(LeadershipLostError):
            await a_term.store.write(Commit(JobRow("other", True, {}, {})))
        assert a_term.lost.done() and not a_term.valid()
        (job,) = await b_term.store.load()
        assert job.row.policy == {"by": "b"}
        assert [e.kind for e in await b_term.store.events(JOB, 10)] == ["b"]
        for term, election in ((a_term, a_election), (b_term, b_election)):
            await term.end()
            await election.close()
        await client.close()

    asyncio.run(body())


def _process(state: str, log: Path, *args: str) -> ControllerProcess:
    return ControllerProcess(
        state,
        ("--lease-ttl", "2", "--flush-seconds", "0", "--report-timeout", "60", "--keepalive-interval", "0.5",
         "--strategies", "recover,exit", *args),
        log,
    )


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Callable[..., ControllerProcess]]:
    started: list[ControllerProcess] = []

    def start(state: str, *args: str) -> ControllerProcess:
        started.append(_process(state, tmp_path / f"replica-{len(started)}.log", *args))
        return started[-1]

    yield start
    for child in started:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGCONT)
            child.kill()


def test_a_frozen_leader_is_replaced_and_steps_down_when_it_thaws(processes, etcd, make_agent) -> None:
    state = etcd.url()
    first = processes(state).wait_serving()
    second = processes(state)
    assert second.health() == NOT_SERVING
    agent = make_agent(first.address, JOB, "n0").join()
    agent.fault({0: 1})
    stop = agent.expect("stopTrain")

    first.proc.send_signal(signal.SIGSTOP)  # past its lease: etcd drops it, the standby leads
    second.wait_serving()
    agent.close()
    agent = make_agent(second.address, JOB, "n0").join()
    assert agent.next_signal().signalSeq == stop.signalSeq  # re-sent, not a new one
    assert agent.stopped().code == 0
    glob = agent.expect("globalFault")

    first.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: first.health() == NOT_SERVING, "the thawed replica to stand by", 3 * WAIT)
    late = make_agent(first.address, JOB, "n0")
    request = pb.RecoverStrategyRequest(jobId=JOB, strategies=["exit"], agentId="n0", uuid=glob.uuid)

    def refusal() -> grpc.RpcError:
        try:
            late.stub.ReportRecoverStrategy(request, timeout=WAIT)
        except grpc.RpcError as exc:
            return exc
        raise AssertionError("the thawed replica took a report")

    assert refusal().code() == grpc.StatusCode.UNAVAILABLE
    # It names the new leader once its campaign has looked at etcd.
    wait_until(lambda: dict(refusal().trailing_metadata()).get(LEADER_METADATA) == second.address, "the thawed replica to name the new leader", WAIT)
    view = agent.job(events=100)
    assert (view.state, view.cycle, view.strategy) == ("wait-strategies", 1, "")
    log = first.log.read_text()
    assert "stopped leading" in log and "Traceback" not in log
    assert agent.strategies(["recover", "exit"]).code == 0
    assert agent.expect("changeStrategy").signalSeq == glob.signalSeq + 1


def test_a_killed_leader_is_replaced_and_the_agent_follows(processes, etcd, make_agent) -> None:
    state = etcd.url()
    group = [processes(state).wait_serving(), processes(state)]
    agent = make_agent(group[0].address, JOB, "n0").join()
    group[0].kill()
    group[1].wait_serving()
    agent.close()
    agent = make_agent(group[1].address, JOB, "n0").join()
    assert agent.fault({0: 1}).code == 0
    assert agent.expect("stopTrain").signalSeq == 1
    assert "Traceback" not in group[1].log.read_text()


def test_a_killed_leaders_lease_is_ended_by_the_standby_which_leads_without_waiting_it_out(
    processes, etcd, make_agent
) -> None:
    # A lease far longer than the wait below: only the standby's probe can make it lead in time.
    state = etcd.url()
    group = [processes(state, "--lease-ttl", "300").wait_serving(), processes(state, "--lease-ttl", "300")]
    agent = make_agent(group[0].address, JOB, "n0").join()
    group[0].kill()
    group[1].wait_serving(timeout=3 * WAIT)
    log = group[1].log.read_text()
    assert f"the leader ({group[0].address}) is gone: nothing listens at {group[0].address}" in log
    agent.close()
    agent = make_agent(group[1].address, JOB, "n0").join()
    assert agent.fault({0: 1}).code == 0
    assert agent.expect("stopTrain").signalSeq == 1


#: A leader in a process of its own that runs beside agent node-1 (as a launcher's replica runs beside its agent).
_LEADER_BESIDE_NODE_1 = """
import dataclasses, sys, time
from taskd_core.controller.server import EmbeddedController
from tests.conftest import TEST_POLICY
policy = dataclasses.replace(TEST_POLICY, report_timeout=3600.0, expected_agents=2)
ctl = EmbeddedController(state=sys.argv[1], defaults=policy, keepalive_interval=0.5, beside="node-1")
print(ctl.address, flush=True)
time.sleep(600)
"""


def test_the_agent_beside_a_killed_leader_is_replaced_by_the_spare_as_the_new_leader_takes_over(
    replicas, etcd, make_agent
) -> None:
    state = etcd.url()
    child = subprocess.Popen(
        [sys.executable, "-c", _LEADER_BESIDE_NODE_1, state], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        address = child.stdout.readline().strip()
        policy = dataclasses.replace(TEST_POLICY, report_timeout=3600.0, expected_agents=2)
        standby = replicas(state, defaults=policy)
        assert not standby.leading
        node0 = make_agent(address, JOB, agent_id="node-0", node_rank=0, rank_ids=(0, 1)).join()
        make_agent(address, JOB, agent_id="node-1", node_rank=1, rank_ids=(2, 3)).join()
        spare = make_agent(address, JOB, agent_id="spare-x", role=SPARE_ROLE)
        assert spare.stub.Init(spare.info, timeout=WAIT).code == 0
        assert spare.stub.Register(spare.info, timeout=WAIT).code == 0
        child.kill()  # node 1's process: its agent and the leading replica together
        child.wait(WAIT)
        wait_until(lambda: standby.leading, "the standby to lead", WAIT)
        node0.close()
        view = make_agent(standby.address, JOB, agent_id="node-0", node_rank=0, rank_ids=(0, 1)).join()

        def lost() -> list[Any]:
            return [e for e in view.job(events=200).events if e.kind == "agent lost" and "node-1" in e.detail]

        (entry,) = wait_until(lost, "node-1 to be declared lost", WAIT)
        # At once, for the reason the standby proved, not after the grace a surviving node gets.
        assert "node-1" in entry.detail and "previous leader's process" in entry.detail
        assert any(a.agentId == "spare-x" and a.nodeRank == 1 for a in view.job().agents)
        # The promoted spare may take longer than a surviving node's grace to start as the node:
        # it was standing by when the new leader loaded the job, and has no stream to come back.
        time.sleep(TAKEOVER_GRACE + 0.5)
        job = view.job(events=200)
        assert not [e for e in job.events if e.kind == "agent lost" and "spare-x" in e.detail]
        assert job.state not in ("given-up", "finished")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(WAIT)


# --- bad starts -------------------------------------------------------------------------------------


def _controller(state: str, *args: str) -> int:
    return main(["controller", "--listen", "127.0.0.1:0", "--state", state, "--etcd-timeout", "0.5", *args])


def test_an_unreachable_etcd_at_start_is_one_line_naming_it_and_exit_2(caplog) -> None:
    state = f"etcd://127.0.0.1:{free_port()}/taskd"
    assert _controller(state) == 2
    line = caplog.records[-1].getMessage()
    assert state in line and "unreachable" in line and "\n" not in line


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ("etcd://", "give a key prefix"),
        ("etcd://127.0.0.1:2379", "give a key prefix"),
        ("etcd://127.0.0.1:2379/", "give a key prefix"),
        ("etcd://127.0.0.1/taskd", "is not HOST:PORT"),
        ("etcd://127.0.0.1:99999/taskd", "is not HOST:PORT"),
        ("etcd://127.0.0.1:2379,/taskd", "is not HOST:PORT"),
    ],
)
def test_a_malformed_etcd_url_is_one_line_and_exit_2(state, message, caplog) -> None:
    assert _controller(state) == 2
    assert message in caplog.records[-1].getMessage()


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (b"config", b"someone's", "not a TaskD controller's state"),
        (b"meta", b'{"app": "something-else"}', "belongs to something else"),
        (b"meta", b'{"app": "taskd-controller", "schema": 99}', "schema version 99"),
    ],
)
def test_a_prefix_with_someone_elses_data_or_another_schema_is_refused(etcd, key, value, message, caplog) -> None:
    state = etcd.url()

    async def plant() -> None:
        client = EtcdClient(parse_etcd_url(state))
        await client.txn([], [put(Layout(parse_etcd_url(state).prefix).root + key, value)])
        await client.close()

    asyncio.run(plant())
    assert _controller(state) == 2
    line = caplog.records[-1].getMessage()
    assert message in line and state in line and "\n" not in line


def test_a_replica_with_another_policy_is_refused(replicas, etcd, caplog) -> None:
    state = etcd.url()
    replicas(state)  # stores its policy: max_cycles 5
    assert _controller(state, "--max-cycles", "7", "--report-timeout", "10") == 2
    line = caplog.records[-1].getMessage()
    assert "policy differs" in line and "max_cycles: 7 here, 5 there" in line and "--replace-policy" in line


def test_replace_policy_takes_over_and_the_old_replicas_stop(processes, etcd, make_agent) -> None:
    state = etcd.url()
    old = processes(state, "--max-cycles", "5").wait_serving()
    new = processes(state, "--max-cycles", "7", "--replace-policy")
    # The old leader's next write finds the policy replaced: it stops leading and exits, saying why.
    agent = make_agent(old.address, JOB, "n0")
    with pytest.raises(grpc.RpcError):
        agent.join()
    assert old.proc.wait(WAIT) == 2
    new.wait_serving()
    log = old.log.read_text()
    assert "policy was replaced" in log and "Traceback" not in log
    agent = make_agent(new.address, JOB, "n0").join()
    assert agent.job().maxCycles == 7


# --- etcd faults while serving ----------------------------------------------------------------------


def test_losing_etcd_stops_the_leader_within_its_lease_and_it_serves_again_once_etcd_is_back(
    tmp_path, replicas, make_agent, caplog
) -> None:
    server = EtcdServer(tmp_path / "etcd").start()
    try:
        ctl = replicas(server.url("lost"))
        assert ctl.wait_leading(WAIT)
        make_agent(ctl.address, JOB, "n0").join()
        server.stop()
        wait_until(lambda: health(ctl.address) == NOT_SERVING, "the leader to stop serving", 3 * WAIT)
        said = [r.getMessage() for r in caplog.records if "stopped leading" in r.getMessage()]
        assert said and "before it ends" in said[0]
        server.start()
        assert ctl.wait_leading(6 * WAIT)
        agent = make_agent(ctl.address, JOB, "n0").join()  # the job was kept in etcd
        assert agent.job().agents[0].agentId == "n0"
    finally:
        server.kill()


def test_etcd_with_client_certificates(tmp_path, pki, replicas, make_agent, caplog) -> None:
    server = EtcdServer(tmp_path / "etcd", tls=(pki.server_cert, pki.server_key, pki.ca)).start()
    try:
        state = server.url("tls")
        ctl = replicas(state, etcd_tls=EtcdTls(pki.ca, pki.client_cert, pki.client_key))
        assert ctl.wait_leading(WAIT)
        make_agent(ctl.address, JOB, "n0").join()
        # Without a client certificate etcd refuses the connection: one line, exit 2.
        assert _controller(state, "--etcd-cacert", pki.ca) == 2
        line = caplog.records[-1].getMessage()
        assert state in line and "--etcd-cert" in line and "\n" not in line
        assert _controller(state, "--etcd-cacert", pki.ca, "--etcd-cert", pki.client_cert) == 2
        assert "--etcd-cert and --etcd-key go together" in caplog.records[-1].getMessage()
    finally:
        server.kill()


def test_replicas_with_the_same_policy_start_side_by_side(replicas, etcd) -> None:
    state = etcd.url()
    policy = JobPolicy(strategies=(Strategy.RECOVER, Strategy.EXIT), max_cycles=2)
    group = [replicas(state, defaults=policy) for _ in range(2)]
    assert leader_of(group).generation > 0


def test_an_embedded_replica_per_node_keeps_the_job_through_the_loss_of_each(replicas, etcd, make_agent) -> None:
    """What taskdrun's nodes will do (issue 22): each runs a replica in-process on the job's etcd.

    The replicas go one by one, each while leading; the next always takes over
    with the job's cycles, and the standbys always name the leader.
    """
    state = etcd.url()
    alive = [replicas(state) for _ in range(3)]
    for cycle in range(1, 4):
        leader = leader_of(alive)
        wait_until(lambda a=leader.address: all(n.leader == a for n in alive), what="the standbys to name the leader")
        agent = make_agent(leader.address, JOB, "n0").join()
        assert agent.job().cycle == cycle - 1  # the cycles run under the lost leaders are kept
        assert agent.fault({0: 1}).code == 0
        agent.expect("stopTrain")
        assert agent.stopped().code == 0
        agent.expect("globalFault")
        assert agent.strategies(["recover", "exit"]).code == 0
        agent.expect("changeStrategy", changeStrategy="recover")
        assert agent.status(0, "recover").code == 0
        agent.close()
        if len(alive) > 1:
            leader.stop()
            alive.remove(leader)
    assert alive[0].leading and alive[0].generation > 0


def test_replicas_starting_together_on_an_empty_prefix_all_come_up(replicas, etcd) -> None:
    """Each marks the prefix or finds the mark another just wrote; none mistakes it for foreign data."""
    import concurrent.futures

    state = etcd.url()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        group = list(pool.map(lambda _: replicas(state), range(4)))
    assert sum(c.leading for c in group) == 1 and len({c.leader for c in group}) == 1
