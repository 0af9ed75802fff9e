"""TaskD for MindSpore's msrun: :class:`MSRunPlugin`, the taskd agent API and the ``mindspore`` adapter.

MindSpore itself is not imported here: msrun hands TaskD its callbacks, and
only the example training script needs the framework (extra ``framework``).
"""

from __future__ import annotations

from taskd_mindspore.adapter import MSRunAdapter
from taskd_mindspore.agent_api import AgentApi
from taskd_mindspore.callbacks import CallbackError, MsrunCallbacks, Operator
from taskd_mindspore.plugin import MSRunPlugin

__all__ = ["AgentApi", "CallbackError", "MSRunAdapter", "MSRunPlugin", "MsrunCallbacks", "Operator"]
