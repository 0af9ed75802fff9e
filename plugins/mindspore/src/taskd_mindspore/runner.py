"""One msrun node under TaskD: settings from msrun's environment, controller, node agent, clean end.

Settings (read once, from msrun's environment when ``start()`` runs):

=========================  ======================================================================
what                       where from, first found wins
=========================  ======================================================================
controller address         ``TASKD_CONTROLLER`` (HOST:PORT); ``MINDX_SERVER_IP`` (the reference's,
                           port 8899 unless it carries one); none: node 0 runs an embedded
                           controller, the other nodes reach it at ``MS_SCHED_HOST``
embedded controller port   ``TASKD_CONTROLLER_PORT``; else any free port on one node and
                           ``MS_SCHED_PORT + 1`` on several (msrun's ``--master_port`` plus
                           one: known to every node, next to the scheduler's port)
job id                     ``TASKD_JOB_ID``; ``MINDX_TASK_ID``; else ``msrun-<launch>``: random on
                           one node, derived from the scheduler's host and port on several (the
                           same on every node of one launch)
node rank                  ``MS_NODE_RANK``; else global rank of local rank 0 (from ``MONITOR``)
                           divided by the local worker count (msrun does not export it)
recover-in-place           ``TASKD_RECOVER_IN_PLACE`` or the reference's
                           ``ENABLE_RESTART_FAULT_PROCESS`` = on / 1 / true
embedded policy            ``TASKD_STRATEGIES`` (comma list), ``TASKD_MAX_CYCLES``; every node's
                           agent is expected (``MS_WORKER_NUM / local workers``)
agent deadlines            ``TASKD_STOP_TIMEOUT``, ``TASKD_DUMP_GRACE``, ``TASKD_CONNECT_TIMEOUT``,
                           ``TASKD_REPORT_DEADLINE``, ``TASKD_HEALTH_INTERVAL`` seconds (defaults:
                           :class:`~taskd_core.agent.config.AgentConfig`)
scheduler grace            ``TASKD_SCHEDULER_GRACE`` seconds (default 30) the scheduler gets to
                           exit by itself after the job succeeded
controller linger          ``TASKD_LINGER`` seconds (default 60) node 0 keeps its embedded
                           controller for the other nodes' agents to finish
security                   ``TASKD_JOB_TOKEN`` (generated on one node when unset, required on several
                           unless the controller is on loopback); ``TASKD_TLS_CA``,
                           ``TASKD_TLS_CERT``, ``TASKD_TLS_KEY`` (node 0's embedded controller then
                           serves mutual TLS); ``TASKD_INSECURE`` = 1 lets it serve plaintext
                           beyond loopback (docs/security.md)
metrics                    ``TASKD_METRICS_PORT``: node 0's embedded controller serves Prometheus
                           ``/metrics`` there (default: off)
=========================  ======================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from taskd_core.controller.policy import parse_strategies
from taskd_core.errors import ConfigError
from taskd_core.launcher.node import run_node_agent
from taskd_core.launcher.settings import (
    NodeSettings,
    agent_config_from_env,
    controller_from_env,
    controller_host,
    default_job_id,
    default_of,
    embedded_port,
    env_count,
    env_seconds,
    job_credentials,
    job_id_from_env,
    launch_identity,
)
from taskd_core.models import JobPolicy, WorkerState, WorkerStatus
from taskd_core.plugins import load_adapter
from taskd_mindspore.adapter import MSRunAdapter
from taskd_mindspore.callbacks import MsrunCallbacks
from taskd_mindspore.scheduler import Scheduler

FRAME = "mindspore"
#: msrun's default ``--master_port``.
_MSRUN_MASTER_PORT = 8118
_TRUE = frozenset({"on", "1", "true", "yes"})


@dataclass(frozen=True, slots=True)
class MsrunSettings:
    """Everything one node's TaskD needs, as msrun's environment gives it (table in the module docstring)."""

    node: NodeSettings
    recover_in_place: bool
    scheduler_grace: float

    @classmethod
    def from_env(cls, env: Mapping[str, str], statuses: Mapping[int, WorkerStatus]) -> MsrunSettings:
        """Settings for this node; ``statuses`` is ``MONITOR`` before the first start (for the ranks)."""
        if not statuses:
            raise ConfigError("msrun's MONITOR reports no local workers; check --local_worker_num")
        local = len(statuses)
        if env.get("MS_NODE_RANK", "").strip():
            node_rank = env_count(env, "MS_NODE_RANK", 0)
        else:
            node_rank = min(s.global_rank for s in statuses.values()) // local
        world = env_count(env, "MS_WORKER_NUM", local)
        nnodes = max(1, -(-world // local))
        host = env.get("MS_SCHED_HOST", "127.0.0.1")
        sched_port = env_count(env, "MS_SCHED_PORT", _MSRUN_MASTER_PORT)
        policy = JobPolicy(
            max_cycles=env_count(env, "TASKD_MAX_CYCLES", default_of(JobPolicy, "max_cycles")),
            expected_agents=nnodes,
        )
        if env.get("TASKD_STRATEGIES", "").strip():
            policy = replace(
                policy, strategies=parse_strategies(env["TASKD_STRATEGIES"], key="TASKD_STRATEGIES")
            )
        explicit = controller_from_env(env)
        launch = launch_identity(nnodes, f"{host}:{sched_port}")
        credentials = job_credentials(
            env,
            tls_ca=None,
            nnodes=nnodes,
            controller_host=controller_host(explicit) if explicit else host,
            launch=launch,
        )
        agent = agent_config_from_env(
            env,
            job_id=job_id_from_env(env) or default_job_id("msrun", launch),
            node_rank=node_rank,
            credentials=credentials,
        )
        port_text = env.get("TASKD_CONTROLLER_PORT", "").strip()
        node = NodeSettings(
            agent=agent,
            nnodes=nnodes,
            master_addr=host,
            controller_port=embedded_port(
                env_count(env, "TASKD_CONTROLLER_PORT", 0) if port_text else None,
                nnodes=nnodes,
                controller=agent.controller,
                multi_node=sched_port + 1,
            ),
            metrics_port=env_count(env, "TASKD_METRICS_PORT", 0)
            if env.get("TASKD_METRICS_PORT", "").strip()
            else None,
            policy=policy,
            linger=env_seconds(env, "TASKD_LINGER", default_of(NodeSettings, "linger")),
            insecure=env.get("TASKD_INSECURE", "").strip().lower() in _TRUE,
        )
        return cls(
            node=node,
            recover_in_place=any(
                env.get(k, "").strip().lower() in _TRUE
                for k in ("TASKD_RECOVER_IN_PLACE", "ENABLE_RESTART_FAULT_PROCESS")
            ),
            scheduler_grace=env_seconds(env, "TASKD_SCHEDULER_GRACE", 30.0),
        )


def run_node(callbacks: MsrunCallbacks, env: Mapping[str, str]) -> int:
    """Run this msrun node's workers under TaskD to the end; returns the job's exit code for this node.

    Never leaves a worker or the scheduler behind, whatever the outcome.
    """
    scheduler = Scheduler()
    impl = MSRunAdapter(callbacks, scheduler=scheduler)
    before = impl.statuses()
    settings = MsrunSettings.from_env(env, before)
    impl.recover_in_place = settings.recover_in_place
    impl.stop_timeout = settings.node.agent.dispatch.stop_timeout
    impl.rank_offset = settings.node.node_rank * len(before)
    exit_code = 1
    try:
        exit_code = run_node_agent(load_adapter(FRAME, instance=impl), settings.node, who="msrun").exit_code
    finally:
        # The agent stops workers on every way out; this catches an exception before or around it.
        if any(s.pid is not None and s.state is WorkerState.RUNNING for s in impl.statuses().values()):
            impl.taskd_stop_workers(None, impl.stop_timeout)
        # A failed job's scheduler waits for workers that will never come: no grace then.
        scheduler.finish(settings.scheduler_grace if exit_code == 0 else 0.0, impl.stop_timeout)
    return exit_code
