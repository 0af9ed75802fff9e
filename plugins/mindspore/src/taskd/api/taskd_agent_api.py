"""The taskd agent API msrun 2.10 imports first; a re-export of :mod:`taskd_mindspore.agent_api`."""

from __future__ import annotations

from taskd_mindspore.agent_api import init_taskd_agent, register_func, start_taskd_agent

__all__ = ["init_taskd_agent", "register_func", "start_taskd_agent"]
