"""The controller's client: :class:`DLRecoverManager` with the seed document's API."""

from __future__ import annotations

from taskd_core.client.manager import DLRecoverManager, SignalHandler

__all__ = ["DLRecoverManager", "SignalHandler"]
