"""``taskdrun``'s command line: torchrun's own parser plus a ``--taskd-*`` group.

The parser is ``torch.distributed.run.get_args_parser()`` itself, so every
torchrun option keeps its name, default and help; TaskD adds its options
under a prefix that cannot collide with torchrun's. Values are checked by the
parser, so a bad one ends with argparse's usage message and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from torch.distributed.run import get_args_parser

from taskd_core.controller.policy import parse_strategies
from taskd_core.errors import ConfigError
from taskd_core.launcher.embedded import DEFAULT_CONTROLLER_PORT, parse_address
from taskd_core.models import JobPolicy, Strategy

_POLICY = JobPolicy()
T = TypeVar("T")


def _arg(convert: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse ``type=`` from a converter that raises ``ValueError``/``ConfigError`` with the reason."""

    def checked(text: str) -> T:
        try:
            return convert(text)
        except (ValueError, ConfigError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return checked


def _bounded(parse: Callable[[str], T], rule: str, ok: Callable[[T], bool]) -> Callable[[str], T]:
    """Parse with ``parse`` and accept only values for which ``ok`` holds."""

    def convert(text: str) -> T:
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise ValueError(f"{text!r} is not {rule}")
        return value

    return _arg(convert)


def _address(text: str) -> str:
    parse_address(text)
    return text


def _strategies(text: str) -> tuple[Strategy, ...]:
    chosen = parse_strategies(text)
    if not chosen:
        raise ValueError("name at least one strategy")
    return chosen


_COUNT = _bounded(int, "a whole number >= 0", lambda v: v >= 0)
_SECONDS = _bounded(float, "a finite number of seconds > 0", lambda v: v > 0 and math.isfinite(v))
_FLUSH = _bounded(float, "a finite number of seconds >= 0", lambda v: v >= 0 and math.isfinite(v))
_PORT = _bounded(int, "a TCP port (0..65535)", lambda v: 0 <= v <= 65535)


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser, renamed ``taskdrun``, with the TaskD options added."""
    parser = get_args_parser()
    parser.prog = "taskdrun"
    parser.description = (
        "torchrun with process-level fault recovery by TaskD: a controller negotiates each recovery and "
        "this node's agent stops and restarts exactly the workers that need it. "
        + (parser.description or "")
    )
    # torchrun stops after --max-restarts failures; here it is the controller's cycle budget.
    parser.set_defaults(max_restarts=_POLICY.max_cycles)
    g = parser.add_argument_group("TaskD fault recovery")
    g.add_argument(
        "--taskd-controller", type=_arg(_address), default=os.environ.get("TASKD_CONTROLLER"), metavar="HOST:PORT",
        help="a running TaskD controller (default: $TASKD_CONTROLLER; without one, node 0 hosts an embedded "
        "controller and the other nodes reach it at the master address)",
    )
    g.add_argument(
        "--taskd-controller-port", type=_PORT, default=None, metavar="PORT",
        help=f"port of node 0's embedded controller (default: any free port on one node, {DEFAULT_CONTROLLER_PORT} "
        "on several)",
    )
    g.add_argument(
        "--taskd-job-id", default=os.environ.get("TASKD_JOB_ID") or os.environ.get("MINDX_TASK_ID"), metavar="ID",
        help="job id, the same on every node (default: $TASKD_JOB_ID, $MINDX_TASK_ID, else --rdzv-id)",
    )
    g.add_argument(
        "--taskd-in-place", action="store_true",
        help="the job's workers survive a peer's restart (no collectives between them): offer recover-in-place, "
        "which restarts only the faulty ranks",
    )
    g.add_argument(
        "--taskd-max-cycles", type=_COUNT, default=None, metavar="N",
        help="recovery cycles before the job is given up (default: --max-restarts, which taskdrun sets to "
        f"{_POLICY.max_cycles})",
    )
    g.add_argument(
        "--taskd-strategies", type=_arg(_strategies), default=_POLICY.strategies, metavar="LIST",
        help="strategies the embedded controller may choose, comma separated (default: "
        + ",".join(s.value for s in _POLICY.strategies) + ")",
    )
    g.add_argument(
        "--taskd-report-timeout", type=_SECONDS, default=_POLICY.report_timeout, metavar="SECONDS",
        help="deadline of each of the embedded controller's waits for the agents (default: %(default)s)",
    )
    g.add_argument(
        "--taskd-flush-seconds", type=_FLUSH, default=_POLICY.flush_seconds, metavar="SECONDS",
        help="window in which the embedded controller collects faults that arrive together (default: %(default)s)",
    )
    g.add_argument(
        "--taskd-stop-timeout", type=_SECONDS, default=30.0, metavar="SECONDS",
        help="seconds between SIGTERM and SIGKILL when workers are stopped (default: %(default)s)",
    )
    g.add_argument(
        "--taskd-connect-timeout", type=_SECONDS, default=60.0, metavar="SECONDS",
        help="seconds to keep trying to reach the controller (default: %(default)s)",
    )
    g.add_argument(
        "--taskd-dump-grace", type=_SECONDS, default=30.0, metavar="SECONDS",
        help="seconds workers get to save after the dump signal SIGUSR1 (default: %(default)s)",
    )
    g.add_argument(
        "--taskd-linger", type=_SECONDS, default=60.0, metavar="SECONDS",
        help="node 0 hosting the controller: seconds to wait for the other nodes' agents to end (default: %(default)s)",
    )
    g.add_argument(
        "--taskd-log-level", default=os.environ.get("TASKD_LOG_LEVEL", "INFO"), metavar="LEVEL",
        help="level of taskdrun's own log (default: $TASKD_LOG_LEVEL or %(default)s)",
    )
    return parser


@dataclass(frozen=True, slots=True)
class TaskdOptions:
    """The TaskD side of one ``taskdrun`` invocation, resolved from the parsed arguments."""

    controller: str | None
    controller_port: int
    job_id: str
    in_place: bool
    policy: JobPolicy
    stop_timeout: float
    connect_timeout: float
    dump_grace: float
    linger: float

    @classmethod
    def from_args(cls, args: argparse.Namespace, nnodes: int) -> TaskdOptions:
        """Resolve defaults that depend on the job's size and on torchrun's options."""
        if args.taskd_controller_port is None:
            # One node: nobody else needs to find the controller, so any free port will do.
            port = 0 if nnodes == 1 else DEFAULT_CONTROLLER_PORT
        else:
            port = args.taskd_controller_port
        if port == 0 and nnodes > 1 and not args.taskd_controller:
            raise ConfigError("--taskd-controller-port 0 only works for one node: the other nodes must know the port")
        job_id = args.taskd_job_id or (args.rdzv_id if args.rdzv_id != "none" else "default")
        cycles = args.taskd_max_cycles if args.taskd_max_cycles is not None else args.max_restarts
        policy = JobPolicy(
            strategies=args.taskd_strategies,
            report_timeout=args.taskd_report_timeout,
            flush_seconds=args.taskd_flush_seconds,
            max_cycles=cycles,
            # Every node's agent must answer before a cycle step ends.
            expected_agents=nnodes,
        )
        return cls(
            controller=args.taskd_controller,
            controller_port=port,
            job_id=job_id,
            in_place=args.taskd_in_place,
            policy=policy,
            stop_timeout=args.taskd_stop_timeout,
            connect_timeout=args.taskd_connect_timeout,
            dump_grace=args.taskd_dump_grace,
            linger=args.taskd_linger,
        )
