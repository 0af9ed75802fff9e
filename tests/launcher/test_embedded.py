"""The "which controller" rule: explicit address, node 0 embeds one, other nodes reach MASTER_ADDR."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import pytest

from taskd_core.errors import ConfigError, ControllerUnavailableError
from taskd_core.launcher.embedded import ControllerEndpoint, controller_address
from taskd_core.launcher.node import SPARE_FRESH, _ended, wait_for_agents
from taskd_core.models import AgentStatus, JobPolicy
from taskd_core.rpc import recover_pb2 as pb
from taskd_core.rpc import recover_pb2_grpc
from taskd_core.values import parse_address
from tests.conftest import RawAgent

POLICY = JobPolicy(max_cycles=7)


def test_explicit_address_wins() -> None:
    with controller_address(
        "ctl.example:9000", node_rank=0, master_addr="10.0.0.1", controller_port=1, policy=POLICY
    ) as endpoint:
        assert endpoint == ControllerEndpoint("ctl.example:9000", embedded=False)


def test_other_nodes_reach_master_addr() -> None:
    with controller_address(
        None, node_rank=3, master_addr="10.0.0.1", controller_port=8899, policy=POLICY
    ) as ep:
        assert ep == ControllerEndpoint("10.0.0.1:8899", embedded=False)


def test_other_nodes_need_a_fixed_port() -> None:
    endpoint = controller_address(None, node_rank=1, master_addr="10.0.0.1", controller_port=0, policy=POLICY)
    with pytest.raises(ConfigError, match="controller port"), endpoint:
        pass


def test_node_zero_embeds_a_controller_with_the_policy() -> None:
    """Node 0 serves a real controller on loopback for a loopback master; it stops with the block."""
    with controller_address(
        None, node_rank=0, master_addr="127.0.0.1", controller_port=0, policy=POLICY
    ) as ep:
        assert ep.embedded and ep.address.startswith("127.0.0.1:")
        with grpc.insecure_channel(ep.address) as channel:
            reply = recover_pb2_grpc.RecoverStub(channel).QueryStatus(pb.StatusQuery(), timeout=30)
        assert reply.status.code == 0
        # No agent of an unknown job ever ends: the wait gives up at its deadline instead of blocking.
        assert wait_for_agents(ep.address, "nobody", agents=1, timeout=0.3) is False
        # A launcher told to stop does not wait out its linger.
        stop = threading.Event()
        stop.set()
        waiting = threading.Thread(
            target=wait_for_agents, args=(ep.address, "nobody", 1, 600.0), kwargs={"stop": stop}
        )
        waiting.start()
        waiting.join(timeout=60)
        assert not waiting.is_alive()
    with grpc.insecure_channel(ep.address) as channel, pytest.raises(grpc.RpcError):
        recover_pb2_grpc.RecoverStub(channel).QueryStatus(pb.StatusQuery(), timeout=2)


def test_node_zero_also_waits_for_a_node_the_job_grew_by(make_agent: Callable[..., RawAgent]) -> None:
    """The first round had two nodes; node 2 joined later (growth): it still runs, so node 0 waits for it."""
    policy = JobPolicy(max_cycles=7, expected_agents=2, min_nodes=2, max_nodes=3)
    with controller_address(
        None, node_rank=0, master_addr="127.0.0.1", controller_port=0, policy=policy
    ) as ep:
        nodes = [
            make_agent(ep.address, "grown", agent_id=f"node-{n}", node_rank=n, rank_ids=(n,)).join()
            for n in range(3)
        ]
        for node in nodes[:2]:
            assert node.exited(0).code == 0
        assert wait_for_agents(ep.address, "grown", agents=2, timeout=0.5) is False
        assert nodes[2].exited(0).code == 0
        assert wait_for_agents(ep.address, "grown", agents=2, timeout=60.0) is True


class Board:
    """A notice board in memory, as a rendezvous store would be."""

    def __init__(self) -> None:
        self.address: str | None = None

    def publish(self, address: str) -> None:
        self.address = address

    def lookup(self, timeout: float) -> str:
        if self.address is None:
            raise ControllerUnavailableError("the board", timeout)
        return self.address


def test_with_a_board_node_zero_publishes_its_free_port_and_the_others_read_it() -> None:
    board = Board()
    with controller_address(
        None, node_rank=0, master_addr="127.0.0.1", controller_port=0, policy=POLICY, board=board
    ) as host:
        assert board.address == host.address
        # The other nodes need no fixed port: the board tells them.
        with controller_address(
            None, node_rank=1, master_addr="10.9.9.9", controller_port=0, policy=POLICY, board=board
        ) as other:
            assert other == ControllerEndpoint(host.address, embedded=False)


def test_with_an_empty_board_the_other_nodes_fail_clearly() -> None:
    endpoint = controller_address(
        None, node_rank=1, master_addr="x", controller_port=0, policy=POLICY, board=Board()
    )
    with pytest.raises(ControllerUnavailableError, match="the board unreachable for"), endpoint:
        pass


@pytest.mark.parametrize("address", ["nohost", "host:", "host:0", "[::1]:70000", "a b:80"])
def test_bad_addresses(address: str) -> None:
    with pytest.raises(ConfigError):
        parse_address(address)


def test_ipv6_address() -> None:
    assert parse_address("[::1]:8899") == ("::1", 8899)


def test_node_0_stops_waiting_for_a_node_that_is_gone_once_the_job_is_over() -> None:
    """A lost node never reports its end: no signal stream, silent for SPARE_FRESH seconds, the job over."""
    now = time.time()
    done = AgentStatus("node-0", "", subscribed=False, node_rank=0, exit_code=0, last_seen=now)
    lost = AgentStatus("node-1", "", subscribed=False, node_rank=1, exit_code=None, last_seen=now - SPARE_FRESH - 1)
    finishing = AgentStatus("node-1", "", subscribed=True, node_rank=1, exit_code=None, last_seen=now - 60)
    quiet = AgentStatus("node-1", "", subscribed=False, node_rank=1, exit_code=None, last_seen=now)
    assert _ended([done, lost], 2, over=True) == 2
    assert _ended([done, lost], 2, over=False) == 1  # the job still runs: the node may come back
    assert _ended([done, finishing], 2, over=True) == 1  # still holds its stream: it is finishing
    assert _ended([done, quiet], 2, over=True) == 1  # its stream just ended: its report may be on the way
