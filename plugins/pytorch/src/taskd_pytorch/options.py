"""``taskdrun``'s command line: torchrun's own parser plus a ``--taskd-*`` group.

The parser is ``torch.distributed.run.get_args_parser()`` itself, so every
torchrun option keeps its name, default and help; TaskD adds the options every
launcher shares (:func:`taskd_core.launcher.settings.add_node_options`) under
a prefix that cannot collide with torchrun's. Values are checked by the
parser, so a bad one ends with argparse's usage message and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from torch.distributed.run import get_args_parser

from taskd_core.launcher.settings import NodeSettings, add_node_options, default_of, node_settings_from_args
from taskd_core.models import JobPolicy

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
    add_node_options(parser, PREFIX, published=True)
    parser.set_defaults(taskd_flush_seconds=FLUSH_SECONDS)
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
        node = node_settings_from_args(
            args,
            env,
            prefix=PREFIX,
            launcher="taskdrun",
            shared=f"{args.rdzv_endpoint}/{args.rdzv_id}/{master_addr}:{args.master_port}",
            job_id=args.rdzv_id if args.rdzv_id != "none" else None,
            # Provisional: cli replaces it by the group rank the rendezvous gives this node.
            node_rank=args.node_rank,
            nnodes=nnodes,
            master_addr=master_addr,
            max_cycles=args.max_restarts,
            stop_signals=STOP_SIGNALS,
            published=True,
        )
        return cls(node=node, in_place=args.taskd_in_place)
