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

import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from taskd_core.errors import ConfigError, FrameworkMissingError, TaskdError
from taskd_core.forkserver.forksafe import disable_grpc_fork_handlers
from taskd_pytorch.adapter import require_torch

logger = logging.getLogger(__name__)


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
        # Imported here: `taskdrun --help` and the parser's errors need neither the agent nor torch.
        from taskd_pytorch.launch import launch

        return launch(args)
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
