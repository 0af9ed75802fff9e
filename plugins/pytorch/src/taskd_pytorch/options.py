"""``taskdrun``'s command line: torchrun's own parser plus a ``--taskd-*`` group.

The parser is ``torch.distributed.run.get_args_parser()`` itself, so every
torchrun option keeps its name, default and help; TaskD adds the options every
launcher shares (:func:`taskd_core.launcher.flags.add_node_options`) under
a prefix that cannot collide with torchrun's. Values are checked by the
parser, torchrun's own numbers, ports, rendezvous backend and endpoint and log
directory included (torch would only fail on them later, with a traceback), so a
bad one ends with argparse's usage message and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.run import get_args_parser

from taskd_core.errors import ConfigError
from taskd_core.launcher.flags import OptionValues, add_node_options, node_settings
from taskd_core.launcher.settings import NodeSettings, default_of
from taskd_core.models import JobPolicy
from taskd_core.values import (
    MAX_LOCAL_WORKERS,
    MAX_NODES,
    argtype,
    check_creatable_dir,
    parse_count,
    parse_port,
    parse_seconds,
)

PREFIX = "taskd-"
#: Signals that end the job: the agent stops every worker and taskdrun exits 128 + signal
#: (SIGHUP too, as torchrun).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: The embedded controller's flush window under taskdrun, seconds. A whole-group restart
#: needs none: the peers' failed collectives that follow a death are faults of workers the
#: cycle already restarts, which the controller recognises and drops. Live peers do not
#: fail at all. So the window only has to catch deaths that happen together (two ranks,
#: a node), at a fifth of the general default, which would be a third of a warm restart.
FLUSH_SECONDS = 0.02


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser, renamed ``taskdrun``, with the TaskD options added."""
    parser = get_args_parser()
    parser.prog = "taskdrun"
    parser.description = (
        "torchrun with process-level fault recovery by TaskD: a controller negotiates each recovery and "
        "this node's agent stops and restarts exactly the workers that need it. " + (parser.description or "")
    )
    # torchrun stops after --max-restarts failures; here it is the controller's cycle budget.
    parser.set_defaults(max_restarts=default_of(JobPolicy, "max_cycles"))
    _check_torchrun_values(parser)
    add_node_options(parser, PREFIX, published=True, defaults=_shown_defaults())
    g = parser.add_argument_group("TaskD workers")
    g.add_argument(
        "--taskd-in-place",
        action="store_true",
        help="the job's workers survive a peer's restart (no collectives between them): "
        "offer recover-in-place, "
        "which restarts only the faulty ranks",
    )
    g.add_argument(
        "--taskd-log-level",
        default=os.environ.get("TASKD_LOG_LEVEL", "INFO"),
        metavar="LEVEL",
        help="level of taskdrun's own log (default: $TASKD_LOG_LEVEL or %(default)s)",
    )
    return parser


def _shown_defaults() -> dict[str, Any]:
    return {"flush-seconds": FLUSH_SECONDS, "max-cycles": "--max-restarts"}


def _nproc_per_node(text: str) -> str:
    """A worker count (1..MAX_LOCAL_WORKERS), or one of the device names torchrun resolves itself."""
    try:
        count = int(text)
    except ValueError:
        return text
    parse_count(str(count), low=1, high=MAX_LOCAL_WORKERS)
    return text


def _nnodes(text: str) -> str:
    """``N`` or ``MIN:MAX`` nodes, each 1..MAX_NODES, MIN at most MAX (torch's own check is an assert)."""
    counts = [parse_count(part.strip(), low=1, high=MAX_NODES) for part in text.split(":", 1)]
    if counts[0] > counts[-1]:
        raise ConfigError(
            f"{text!r}: MIN ({counts[0]}) is more than MAX ({counts[-1]}); use --nnodes=MIN:MAX"
        )
    return text


def _rdzv_backend(text: str) -> str:
    """A rendezvous backend torch has registered (its own, and those of installed ``torchrun.handlers``)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    # torch keeps the registered names in a private dict; without it, torch's own error stays the check.
    known = getattr(rendezvous_handler_registry, "_registry", None)
    if isinstance(known, dict) and text not in known:
        raise ConfigError(f"unknown rendezvous backend {text!r}; use one of: {', '.join(sorted(known))}")
    return text


def _rdzv_endpoint(text: str) -> str:
    """``HOST[:PORT]`` as torch's rendezvous reads it (an IPv6 host in brackets)."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:
        parse_rendezvous_endpoint(text, default_port=0)
    except ValueError as exc:
        raise ConfigError(f"{text!r} is not HOST[:PORT] ({exc})") from None
    return text


def _log_dir(text: str) -> str:
    check_creatable_dir(Path(text), "")
    return text


#: torchrun's options whose values torch checks only when it uses them (or never), and their checks.
_TORCHRUN_CHECKS: dict[str, Callable[[str], Any]] = {
    "--nproc-per-node": _nproc_per_node,
    "--nnodes": _nnodes,
    "--node-rank": lambda text: parse_count(text, high=MAX_NODES - 1),
    "--master-port": parse_port,
    "--max-restarts": parse_count,
    "--monitor-interval": parse_seconds,
    "--rdzv-backend": _rdzv_backend,
    "--rdzv-endpoint": _rdzv_endpoint,
    "--log-dir": _log_dir,
}


def _check_torchrun_values(parser: argparse.ArgumentParser) -> None:
    """Give torchrun's own options the checks of :data:`_TORCHRUN_CHECKS` (defaults from ``PET_*`` too)."""
    for action in parser._actions:  # argparse has no public way to find an action
        check = next((_TORCHRUN_CHECKS[o] for o in action.option_strings if o in _TORCHRUN_CHECKS), None)
        if check is not None:
            action.type = argtype(check)


@dataclass(frozen=True, slots=True)
class TaskdOptions:
    """The TaskD side of one ``taskdrun`` invocation, resolved from the parsed arguments."""

    node: NodeSettings
    in_place: bool

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, env: Mapping[str, str], *, nnodes: int, master_addr: str
    ) -> TaskdOptions:
        """Resolve defaults that depend on the job's size and on torchrun's options.

        The job id falls back to ``--rdzv-id``, the cycle budget to ``--max-restarts``.
        """
        defaults = {"flush-seconds": FLUSH_SECONDS, "max-cycles": args.max_restarts}
        node = node_settings(
            OptionValues(env, args, PREFIX, defaults),
            launcher="taskdrun",
            shared=f"{args.rdzv_endpoint}/{args.rdzv_id}/{master_addr}:{args.master_port}",
            job_id=args.rdzv_id if args.rdzv_id != "none" else None,
            # Provisional: cli replaces it by the group rank the rendezvous gives this node.
            node_rank=args.node_rank,
            nnodes=nnodes,
            master_addr=master_addr,
            stop_signals=STOP_SIGNALS,
            published=True,
        )
        return cls(node=node, in_place=args.taskd_in_place)
