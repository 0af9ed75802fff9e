"""``taskdrun``: torchrun's command line, with TaskD recovering the workers.

One ``taskdrun`` per node, exactly like ``torchrun``, in every rendezvous form::

    taskdrun --nproc-per-node=2 train.py                                   # one node (--standalone)
    taskdrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        --rdzv-id=JOB train.py
    taskdrun --nnodes=2 --node-rank=N --master-addr=HOST --master-port=29500 --nproc-per-node=4 train.py
    taskdrun --nnodes=3 --nproc-per-node=4 --rdzv-backend=etcd-v2 --rdzv-endpoint=ETCD:2379 \
        --rdzv-id=JOB train.py                                             # no node is special

The node's :class:`~taskd_pytorch.elastic.TaskdElasticAgent` runs under the
core node agent, which owns the control loop: it starts the workers, learns
of a death at once, reports it and carries out what the controller decides.

taskdrun joins the first rendezvous round before anything else. Without
``--taskd-controller``, where the controller runs depends on the rendezvous:

* etcd (``--rdzv-backend=etcd-v2`` or ``etcd``): every node runs a replica of
  the job's controller whose state is in that same etcd (under
  ``/taskd/rdzv/RUN_ID``); one is elected leader, every agent knows every
  replica and follows the leader, so the job keeps a controller whichever node
  is lost, the leader's included. The last node to end removes the state.
* c10d and static: the node that round makes group rank 0 hosts an embedded
  controller on a free port and publishes its address in the rendezvous
  store; the other nodes read it there. As with torchrun, whose c10d store
  lives in that launcher too, the job does not survive the loss of that node:
  the other nodes cannot reach it and end with exit code 1 after
  ``--taskd-connect-timeout`` (taskdrun says so in one line at start).

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
from typing import TYPE_CHECKING, NoReturn

from taskd_core.errors import ConfigError, FrameworkMissingError, TaskdError
from taskd_core.forkserver.forksafe import disable_grpc_fork_handlers
from taskd_core.scratch import check_temp_dir
from taskd_pytorch.adapter import require_torch

if TYPE_CHECKING:
    from taskd_core.forkserver.client import ForkLauncher
    from taskd_core.forkserver.lifeline import Lifeline

logger = logging.getLogger(__name__)

#: Options after which the workers' interpreter is not known before torch's parser ran, or no fork
#: server is wanted (function entry points start through multiprocessing); prefixes, as argparse
#: takes abbreviations. A script argument that looks like one only costs the early start.
_NOT_EARLY = ("--taskd-no-f", "--taskd-fork-server-p", "--no-p", "--no_p", "--run-p", "--run_p", "-h", "--he")


def _option(argv: Sequence[str], *names: str) -> str | None:
    """The last value of option ``names`` in ``argv`` (``--name V``, ``--name=V``), as a scan tells it."""
    value = None
    for i, arg in enumerate(argv):
        name, eq, given = arg.partition("=")
        if name in names:
            value = given if eq else argv[i + 1] if i + 1 < len(argv) else value
    return value


def _early_fork_launcher(argv: Sequence[str]) -> ForkLauncher | None:
    """The node's fork server, started before anything else, so that it imports torch while taskdrun does.

    torchrun runs every script as ``sys.executable -u``; which script only its parser says, and
    that parser imports torch (2 s): a server started after it made the first workers wait. The
    server gets the startup environment torch then gives the workers (``OMP_NUM_THREADS=1`` for more
    than one per node); :func:`taskd_pytorch.launch.fork_launcher` starts another if it guessed wrong.
    """
    if any(arg.startswith(_NOT_EARLY) for arg in argv):
        return None
    env = {}
    if "OMP_NUM_THREADS" not in os.environ:
        nproc = _option(argv, "--nproc-per-node", "--nproc_per_node") or "1"
        if not nproc.isdigit():
            return None  # auto, cpu, gpu: what torch makes of it is known once it ran
        env = {"OMP_NUM_THREADS": "1"} if int(nproc) > 1 else {}
    from taskd_core.forkserver.client import ForkLauncher, ForkServerSettings

    return ForkLauncher.for_interpreter(
        sys.executable, ("-u",), ForkServerSettings(), imports_torch=True, env=env
    )


def _configure_logging(level: str) -> bool:
    """taskdrun's log at ``level``; False when that is no level's name."""
    if not isinstance(logging.getLevelName(level.upper()), int):
        return False
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s [%(process)d]: %(message)s")
    logging.getLogger().setLevel(level.upper())
    return True


def main(argv: Sequence[str] | None = None) -> int:
    # Before anything imports grpc: torch starts workers beside the agent's gRPC threads.
    disable_grpc_fork_handlers()
    try:
        # Checked without importing torch, before a fork server that would preload it starts.
        require_torch()
        # torch's import itself needs one (through dill): said in one line before anything imports it.
        check_temp_dir(os.environ)
    except (FrameworkMissingError, ConfigError) as exc:
        print(f"taskdrun: {exc}", file=sys.stderr)
        return 2
    given = sys.argv[1:] if argv is None else argv
    # Before the fork server starts, so that what it says (when it is ready, say) is in the log.
    _configure_logging(_option(given, "--taskd-log-level") or os.environ.get("TASKD_LOG_LEVEL", "INFO"))
    from taskd_core.forkserver.lifeline import Lifeline

    # First: the fork server and every worker started afterwards are marked as this job's, and
    # whatever of the job is left when taskdrun ends (or dies) is ended.
    with Lifeline() as lifeline:
        early = _early_fork_launcher(given)
        try:
            return _main(argv, lifeline, early)
        finally:
            if early is not None:
                early.close()  # a no-op when the launch took it over (and closed it)


def _main(argv: Sequence[str] | None, lifeline: Lifeline, early: ForkLauncher | None) -> int:
    # Imported once torch is known to be there: the parser is torchrun's own.
    from taskd_pytorch.options import build_parser

    parser = build_parser()
    args = parser.parse_args(argv)
    if not _configure_logging(args.taskd_log_level):
        parser.error(f"--taskd-log-level: unknown level {args.taskd_log_level!r}")
    try:
        # Imported here: `taskdrun --help` and the parser's errors need neither the agent nor torch.
        from taskd_pytorch.launch import launch

        return launch(args, lifeline, early)
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
