"""``MSRunPlugin``: the object msrun hands its workers to.

msrun imports it as ``taskd.python.framework.agent.ms_mgr.msrun_plugin.MSRunPlugin``.

msrun 2.10 uses it when ``taskd.api.taskd_agent_api`` cannot be imported or
refuses to initialise::

    plugin = MSRunPlugin()
    for name, func in {"KILL_WORKER": ..., "START_ALL_WORKER": ...,
                       "START_WORKER_LIST": ..., "MONITOR": ...}.items():
        plugin.register_callbacks(name, func)
    plugin.start()          # on msrun's main thread; msrun's run() returns after it

What ``start()`` does is :func:`taskd_mindspore.runner.run_node`; see there
for the settings it reads from the environment.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from taskd_core.forkserver.forksafe import disable_grpc_fork_handlers
from taskd_mindspore.callbacks import CallbackRegistry
from taskd_mindspore.warm import quick_heartbeat

logger = logging.getLogger(__name__)


def _log_to_stderr(env: Mapping[str, str]) -> None:
    # msrun configures no Python logging (MindSpore has its own logger), so without this TaskD's
    # recovery steps would be invisible in msrun's output. start() is msrun's equivalent of a
    # command line's main(), the one place allowed to configure logging; an embedding program
    # that configured handlers itself keeps them.
    if not logging.getLogger().handlers:
        level = logging.getLevelName(env.get("TASKD_LOG_LEVEL", "INFO").upper())
        logging.basicConfig(
            level=level if isinstance(level, int) else logging.INFO,
            format="%(asctime)s %(levelname)s [taskd pid %(process)d] %(name)s: %(message)s",
        )


class MSRunPlugin:
    """Takes over msrun's worker life cycle: the seed API, ``register_callbacks`` then ``start``.

    :param env: the environment to read settings from; msrun's own (``os.environ``) by default.
    """

    def __init__(self, *, env: Mapping[str, str] | None = None) -> None:
        self._registry = CallbackRegistry()
        self._env = env
        # msrun forks every worker with a preexec_fn; gRPC's fork handlers would
        # kill some of them at birth (see taskd_core.forkserver.forksafe). This is
        # the first call msrun makes into TaskD, before anything imports grpc.
        disable_grpc_fork_handlers()
        if env is None:
            # Also before msrun starts its scheduler: it and every worker inherit msrun's environment.
            quick_heartbeat(os.environ)

    def register_callbacks(self, operator: str, func: Callable[..., Any]) -> None:
        """Register msrun's callback for ``operator`` (``KILL_WORKER``, ``START_ALL_WORKER``,
        ``START_WORKER_LIST`` or ``MONITOR``).

        An operator this TaskD does not know is logged and ignored (a newer msrun may register more).

        :raises CallbackError: (a ``ValueError``) for a non-callable.
        """
        self._registry.register(operator, func)

    def run(self) -> int:
        """Run the job on this node to the end and return its exit code (0: every worker exited 0).

        :raises CallbackError: when a callback was never registered.
        """
        # Imported here, not at the top: the runner imports grpc, which must
        # wait until __init__ has configured it.
        from taskd_mindspore.runner import run_node

        return run_node(self._registry.complete(), os.environ if self._env is None else self._env)

    def start(self) -> NoReturn:
        """Run the job, then end msrun with the job's exit code.

        msrun calls this as the last thing its ``run()`` does and then returns
        from ``main()`` with status 0 whatever happened, so the job's failure
        can only reach msrun's caller (a shell, a scheduler, CI) by ending the
        process here. It is the one place that does: :meth:`run` and everything
        below return codes, and ``SystemExit`` still unwinds ``finally`` blocks.
        """
        _log_to_stderr(os.environ if self._env is None else self._env)
        code = self.run()
        logger.info("msrun ends with exit code %s", code)
        raise SystemExit(code)
