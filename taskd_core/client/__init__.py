"""The controller's clients: :class:`DLRecoverManager` (the seed document's API) and :class:`QueryClient`."""

from __future__ import annotations

from taskd_core.client.manager import DLRecoverManager, SignalHandler
from taskd_core.client.query import QueryClient

__all__ = ["DLRecoverManager", "QueryClient", "SignalHandler"]
