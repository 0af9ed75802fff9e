"""An agent that is gone during a wait settles its answer at once instead of the wait running out."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import pytest

from taskd_core.controller.server import EmbeddedController
from taskd_core.models import Code
from taskd_core.testing import wait_until
from tests.conftest import TEST_POLICY, WAIT, RawAgent

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
