"""The ``taskd`` command line: one sub-command per module in this package.

Only this package configures logging and turns outcomes into exit codes; the
library underneath raises :class:`~taskd_core.errors.TaskdError` and returns.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from importlib.metadata import version

from taskd_core.errors import TaskdError
from taskd_core.forkserver.forksafe import disable_grpc_fork_handlers

logger = logging.getLogger(__name__)

#: Sub-command modules of this package; each has ``add_parser(subparsers)``
#: which registers its parser with ``func=<callable(args) -> int>``.
_COMMANDS = ("controller", "status", "events", "timeline", "run", "plugins")


class _VersionAction(argparse.Action):
    """``--version``: taskd-core's version and every installed adapter distribution's, read when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(
            option_strings, dest, nargs=0, help="print the versions of taskd-core and every adapter"
        )

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        from taskd_core.plugins import adapter_distributions

        lines = [f"taskd-core {version('taskd-core')}"]
        lines += [
            f"{dist} (adapter {', '.join(names)})"
            for dist, names in adapter_distributions().items()
            if not dist.startswith("taskd-core ")
        ]
        print("\n".join(lines))
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="taskd", description="TaskD process-level fault recovery")
    parser.add_argument("--version", action=_VersionAction)
    parser.add_argument(
        "--log-level",
        default=os.environ.get("TASKD_LOG_LEVEL", "INFO"),
        help="logging level (default: %(default)s, or $TASKD_LOG_LEVEL)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMANDS:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    return parser


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s [%(process)d]: %(message)s",
        stream=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    # Before the sub-commands import grpc: `taskd run` forks workers beside gRPC threads.
    disable_grpc_fork_handlers()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configure_logging(args.log_level)
    except ValueError:
        parser.error(f"--log-level: unknown level {args.log_level!r}")
    try:
        return int(args.func(args))
    except TaskdError as exc:
        logger.error("%s", exc)
        return 2
