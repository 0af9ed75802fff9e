"""The taskd agent API msrun 2.10 imports first; a re-export of :mod:`taskd_mindspore.agent_api`.

Shipped by taskd-core rather than taskd-mindspore so that msrun with
``MS_ENABLE_TFT`` and only the core installed logs what to install (this
import fails with that message) instead of "No module named ...".
"""

from __future__ import annotations

from taskd_core.plugins.requires import adapter_module

_api = adapter_module("mindspore", "taskd_mindspore.agent_api", "taskd-mindspore")
init_taskd_agent = _api.init_taskd_agent
register_func = _api.register_func
start_taskd_agent = _api.start_taskd_agent

__all__ = ["init_taskd_agent", "register_func", "start_taskd_agent"]
