"""One ``taskdrun`` node, from its parsed command line to its exit code, in steps.

:func:`launch` runs them in order: parse (torchrun's own choices, then the
TaskD options) → the fork server (started first, so it preloads torch
meanwhile) → the rendezvous → torch's elastic agent, which joins the first
round → the core node agent, until the job ends here. :meth:`Node.close` is
the one way out of every step: no worker outlives ``taskdrun``, and the
rendezvous is closed as torchrun closes it when its agent ends without a
signal. The stop signals are routed to every step, from before the
rendezvous to after the cleanup.

A launcher that finds its job already has all its nodes (c10d and etcd-v2:
:mod:`taskd_pytorch.membership`) joins no round: it stands by as a spare
(:mod:`taskd_pytorch.spare`) and, once the controller gives it a lost node's
place, runs that node's workers from the job's next restart on.

Imported by :mod:`taskd_pytorch.cli` once the options parsed: ``taskdrun --help``
and option errors need neither the agent nor torch's launcher.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
    c10d_rendezvous_backend,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, create_handler
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig
from torch.distributed.run import config_from_args, parse_min_max_nnodes

from taskd_core.agent.node_agent import AgentOutcome, Outcome
from taskd_core.controller.etcd_client import EtcdTls, is_etcd_url
from taskd_core.errors import ConfigError, LauncherInterrupted
from taskd_core.forkserver.client import ForkLauncher
from taskd_core.forkserver.lifeline import Lifeline
from taskd_core.launcher.interrupt import StopRequest, forward_stop_signals
from taskd_core.launcher.node import run_node_agent
from taskd_core.launcher.roster import replica_addresses
from taskd_core.launcher.settings import NodeSettings
from taskd_core.plugins import load_adapter
from taskd_core.snapshots.keeper import Keeper
from taskd_core.values import LOCALHOST, is_loopback, join_address
from taskd_pytorch.adapter import PytorchAdapter
from taskd_pytorch.elastic import TaskdElasticAgent
from taskd_pytorch.listen import job_interface
from taskd_pytorch.membership import Command, JobStore
from taskd_pytorch.options import STOP_SIGNALS, TaskdOptions
from taskd_pytorch.rendezvous import StoreBoard, run_interruptibly
from taskd_pytorch.rendezvous_reuse import ETCD_BACKEND, REUSABLE_BACKEND
from taskd_pytorch.spare import stand_by

logger = logging.getLogger(__name__)

#: torchrun's static rendezvous port when none is given.
_TORCHRUN_MASTER_PORT = 29500


def launch(args: argparse.Namespace, lifeline: Lifeline, early: ForkLauncher | None = None) -> int:
    """Run this node's share of the job; the exit code.

    :param lifeline: ends the job's processes with taskdrun (its owner closes it).
    :param early: the fork server started with taskdrun, taken over when it fits the workers.
    :raises ConfigError: for options that cannot work.
    """
    job = parse(args)
    stop = StopRequest()
    node = Node(job, stop, lifeline, early)
    # Installed before the rendezvous: a signal must end taskdrun in every phase, not only once workers run.
    with forward_stop_signals(stop, "taskdrun", STOP_SIGNALS), contextlib.closing(node):
        try:
            outcome = node.run()
        except LauncherInterrupted as exc:
            logger.warning("taskdrun: %s", exc)
            return 128 + exc.signum
    # A stop signal that came after the agent's end (while the controller waited for the other
    # nodes) still counts.
    return 128 + stop.signum if stop.signum is not None else outcome.exit_code


# --- parse ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeJob:
    """What the command line asks of this node."""

    config: LaunchConfig
    #: the script (or callable) each worker runs, and its arguments.
    entrypoint: str | Callable[..., object]
    entry_args: tuple[str, ...]
    #: the rendezvous endpoint's host.
    master_host: str
    options: TaskdOptions

    def command(self) -> Command:
        """What every node of the job, spares included, must be started with."""
        config = self.config
        return {
            "--nnodes": f"{config.min_nodes}:{config.max_nodes}",
            "--nproc-per-node": str(config.nproc_per_node),
            "--rdzv-backend": config.rdzv_backend,
            "--rdzv-endpoint": config.rdzv_endpoint,
            "--rdzv-id": config.run_id,
            "the script": str(self.entrypoint),
            "the script's arguments": " ".join(self.entry_args),
        }


def parse(args: argparse.Namespace) -> NodeJob:
    """torchrun's launch configuration and the TaskD options, checked.

    :raises ConfigError: for options torchrun refuses, or that taskdrun cannot honour.
    """
    _apply_torchrun_defaults(args)
    try:
        config, entrypoint, entry_args = config_from_args(args)
    except (AssertionError, RuntimeError, ValueError) as exc:
        # torchrun reports its own option errors this way; they are option errors all the same.
        raise ConfigError(str(exc)) from exc
    if config.duplicate_stdout_filters or config.duplicate_stderr_filters:
        raise ConfigError("taskdrun does not support --duplicate-stdout-filters/--duplicate-stderr-filters")
    if config.min_nodes != config.max_nodes and config.rdzv_backend not in ELASTIC_BACKENDS:
        raise ConfigError(
            f"--nnodes={args.nnodes} with --rdzv-backend={config.rdzv_backend}: a job whose number of nodes "
            f"may change needs a rendezvous with rounds; use --rdzv-backend={' or '.join(ELASTIC_BACKENDS)}"
            + (
                " (static is the default when no --rdzv-backend is given)"
                if config.rdzv_backend == "static"
                else ""
            )
        )
    master_host, _ = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=-1)
    options = TaskdOptions.from_args(args, os.environ, nnodes=config.max_nodes, master_addr=master_host)
    if not options.node.agent.controller and config.rdzv_backend in ETCD_BACKENDS:
        # No node is special: each runs a replica of the job's controller in the rendezvous' etcd.
        url, tls = replica_state(config)
        options = replace(options, node=replace(options.node, controller_state=url, etcd_tls=tls))
    return NodeJob(config, entrypoint, tuple(entry_args), master_host, options)


#: torch's rendezvous backends whose rounds TaskD keeps across restarts (a job of MIN:MAX nodes needs them).
ELASTIC_BACKENDS = (REUSABLE_BACKEND, ETCD_BACKEND)
#: torch's rendezvous backends that keep the rendezvous in etcd (and so can keep the controller there).
ETCD_BACKENDS = ("etcd", "etcd-v2")
#: Where the job's controller state lives in the rendezvous' etcd; the run id follows.
STATE_PREFIX = "/taskd/rdzv/"
#: The rendezvous options naming etcd's TLS files, per backend: (CA, client certificate, its key).
_ETCD_TLS_CONF = {"etcd-v2": ("ca_cert", "ssl_cert", "ssl_cert_key"), "etcd": ("cacert", "cert", "key")}


def replica_state(config: LaunchConfig) -> tuple[str, EtcdTls | None]:
    """The ``etcd://`` state of the job's controller replicas, and its TLS files.

    The etcd is the rendezvous' own (``--rdzv-endpoint``, etcd's port 2379 by
    default, as torch reads it), over TLS when ``--rdzv-conf protocol=https``
    says so, with the files torch's etcd client is given; the prefix is the
    run id's, so every node of the job derives the same one and no other job does.
    """
    host, port = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=2379)
    conf = {key: str(value) for key, value in config.rdzv_configs.items()}
    tls = None
    if conf.get("protocol", "http").strip().lower() == "https":
        ca, cert, key = (conf.get(name, "") for name in _ETCD_TLS_CONF[config.rdzv_backend])
        tls = EtcdTls(ca=ca, cert=cert, key=key)
    prefix = STATE_PREFIX + urllib.parse.quote(config.run_id, safe="")
    return f"etcd://{join_address(host, port)}{prefix}", tls


def _apply_torchrun_defaults(args: argparse.Namespace) -> None:
    """The choices ``torch.distributed.run.run()`` makes before launching.

    (It launches too, so it is not called.)
    """
    single_node = parse_min_max_nnodes(args.nnodes)[1] == 1
    if args.standalone or (
        args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None and single_node
    ):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = _TORCHRUN_MASTER_PORT


# --- the node's parts, started in order and closed on one path ------------------------------


class Node:
    """One taskdrun node's fork server, rendezvous, elastic agent and node agent.

    The fork server starts with the node, so that it preloads torch while the
    rendezvous and the agent get going; :meth:`run` starts the rest.
    """

    def __init__(
        self, job: NodeJob, stop: StopRequest, lifeline: Lifeline, early: ForkLauncher | None = None
    ) -> None:
        self.job = job
        self.stop = stop
        self.lifeline = lifeline
        self.launcher = fork_launcher(job, early)
        self.rendezvous: RendezvousHandler | None = None
        self.members: JobStore | None = None
        self.elastic: TaskdElasticAgent | None = None
        self.keeper: Keeper | None = None
        self.outcome: AgentOutcome | None = None
        #: this launcher came after the job had all its nodes (a spare, until it is given a node's place).
        self.spare = False

    def run(self) -> AgentOutcome:
        """Join the job and run its workers here until the job ends on this node.

        :raises LauncherInterrupted: when the stop request fires before the node agent runs.
        """
        self.rendezvous, self.members = connect_rendezvous(self.job, self.stop)
        self.keeper = snapshot_keeper(self.job)
        self.elastic = elastic_agent(
            self.job, self.rendezvous, self.stop, self.lifeline, self.launcher, self.keeper, self.members
        )
        if self.members is not None and self.members.has_all_nodes():
            self.spare = True
            self.outcome = run_spare(self.job, self.members, self.elastic, self.stop)
        else:
            self.outcome = run_agent(self.job, self.elastic, self.stop, self.members)
        return self.outcome

    def close(self) -> None:
        """Whatever path the run took, no worker outlives taskdrun."""
        if self.elastic is not None:
            self.elastic.close()
        interrupted = self.outcome is None or self.outcome.kind is Outcome.INTERRUPTED
        # A spare never joined the rendezvous: closing it would end the job's.
        if self.rendezvous is not None and not interrupted and not self.spare:
            close_rendezvous(self.rendezvous)
        if self.keeper is not None:
            self.keeper.close()
        if self.launcher is not None:
            self.launcher.close()


def fork_launcher(job: NodeJob, early: ForkLauncher | None = None) -> ForkLauncher | None:
    """The fork server that starts this node's workers warm, if enabled and the entrypoint is a script.

    ``early``, started with taskdrun before torch's parser ran, is taken over when it fits these
    workers (same settings, same startup environment), else closed.
    """
    forks = job.options.node.fork_server
    launcher = None
    if forks.enabled and isinstance(job.entrypoint, str):
        if early is not None and early.settings == forks and early.fits(os.environ):
            launcher = early
        else:
            # The script may import torch through its own modules: always preload it.
            launcher = ForkLauncher([job.entrypoint, *job.entry_args], forks, imports_torch=True)
    if early is not None and early is not launcher:
        logger.info("the fork server started with taskdrun does not fit these workers: starting another")
        early.close()
    return launcher


def connect_rendezvous(job: NodeJob, stop: StopRequest) -> tuple[RendezvousHandler, JobStore | None]:
    """The job's rendezvous handler and, with c10d, the job's keys in its store.

    Connecting may wait for the store's host (c10d, etcd), interruptibly. The
    c10d handler is built as torch's registry builds it, keeping its store.
    """
    config = job.config
    logger.info(
        "job %s: joining the %s rendezvous at %s for %s nodes",
        job.options.node.job_id,
        config.rdzv_backend,
        config.rdzv_endpoint,
        config.max_nodes,
    )
    if config.rdzv_backend == "c10d" and config.max_nodes > 1:
        logger.info(
            "the c10d rendezvous store lives in the launcher on %s, as with torchrun: the job does not "
            "survive the loss of that node; to survive any node's loss, rendezvous through etcd "
            "(--rdzv-backend=etcd-v2 --rdzv-endpoint=ETCD_HOST:2379; see docs/deploy.md)",
            config.rdzv_endpoint,
        )
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )

    def connect() -> tuple[RendezvousHandler, JobStore | None]:
        backend: RendezvousBackend
        if config.rdzv_backend == REUSABLE_BACKEND:
            backend, store = c10d_rendezvous_backend.create_backend(params)
        elif config.rdzv_backend == ETCD_BACKEND:
            # Imported here: torch's etcd backend needs python-etcd, which only its users install.
            from torch.distributed.elastic.rendezvous import etcd_rendezvous_backend

            backend, store = etcd_rendezvous_backend.create_backend(params)
        else:
            return get_rendezvous_handler(params), None
        return create_handler(store, backend, params), JobStore(store, config.run_id)

    return run_interruptibly(connect, stop, "connecting to the rendezvous")


def snapshot_keeper(job: NodeJob) -> Keeper | None:
    """The node's keeper of memory snapshots (``taskd_pytorch.snapshot``), unless turned off."""
    node = job.options.node
    if not node.snapshots.enabled:
        return None
    return Keeper(
        node.snapshots,
        job_id=node.job_id,
        host=store_host(job.master_host, job.config.local_addr),
        token=node.agent.credentials.token,
        local_world_size=job.config.nproc_per_node,
    )


def elastic_agent(
    job: NodeJob,
    rendezvous: RendezvousHandler,
    stop: StopRequest,
    lifeline: Lifeline,
    launcher: ForkLauncher | None,
    keeper: Keeper | None = None,
    members: JobStore | None = None,
) -> TaskdElasticAgent:
    """torch's elastic agent for this node's workers (it starts none yet)."""
    config = job.config
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        rdzv_handler=rendezvous,
        entrypoint=job.entrypoint,
        args=job.entry_args,
        max_restarts=job.options.node.policy.max_cycles,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
        virtual_local_rank=config.virtual_local_rank,
    )
    return TaskdElasticAgent(
        spec,
        config.logs_specs,  # type: ignore[arg-type]  # LaunchConfig fills it in __post_init__
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        stop_timeout=job.options.node.agent.dispatch.stop_timeout,
        stop=stop,
        lifeline=lifeline,
        launcher=launcher,
        store_host=store_host(job.master_host, config.local_addr),
        job_token=job.options.node.agent.credentials.token,
        keeper=keeper,
        members=members,
    )


def store_host(rdzv_host: str, local_addr: str | None) -> str:
    """Where the workers' stores listen and every worker reaches them (see :mod:`taskd_pytorch.listen`).

    ``--local-addr`` when given, else the address by which this host reaches
    the rendezvous: loopback when the whole job runs on this host.
    """
    if local_addr:
        return local_addr
    try:
        return job_interface(rdzv_host)
    except OSError as exc:
        raise ConfigError(f"no route from this host to the rendezvous host {rdzv_host!r}: {exc}") from exc


def run_agent(
    job: NodeJob, elastic: TaskdElasticAgent, stop: StopRequest, members: JobStore | None = None
) -> AgentOutcome:
    """Join the first rendezvous round, then run the node agent over ``elastic`` until the job ends here."""
    group_rank, store = elastic.join()
    nodes = elastic.get_worker_group().group_world_size or job.config.max_nodes
    if members is not None:
        # Every round (and a spare) reads the controller's address from the job's own keys.
        store = members.store
        if group_rank == 0:
            members.formed(job.command(), nodes)
    logger.info(
        "job %s node %s: %s workers of %s (%s nodes)",
        job.options.node.job_id,
        group_rank,
        job.config.nproc_per_node,
        elastic.get_worker_group().spec.get_entrypoint_name(),  # type: ignore[no-untyped-call]
        nodes,
    )
    config = job.config
    # The rendezvous, not --node-rank, says which node this is (torch's c10d ignores --node-rank too).
    settings = replace(
        job_nodes(job, nodes),
        agent=replace(job.options.node.agent, node_rank=group_rank),
        master_addr=controller_host(config.rdzv_backend, job.master_host, config.local_addr),
        board=StoreBoard(store, stop),
    )
    adapter = load_adapter("pytorch", instance=PytorchAdapter(elastic, in_place=job.options.in_place))
    return run_node_agent(adapter, settings, who="taskdrun", stop=stop)


def job_nodes(job: NodeJob, nodes: int) -> NodeSettings:
    """The node's settings for a job whose first round admitted ``nodes`` nodes (MIN to MAX).

    Every one of them must answer each cycle; a job of ``--nnodes=MIN:MAX`` may shrink down to MIN
    and grow up to MAX.
    Every node derives the same policy (the etcd-v2 controller replicas must agree on it).
    """
    config, settings = job.config, job.options.node
    elastic = config.min_nodes != config.max_nodes
    policy = replace(
        settings.policy,
        expected_agents=nodes,
        min_nodes=config.min_nodes if elastic else 0,
        max_nodes=config.max_nodes if elastic else 0,
    )
    return replace(settings, nnodes=nodes, policy=policy)


def run_spare(job: NodeJob, members: JobStore, elastic: TaskdElasticAgent, stop: StopRequest) -> AgentOutcome:
    """Stand by as a spare of the job; once given a lost node's place, run that node's workers.

    :raises ConfigError: when this launcher's command line is not the job's.
    """
    members.check_command(job.command())
    settings = job_nodes(job, members.nodes())
    replicated = not settings.agent.controller and is_etcd_url(settings.controller_state)
    if replicated:
        # The job's controller replicas announce themselves in etcd; this spare runs one of its own
        # only once it is a node of the job (below: the node agent's start, as on every node).
        controller = replica_addresses(settings, settings.agent.connect_timeout)
    else:
        controller = settings.agent.controller or StoreBoard(members.store, stop).lookup(
            settings.agent.connect_timeout
        )
    promotion = stand_by(settings, controller, stop)
    if promotion is None:
        return AgentOutcome(Outcome.SUCCEEDED, 0, "spare not needed")
    elastic.stand_in(promotion.node_rank)
    seat = replace(
        settings,
        agent=replace(
            settings.agent,
            node_rank=promotion.node_rank,
            agent_id=promotion.agent_id,
            controller="" if replicated else promotion.controller,
        ),
        master_addr=controller_host(job.config.rdzv_backend, job.master_host, job.config.local_addr),
    )
    adapter = load_adapter("pytorch", instance=PytorchAdapter(elastic, in_place=job.options.in_place))
    return run_node_agent(adapter, seat, who="taskdrun", stop=stop)


def controller_host(backend: str, rdzv_host: str, local_addr: str | None) -> str:
    """The address the other nodes reach this node's embedded controller at, should it host one.

    The same choice torch makes for the workers' ``MASTER_ADDR``: the master
    address in the static form (rank 0 is that host), else ``--local-addr`` or
    this host's FQDN; loopback when the rendezvous itself is on loopback (every
    node runs on this machine).
    """
    if backend == "static":
        return rdzv_host
    if is_loopback(rdzv_host):
        return LOCALHOST
    return local_addr or socket.getfqdn()


def close_rendezvous(rendezvous: RendezvousHandler) -> None:
    """Close the job's rendezvous, as torchrun does when its agent ends without a signal."""
    try:
        rendezvous.shutdown()
    except Exception as exc:  # the store may have gone with the node that hosted it; nothing is left to close
        logger.info("rendezvous already gone at shutdown: %s", exc)
