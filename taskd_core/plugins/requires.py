"""What an adapter needs installed, checked without importing it, and said as one line when missing.

Frameworks are imported lazily (``import torch`` alone takes seconds), so an
adapter states its framework here instead: :func:`require_module` finds the
module without importing it and raises :class:`~taskd_core.errors.FrameworkMissingError`
with the command that installs it. :func:`adapter_module` does the same for the
``taskd`` seed paths that re-export an adapter distribution.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from taskd_core.errors import FrameworkMissingError


def require_module(plugin: str, module: str, missing: str, install: str) -> None:
    """Raise :class:`FrameworkMissingError` (``missing``, ``install``) unless ``module`` is installed."""
    if importlib.util.find_spec(module) is None:
        raise FrameworkMissingError(plugin, missing, install)


def adapter_module(plugin: str, module: str, distribution: str) -> ModuleType:
    """Module ``module`` of adapter distribution ``distribution``; a clear error when that is not installed.

    Only the absence of the distribution's own package becomes
    :class:`FrameworkMissingError`; an installed adapter that fails to import
    keeps its own error.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module.partition(".")[0]:
            raise
        raise FrameworkMissingError(
            plugin, f"the TaskD {plugin} adapter ({distribution})", f"pip install {distribution}"
        ) from None
