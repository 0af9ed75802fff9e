"""Framework adapters: the hook specifications and the registry that loads them.

For adapter authors, the whole surface is :data:`hookimpl` and the hook
reference in :mod:`taskd_core.plugins.hookspecs`. An adapter is an object (or
a class constructible without arguments) whose methods carry ``@hookimpl``,
published under the entry-point group ``taskd`` with the framework's name::

    [project.entry-points.taskd]
    myframe = "my_package.adapter:MyAdapter"

An adapter whose framework is missing calls :func:`require_module` in its
constructor, so ``taskd plugins`` lists it as unavailable with the command
that installs the framework.
"""

from __future__ import annotations

from taskd_core.plugins._markers import PROJECT, hookimpl, hookspec
from taskd_core.plugins.registry import (
    Adapter,
    InstalledAdapter,
    adapter_distributions,
    list_adapters,
    load_adapter,
)
from taskd_core.plugins.requires import adapter_module, require_module

__all__ = [
    "PROJECT",
    "Adapter",
    "InstalledAdapter",
    "adapter_distributions",
    "adapter_module",
    "hookimpl",
    "hookspec",
    "list_adapters",
    "load_adapter",
    "require_module",
]
