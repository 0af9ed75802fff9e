"""Seed import path of ``MSRunPlugin`` (real msrun imports exactly this), from :mod:`taskd_mindspore`.

Shipped by taskd-core, like :mod:`taskd.api.taskd_agent_api`, so that a missing
taskd-mindspore is reported with the command that installs it.
"""

from __future__ import annotations

from taskd_core.plugins.requires import adapter_module

MSRunPlugin = adapter_module("mindspore", "taskd_mindspore.plugin", "taskd-mindspore").MSRunPlugin

__all__ = ["MSRunPlugin"]
