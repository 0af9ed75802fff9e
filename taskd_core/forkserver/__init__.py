"""Warm worker starts and worker lifetimes: the fork server and the lifeline.

What every launcher (``taskd run``, ``taskdrun``, msrun's adapter) uses to start
Python workers warm and to make sure none outlives it:

- :mod:`~taskd_core.forkserver.client`: :class:`ForkLauncher`, the agent's side of the
  per-node fork server (a worker forked from a process that imported the framework once);
- :mod:`~taskd_core.forkserver._server`: the server's own process, standard library only;
- :mod:`~taskd_core.forkserver._wire`: the messages both sides exchange, as frozen dataclasses with
  their one encoding (standard library only: the server loads it by path);
- :mod:`~taskd_core.forkserver.forksafe`: keeping gRPC's fork handlers out of launchers that fork;
- :mod:`~taskd_core.forkserver.lifeline`: :class:`Lifeline`, a guard process that SIGKILLs every
  worker's process group when its launcher dies, however it dies (the fork server's children,
  forked without exec, use ``PR_SET_PDEATHSIG`` instead).
"""

from __future__ import annotations

from taskd_core.forkserver.client import TORCH_PRELOAD, ForkLauncher, ForkServerError, ForkServerSettings
from taskd_core.forkserver.lifeline import Lifeline

__all__ = ["TORCH_PRELOAD", "ForkLauncher", "ForkServerError", "ForkServerSettings", "Lifeline"]
