"""Launching workers: process supervision, the built-in ``process`` adapter and the controller rule.

- :mod:`~taskd_core.launcher.supervisor`: start workers in their own process
  groups and stop them (SIGTERM, one deadline, SIGKILL, reap).
- :mod:`~taskd_core.launcher.spec`: :class:`LaunchSpec`, what one node runs.
- :mod:`~taskd_core.launcher.process_adapter`: :class:`ProcessAdapter`, the hooks over the supervisor.
- :mod:`~taskd_core.launcher.settings`: :class:`NodeSettings`, the one settings chain, and the
  checks, environment and port rules every launcher shares.
- :mod:`~taskd_core.launcher.embedded`: which controller a launcher talks to.
- :mod:`~taskd_core.launcher.interrupt`: SIGTERM / SIGINT turned into an orderly stop.
- :mod:`~taskd_core.launcher.node`: :func:`run_node_agent`, the end every launcher shares.

Warm starts (the fork server) and the lifeline that ends workers with their launcher are
:mod:`taskd_core.forkserver`; hang detection is :mod:`taskd_core.agent.hangs`.
"""

from __future__ import annotations

from taskd_core.launcher.process_adapter import ProcessAdapter
from taskd_core.launcher.spec import LaunchSpec

__all__ = ["LaunchSpec", "ProcessAdapter"]
