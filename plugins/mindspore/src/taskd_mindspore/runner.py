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
embedded policy            ``TASKD_STRATEGIES`` (comma list), ``TASKD_MAX_CYCLES``,
                           ``TASKD_CYCLE_WINDOW`` (refused with an explicit controller, whose policy
                           it is); every node's agent is expected (``MS_WORKER_NUM / local workers``)
every shared setting       ``TASKD_<NAME>`` for each flag ``taskd run --<name>`` has
                           (:data:`taskd_core.launcher.flags.OPTIONS`): ``TASKD_STOP_TIMEOUT``,
                           ``TASKD_DUMP_GRACE``, ``TASKD_CONNECT_TIMEOUT``, ``TASKD_REPORT_DEADLINE``,
                           ``TASKD_HEALTH_INTERVAL``, ``TASKD_HANG_*``, ``TASKD_REPORT_TIMEOUT`` ...
                           (defaults: the settings' own types, as for ``taskd run``)
scheduler grace            ``TASKD_SCHEDULER_GRACE`` seconds (default 30) the scheduler gets to
                           exit by itself after the job succeeded
controller linger          ``TASKD_LINGER`` seconds (default 60) node 0 keeps its embedded
                           controller for the other nodes' agents to finish
security                   ``TASKD_JOB_TOKEN`` (generated on one node when unset, required on several
                           unless the controller is on loopback); ``TASKD_TLS_CA``,
                           ``TASKD_TLS_CERT``, ``TASKD_TLS_KEY`` (node 0's embedded controller then
                           serves mutual TLS); ``TASKD_INSECURE`` = 1 (on, true, yes) lets it serve
                           plaintext beyond loopback (docs/security.md)
metrics                    ``TASKD_METRICS_PORT``: node 0's embedded controller serves Prometheus
                           ``/metrics`` there (default: off)
=========================  ======================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from taskd_core.errors import ConfigError
from taskd_core.launcher.flags import OptionValues, node_settings
from taskd_core.launcher.node import run_node_agent
from taskd_core.launcher.settings import NodeSettings
from taskd_core.models import WorkerState, WorkerStatus
from taskd_core.plugins import load_adapter
from taskd_core.values import LOCALHOST, MAX_NODES, parse_count, parse_seconds, parse_switch
from taskd_mindspore.adapter import MSRunAdapter
from taskd_mindspore.callbacks import MsrunCallbacks
from taskd_mindspore.scheduler import Scheduler
from taskd_mindspore.warm import WarmStarts

FRAME = "mindspore"
#: msrun's default ``--master_port``.
_MSRUN_MASTER_PORT = 8118
#: seconds the scheduler gets to exit by itself after the job succeeded (``TASKD_SCHEDULER_GRACE``).
_SCHEDULER_GRACE = 30.0


def _count(env: Mapping[str, str], key: str, default: int, *, high: int) -> int:
    text = env.get(key, "").strip()
    return parse_count(text, key, high=high) if text else default


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
            node_rank = _count(env, "MS_NODE_RANK", 0, high=MAX_NODES - 1)
        else:
            node_rank = min(s.global_rank for s in statuses.values()) // local
        world = _count(env, "MS_WORKER_NUM", local, high=MAX_NODES * local)
        nnodes = max(1, -(-world // local))
        host = env.get("MS_SCHED_HOST", "").strip() or LOCALHOST
        sched_port = _count(env, "MS_SCHED_PORT", _MSRUN_MASTER_PORT, high=65534)
        node = node_settings(
            OptionValues(env),
            launcher="msrun",
            shared=f"{host}:{sched_port}",
            node_rank=node_rank,
            nnodes=nnodes,
            master_addr=host,
            # msrun's --master_port plus one: known to every node, next to the scheduler's port.
            multi_node_port=sched_port + 1,
        )
        grace = env.get("TASKD_SCHEDULER_GRACE", "").strip()
        return cls(
            node=node,
            recover_in_place=any(
                parse_switch(env[k], k)
                for k in ("TASKD_RECOVER_IN_PLACE", "ENABLE_RESTART_FAULT_PROCESS")
                if env.get(k, "").strip()
            ),
            scheduler_grace=parse_seconds(grace, "TASKD_SCHEDULER_GRACE") if grace else _SCHEDULER_GRACE,
        )


def run_node(callbacks: MsrunCallbacks, env: Mapping[str, str]) -> int:
    """Run this msrun node's workers under TaskD to the end; returns the job's exit code for this node.

    Workers (and the schedulers TaskD starts) are forked from a MindSpore fork
    server where they can be (:mod:`taskd_mindspore.warm`). Never leaves a
    worker, the scheduler or the fork server behind, whatever the outcome.
    """
    warm = WarmStarts.install(callbacks, env)
    try:
        return _run_node(callbacks, env, warm)
    finally:
        if warm is not None:
            warm.close()


def _run_node(callbacks: MsrunCallbacks, env: Mapping[str, str], warm: WarmStarts | None) -> int:
    scheduler = Scheduler(start=None if warm is None else warm.start_scheduler)
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
