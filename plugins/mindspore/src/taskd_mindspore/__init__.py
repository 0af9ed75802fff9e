"""TaskD for MindSpore's msrun: :class:`MSRunPlugin`, the taskd agent API and the ``mindspore`` adapter.

MindSpore itself is not imported here: msrun hands TaskD its callbacks, and
only the training script needs the framework (extra ``framework``). The names
below are imported on first use, so that importing one submodule (the fork
server imports :mod:`taskd_mindspore.forkhooks`; a training script
:mod:`taskd_mindspore.dump`) brings nothing else of TaskD along.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from taskd_mindspore.adapter import MSRunAdapter
    from taskd_mindspore.agent_api import AgentApi
    from taskd_mindspore.callbacks import CallbackError, MsrunCallbacks, Operator
    from taskd_mindspore.plugin import MSRunPlugin

_HOMES = {
    "AgentApi": "agent_api",
    "CallbackError": "callbacks",
    "MSRunAdapter": "adapter",
    "MSRunPlugin": "plugin",
    "MsrunCallbacks": "callbacks",
    "Operator": "callbacks",
}

__all__ = ["AgentApi", "CallbackError", "MSRunAdapter", "MSRunPlugin", "MsrunCallbacks", "Operator"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'taskd_mindspore' has no attribute {name!r}")
    return getattr(importlib.import_module(f"taskd_mindspore.{home}"), name)
