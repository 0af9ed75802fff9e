"""An agent that is gone during a wait settles its answer at once instead of the wait running out."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import pytest

from taskd_core.controller.server import EmbeddedController
from taskd_core.models import Code
from taskd_core.testing import wait_until
from tests.conftest import TEST_POLICY, WAIT, RawAgent
from tests.etcd_server import EtcdServer

JOB = "gone"
#: Far longer than any test may take: a wait that ends did not run out.
NEVER = 3600.0


@pytest.fixture
def slow_waits() -> Iterator[Callable[[float], EmbeddedController]]:
    started: list[EmbeddedController] = []

    def start(stream_grace: float) -> EmbeddedController:
        policy = dataclasses.replace(TEST_POLICY, report_timeout=NEVER, expected_agents=2)
        ctl = EmbeddedController(defaults=policy, keepalive_interval=0.5, stream_grace=stream_grace)
        started.append(ctl)
        return ctl

    yield start
    for ctl in started:
        ctl.stop()


def two_agents(ctl: EmbeddedController, make_agent: Callable[..., RawAgent]) -> tuple[RawAgent, RawAgent]:
    a = make_agent(ctl.address, JOB, agent_id="a", rank_ids=(0,)).join()
    b = make_agent(ctl.address, JOB, agent_id="b", rank_ids=(1,)).join()
    assert a.fault({1: 1}).code == Code.OK
    a.expect("stopTrain")
    b.expect("stopTrain")
    return a, b


def test_an_agent_that_exits_during_a_wait_fails_it_at_once(slow_waits, make_agent) -> None:
    a, b = two_agents(slow_waits(NEVER), make_agent)
    assert a.stopped().code == Code.OK
    assert b.exited(1).code == Code.OK
    a.expect("changeStrategy", changeStrategy="exit")
    a.expect("killMaster")
    view = a.job(events=50)
    assert view.state == "given-up"
    assert any(e.kind == "report" and '"gone": true' in e.detail for e in view.events)


def test_a_stream_that_ends_for_good_fails_the_wait_after_the_grace(slow_waits, make_agent) -> None:
    a, b = two_agents(slow_waits(0.5), make_agent)
    assert a.stopped().code == Code.OK
    b.cut()
    a.expect("changeStrategy", changeStrategy="exit")
    assert any(e.kind == "agent lost" for e in a.job(events=50).events)


def test_an_agent_back_within_the_grace_rejoins_the_cycle(slow_waits, make_agent) -> None:
    a, b = two_agents(slow_waits(NEVER), make_agent)
    b.cut()
    b.resubscribe()
    b.expect("stopTrain")  # the pending signal again
    assert a.stopped().code == Code.OK and b.stopped().code == Code.OK
    a.expect("globalFault")
    wait_until(lambda: a.job().state == "wait-strategies", "the cycle to go on", WAIT)


def to_live_round(a: RawAgent, b: RawAgent, also: tuple[str, ...] = ()) -> None:
    """Both agents stop, offer recover-live and recover (and ``also``); the controller starts the live round."""
    assert a.stopped().code == Code.OK and b.stopped().code == Code.OK
    a.expect("globalFault")
    b.expect("globalFault")
    offered = ["recover-live", "recover", *also, "exit"]
    assert a.strategies(offered).code == Code.OK and b.strategies(offered).code == Code.OK
    a.expect("changeStrategy", changeStrategy="recover", extraParams="recover-live")
    b.expect("changeStrategy", changeStrategy="recover", extraParams="recover-live")


def test_an_agent_lost_in_a_live_round_ends_the_job_instead_of_a_restart_it_cannot_join(
    slow_waits, make_agent
) -> None:
    """The full restart that follows a failed live round needs every node; with one gone for good it
    would leave the others waiting in their rendezvous for ever. The job ends with a message naming it."""
    a, b = two_agents(slow_waits(0.5), make_agent)
    to_live_round(a, b)
    b.cut()  # node b is lost during the hand-over
    assert a.status(Code.RECOVERABLE_RETRY_ERROR, "recover").code == Code.OK  # a's round could not form
    a.expect("changeStrategy", changeStrategy="exit")  # the very next signal: no full restart first
    kill = a.expect("killMaster")
    assert "agent(s) b left the job during recovery cycle 1" in kill.extraParams
    assert a.job().state == "given-up"


def test_an_agent_lost_before_the_others_answer_the_live_round_ends_it_as_soon_as_they_do(
    slow_waits, make_agent
) -> None:
    a, b = two_agents(slow_waits(0.5), make_agent)
    to_live_round(a, b)
    b.cut()
    wait_until(lambda: any(e.kind == "agent lost" for e in a.job(events=80).events), what="b to be lost")
    assert a.status(Code.RECOVERABLE_RETRY_ERROR, "recover").code == Code.OK
    a.expect("changeStrategy", changeStrategy="exit")
    assert "left the job" in a.expect("killMaster").extraParams


def test_the_survivors_may_still_dump_when_an_agent_is_lost_and_the_dump_does_not_wait_for_it(
    slow_waits, make_agent
) -> None:
    a, b = two_agents(slow_waits(0.5), make_agent)
    to_live_round(a, b, also=("dump",))
    b.cut()
    wait_until(lambda: any(e.kind == "agent lost" for e in a.job(events=80).events), what="b to be lost")
    assert a.status(Code.RECOVERABLE_RETRY_ERROR, "recover").code == Code.OK
    a.expect("changeStrategy", changeStrategy="dump")
    assert a.status(Code.OK, "dump").code == Code.OK  # b cannot dump: settled at once, a's answer ends the wait
    a.expect("changeStrategy", changeStrategy="exit")
    assert "dump failed, job exits: agent(s) b left the job" in a.expect("killMaster").extraParams


def test_an_agent_lost_with_the_leader_is_lost_to_the_next_leader_too(make_agent, etcd: EtcdServer) -> None:
    """The old leader saw the stream of a node lost together with it end; the new one never had it.

    An agent loaded from the state that does not subscribe to the new leader within the grace
    is lost as if its stream had ended there: the wait in flight does not sit out its timeout.
    """
    policy = dataclasses.replace(TEST_POLICY, report_timeout=NEVER, expected_agents=2)
    state = etcd.url()
    with EmbeddedController(state=state, defaults=policy, stream_grace=0.5) as first:
        a, b = two_agents(first, make_agent)
    with EmbeddedController(state=state, defaults=policy, stream_grace=0.5) as second:
        assert second.wait_leading(WAIT)
        back = make_agent(second.address, JOB, agent_id="a", rank_ids=(0,))
        back.subscribe()  # a's node survived: its agent follows the new leader; b's never comes
        back.expect("stopTrain")
        assert back.stopped().code == Code.OK
        back.expect("changeStrategy", changeStrategy="exit")
        assert any(e.kind == "agent lost" for e in back.job(events=50).events)
