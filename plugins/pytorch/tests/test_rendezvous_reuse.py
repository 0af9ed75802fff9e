"""The agreement on keeping a rendezvous round, between real rendezvous handlers: c10d on a real TCP
store, and etcd-v2 on a real etcd.

Each handler plays one node's agent (torch gives every handler of a process
a node identity of its own); no worker is started.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TypeVar

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from taskd_core.errors import LauncherInterrupted
from taskd_core.launcher.interrupt import StopRequest
from taskd_core.testing import wait_until
from taskd_pytorch.rendezvous_reuse import Regroup, RoundReuse

T = TypeVar("T")

Nodes = Callable[..., list[RendezvousHandler]]


@pytest.fixture(params=["c10d", "etcd-v2"])
def nodes(request: pytest.FixtureRequest) -> Iterator[Nodes]:
    """Make ``n`` handlers of one rendezvous (c10d: its store hosted here; etcd-v2: on a real etcd);
    all are shut down at teardown."""
    backend: str = request.param
    if backend == "c10d":
        store = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
        endpoint = f"127.0.0.1:{store.port}"
    else:
        endpoint = request.getfixturevalue("etcd_v2").endpoint
    made: list[RendezvousHandler] = []

    def make(n: int, min_nodes: int, max_nodes: int, last_call: float = 1) -> list[RendezvousHandler]:
        params = RendezvousParameters(
            backend=backend,
            endpoint=endpoint,
            run_id=uuid.uuid4().hex,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            is_host=False,
            last_call_timeout=last_call,
            # torch's default join timeout (600 s) outlasts the test's own ceiling: a round that never forms
            # fails here with torch's message instead of as a pytest timeout.
            join_timeout=120,
        )
        made.extend(get_rendezvous_handler(params) for _ in range(n))
        return made[-n:]

    yield make
    for handler in made:
        handler.shutdown()


def together(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Run the calls at once, one thread each, as the nodes' agents would; their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result(timeout=120) for f in [pool.submit(c) for c in calls]]


def rendezvous(handlers: Sequence[RendezvousHandler]) -> list[RendezvousInfo]:
    return together([h.next_rendezvous for h in handlers])


def decide_all(agents: Sequence[RoundReuse], infos: Sequence[RendezvousInfo]) -> list[Regroup]:
    """Every agent's decision on its restart, all restarting at once."""
    pairs = zip(agents, infos, strict=True)
    return together([partial(a.decide, i.store, len(infos), StopRequest()) for a, i in pairs])


def test_every_agent_of_the_round_keeps_it_restart_after_restart(nodes: Nodes) -> None:
    handlers = nodes(2, 2, 2)
    infos = rendezvous(handlers)
    agents = [RoundReuse(h) for h in handlers]

    for _ in range(3):
        assert decide_all(agents, infos) == [Regroup.KEEP, Regroup.KEEP]


def test_an_agent_that_does_not_restart_makes_every_agent_take_a_new_round(nodes: Nodes) -> None:
    handlers = nodes(2, 2, 2)
    infos = rendezvous(handlers)
    agents = [RoundReuse(h, wait=0.5) for h in handlers]

    alone = agents[0].decide(infos[0].store, 2, StopRequest())
    late = agents[1].decide(infos[1].store, 2, StopRequest())

    assert (alone, late) == (Regroup.NEW_ROUND, Regroup.NEW_ROUND)
    # Both take torch's new round, which forms as usual; its store starts the agreement afresh.
    again = rendezvous(handlers)
    assert sorted(i.rank for i in again) == [0, 1]
    for agent in agents:
        agent.formed()
    assert decide_all(agents, again) == [Regroup.KEEP, Regroup.KEEP]


def test_a_node_waiting_to_join_makes_the_restart_a_new_round_that_admits_it(
    nodes: Nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With the shared agent store, torch 2.13 does not publish the new round's MASTER_ADDR when its rank 0
    # was rank 0 of the last round too, so the newcomer would wait for it: not what is tested here.
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # The newcomer must join the new round within its last call: under load it missed a 1 s one and was left
    # waiting for a round that never came (the first round, of the first node alone, waits it out once).
    first, newcomer = nodes(2, 1, 2, last_call=5)
    (info,) = rendezvous([first])
    agent = RoundReuse(first)
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(newcomer.next_rendezvous)
        wait_until(lambda: first.num_nodes_waiting() == 1, "the new node in the wait list", 60)

        assert agent.decide(info.store, 1, StopRequest()) is Regroup.NEW_ROUND

        # torch's new round takes the waiting node in.
        assert sorted([first.next_rendezvous().world_size, joined.result(timeout=120).world_size]) == [2, 2]


def test_a_stop_request_ends_the_wait_for_the_other_agents(nodes: Nodes) -> None:
    handlers = nodes(2, 2, 2)
    infos = rendezvous(handlers)
    stop = StopRequest()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(RoundReuse(handlers[0], wait=600).decide, infos[0].store, 2, stop)
        stop(signal.SIGTERM)

        with pytest.raises(LauncherInterrupted):
            waiting.result(timeout=60)


def test_a_new_round_is_the_only_choice_before_the_first_rendezvous(nodes: Nodes) -> None:
    (handler,) = nodes(1, 1, 1)
    assert RoundReuse(handler).decide(None, None, StopRequest()) is Regroup.NEW_ROUND
    # The static rendezvous has no rounds to save: it is always asked again (it answers at once).
    params = RendezvousParameters(
        backend="static", endpoint="127.0.0.1:0", run_id="s", min_nodes=1, max_nodes=1, rank=0
    )
    static = get_rendezvous_handler(params)
    try:
        info = static.next_rendezvous()
        assert RoundReuse(static).decide(info.store, 1, StopRequest()) is Regroup.NEW_ROUND
    finally:
        static.shutdown()


def test_the_agreement_keys_of_one_round_never_meet_another_rounds(nodes: Nodes) -> None:
    handlers = nodes(2, 2, 2)
    infos = rendezvous(handlers)
    decision = "taskd/regroup/0/decision"
    decide_all([RoundReuse(h) for h in handlers], infos)
    assert infos[0].store.check([decision])

    again = rendezvous(handlers)

    assert not again[0].store.check([decision])


def test_on_etcd_an_agent_that_won_the_proposal_but_never_wrote_it_leaves_the_others_a_new_round(
    etcd_v2: object, nodes: Nodes
) -> None:
    handlers = nodes(2, 2, 2)
    infos = rendezvous(handlers)
    if handlers[0].get_backend() != "etcd-v2":
        pytest.skip("c10d's compare_set writes the proposal in the same step")
    infos[0].store.add("taskd/regroup/0/decision/proposers", 1)  # it won, then its node was lost

    assert RoundReuse(handlers[1], wait=0.5).decide(infos[1].store, 2, StopRequest()) is Regroup.NEW_ROUND
