"""Keeping gRPC out of the way of launchers that fork their workers.

A launcher hosts gRPC (the agent's client, node 0's embedded controller)
while it starts worker processes. With gRPC's fork support on, its core runs
``pthread_atfork`` handlers in every forked child; while other threads are
inside gRPC (a signal stream is always open) those handlers abort the child
("Check failed: next_worker->state == KICKED"), before it can ``exec``. A
launcher that forks with a ``preexec_fn`` — msrun starts every worker with
``preexec_fn=os.setsid`` — then sees some of its new workers die at birth:
measured here, 32 of 300 forks, and none once fork support was off.

Children that ``exec`` right away need none of gRPC's fork handling, so the
launchers turn it off. gRPC reads the setting when it is imported, so
:func:`disable_grpc_fork_handlers` must run before anything imports ``grpc``;
the launchers' entry points call it first thing.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

ENV = "GRPC_ENABLE_FORK_SUPPORT"


def disable_grpc_fork_handlers() -> bool:
    """Turn gRPC's fork handlers off for this process unless the user chose otherwise.

    :returns: whether gRPC will run without fork handlers; False (with a
        warning naming the fix) when ``grpc`` was imported too early or the
        user set ``GRPC_ENABLE_FORK_SUPPORT`` to something true.
    """
    if "grpc" in sys.modules:
        logger.warning(
            "grpc was imported before TaskD could turn its fork handlers off: workers forked by this "
            "launcher may die at start; set %s=false in the launcher's environment",
            ENV,
        )
        return False
    value = os.environ.setdefault(ENV, "false")
    return value.strip().lower() in {"0", "false", "no", "off"}
