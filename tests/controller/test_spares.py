"""A lost node replaced by a spare: the spare takes its seat in the cycle, the lost agent is fenced."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import grpc
import pytest

from taskd_core.controller.server import EmbeddedController
from taskd_core.models import SPARE_ROLE, Code
from taskd_core.testing import wait_until
from tests.conftest import TEST_POLICY, WAIT, RawAgent

JOB = "spares"
NEVER = 3600.0


@pytest.fixture
def start() -> Iterator[Callable[..., EmbeddedController]]:
    started: list[EmbeddedController] = []

    def make(
        node_lost_timeout: float = 5.0, spare_wait: float = 0.0, state: str = ":memory:"
    ) -> EmbeddedController:
        policy = dataclasses.replace(
            TEST_POLICY,
            report_timeout=NEVER,
            expected_agents=2,
            node_lost_timeout=node_lost_timeout,
            spare_wait=spare_wait,
        )
        # Streams closed with no spare ready count as lost after this grace (0.5 s with one).
        ctl = EmbeddedController(
            state=state, defaults=policy, keepalive_interval=0.5, stream_grace=1.0 if spare_wait else NEVER
        )
        started.append(ctl)
        return ctl

    yield make
    for ctl in started:
        ctl.stop()


def job_of_two_and_a_spare(
    ctl: EmbeddedController, make_agent: Callable[..., RawAgent]
) -> tuple[RawAgent, RawAgent, RawAgent]:
    a = make_agent(ctl.address, JOB, agent_id="node-0", node_rank=0, rank_ids=(0, 1)).join()
    b = make_agent(ctl.address, JOB, agent_id="node-1", node_rank=1, rank_ids=(2, 3)).join()
    spare = make_agent(ctl.address, JOB, agent_id="spare-x", role=SPARE_ROLE)
    assert spare.stub.Init(spare.info, timeout=WAIT).code == 0
    assert spare.stub.Register(spare.info, timeout=WAIT).code == 0
    return a, b, spare


def kinds(agent: RawAgent) -> list[str]:
    return [e.kind for e in agent.job(events=200).events]


def promoted(agent: RawAgent) -> RawAgent:
    """The spare, once the controller gave it the lost node's rank, registers as that node and subscribes."""
    wait_until(
        lambda: any(a.agentId == "spare-x" and a.nodeRank == 1 for a in agent.job().agents),
        "the spare to get node rank 1",
        WAIT,
    )
    agent.info.role, agent.info.nodeRank = "taskd", 1
    agent.info.rankIds[:] = ["2", "3"]
    assert agent.stub.Register(agent.info, timeout=WAIT).code == 0
    agent.subscribe()
    return agent


def test_a_node_whose_stream_closes_is_replaced_by_the_spare_which_answers_the_cycle_in_its_place(
    start, make_agent
) -> None:
    a, b, spare = job_of_two_and_a_spare(start(), make_agent)
    b.cut()  # node 1 dies: its stream closes, a cycle starts for its ranks though nobody reported them
    a.expect("stopTrain")
    promoted(spare).expect("stopTrain")  # the pending signal, as for a node that comes back
    assert a.stopped().code == Code.OK and spare.stopped().code == Code.OK
    a.expect("globalFault")
    spare.expect("globalFault")
    assert a.strategies(["recover", "exit"]).code == Code.OK
    assert spare.strategies(["recover", "exit"]).code == Code.OK
    a.expect("changeStrategy", changeStrategy="recover")
    assert a.status(Code.OK, "recover").code == Code.OK and spare.status(Code.OK, "recover").code == Code.OK
    wait_until(lambda: a.job().state == "idle", "the cycle to succeed", WAIT)
    assert "node replaced" in kinds(a)
    # The job ends when its nodes end, the replaced one not counted.
    assert a.exited(0).code == Code.OK and spare.exited(0).code == Code.OK
    wait_until(lambda: a.job().state == "finished", "the job to finish", WAIT)


def test_the_replaced_agent_is_fenced_with_a_clear_reason(start, make_agent) -> None:
    a, b, spare = job_of_two_and_a_spare(start(), make_agent)
    assert a.fault({0: 1}).code == Code.OK
    a.expect("stopTrain")
    b.cut()
    promoted(spare)
    stale = b.stub.Register(b.info, timeout=WAIT)
    assert stale.code == Code.NODE_REPLACED and "spare 'spare-x' took its place" in stale.info
    assert b.stopped().code == Code.NODE_REPLACED
    b.subscribe()
    refused = b.stream_end()
    assert refused is not None and refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "was declared lost" in (refused.details() or "")


def test_the_fence_outlives_the_controller_a_restart_from_its_state_or_a_new_leader_still_refuses(
    start, make_agent, state_url
) -> None:
    ctl = start(state=state_url)
    a, b, spare = job_of_two_and_a_spare(ctl, make_agent)
    b.cut()
    wait_until(
        lambda: any(x.agentId == "spare-x" and x.nodeRank == 1 for x in a.job().agents),
        "the spare to get node rank 1",
        WAIT,
    )
    # SQLite: the same state file, a new controller; etcd: the leader gives up its lease, a new one leads.
    ctl.stop()
    ctl = start(state=state_url)
    agents = {x.agentId: x for x in make_agent(ctl.address, JOB).job().agents}
    assert agents["spare-x"].nodeRank == 1  # the replacement was stored, not only the fence
    stale = make_agent(ctl.address, JOB, agent_id="node-1", node_rank=1, rank_ids=(2, 3))
    refused = stale.stub.Register(stale.info, timeout=WAIT)
    assert refused.code == Code.NODE_REPLACED and "spare 'spare-x' took its place" in refused.info
    stale.subscribe()
    end = stale.stream_end()
    assert end is not None and end.code() == grpc.StatusCode.PERMISSION_DENIED
    # The job's other node and the promoted spare go on with the new controller.
    node0 = make_agent(ctl.address, JOB, agent_id="node-0", node_rank=0, rank_ids=(0, 1))
    assert node0.stub.Register(node0.info, timeout=WAIT).code == Code.OK
    promoted(make_agent(ctl.address, JOB, agent_id="spare-x", role=SPARE_ROLE))


def test_a_node_that_stops_sending_health_checks_is_declared_lost_when_a_spare_waits(
    start, make_agent
) -> None:
    ctl = start(node_lost_timeout=1.0)
    a, b, spare = job_of_two_and_a_spare(ctl, make_agent)
    # a and the spare stay heard from; b holds its stream open but says nothing (a stopped machine).
    beating_until(lambda: "node replaced" in kinds(a), "b to be declared lost", a, spare)
    assert b.stream_end() is None  # the controller closed the stream it still held
    a.expect("stopTrain")
    events = a.job(events=200).events
    lost = next(e for e in events if e.kind == "agent lost")
    assert "no HealthCheck" in lost.detail and "node-1" in lost.detail


def test_without_a_spare_a_lost_node_still_ends_the_job_as_before(start, make_agent) -> None:
    ctl = start()
    a = make_agent(ctl.address, JOB, agent_id="node-0", rank_ids=(0,)).join()
    b = make_agent(ctl.address, JOB, agent_id="node-1", node_rank=1, rank_ids=(1,)).join()
    assert a.fault({1: 1}).code == Code.OK
    a.expect("stopTrain")
    assert "node replaced" not in kinds(a)
    assert b is not None


def beat(*agents: RawAgent) -> None:
    for agent in agents:
        agent.stub.HealthCheck(agent.info, timeout=WAIT)


def beating_until(check: Callable[[], bool], what: str, *agents: RawAgent) -> None:
    """Wait for ``check`` while ``agents`` keep sending health checks (the others stay silent)."""
    wait_until(lambda: beat(*agents) or check(), what, WAIT, interval=0.2)


def test_a_second_node_lost_while_the_first_is_replaced_with_no_spare_left_ends_the_job_with_the_reason(
    start, make_agent
) -> None:
    ctl = start(node_lost_timeout=1.0)
    a, b, spare = job_of_two_and_a_spare(ctl, make_agent)
    c = make_agent(ctl.address, JOB, agent_id="node-2", node_rank=2, rank_ids=(4, 5)).join()
    b.cut()  # node 1: replaced by the only spare
    a.expect("stopTrain")
    promoted(spare)
    c.cut()  # node 2, while node 1's replacement joins: no spare is left; found by its silence
    beating_until(lambda: "node given up" in kinds(a), "node 2 to be given up", a, spare)
    assert a.stopped().code == Code.OK and spare.stopped().code == Code.OK
    kill = next(s for s in iter(lambda: a.next_signal(), None) if s.signalType == "killMaster")
    assert "node-2" in kill.extraParams  # the job ends at once, saying which node it lost
    assert kinds(a).count("node replaced") == 1 and "node given up" in kinds(a)


def test_a_spare_that_dies_as_it_starts_is_replaced_by_the_next_spare(start, make_agent) -> None:
    ctl = start(node_lost_timeout=1.0)
    a, b, first = job_of_two_and_a_spare(ctl, make_agent)
    second = make_agent(ctl.address, JOB, agent_id="spare-y", role=SPARE_ROLE)
    assert second.stub.Init(second.info, timeout=WAIT).code == 0
    assert second.stub.Register(second.info, timeout=WAIT).code == 0
    b.cut()
    a.expect("stopTrain")
    # spare-x (first by name) gets node 1 and dies before it subscribes: it sends nothing more.
    beating_until(
        lambda: any(x.agentId == "spare-y" and x.nodeRank == 1 for x in a.job().agents),
        "the second spare to get node 1",
        a,
        second,
    )
    replaced = [e.detail for e in a.job(events=200).events if e.kind == "node replaced"]
    assert len(replaced) == 2 and '"lost": "spare-x"' in replaced[1] and '"spare": "spare-y"' in replaced[1]
    assert first is not None


def test_a_node_lost_while_the_job_waits_for_the_strategy_result_is_replaced_into_that_restart(
    start, make_agent
) -> None:
    """The strategy went out; node 1 dies during its restart: the spare gets the same changeStrategy."""
    a, b, spare = job_of_two_and_a_spare(start(), make_agent)
    assert a.fault({0: 1}).code == Code.OK
    for agent in (a, b):
        agent.expect("stopTrain")
        assert agent.stopped().code == Code.OK
    for agent in (a, b):
        agent.expect("globalFault")
        assert agent.strategies(["recover", "exit"]).code == Code.OK
    a.expect("changeStrategy", changeStrategy="recover")
    b.cut()
    promoted(spare).expect("changeStrategy", changeStrategy="recover")
    assert a.status(Code.OK, "recover").code == Code.OK and spare.status(Code.OK, "recover").code == Code.OK
    wait_until(lambda: a.job().state == "idle", "the cycle to succeed with the spare", WAIT)


def test_a_lost_node_waits_for_a_spare_up_to_the_bound_and_one_that_registers_takes_its_place(
    start, make_agent
) -> None:
    ctl = start(spare_wait=30.0)
    a = make_agent(ctl.address, JOB, agent_id="node-0", node_rank=0, rank_ids=(0, 1)).join()
    b = make_agent(ctl.address, JOB, agent_id="node-1", node_rank=1, rank_ids=(2, 3)).join()
    assert a.fault({0: 1}).code == Code.OK
    a.expect("stopTrain")
    b.cut()  # no spare yet: after the stream grace, the node's place waits for one
    wait_until(lambda: "node waits for a spare" in kinds(a), "node 1 to wait for a spare", WAIT)
    spare = make_agent(ctl.address, JOB, agent_id="spare-x", role=SPARE_ROLE)
    assert spare.stub.Init(spare.info, timeout=WAIT).code == 0
    assert spare.stub.Register(spare.info, timeout=WAIT).code == 0
    promoted(spare).expect("stopTrain")
    assert "node replaced" in kinds(a)


def test_past_the_bound_with_no_spare_the_job_ends_naming_the_node(start, make_agent) -> None:
    ctl = start(spare_wait=1.0)
    a = make_agent(ctl.address, JOB, agent_id="node-0", node_rank=0, rank_ids=(0, 1)).join()
    b = make_agent(ctl.address, JOB, agent_id="node-1", node_rank=1, rank_ids=(2, 3)).join()
    assert a.fault({0: 1}).code == Code.OK
    a.expect("stopTrain")
    assert a.stopped().code == Code.OK
    b.cut()
    kill = next(s for s in iter(lambda: a.next_signal(), None) if s.signalType == "killMaster")
    assert "node-1" in kill.extraParams
    given_up = [e.detail for e in a.job(events=200).events if e.kind == "node given up"]
    assert given_up and "no spare came within 1s" in given_up[0]
