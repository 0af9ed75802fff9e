"""Framework adapters: the hook specifications and the registry that loads them.

For adapter authors, the whole surface is :data:`hookimpl` and the hook
reference in :mod:`taskd_core.plugins.hookspecs`. An adapter is an object (or
a class constructible without arguments) whose methods carry ``@hookimpl``,
published under the entry-point group ``taskd`` with the framework's name::

    [project.entry-points.taskd]
    myframe = "my_package.adapter:MyAdapter"
"""

from __future__ import annotations

from taskd_core.plugins._markers import PROJECT, hookimpl, hookspec
from taskd_core.plugins.registry import Adapter, InstalledAdapter, list_adapters, load_adapter

__all__ = ["PROJECT", "Adapter", "InstalledAdapter", "hookimpl", "hookspec", "list_adapters", "load_adapter"]
