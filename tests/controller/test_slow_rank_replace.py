"""The ``replace`` policy: a slow rank's node is drained onto a waiting spare, once; slow again, it is reported."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator

import pytest

from taskd_core.controller.server import EmbeddedController
from taskd_core.models import SPARE_ROLE, Code, SlowRankPolicy
from taskd_core.rpc import recover_pb2 as pb
from tests.conftest import TEST_POLICY, WAIT, RawAgent
from tests.controller.test_spares import promoted

JOB = "slow-replace"
NEVER = 3600.0


@pytest.fixture
def controller() -> Iterator[EmbeddedController]:
    policy = dataclasses.replace(
        TEST_POLICY, report_timeout=NEVER, expected_agents=2, slow_rank=SlowRankPolicy.REPLACE
    )
    ctl = EmbeddedController(defaults=policy, keepalive_interval=0.5, stream_grace=NEVER)
    yield ctl
    ctl.stop()


def two_nodes_and_a_spare(make_agent: Callable[..., RawAgent], address: str) -> tuple[RawAgent, RawAgent, RawAgent]:
    """Nodes 0 (ranks 0, 1) and 1 (ranks 2, 3) of the job, joined, and a spare standing by."""
    a = make_agent(address, JOB, agent_id="node-0", node_rank=0, rank_ids=(0, 1)).join()
    b = make_agent(address, JOB, agent_id="node-1", node_rank=1, rank_ids=(2, 3)).join()
    spare = make_agent(address, JOB, agent_id="spare-x", role=SPARE_ROLE)
    assert spare.stub.Init(spare.info, timeout=WAIT).code == 0
    assert spare.stub.Register(spare.info, timeout=WAIT).code == 0
    return a, b, spare


def report_work(agent: RawAgent, ranks: dict[int, tuple[int, float]], steps: range) -> list[int]:
    """Each rank's (pid, seconds of work per step) over ``steps``, 5 steps a report; the codes answered."""
    codes = []
    for end in steps:
        work = [
            pb.RankWork(rank=r, pid=pid, step=end, steps=5, busySeconds=5 * w)
            for r, (pid, w) in ranks.items()
        ]
        request = pb.WorkerEventsRequest(jobId=agent.job_id, agentId=agent.agent_id, work=work)
        codes.append(agent.stub.ReportWorkerEvents(request, timeout=WAIT).code)
    return codes


def slow_events(agent: RawAgent) -> list[dict[str, object]]:
    return [json.loads(e.detail) for e in agent.job(events=500).events if e.kind == "slow-rank"]


def test_a_slow_ranks_node_is_replaced_by_the_spare_once_and_reported_when_slow_again(
    controller: EmbeddedController, make_agent: Callable[..., RawAgent]
) -> None:
    a, b, spare = two_nodes_and_a_spare(make_agent, controller.address)
    steps = range(5, 101, 5)
    for end in steps:  # both nodes report, rank 3 at 2x from step 40 on
        assert report_work(a, {0: (10, 0.1), 1: (11, 0.1)}, range(end, end + 1)) == [Code.OK]
        codes = report_work(b, {2: (12, 0.1), 3: (13, 0.2 if end > 40 else 0.1)}, range(end, end + 1))
        if codes != [Code.OK]:
            break  # node-1 was replaced and fenced: its reports are refused from then on
    (first,) = slow_events(a)
    assert (first["ranks"], first["action"], first["node"], first["policy"]) == (
        [3],
        "replace",
        "node-1",
        "replace",
    )
    # The lost-node path: node-1 is fenced, the spare takes its place in the cycle that drains it.
    assert "node replaced" in [e.kind for e in a.job(events=500).events]
    fenced = b.stub.Register(b.info, timeout=WAIT)
    assert fenced.code == Code.NODE_REPLACED and "spare 'spare-x' took its place" in fenced.info
    a.expect("stopTrain")
    promoted(spare)
    # Rank 3 on its replacement (a new pid) is slow too: reported, not bounced onto another node.
    more = range(105, 201, 5)
    for end in more:
        assert report_work(a, {0: (20, 0.1), 1: (21, 0.1)}, range(end, end + 1)) == [Code.OK]
        assert report_work(spare, {2: (22, 0.1), 3: (23, 0.2)}, range(end, end + 1)) == [Code.OK]
    second = slow_events(a)[1:]
    assert [(d["ranks"], d["evidence"][0]["pid"], d["action"]) for d in second] == [([3], 23, "warn")]
    assert "replaced once already: reported, not bounced" in str(second[0]["reason"])
    assert "node" not in second[0]


def test_without_a_spare_the_slow_rank_is_reported_and_replaced_once_a_spare_stands_by(
    controller: EmbeddedController, make_agent: Callable[..., RawAgent]
) -> None:
    a = make_agent(controller.address, JOB, agent_id="node-0", node_rank=0, rank_ids=(0, 1)).join()
    b = make_agent(controller.address, JOB, agent_id="node-1", node_rank=1, rank_ids=(2, 3)).join()
    for end in range(5, 101, 5):
        report_work(a, {0: (10, 0.1), 1: (11, 0.1)}, range(end, end + 1))
        report_work(b, {2: (12, 0.1), 3: (13, 0.3)}, range(end, end + 1))
    (found,) = slow_events(a)
    assert (found["ranks"], found["action"], found["reason"]) == ([3], "warn", "no hot spare stands by (yet)")
    assert "node replaced" not in [e.kind for e in a.job(events=500).events]
    # A spare comes: the next report finds rank 3 still slow and drains its node.
    spare = make_agent(controller.address, JOB, agent_id="spare-x", role=SPARE_ROLE)
    assert spare.stub.Init(spare.info, timeout=WAIT).code == 0
    assert spare.stub.Register(spare.info, timeout=WAIT).code == 0
    report_work(a, {0: (10, 0.1), 1: (11, 0.1)}, range(105, 106))
    later = slow_events(a)[1:]
    assert [(d["ranks"], d["action"], d["node"]) for d in later] == [([3], "replace", "node-1")]
    assert "node replaced" in [e.kind for e in a.job(events=500).events]


def test_a_slow_node_is_drained_once_for_both_its_ranks(
    controller: EmbeddedController, make_agent: Callable[..., RawAgent]
) -> None:
    a, b, spare = two_nodes_and_a_spare(make_agent, controller.address)
    for end in range(5, 101, 5):
        report_work(a, {0: (10, 0.1), 1: (11, 0.1)}, range(end, end + 1))
        slow = 0.25 if end > 40 else 0.1
        if report_work(b, {2: (12, slow), 3: (13, slow * 0.8 if end > 40 else 0.1)}, range(end, end + 1)) != [Code.OK]:
            break  # replaced and fenced
    assert [(d["ranks"], d["action"], d.get("node")) for d in slow_events(a)] == [([2, 3], "replace", "node-1")]
    replaced = [json.loads(e.detail) for e in a.job(events=500).events if e.kind == "node replaced"]
    assert [(d["lost"], d["ranks"]) for d in replaced] == [("node-1", [2, 3])], replaced
    promoted(spare)
    # Both ranks slow again on the spare: reported once, together, not bounced.
    for end in range(105, 201, 5):
        assert report_work(a, {0: (20, 0.1), 1: (21, 0.1)}, range(end, end + 1)) == [Code.OK]
        assert report_work(spare, {2: (22, 0.25), 3: (23, 0.25)}, range(end, end + 1)) == [Code.OK]
    assert [(d["ranks"], d["action"]) for d in slow_events(a)[1:]] == [([2, 3], "warn")]


def test_a_restarted_controller_remembers_the_rank_it_replaced_and_only_reports_it_when_slow_again(
    controller_factory: Callable[..., EmbeddedController],
    make_agent: Callable[..., RawAgent],
    state_url: str,
) -> None:
    """The detector's windows are rebuilt from fresh reports; "replaced once" is stored with the job."""
    policy = {"report_timeout": NEVER, "expected_agents": 2, "slow_rank": SlowRankPolicy.REPLACE}
    ctl = controller_factory(state=state_url, **policy)
    a, b, spare = two_nodes_and_a_spare(make_agent, ctl.address)
    for end in range(5, 101, 5):
        report_work(a, {0: (10, 0.1), 1: (11, 0.1)}, range(end, end + 1))
        if report_work(b, {2: (12, 0.1), 3: (13, 0.3)}, range(end, end + 1)) != [Code.OK]:
            break  # replaced and fenced
    assert [(d["ranks"], d["action"]) for d in slow_events(a)] == [([3], "replace")]
    promoted(spare)
    ctl.stop()  # on etcd: a leader change, the next replica loads what the last one wrote
    ctl = controller_factory(state=state_url, **policy)
    a = make_agent(ctl.address, JOB, agent_id="node-0", node_rank=0, rank_ids=(0, 1)).join()
    again = make_agent(ctl.address, JOB, agent_id="spare-x", node_rank=1, rank_ids=(2, 3)).join()
    # A second spare stands by: only the memory of the first replacement keeps rank 3 where it is.
    other = make_agent(ctl.address, JOB, agent_id="spare-y", role=SPARE_ROLE)
    assert other.stub.Init(other.info, timeout=WAIT).code == 0
    assert other.stub.Register(other.info, timeout=WAIT).code == 0
    for end in range(105, 201, 5):
        assert report_work(a, {0: (20, 0.1), 1: (21, 0.1)}, range(end, end + 1)) == [Code.OK]
        assert report_work(again, {2: (22, 0.1), 3: (23, 0.3)}, range(end, end + 1)) == [Code.OK]
    second = slow_events(a)[1:]
    assert [(d["ranks"], d["action"]) for d in second] == [([3], "warn")], second
    assert "replaced once already: reported, not bounced" in str(second[0]["reason"])
