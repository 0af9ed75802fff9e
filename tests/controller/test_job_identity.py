"""Who may take a job id: a job that has not ended keeps it; an ended job's journal stays with its claim.

The first test drives the runtime on a clock it sets (the windows are a minute
and more); the others go over real gRPC.
"""

from __future__ import annotations

import asyncio

import pytest

from taskd_core.controller.access import AccessRules
from taskd_core.controller.policy import PolicyBook
from taskd_core.controller.runtime import AgentIdentity, Controller, Limits
from taskd_core.controller.store_sqlite import SqliteState
from taskd_core.errors import RequestRejected
from taskd_core.models import CONNECT_TIMEOUT, Code, Credentials
from taskd_core.rpc import recover_pb2 as pb
from taskd_core.rpc.security import Caller, token_digest
from tests.conftest import RawAgent, token_file

JOB = "claimed"


def test_a_silent_job_keeps_its_id_from_other_tokens_and_past_its_agents_connect_timeout() -> None:
    """Frozen 31 s (a GC pause, a partition), the job is not taken over; then only by its own token."""

    async def run() -> None:
        now = [1000.0]
        ctl = Controller(
            SqliteState(":memory:"),
            PolicyBook(),
            clock=lambda: now[0],
            access=AccessRules(admin_digest=token_digest("the-admin")),
        )
        await ctl.start()
        who = AgentIdentity(JOB, "taskd", "node-0")
        try:
            assert (await ctl.init(who, Caller("t1", "L1"))).code == Code.OK
            assert (await ctl.register(who, Caller("t1", "L1"))).code == Code.OK
            for silent in (31.0, CONNECT_TIMEOUT + 1.0, 10_000.0):
                now[0] = 1000.0 + silent
                with pytest.raises(RequestRejected, match="job token does not match") as refused:
                    await ctl.init(who, Caller("t2", "L2"))
                assert refused.value.code == Code.FORBIDDEN
            now[0] = 1000.0 + CONNECT_TIMEOUT + 1.0
            # Within the agents' connect timeout plus the margin, a new launch of the same token waits too.
            with pytest.raises(RequestRejected, match="another live launch"):
                await ctl.init(who, Caller("t1", "L2"))
            now[0] = 1000.0 + Limits().abandon_after + 1.0
            assert (await ctl.init(who, Caller("t1", "L2"))).code == Code.OK  # abandoned: its own token
            (job,) = await ctl.status(JOB, events=0, caller=Caller("t1", "L2"))
            assert job.state.value == "idle" and not job.agents
            # The admin token may take over even a job whose agents are live.
            assert (await ctl.register(who, Caller("t1", "L2"))).code == Code.OK
            assert (await ctl.init(who, Caller("the-admin", "L3"))).code == Code.OK
            with pytest.raises(RequestRejected, match="job token does not match"):
                await ctl.register(who, Caller("t1", "L2"))
        finally:
            await ctl.close()

    asyncio.run(run())


def _finish(agent: RawAgent) -> None:
    assert agent.fault({0: 1}).code == 0
    stop = agent.expect("stopTrain")
    assert agent.stopped(uuid=stop.uuid).code == 0
    assert agent.exited(0).code == 0
    assert agent.job().state in ("finished", "given-up")


def _kinds(agent: RawAgent) -> list[str]:
    page = agent.stub.QueryEvents(pb.EventQuery(jobId=JOB, afterSeq=0, limit=1000), timeout=10)
    assert page.status.code == 0, page.status
    return [e.kind for e in page.events]


def test_an_ended_jobs_journal_stays_with_its_claim(tmp_path, controller_factory, make_agent) -> None:
    admin_file = tmp_path / "admin-token"
    token_file(admin_file, "the-admin")
    ctl = controller_factory(admin_token_file=str(admin_file))
    first = make_agent(ctl.address, JOB, "node-0", credentials=Credentials(token="t1", launch="L1")).join()
    _finish(first)
    assert "fault" in _kinds(first)
    second = make_agent(ctl.address, JOB, "node-0", credentials=Credentials(token="t2", launch="L2")).join()
    seen = _kinds(second)
    assert "job retired" in seen and "job claimed" in seen
    assert "fault" not in seen and "agent exit" not in seen  # the first run's history
    assert not {e.kind for e in second.job(events=100).events} & {"fault", "agent exit"}
    admin = make_agent(ctl.address, JOB, credentials=Credentials(token="the-admin"))
    assert "fault" in _kinds(admin)  # the admin still sees every run
    reply = first.stub.QueryEvents(pb.EventQuery(jobId=JOB, afterSeq=0, limit=10), timeout=10)
    assert reply.status.code == Code.FORBIDDEN  # the old claim's token reads nothing of the new one
