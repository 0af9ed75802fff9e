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
import logging
import os
import signal
import socket
from pathlib import Path

from taskd_core.controller.policy import parse_strategies
from taskd_core.errors import ConfigError
from taskd_core.launcher.embedded import DEFAULT_CONTROLLER_PORT, parse_address
from taskd_core.launcher.process_adapter import ProcessAdapter
from taskd_core.launcher.spec import DEFAULT_MASTER_PORT, LaunchSpec
from taskd_core.models import JobPolicy
from taskd_core.plugins import load_adapter

logger = logging.getLogger(__name__)

_DEFAULTS = JobPolicy()


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, not {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, not {text}")
    return value


def _signal(text: str) -> signal.Signals:
    """A signal by name (``USR1``, ``SIGUSR1``) or number."""
    name = text.strip().upper()
    try:
        return (
            signal.Signals(int(name))
            if name.isdigit()
            else signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
        )
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown signal {text!r}") from None


def _address(text: str) -> str:
    try:
        parse_address(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _reference_controller() -> str | None:
    """The controller the reference's environment names: ClusterD at ``$MINDX_SERVER_IP``, fixed port."""
    host = os.environ.get("MINDX_SERVER_IP")
    return f"{host}:{DEFAULT_CONTROLLER_PORT}" if host else None


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "run",
        help="launch a command's workers on this node with fault recovery",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    topo = p.add_argument_group("workers")
    topo.add_argument(
        "--nproc", "--nproc-per-node", type=_positive_int, default=1, help="workers on this node"
    )
    topo.add_argument("--nnodes", type=_positive_int, default=1, help="nodes in the job")
    topo.add_argument("--node-rank", type=_non_negative_int, default=0, help="this node's rank (0..nnodes-1)")
    topo.add_argument(
        "--master-addr", default="127.0.0.1", help="host of rank 0 and of the embedded controller"
    )
    topo.add_argument(
        "--master-port",
        type=int,
        default=None,
        help=f"workers' rendezvous port (default: free port on one node, {DEFAULT_MASTER_PORT} on several)",
    )
    topo.add_argument(
        "--job-id",
        default=os.environ.get("TASKD_JOB_ID") or os.environ.get("MINDX_TASK_ID") or "default",
        help="job id, the same on every node (default: $TASKD_JOB_ID, $MINDX_TASK_ID or 'default')",
    )
    topo.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="write each worker's output to <dir>/rank<R>/restart<K>.log",
    )
    topo.add_argument(
        "--in-place",
        action="store_true",
        help="workers are independent: a faulty one may be restarted alone (recover-in-place)",
    )
    ctl = p.add_argument_group("controller")
    ctl.add_argument(
        "--controller",
        type=_address,
        default=_reference_controller(),
        help="HOST:PORT of a running controller (default: $MINDX_SERVER_IP:8899 if set, as in ClusterD)",
    )
    ctl.add_argument(
        "--controller-port",
        type=int,
        default=None,
        help=f"port of node 0's embedded controller "
        f"(default: any free port on one node, {DEFAULT_CONTROLLER_PORT} on several)",
    )
    ctl.add_argument(
        "--controller-state", default=":memory:", help="SQLite state file of the embedded controller"
    )
    ctl.add_argument(
        "--linger",
        type=_seconds,
        default=60.0,
        help="node 0 with the embedded controller: seconds to wait for the other nodes' agents to end",
    )
    ctl.add_argument(
        "--connect-timeout",
        type=_seconds,
        default=60.0,
        help="seconds to keep trying to reach the controller",
    )
    pol = p.add_argument_group("recovery policy (embedded controller only)")
    pol.add_argument(
        "--strategies",
        default=None,
        help="allowed strategies, comma separated (default: "
        + ",".join(s.value for s in _DEFAULTS.strategies)
        + ")",
    )
    pol.add_argument(
        "--max-cycles",
        type=_non_negative_int,
        default=_DEFAULTS.max_cycles,
        help="recovery cycles before giving up",
    )
    pol.add_argument(
        "--report-timeout",
        type=_seconds,
        default=_DEFAULTS.report_timeout,
        help="deadline of each wait for the agents",
    )
    pol.add_argument(
        "--flush-seconds",
        type=_seconds,
        default=_DEFAULTS.flush_seconds,
        help="window collecting faults that arrive together",
    )
    act = p.add_argument_group("stopping")
    act.add_argument(
        "--stop-timeout", type=_seconds, default=30.0, help="seconds between SIGTERM and SIGKILL"
    )
    act.add_argument(
        "--dump-signal",
        type=_signal,
        default=signal.SIGUSR1,
        help="signal asking workers to save (default: SIGUSR1)",
    )
    act.add_argument("--dump-grace", type=_seconds, default=30.0, help="seconds workers get to save on dump")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]: what each worker runs")
    p.set_defaults(func=run)


def _free_port(host: str) -> int:
    """A TCP port that is free on ``host`` right now (torchrun's standalone mode does the same)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def build_spec(args: argparse.Namespace) -> LaunchSpec:
    """The :class:`LaunchSpec` the flags describe; :class:`ConfigError` for combinations that cannot work."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.master_port is None:
        one_node = args.nnodes == 1
        master_port = _free_port("127.0.0.1") if one_node else DEFAULT_MASTER_PORT
    else:
        master_port = args.master_port
    return LaunchSpec(
        command=tuple(command),
        nproc=args.nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=master_port,
        job_id=args.job_id,
        log_dir=args.log_dir,
        independent_workers=args.in_place,
        stop_timeout=args.stop_timeout,
    )


def build_policy(args: argparse.Namespace, nnodes: int) -> JobPolicy:
    strategies = parse_strategies(args.strategies) if args.strategies is not None else _DEFAULTS.strategies
    if not strategies:
        raise ConfigError("--strategies: name at least one strategy")
    return JobPolicy(
        strategies=strategies,
        report_timeout=args.report_timeout,
        flush_seconds=args.flush_seconds,
        max_cycles=args.max_cycles,
        # Every node's agent must answer before a cycle step ends.
        expected_agents=nnodes,
    )


def run(args: argparse.Namespace) -> int:
    # Imported here: the agent pulls in the gRPC client, which `taskd run --help` does not need.
    from taskd_core.launcher.node import NodeSettings, run_node_agent

    spec = build_spec(args)
    if args.controller_port is None:
        controller_port = 0 if spec.nnodes == 1 else DEFAULT_CONTROLLER_PORT
    else:
        controller_port = args.controller_port
    settings = NodeSettings(
        job_id=spec.job_id,
        node_rank=spec.node_rank,
        nnodes=spec.nnodes,
        master_addr=spec.master_addr,
        controller=args.controller,
        controller_port=controller_port,
        controller_state=args.controller_state,
        policy=build_policy(args, spec.nnodes),
        stop_timeout=args.stop_timeout,
        dump_signal=args.dump_signal,
        dump_grace=args.dump_grace,
        connect_timeout=args.connect_timeout,
        linger=args.linger,
    )
    adapter = load_adapter("process", instance=ProcessAdapter(spec))
    logger.info("%s workers of %s", spec.nproc, " ".join(spec.command))
    try:
        outcome = run_node_agent(adapter, settings, "taskd run")
    finally:
        # Workers that exited 0 may leave children behind (the agent is done with
        # them once the leaders ended): taskd run leaves no process of the job running.
        adapter.stop(None, args.stop_timeout)
    return outcome.exit_code
