"""A ``taskdrun`` started after its job had all its nodes: it stands by, warm, as a spare.

:func:`stand_by` registers this launcher with the job's controller as a spare
(:data:`~taskd_core.models.SPARE_ROLE`, no ranks, no workers; its fork server
has torch imported meanwhile), sends a HealthCheck every second so that the
controller counts it as ready, and looks every :data:`POLL` seconds whether the
controller gave it a lost node's place
(:mod:`taskd_core.controller.membership`). It returns that
:class:`Promotion`, or None once the job ended without needing it: the
launcher then exits 0.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass

import grpc

from taskd_core.client.manager import DLRecoverManager
from taskd_core.client.query import QueryClient
from taskd_core.errors import LauncherInterrupted, TaskdError
from taskd_core.launcher.interrupt import StopRequest
from taskd_core.launcher.settings import NodeSettings
from taskd_core.models import SPARE_ROLE, Code, JobState

logger = logging.getLogger(__name__)

#: How often a spare asks whether it was given a node's place.
POLL = 0.05
#: How often it tells the controller it is there.
HEALTH_INTERVAL = 1.0
_ENDED = (JobState.FINISHED, JobState.GIVEN_UP)


@dataclass(frozen=True, slots=True)
class Promotion:
    """The lost node's place this spare takes."""

    node_rank: int
    #: the spare's agent id, which it keeps as the node's agent.
    agent_id: str
    controller: str


def stand_by(settings: NodeSettings, controller: str, stop: StopRequest) -> Promotion | None:
    """Wait as a spare of the job until the controller promotes this launcher or the job ends.

    :raises LauncherInterrupted: when a stop signal comes first.
    :raises ControllerUnavailableError: when the controller cannot be reached within the connect timeout.
    """
    agent = settings.agent
    agent_id = f"spare-{secrets.token_hex(4)}"
    client = DLRecoverManager.for_job(
        agent.job_id,
        controller,
        role=SPARE_ROLE,
        agent_id=agent_id,
        credentials=agent.credentials,
        connect_deadline=agent.connect_timeout,
    )
    try:
        client.rejoin()
        logger.info(
            "job %s has all its nodes: standing by as spare %s (controller %s)",
            agent.job_id,
            agent_id,
            controller,
        )
        with QueryClient(controller, agent.credentials) as query:
            return _wait(client, query, agent.job_id, agent_id, controller, agent.connect_timeout, stop)
    finally:
        client.close()


def _wait(
    client: DLRecoverManager,
    query: QueryClient,
    job_id: str,
    agent_id: str,
    controller: str,
    patience: float,
    stop: StopRequest,
) -> Promotion | None:
    next_health = 0.0
    heard = time.monotonic()
    while True:
        if stop.signum is not None:
            raise LauncherInterrupted("standing by as a spare", stop.signum)
        now = time.monotonic()
        try:
            if now >= next_health:
                client.health_check()
                next_health = now + HEALTH_INTERVAL
            job = query.job(job_id)
            heard = now
        except (grpc.RpcError, TaskdError) as exc:  # the controller may be gone for good
            if now - heard > patience:
                logger.warning(
                    "spare %s: the job's controller %s has not answered for %.0fs (%s): the job is over",
                    agent_id,
                    controller,
                    patience,
                    exc,
                )
                return None
            stop.event.wait(POLL)
            continue
        me = next((a for a in job.agents if a.agent_id == agent_id), None)
        if me is not None and me.node_rank is not None:
            logger.warning("spare %s takes the place of lost node %s", agent_id, me.node_rank)
            return Promotion(me.node_rank, agent_id, controller)
        if job.state in _ENDED:
            logger.info("spare %s: job %s %s without needing it", agent_id, job_id, job.state.value)
            _farewell(client)
            return None
        stop.event.wait(POLL)


def _farewell(client: DLRecoverManager) -> None:
    try:
        client.report_agent_exit(int(Code.OK), "spare not needed", deadline=5.0)
    except TaskdError as exc:
        logger.info("could not tell the controller that this spare ends: %s", exc)
