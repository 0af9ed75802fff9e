"""msrun's environment resolves through the launchers' one settings chain."""

from __future__ import annotations

import dataclasses

import pytest

from taskd_core.agent.config import AgentConfig, DispatchConfig
from taskd_core.agent.hangs.config import ProgressConfig
from taskd_core.errors import ConfigError
from taskd_core.models import Credentials, WorkerState, WorkerStatus
from taskd_mindspore.runner import MsrunSettings

TWO_LOCAL = {r: WorkerStatus(r, r, WorkerState.NOT_STARTED) for r in range(2)}


def settings(**env: str) -> MsrunSettings:
    """Credentials are compared in their own test; here they are blanked."""
    got = MsrunSettings.from_env(env, TWO_LOCAL)
    agent = dataclasses.replace(got.node.agent, credentials=Credentials())
    return dataclasses.replace(got, node=dataclasses.replace(got.node, agent=agent))


def test_the_reference_environment_is_read_as_taskd_run_reads_it() -> None:
    node = settings(MINDX_SERVER_IP="10.0.0.5", MINDX_TASK_ID="mindx-job").node
    assert (node.agent.controller, node.job_id) == ("10.0.0.5:8899", "mindx-job")


def test_agent_settings_come_from_taskd_variables_with_the_types_defaults() -> None:
    assert settings(TASKD_JOB_ID="j").node.agent == AgentConfig(job_id="j")
    agent = settings(
        TASKD_JOB_ID="j", TASKD_REPORT_DEADLINE="7", TASKD_HEALTH_INTERVAL="2", TASKD_CONNECT_TIMEOUT="3",
        TASKD_STOP_TIMEOUT="4", TASKD_DUMP_GRACE="6",
    ).node.agent
    assert agent == AgentConfig(
        job_id="j", connect_timeout=3.0, report_deadline=7.0, health_interval=2.0,
        dispatch=DispatchConfig(stop_timeout=4.0, dump_grace=6.0),
    )


def test_hang_detection_comes_from_taskd_variables() -> None:
    agent = settings(TASKD_HANG_TIMEOUT="20", TASKD_STOPPED_BOUND="1", TASKD_HANG_CEILING="60").node.agent
    assert agent.progress == ProgressConfig(heartbeat_timeout=20.0, stopped_bound=1.0, ceiling=60.0)
    assert settings(TASKD_HANG_DETECTION="0").node.agent.progress == ProgressConfig(enabled=False)


def test_the_port_rule_is_the_launchers_one() -> None:
    """One node: any free port; several: the scheduler's port plus one, known to every node."""
    assert settings().node.controller_port == 0
    assert settings(MS_WORKER_NUM="4", MS_SCHED_PORT="9000").node.controller_port == 9001
    with pytest.raises(ConfigError, match="controller port 0 only works for one node"):
        settings(MS_WORKER_NUM="4", TASKD_CONTROLLER_PORT="0")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TASKD_HEALTH_INTERVAL": "0"}, "TASKD_HEALTH_INTERVAL: '0' is not a finite number of seconds > 0"),
        ({"TASKD_REPORT_DEADLINE": "soon"}, "TASKD_REPORT_DEADLINE: 'soon' is not a finite number"),
        ({"MINDX_SERVER_IP": "bad host!"}, "MINDX_SERVER_IP"),
        ({"TASKD_MAX_CYCLES": "1.5"}, "TASKD_MAX_CYCLES: '1.5' is not a whole number >= 0"),
        ({"TASKD_HANG_DETECTION": "maybe"}, "TASKD_HANG_DETECTION: 'maybe' is neither on .1, on, true, yes. nor off"),
        ({"TASKD_HANG_FLOOR": "-1"}, "TASKD_HANG_FLOOR: '-1' is not a finite number of seconds > 0"),
        ({"TASKD_HANG_FLOOR": "9", "TASKD_HANG_CEILING": "8"}, "floor 9.0s is above ceiling 8.0s"),
        ({"TASKD_DUMP_SIGNAL": "KILL"}, "TASKD_DUMP_SIGNAL: SIGKILL cannot be caught"),
        ({"TASKD_STOP_TIMEOUT": "1e308"}, r"TASKD_STOP_TIMEOUT: '1e308' is more than 86400 seconds \(a day\)"),
        ({"TASKD_MAX_CYCLES": "99999999999"}, "TASKD_MAX_CYCLES: '99999999999' is more than 2147483647"),
        ({"MS_WORKER_NUM": "99999999999"}, "MS_WORKER_NUM: '99999999999' is more than"),
        ({"TASKD_INSECURE": "maybe"}, "TASKD_INSECURE: 'maybe' is neither on"),
        ({"TASKD_CONTROLLER": "ctl:7000", "TASKD_MAX_CYCLES": "5"}, "TASKD_MAX_CYCLES sets the budget of the embedded"),
    ],
)
def test_bad_variables_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        settings(**env)


def test_every_shared_setting_has_its_variable() -> None:
    """msrun reads the same settings as `taskd run`'s flags, by their TASKD_ names: one builder for all."""
    node = settings(TASKD_JOB_ID="j", TASKD_DUMP_SIGNAL="USR2", TASKD_RESTART_BACKOFF="0", TASKD_REPORT_TIMEOUT="30",
                    TASKD_CYCLE_WINDOW="0", TASKD_METRICS_PORT="0", TASKD_FORK_SERVER="0").node
    assert node.agent.dispatch.dump_signal.name == "SIGUSR2" and node.agent.restart_backoff.initial == 0.0
    assert (node.policy.report_timeout, node.policy.cycle_window, node.metrics_port) == (30.0, 0.0, 0)
    assert not node.fork_server.enabled


def test_msrun_credentials_and_launch_identity() -> None:
    one = MsrunSettings.from_env({}, TWO_LOCAL).node
    again = MsrunSettings.from_env({}, TWO_LOCAL).node
    assert one.agent.credentials.token and one.agent.credentials.token != again.agent.credentials.token
    assert one.job_id.startswith("msrun-") and one.job_id != again.job_id  # unique per launch
    env = {"MS_WORKER_NUM": "4", "MS_SCHED_HOST": "10.0.0.1", "MS_SCHED_PORT": "9000", "TASKD_JOB_TOKEN": "t"}
    node0, node1 = (MsrunSettings.from_env({**env, "MS_NODE_RANK": str(n)}, TWO_LOCAL).node for n in (0, 1))
    assert node0.job_id == node1.job_id and node0.agent.credentials.launch == node1.agent.credentials.launch
    with pytest.raises(ConfigError, match="needs TASKD_JOB_TOKEN"):
        MsrunSettings.from_env({**env, "TASKD_JOB_TOKEN": ""}, TWO_LOCAL)
    assert MsrunSettings.from_env({**env, "TASKD_INSECURE": "1"}, TWO_LOCAL).node.insecure
