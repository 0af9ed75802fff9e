"""Launching workers: process supervision, the built-in ``process`` adapter and the controller rule.

- :mod:`~taskd_core.launcher.supervisor`: start workers in their own process
  groups and stop them (SIGTERM, one deadline, SIGKILL, reap).
- :mod:`~taskd_core.launcher.spec`: :class:`LaunchSpec`, what one node runs.
- :mod:`~taskd_core.launcher.process_adapter`: :class:`ProcessAdapter`, the hooks over the supervisor.
- :mod:`~taskd_core.launcher.settings`: :class:`NodeSettings`, the chain's outer link, and the
  embedded controller's port rule.
- :mod:`~taskd_core.launcher.flags`: the settings every launcher shares, as flags and
  ``TASKD_*`` variables, and :func:`~taskd_core.launcher.flags.node_settings`, the one builder.
- :mod:`~taskd_core.launcher.environment`: the reference's variables, a usable temporary directory.
- :mod:`~taskd_core.launcher.identity`: the launch identity, default job ids, the job's credentials.
- :mod:`~taskd_core.launcher.embedded`: which controller a launcher talks to.
- :mod:`~taskd_core.launcher.interrupt`: SIGTERM / SIGINT turned into an orderly stop.
- :mod:`~taskd_core.launcher.node`: :func:`run_node_agent`, the end every launcher shares.

Values themselves (addresses, seconds, counts, loopback) are checked by :mod:`taskd_core.values`.
Warm starts (the fork server) and the lifeline that ends workers with their launcher are
:mod:`taskd_core.forkserver`; hang detection is :mod:`taskd_core.agent.hangs`.
"""

from __future__ import annotations

from taskd_core.launcher.process_adapter import ProcessAdapter
from taskd_core.launcher.spec import LaunchSpec

__all__ = ["LaunchSpec", "ProcessAdapter"]
