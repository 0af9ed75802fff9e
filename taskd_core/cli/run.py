"""``taskd run``: launch N local workers of a command under a node agent, with fault recovery.

One ``taskd run`` per node, like ``torchrun``::

    taskd run --nproc 2 -- python train.py            # one node, embedded controller
    taskd run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc 4 -- python train.py
    taskd run --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --nproc 4 -- python train.py

Without ``--controller``, node 0 hosts the controller in-process (recovery
policy from the flags below) and the other nodes reach it at
``MASTER_ADDR:--controller-port``. SIGTERM / SIGINT stop every worker and
exit 143 / 130; otherwise the exit code is the agent's outcome (0 every worker
exited 0, 1 the job was given up or failed).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
from pathlib import Path

from taskd_core.forkserver.client import ForkLauncher
from taskd_core.forkserver.lifeline import Lifeline
from taskd_core.launcher.flags import OptionValues, add_node_options, node_settings
from taskd_core.launcher.process_adapter import ProcessAdapter
from taskd_core.launcher.spec import DEFAULT_MASTER_PORT, LaunchSpec
from taskd_core.plugins import load_adapter
from taskd_core.snapshots.keeper import Keeper
from taskd_core.values import (
    LOCALHOST,
    MAX_LOCAL_WORKERS,
    MAX_NODES,
    argtype,
    check_creatable_dir,
    check_writable_file,
    parse_count,
)

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "run",
        help="launch a command's workers on this node with fault recovery",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    topo = p.add_argument_group("workers")
    topo.add_argument(
        "--nproc",
        "--nproc-per-node",
        type=argtype(lambda text: parse_count(text, low=1, high=MAX_LOCAL_WORKERS)),
        default=1,
        help=f"workers on this node (1..{MAX_LOCAL_WORKERS})",
    )
    topo.add_argument(
        "--nnodes",
        type=argtype(lambda text: parse_count(text, low=1, high=MAX_NODES)),
        default=1,
        help=f"nodes in the job (1..{MAX_NODES})",
    )
    topo.add_argument(
        "--node-rank",
        type=argtype(lambda text: parse_count(text, high=MAX_NODES - 1)),
        default=0,
        help="this node's rank (0..nnodes-1)",
    )
    topo.add_argument(
        "--master-addr", default=LOCALHOST, help="host of rank 0 and of the embedded controller"
    )
    topo.add_argument(
        "--master-port",
        type=argtype(parse_count),
        default=None,
        help=f"workers' rendezvous port (default: free port on one node, {DEFAULT_MASTER_PORT} on several)",
    )
    topo.add_argument(
        "--log-dir",
        type=argtype(lambda text: check_creatable_dir(Path(text))),
        default=None,
        help="write each worker's output to <dir>/rank<R>/restart<K>.log",
    )
    topo.add_argument(
        "--in-place",
        action="store_true",
        help="workers are independent: a faulty one may be restarted alone (recover-in-place)",
    )
    add_node_options(p)
    p.add_argument(
        "--controller-state", default=":memory:", help="SQLite state file of the embedded controller"
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]: what each worker runs")
    p.set_defaults(func=run)


def _free_port(host: str) -> int:
    """A TCP port that is free on ``host`` right now (torchrun's standalone mode does the same)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def build_spec(args: argparse.Namespace, job_id: str, stop_timeout: float) -> LaunchSpec:
    """The :class:`LaunchSpec` the flags describe; :class:`ConfigError` for combinations that cannot work."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.master_port is None:
        one_node = args.nnodes == 1
        master_port = _free_port(LOCALHOST) if one_node else DEFAULT_MASTER_PORT
    else:
        master_port = args.master_port
    return LaunchSpec(
        command=tuple(command),
        nproc=args.nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=master_port,
        job_id=job_id,
        log_dir=args.log_dir,
        independent_workers=args.in_place,
        stop_timeout=stop_timeout,
    )


def run(args: argparse.Namespace) -> int:
    # Imported here: the agent pulls in the gRPC client, which `taskd run --help` does not need.
    from taskd_core.launcher.node import run_node_agent

    if args.controller_state != ":memory:":
        check_writable_file(Path(args.controller_state), "--controller-state")
    settings = node_settings(
        OptionValues(os.environ, args),
        launcher="taskd",
        shared=f"{args.master_addr}:{args.master_port or DEFAULT_MASTER_PORT}",
        node_rank=args.node_rank,
        nnodes=args.nnodes,
        master_addr=args.master_addr,
        controller_state=args.controller_state,
    )
    spec = build_spec(args, settings.job_id, settings.agent.dispatch.stop_timeout)
    keeper = None
    if settings.snapshots.enabled:
        # Snapshots stay on their node here: taskdrun's keepers also take the other nodes' copies.
        keeper = Keeper(
            settings.snapshots, job_id=spec.job_id, host="", token="", local_world_size=spec.nproc
        )
        spec = dataclasses.replace(spec, env={**spec.env, **keeper.worker_env()})
    try:
        # First: the fork server and every worker started afterwards are marked as this job's.
        with Lifeline() as lifeline:
            launcher = None
            if settings.fork_server.enabled:
                # Started now, so that the server preloads while the agent finds the controller.
                cwd = None if spec.cwd is None else str(spec.cwd)
                shared = {**spec.env, "TASKD_JOB_ID": spec.job_id}
                launcher = ForkLauncher(spec.command, settings.fork_server, cwd, shared)
            try:
                adapter = load_adapter("process", instance=ProcessAdapter(spec, lifeline, launcher))
                logger.info("%s workers of %s", spec.nproc, " ".join(spec.command))
                try:
                    outcome = run_node_agent(adapter, settings, "taskd run")
                finally:
                    # Workers that exited 0 may leave children behind (the agent is done with
                    # them once the leaders ended): taskd run leaves no process of the job running.
                    adapter.stop(None, spec.stop_timeout)
            finally:
                if launcher is not None:
                    launcher.close()
    finally:
        if keeper is not None:
            keeper.close()
    return outcome.exit_code
