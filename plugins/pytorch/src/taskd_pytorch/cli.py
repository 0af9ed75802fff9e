"""``taskdrun``: torchrun's command line, with TaskD recovering the workers.

One ``taskdrun`` per node, exactly like ``torchrun``, in every rendezvous form::

    taskdrun --nproc-per-node=2 train.py                                   # one node (--standalone)
    taskdrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        --rdzv-id=JOB train.py
    taskdrun --nnodes=2 --node-rank=N --master-addr=HOST --master-port=29500 --nproc-per-node=4 train.py

The node's :class:`~taskd_pytorch.elastic.TaskdElasticAgent` runs under the
core node agent, which owns the control loop: it starts the workers, learns
of a death at once, reports it and carries out what the controller decides.

taskdrun joins the first rendezvous round before anything else. Without
``--taskd-controller``, the node that round makes group rank 0 hosts an
embedded controller on a free port and publishes its address in the
rendezvous store; the other nodes read it there (so exactly one controller
serves the job, whichever form the rendezvous takes). The controller stays on
that node for the whole job: if that node is lost, the other nodes cannot
reach it and end with exit code 1 after ``--taskd-connect-timeout``.
A stop signal ends every phase: the rendezvous wait is abandoned at once.

Exit codes: 0 every worker exited 0; 1 the job was given up or failed;
128 + signal after SIGINT/SIGTERM/SIGHUP; 2 for options that cannot work, or when
torch is not installed.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, NoReturn

from taskd_core.errors import ConfigError, FrameworkMissingError, LauncherInterrupted, TaskdError
from taskd_core.forkserver.forksafe import disable_grpc_fork_handlers
from taskd_core.launcher.interrupt import StopRequest, forward_stop_signals
from taskd_core.values import LOCALHOST, is_loopback
from taskd_pytorch.adapter import require_torch

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler

logger = logging.getLogger(__name__)

#: torchrun's static rendezvous port when none is given.
_TORCHRUN_MASTER_PORT = 29500


def _apply_torchrun_defaults(args: argparse.Namespace) -> None:
    """The choices ``torch.distributed.run.run()`` makes before launching.

    (It launches too, so it is not called.)
    """
    from torch.distributed.run import parse_min_max_nnodes

    single_node = parse_min_max_nnodes(args.nnodes)[1] == 1
    if args.standalone or (
        args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None and single_node
    ):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = _TORCHRUN_MASTER_PORT


def main(argv: Sequence[str] | None = None) -> int:
    # Before anything imports grpc: torch starts workers beside the agent's gRPC threads.
    disable_grpc_fork_handlers()
    try:
        require_torch()
    except FrameworkMissingError as exc:
        print(f"taskdrun: {exc}", file=sys.stderr)
        return 2
    # Imported once torch is known to be there: the parser is torchrun's own.
    from taskd_pytorch.options import build_parser

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        logging.basicConfig(
            level=args.taskd_log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s [%(process)d]: %(message)s",
            stream=sys.stderr,
        )
    except ValueError:
        parser.error(f"--taskd-log-level: unknown level {args.taskd_log_level!r}")
    try:
        return _launch(args)
    except ConfigError as exc:
        parser.error(str(exc))
    except TaskdError as exc:
        logger.error("%s", exc)
        return 1


def console_main() -> NoReturn:
    """The ``taskdrun`` command: :func:`main`, then the process ends at once.

    Python's finalization of torch's objects takes seconds on a busy machine
    (3.6 s measured after a SIGTERM in the rendezvous, on 2 loaded cores) and
    does nothing a launcher needs once :func:`main` returned: every worker is
    reaped, the controller stopped and the logs are flushed here.
    """
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _launch(args: argparse.Namespace) -> int:
    # Imported here: `taskdrun --help` and option errors need neither the agent nor torch's launcher.
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    from torch.distributed.run import config_from_args

    from taskd_core.agent.node_agent import Outcome
    from taskd_core.forkserver.client import TORCH_PRELOAD, ForkLauncher
    from taskd_core.forkserver.lifeline import Lifeline
    from taskd_core.launcher.node import run_node_agent
    from taskd_core.plugins import load_adapter
    from taskd_pytorch.adapter import PytorchAdapter
    from taskd_pytorch.elastic import TaskdElasticAgent
    from taskd_pytorch.options import STOP_SIGNALS, TaskdOptions
    from taskd_pytorch.rendezvous import StoreBoard, run_interruptibly

    _apply_torchrun_defaults(args)
    try:
        config, entrypoint, entry_args = config_from_args(args)
    except (AssertionError, RuntimeError, ValueError) as exc:
        # torchrun reports its own option errors this way; they are option errors all the same.
        raise ConfigError(str(exc)) from exc
    if config.duplicate_stdout_filters or config.duplicate_stderr_filters:
        raise ConfigError("taskdrun does not support --duplicate-stdout-filters/--duplicate-stderr-filters")
    if config.min_nodes != config.max_nodes:
        raise ConfigError(
            f"--nnodes={args.nnodes}: taskdrun needs a fixed number of nodes (--nnodes=N); every node's "
            "agent takes part in each recovery, so the job cannot shrink or grow between restarts"
        )
    master_host, _ = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=-1)
    options = TaskdOptions.from_args(args, os.environ, nnodes=config.max_nodes, master_addr=master_host)
    stop_timeout = options.node.agent.dispatch.stop_timeout
    stop = StopRequest()
    elastic = None
    outcome = None
    lifeline = Lifeline()
    launcher = None
    forks = options.node.fork_server
    if forks.enabled and isinstance(entrypoint, str):
        # Started now, so that the server preloads torch while the rendezvous and the agent get going.
        if forks.preload is None:  # the script may import torch through its own modules: always preload it
            forks = replace(forks, preload=TORCH_PRELOAD)
        launcher = ForkLauncher([entrypoint, *entry_args], forks)
    # Installed before the rendezvous: a signal must end taskdrun in every phase, not only once workers run.
    with forward_stop_signals(stop, "taskdrun", STOP_SIGNALS):
        try:
            logger.info(
                "job %s: joining the %s rendezvous at %s for %s nodes",
                options.node.job_id,
                config.rdzv_backend,
                config.rdzv_endpoint,
                config.max_nodes,
            )
            # Connecting may wait for the store's host to come up (c10d, etcd): interruptible too.
            rdzv = run_interruptibly(
                lambda: get_rendezvous_handler(
                    RendezvousParameters(
                        backend=config.rdzv_backend,
                        endpoint=config.rdzv_endpoint,
                        run_id=config.run_id,
                        min_nodes=config.min_nodes,
                        max_nodes=config.max_nodes,
                        local_addr=config.local_addr,
                        **config.rdzv_configs,
                    )
                ),
                stop,
                "connecting to the rendezvous",
            )
            spec = WorkerSpec(
                role=config.role,
                local_world_size=config.nproc_per_node,
                rdzv_handler=rdzv,
                entrypoint=entrypoint,
                args=tuple(entry_args),
                max_restarts=options.node.policy.max_cycles,
                local_addr=config.local_addr,
                event_log_handler=config.event_log_handler,
                numa_options=config.numa_options,
                virtual_local_rank=config.virtual_local_rank,
            )
            elastic = TaskdElasticAgent(
                spec,
                config.logs_specs,  # type: ignore[arg-type]  # LaunchConfig fills it in __post_init__
                start_method=config.start_method,
                log_line_prefix_template=config.log_line_prefix_template,
                stop_timeout=stop_timeout,
                stop=stop,
                lifeline=lifeline,
                launcher=launcher,
            )
            group_rank, store = elastic.join()
            logger.info(
                "job %s node %s: %s workers of %s",
                options.node.job_id,
                group_rank,
                config.nproc_per_node,
                spec.get_entrypoint_name(),  # type: ignore[no-untyped-call]
            )
            # The rendezvous, not --node-rank, says which node this is (torch's c10d ignores --node-rank too).
            settings = replace(
                options.node,
                agent=replace(options.node.agent, node_rank=group_rank),
                master_addr=_controller_host(config.rdzv_backend, master_host, config.local_addr),
                board=StoreBoard(store, stop),
            )
            adapter = load_adapter("pytorch", instance=PytorchAdapter(elastic, in_place=options.in_place))
            outcome = run_node_agent(adapter, settings, who="taskdrun", stop=stop)
        except LauncherInterrupted as exc:
            logger.warning("taskdrun: %s", exc)
            return 128 + exc.signum
        finally:
            if elastic is not None:
                # Whatever path the agent took, no worker outlives taskdrun.
                elastic.close()
                if outcome is not None and outcome.kind is not Outcome.INTERRUPTED:
                    _close_rendezvous(rdzv)
            lifeline.close()
            if launcher is not None:
                launcher.close()
    # A stop signal that came after the agent's end (while the controller waited for the other
    # nodes) still counts.
    return 128 + stop.signum if stop.signum is not None else outcome.exit_code


def _controller_host(backend: str, rdzv_host: str, local_addr: str | None) -> str:
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


def _close_rendezvous(rdzv: RendezvousHandler) -> None:
    """Close the job's rendezvous, as torchrun does when its agent ends without a signal."""
    try:
        rdzv.shutdown()
    except Exception as exc:  # the store may have gone with the node that hosted it; nothing is left to close
        logger.info("rendezvous already gone at shutdown: %s", exc)
