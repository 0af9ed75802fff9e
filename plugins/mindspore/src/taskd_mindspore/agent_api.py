"""The taskd agent API msrun 2.10 tries first (``taskd.api.taskd_agent_api``), over :class:`MSRunPlugin`.

msrun calls three *module functions* and keeps no object of its own::

    init_taskd_agent({"Framework": "MindSpore"})   # must return True, else msrun falls back to MSRunPlugin
    register_func("KILL_WORKER", kill_workers)     # ... once per callback
    start_taskd_agent()                            # on msrun's main thread

That call style forces some module-level state. All of it is one
:class:`AgentApi` object, :data:`session`; the module functions are its bound
methods. Every ``init_taskd_agent`` starts a fresh plugin, and tests build
their own ``AgentApi()`` instead of touching :data:`session`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from taskd_mindspore.callbacks import CallbackError
from taskd_mindspore.plugin import MSRunPlugin

logger = logging.getLogger(__name__)

#: The only ``Framework`` this distribution serves (compared case-insensitively).
FRAMEWORK = "MindSpore"


class AgentApi:
    """State behind ``init_taskd_agent`` / ``register_func`` / ``start_taskd_agent``.

    :param env: environment the plugin reads its settings from (msrun's by default).
    """

    def __init__(self, *, env: Mapping[str, str] | None = None) -> None:
        self._env = env
        self.plugin: MSRunPlugin | None = None

    def init_taskd_agent(self, config: Mapping[str, Any], cls: object | None = None) -> bool:
        """Begin a new agent for ``config["Framework"]``; returns True (msrun requires a true value).

        :param cls: the launcher object the PyTorch side of the reference passes; msrun passes none.
        :raises CallbackError: for a framework other than MindSpore (msrun then falls back to MSRunPlugin).
        """
        framework = str(config.get("Framework", FRAMEWORK)) if isinstance(config, Mapping) else None
        if framework is None or framework.lower() != FRAMEWORK.lower():
            raise CallbackError(
                f"taskd-mindspore serves config {{'Framework': '{FRAMEWORK}'}}, got {config!r}; "
                "PyTorch jobs are served by taskd-pytorch"
            )
        if cls is not None:
            logger.info("init_taskd_agent ignores cls=%r: msrun's callbacks carry everything", cls)
        self.plugin = MSRunPlugin(env=self._env)
        return True

    def _plugin(self) -> MSRunPlugin:
        if self.plugin is None:
            raise CallbackError("call init_taskd_agent({'Framework': 'MindSpore'}) first")
        return self.plugin

    def register_func(self, operator: str, func: Callable[..., Any]) -> None:
        """Same as :meth:`MSRunPlugin.register_callbacks`."""
        self._plugin().register_callbacks(operator, func)

    def run(self) -> int:
        """Same as :meth:`MSRunPlugin.run`."""
        return self._plugin().run()

    def start_taskd_agent(self) -> NoReturn:
        """Same as :meth:`MSRunPlugin.start`: ends msrun with the job's exit code."""
        self._plugin().start()


#: The state msrun's module-level calls go to.
session = AgentApi()
init_taskd_agent = session.init_taskd_agent
register_func = session.register_func
start_taskd_agent = session.start_taskd_agent
