"""The environment every launcher reads alike: the reference's variables.

- :func:`controller_from_env`: ``TASKD_CONTROLLER`` (one controller, or its replicas
  comma-separated), else ClusterD's
  ``MINDX_SERVER_IP`` (port 8899 unless it names one);
- :func:`job_id_from_env`: ``TASKD_JOB_ID``, else the reference's ``MINDX_TASK_ID``.

Whether a usable temporary directory exists: :func:`taskd_core.scratch.check_temp_dir`.

The ``TASKD_<NAME>`` variable of each shared flag is read by
:class:`taskd_core.launcher.flags.OptionValues`.
"""

from __future__ import annotations

from collections.abc import Mapping

from taskd_core.values import DEFAULT_CONTROLLER_PORT, join_address, parse_address, parse_controller


def controller_from_env(env: Mapping[str, str]) -> str | None:
    """The controller the environment names: ``TASKD_CONTROLLER``, else ClusterD at ``MINDX_SERVER_IP``.

    ``MINDX_SERVER_IP`` is a host in the reference (ClusterD listens on its
    fixed port 8899); a value that already carries a port keeps it.
    :raises ConfigError: naming the variable, for a value that is no address.
    """
    explicit = env.get("TASKD_CONTROLLER", "").strip()
    if explicit:
        return parse_controller(explicit, "TASKD_CONTROLLER")
    server = env.get("MINDX_SERVER_IP", "").strip()
    if not server:
        return None
    has_port = server.rpartition(":")[2].isdigit() and (server.count(":") == 1 or server.startswith("["))
    if not has_port:
        server = join_address(server, DEFAULT_CONTROLLER_PORT)
    parse_address(server, "MINDX_SERVER_IP")
    return server


def job_id_from_env(env: Mapping[str, str]) -> str | None:
    """The job id the environment names: ``TASKD_JOB_ID``, else the reference's ``MINDX_TASK_ID``."""
    return env.get("TASKD_JOB_ID", "").strip() or env.get("MINDX_TASK_ID", "").strip() or None
