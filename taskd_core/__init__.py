"""TaskD: process-level fault recovery for distributed training.

The public surface for users and adapter authors; everything else lives in
the sub-packages named after the architecture: ``controller`` (the recovery
service), ``client`` (``DLRecoverManager``), ``agent`` (the node agent and
the action dispatcher), ``plugins`` (hook specifications and registry),
``launcher`` (the built-in process launcher) and ``rpc`` (the wire layer).
"""

from __future__ import annotations

import importlib
from typing import Any

# Names resolve on first use (PEP 562): importing taskd_core must not import
# grpc, so that launchers can configure it first (see launcher.forksafe).
_EXPORTS = {
    "DLRecoverManager": "taskd_core.client.manager",
    "AccessDeniedError": "taskd_core.errors",
    "AdapterNotFoundError": "taskd_core.errors",
    "ConfigError": "taskd_core.errors",
    "ControllerUnavailableError": "taskd_core.errors",
    "FrameworkMissingError": "taskd_core.errors",
    "PluginError": "taskd_core.errors",
    "PluginLoadError": "taskd_core.errors",
    "ProtocolError": "taskd_core.errors",
    "RecoveryDisabledError": "taskd_core.errors",
    "TaskdError": "taskd_core.errors",
    "WorkerControlError": "taskd_core.errors",
    "Code": "taskd_core.models",
    "Credentials": "taskd_core.models",
    "FaultRank": "taskd_core.models",
    "FaultType": "taskd_core.models",
    "JobPolicy": "taskd_core.models",
    "Signal": "taskd_core.models",
    "Strategy": "taskd_core.models",
    "WorkerState": "taskd_core.models",
    "WorkerStatus": "taskd_core.models",
    "hookimpl": "taskd_core.plugins",
}

__all__ = [
    "AccessDeniedError",
    "AdapterNotFoundError",
    "Code",
    "ConfigError",
    "ControllerUnavailableError",
    "Credentials",
    "DLRecoverManager",
    "FaultRank",
    "FaultType",
    "FrameworkMissingError",
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
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    # Resolved lazily so importing the package never reads distribution metadata.
    if name == "__version__":
        from importlib.metadata import version

        return version("taskd-core")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
