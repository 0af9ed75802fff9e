"""The options every command that talks to a running controller shares.

They say where the controller is and how to prove who we are.

``taskd status`` (and any later command that queries a controller) calls
:func:`add_connection_options` on its parser and :func:`credentials` on the
parsed arguments, then hands both to the client.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from taskd_core.models import Credentials
from taskd_core.rpc.security import read_token_file
from taskd_core.values import DEFAULT_CONTROLLER, argtype, check_secret, parse_controller, parse_seconds


def add_connection_options(parser: argparse.ArgumentParser) -> None:
    """``--controller``, ``--tls-ca``, ``--admin-token-file`` and ``--timeout``."""
    parser.add_argument(
        "--controller",
        type=argtype(parse_controller),
        default=os.environ.get("TASKD_CONTROLLER", DEFAULT_CONTROLLER),
        help="controller HOST:PORT (default: %(default)s, or $TASKD_CONTROLLER)",
    )
    parser.add_argument(
        "--tls-ca",
        default=None,
        metavar="FILE",
        help="CA that signed the controller's certificate (default: $TASKD_TLS_CA; none: plaintext). "
        "A client certificate for mutual TLS comes from $TASKD_TLS_CERT and $TASKD_TLS_KEY",
    )
    parser.add_argument(
        "--admin-token-file",
        default=None,
        metavar="FILE",
        help="present the controller's admin token (sees every job); otherwise $TASKD_JOB_TOKEN is sent",
    )
    parser.add_argument(
        "--timeout",
        type=argtype(lambda text: parse_seconds(text, positive=True)),
        default=5.0,
        metavar="S",
        help="RPC deadline (default: %(default)s)",
    )


def credentials(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Credentials:
    """What the parsed options and the environment say to present.

    :raises ConfigError: for unreadable files.
    """
    token = read_token_file(args.admin_token_file, "--admin-token-file") if args.admin_token_file else None
    given = Credentials.from_env(os.environ if env is None else env, tls_ca=args.tls_ca, token=token)
    if token is None and given.token:
        check_secret(given.token, "TASKD_JOB_TOKEN")  # gRPC cannot send it: say so now, not after retries
    return given
