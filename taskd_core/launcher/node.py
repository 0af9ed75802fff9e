"""One node of a job under TaskD: the controller rule, the node agent and its signals, in one call.

Every launcher (``taskd run``, the msrun plugin, ``taskdrun``) ends the same
way once it has an adapter for its workers: find the controller (embedding it
on node 0 when none is given), run a :class:`~taskd_core.agent.node_agent.NodeAgent`
with SIGTERM / SIGINT forwarded to it, and on node 0 keep the embedded
controller up until the other nodes' agents have ended. :func:`run_node_agent`
is that sequence; the launcher only adds its own cleanup around it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from taskd_core.agent.node_agent import AgentOutcome, NodeAgent, Outcome
from taskd_core.client.query import QueryClient
from taskd_core.errors import ControllerUnavailableError, TaskdError
from taskd_core.launcher.embedded import controller_address
from taskd_core.launcher.interrupt import StopRequest, forward_stop_signals
from taskd_core.launcher.settings import NodeSettings
from taskd_core.models import SPARE_ROLE, AgentStatus, Credentials, JobState
from taskd_core.plugins import Adapter

logger = logging.getLogger(__name__)

#: How often :func:`wait_for_agents` asks the controller again.
_AGENT_POLL = 0.2
#: Seconds since its last HealthCheck within which a spare counts as standing by; an agent
#: without a signal stream silent for longer once its job ended is gone (its node was lost).
SPARE_FRESH = 5.0
_ENDED = (JobState.FINISHED, JobState.GIVEN_UP)


def run_node_agent(
    adapter: Adapter, settings: NodeSettings, who: str = "launcher", stop: StopRequest | None = None
) -> AgentOutcome:
    """Run this node's workers through ``adapter`` under a node agent until the job ends here.

    Blocks; returns the agent's outcome (``exit_code`` is the launcher's exit
    code). Stopping the workers on every way out stays the caller's job, in a
    ``finally`` around this call: only the caller knows what else to clean.

    :param stop: the caller's stop request, when it already forwards the stop
        signals itself (then no handler is installed here); the agent listens to it.

    :raises ConfigError: for a controller address or port that cannot work,
        or an embedded controller that cannot bind.
    """
    with controller_address(
        settings.agent.controller or None,
        node_rank=settings.node_rank,
        master_addr=settings.master_addr,
        controller_port=settings.controller_port,
        policy=settings.policy,
        state=settings.controller_state,
        credentials=settings.agent.credentials,
        insecure=settings.insecure,
        metrics_port=settings.metrics_port,
        board=settings.board,
        lookup_timeout=settings.agent.connect_timeout,
        nnodes=settings.nnodes,
        job_id=settings.job_id,
        etcd_tls=settings.etcd_tls,
        agent_id=settings.agent.identity,
    ) as endpoint:
        agent = NodeAgent(replace(settings.agent, controller=endpoint.address), adapter, endpoint.leader)
        logger.info(
            "%s: job %s node %s/%s, adapter %s, controller %s%s",
            who,
            settings.job_id,
            settings.node_rank,
            settings.nnodes,
            adapter.name,
            endpoint.address,
            " (embedded)" if endpoint.embedded else "",
        )
        if stop is None:
            with forward_stop_signals(agent.shutdown, who, settings.stop_signals):
                outcome = agent.run()
        else:
            stop.listen(agent.shutdown)
            outcome = agent.run()
        if endpoint.embedded and settings.nnodes > 1 and outcome.kind is not Outcome.INTERRUPTED:
            # The other nodes' agents may still be finishing; they need this controller until they end.
            wait_for_agents(
                endpoint.address,
                settings.job_id,
                settings.nnodes,
                settings.linger,
                settings.agent.credentials,
                stop.event if stop else None,
            )
    return outcome


def wait_for_agents(
    address: str,
    job_id: str,
    agents: int,
    timeout: float,
    credentials: Credentials | None = None,
    stop: threading.Event | None = None,
) -> bool:
    """Wait until ``agents`` agents of ``job_id`` have reported their end to the controller at ``address``.

    Node 0 calls this before its embedded controller stops with it: an agent
    on another node that is still finishing would otherwise lose the
    controller and could not report. The spares standing by (heard from within
    :data:`SPARE_FRESH` seconds) must have seen the job end too, and so must every
    node still running (holding its signal stream, heard from as recently): a node
    the job grew by (``--nnodes=MIN:MAX``) is one more than ``agents``. A node lost for
    good (no signal stream, silent as long, the job over) is not waited for:
    the controller knows it will never report. True when all
    have ended, False at the deadline (logged; the caller goes on regardless)
    or as soon as ``stop`` is set.
    """
    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        try:
            with QueryClient(address, credentials or Credentials(), timeout=max(remaining, 0.1)) as client:
                job = client.job(job_id)
            spares = [a for a in job.agents if a.role == SPARE_ROLE and a.node_rank is None]
            nodes = [a for a in job.agents if a not in spares]
            ended = _ended(nodes, agents, job.state in _ENDED)
            # A node the job grew by (``--nnodes=MIN:MAX``) is one more than the first round's count.
            running = [a for a in nodes if a.exit_code is None and a.subscribed and _fresh(a)]
            standing_by = [a for a in spares if a.exit_code is None and _fresh(a)]
        except ControllerUnavailableError as exc:
            logger.warning("cannot ask the controller about job %s: %s", job_id, exc)
            return False
        except TaskdError:
            # The job is not registered (yet): none of its agents has ended.
            ended, standing_by, running = 0, [], []
        if ended >= agents and not standing_by and not running:
            return True
        if remaining <= 0:
            logger.warning(
                "only %s of %s agents of job %s ended within %.1fs", ended, agents, job_id, timeout
            )
            return False
        if stop.wait(min(_AGENT_POLL, remaining)):
            logger.warning("stopped waiting for the other agents of job %s: the launcher is stopping", job_id)
            return False


def _fresh(agent: AgentStatus) -> bool:
    """Heard from within :data:`SPARE_FRESH` seconds (agents send a HealthCheck every second)."""
    return time.time() - agent.last_seen < SPARE_FRESH


def _ended(nodes: list[AgentStatus], agents: int, over: bool) -> int:
    """How many of the job's nodes ended; all ``agents`` when the job is over and the only ones
    that did not report their end are gone (no signal stream, silent for :data:`SPARE_FRESH`
    seconds): a lost node never reports, and waiting out the linger for it changes nothing."""
    ended = sum(1 for a in nodes if a.exit_code is not None)
    silent = [a for a in nodes if a.exit_code is None]
    gone = over and all(not a.subscribed and time.time() - a.last_seen >= SPARE_FRESH for a in silent)
    return agents if gone and len(nodes) >= agents else ended
