"""A lost node with no spare ready shrinks a ``--nnodes=MIN:MAX`` job: the decision and the machine's cycle."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from taskd_core.controller.machine import (
    AgentExited,
    AgentInfo,
    AgentLost,
    JobMachine,
    SpareJoined,
    State,
    StatusReported,
    StopReported,
    StrategiesReported,
)
from taskd_core.controller.membership import SHRUNK, NodeLossKind, decide_node_loss, shrunk_layout
from taskd_core.controller.server import EmbeddedController
from taskd_core.controller.store import snapshot_from_dict, snapshot_to_dict
from taskd_core.models import SPARE_ROLE, Code, JobPolicy, Resize, Strategy
from taskd_core.testing import wait_until
from tests.conftest import TEST_POLICY, WAIT, RawAgent

NOW = 1_000.0


def nodes(count: int, ranks_each: int = 2) -> dict[str, AgentInfo]:
    return {
        f"node-{n}": AgentInfo(
            f"node-{n}", "taskd", n, tuple(range(n * ranks_each, (n + 1) * ranks_each)), None, NOW
        )
        for n in range(count)
    }


def policy(**changes: object) -> JobPolicy:
    base = {"strategies": tuple(Strategy), "flush_seconds": 0, "report_timeout": 5, "expected_agents": 3}
    return JobPolicy(**{**base, **changes})  # type: ignore[arg-type]


def test_a_job_above_its_fewest_nodes_shrinks_and_one_at_them_waits_or_gives_up() -> None:
    agents = nodes(3)
    assert decide_node_loss("node-1", agents, NOW, policy(min_nodes=2)).kind is NodeLossKind.SHRINK
    at_min = decide_node_loss("node-1", agents, NOW, policy(min_nodes=3))
    assert at_min.kind is NodeLossKind.GIVE_UP
    assert "at its fewest nodes (3)" in at_min.reason
    assert (
        decide_node_loss("node-1", agents, NOW, policy(min_nodes=3, spare_wait=10)).kind is NodeLossKind.WAIT
    )
    # A fixed job (min_nodes 0) never shrinks, and a ready spare beats shrinking.
    assert decide_node_loss("node-1", agents, NOW, policy()).kind is NodeLossKind.GIVE_UP
    spare = AgentInfo("spare-x", SPARE_ROLE, None, (), None, NOW)
    replaced = decide_node_loss("node-1", {**agents, "spare-x": spare}, NOW, policy(min_nodes=2))
    assert (replaced.kind, replaced.spare) == (NodeLossKind.REPLACE, "spare-x")


def test_the_survivors_close_up_their_node_ranks_and_global_ranks() -> None:
    assert shrunk_layout("node-1", nodes(3)) == {"node-0": (0, (0, 1)), "node-2": (1, (2, 3))}
    assert shrunk_layout("node-0", nodes(3)) == {"node-1": (0, (0, 1)), "node-2": (1, (2, 3))}


def to_recover(m: JobMachine) -> object:
    for agent in m.snap.members:
        m.handle(StopReported(agent, 0), NOW)
    reaction = None
    for agent in m.snap.members:
        reaction = m.handle(StrategiesReported(agent, ("recover-live", "recover", "dump", "exit")), NOW)
    return reaction


def test_a_lost_node_shrinks_the_job_through_a_whole_restart_that_carries_the_new_layout() -> None:
    agents = nodes(3)
    m = JobMachine("job", policy(min_nodes=2), agents)
    reaction = m.handle(AgentLost("node-1", "no HealthCheck for 5.0s"), NOW)
    shrunk = [e for e in reaction.journal if e.kind == "job shrunk"]
    assert shrunk and shrunk[0].detail["nodes"] == 2
    assert shrunk[0].detail["node_ranks"] == {"node-0": 0, "node-2": 1}
    assert agents["node-1"].replaced_by == SHRUNK
    assert (agents["node-2"].node_rank, agents["node-2"].rank_ids) == (1, (2, 3))
    assert m.state is State.WAIT_STOP and m.snap.members == ["node-0", "node-2"]
    recover = to_recover(m)
    # Live recovery is offered by every agent, but the world size changes: a whole restart it is.
    signal = recover.signals[-1]  # type: ignore[attr-defined]
    assert (signal.change_strategy, signal.extra_params) == ("recover", "resize:0,2")
    assert Resize.parse(signal.extra_params) == Resize((0, 2))
    for agent in m.snap.members:
        m.handle(StatusReported(agent, 0, "recover"), NOW)
    assert m.state is State.IDLE and m.snap.resize == ""
    assert m.snap.outcome.endswith("on 2 nodes")
    # Two agents are the job now: their exits finish it.
    for agent in ("node-0", "node-2"):
        agents[agent].exit_code = 0
        m.handle(AgentExited(agent, 0), NOW)
    assert m.state is State.FINISHED
    assert snapshot_from_dict(snapshot_to_dict(m.snap)).nodes == 2


def test_a_second_loss_before_the_restart_composes_the_layouts_and_one_at_min_gives_up() -> None:
    agents = nodes(4)
    m = JobMachine("job", policy(min_nodes=2, expected_agents=4), agents)
    m.handle(AgentLost("node-1"), NOW)
    m.handle(AgentLost("node-3"), NOW)  # old node 3 was new node 2
    assert Resize.parse(m.snap.resize) == Resize((0, 2)) and m.snap.nodes == 2
    signal = to_recover(m).signals[-1]  # type: ignore[attr-defined]
    assert signal.extra_params == "resize:0,2"
    for agent in m.snap.members:
        m.handle(StatusReported(agent, 0, "recover"), NOW)
    gone = m.handle(AgentLost("node-2"), NOW)
    assert any(e.kind == "node given up" for e in gone.journal)
    assert not any(e.kind == "job shrunk" for e in gone.journal)


def test_malformed_resizes_are_not_resizes() -> None:
    for extra in ("", "recover-live", "resize:", "resize:a,1", "resize:1,1", "resize:-1", "resize:0+x"):
        assert Resize.parse(extra) is None, extra
    assert Resize.parse("resize:0,1+2") == Resize((0, 1), 2)
    assert Resize((2, 0)).node_rank(0) == 1 and Resize((2, 0)).nodes == 2


def test_a_spare_that_comes_while_the_job_is_below_max_joins_it_through_a_whole_restart() -> None:
    agents = nodes(2)
    agents["spare-x"] = AgentInfo("spare-x", SPARE_ROLE, None, (), None, NOW)
    m = JobMachine("job", policy(min_nodes=2, max_nodes=3, expected_agents=2), agents)
    reaction = m.handle(SpareJoined("spare-x"), NOW)
    grown = [e for e in reaction.journal if e.kind == "job grown"]
    assert grown and grown[0].detail == {"agent": "spare-x", "nodes": 3, "node_rank": 2, "ranks": [4, 5]}
    assert m.state is State.WAIT_STOP and m.snap.members == ["node-0", "node-1", "spare-x"]
    signal = to_recover(m).signals[-1]  # type: ignore[attr-defined]
    assert signal.extra_params == "resize:0,1+1"
    assert [Resize.parse(signal.extra_params).node_rank(n) for n in (0, 1, 2)] == [0, 1, 2]  # type: ignore[union-attr]
    # At MAX, or in a job that never grows, a spare only stands by.
    agents["spare-y"] = AgentInfo("spare-y", SPARE_ROLE, None, (), None, NOW)
    for agent in m.snap.members:
        m.handle(StatusReported(agent, 0, "recover"), NOW)
    assert m.state is State.IDLE
    assert not m.handle(SpareJoined("spare-y"), NOW).journal
    fixed = JobMachine("job", policy(), {**nodes(2), "spare-y": agents["spare-y"]})
    assert not fixed.handle(SpareJoined("spare-y"), NOW).journal


def test_a_spare_that_comes_during_a_recovery_grows_the_job_once_that_recovery_ends(
    make_agent: Callable[..., RawAgent],
) -> None:
    """Real gRPC agents: the spare registers while the restart is out; its success starts the growth."""
    grows = dataclasses.replace(
        TEST_POLICY, report_timeout=3600.0, expected_agents=2, min_nodes=2, max_nodes=3, node_lost_timeout=5.0
    )
    ctl = EmbeddedController(defaults=grows, keepalive_interval=0.5)
    try:
        a = make_agent(ctl.address, "grow", agent_id="node-0", node_rank=0, rank_ids=(0, 1)).join()
        b = make_agent(ctl.address, "grow", agent_id="node-1", node_rank=1, rank_ids=(2, 3)).join()
        assert a.fault({0: 1}).code == Code.OK
        for agent in (a, b):
            agent.expect("stopTrain")
            assert agent.stopped().code == Code.OK
        for agent in (a, b):
            agent.expect("globalFault")
            assert agent.strategies(["recover", "exit"]).code == Code.OK
        for agent in (a, b):
            agent.expect("changeStrategy", changeStrategy="recover")
        spare = make_agent(ctl.address, "grow", agent_id="spare-x", role=SPARE_ROLE)
        assert spare.stub.Init(spare.info, timeout=WAIT).code == 0
        assert spare.stub.Register(spare.info, timeout=WAIT).code == 0
        # The restart in flight has two nodes: the spare only stands by until it succeeds.
        assert "job grown" not in [e.kind for e in a.job(events=200).events]
        for agent in (a, b):
            assert agent.status(Code.OK, "recover").code == Code.OK
        for agent in (a, b):
            agent.expect("stopTrain")  # the growth's whole restart
        job = a.job(events=200)
        assert [x.nodeRank for x in job.agents if x.agentId == "spare-x"] == [2]
        grown = [e.detail for e in job.events if e.kind == "job grown"]
        assert len(grown) == 1 and '"nodes": 3' in grown[0]
        for agent in (a, b):
            assert agent.stopped().code == Code.OK
        spare.info.role, spare.info.nodeRank = "taskd", 2
        spare.info.rankIds[:] = ["4", "5"]
        assert spare.stub.Register(spare.info, timeout=WAIT).code == 0
        spare.subscribe()
        spare.expect("stopTrain")  # the signal of the cycle it is a member of, once it subscribes
        assert spare.stopped().code == Code.OK
        for agent in (a, b, spare):
            agent.expect("globalFault")
            assert agent.strategies(["recover", "exit"]).code == Code.OK
        for agent in (a, b, spare):
            agent.expect("changeStrategy", changeStrategy="recover", extraParams="resize:0,1+1")
        for agent in (a, b, spare):
            assert agent.status(Code.OK, "recover").code == Code.OK
        wait_until(lambda: a.job().state == "idle", "the growth's cycle to succeed on 3 nodes", WAIT)
        assert a.job().outcome.endswith("on 3 nodes")
    finally:
        ctl.stop()
