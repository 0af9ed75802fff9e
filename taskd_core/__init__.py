"""TaskD: process-level fault recovery for distributed training.

The public surface for users and adapter authors; everything else lives in
the sub-packages named after the architecture: ``controller`` (the recovery
service), ``client`` (``DLRecoverManager``), ``agent`` (the node agent and
the action dispatcher), ``plugins`` (hook specifications and registry),
``launcher`` (the built-in process launcher) and ``rpc`` (the wire layer).
"""

from __future__ import annotations

from typing import Any

from taskd_core.client.manager import DLRecoverManager
from taskd_core.errors import (
    AdapterNotFoundError,
    ConfigError,
    ControllerUnavailableError,
    PluginError,
    PluginLoadError,
    ProtocolError,
    RecoveryDisabledError,
    TaskdError,
    WorkerControlError,
)
from taskd_core.models import Code, FaultRank, FaultType, JobPolicy, Signal, Strategy, WorkerState, WorkerStatus
from taskd_core.plugins import hookimpl

__all__ = [
    "AdapterNotFoundError",
    "Code",
    "ConfigError",
    "ControllerUnavailableError",
    "DLRecoverManager",
    "FaultRank",
    "FaultType",
    "JobPolicy",
    "PluginError",
    "PluginLoadError",
    "ProtocolError",
    "RecoveryDisabledError",
    "Signal",
    "Strategy",
    "TaskdError",
    "WorkerControlError",
    "WorkerState",
    "WorkerStatus",
    "hookimpl",
]


def __getattr__(name: str) -> Any:
    # Resolved lazily so importing the package never reads distribution metadata.
    if name == "__version__":
        from importlib.metadata import version

        return version("taskd-core")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
