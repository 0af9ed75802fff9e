"""One settings chain: defaults once, the reference's environment read one way, the port rule in one place."""

from __future__ import annotations

import argparse
import dataclasses
import signal

import pytest

from taskd_core.agent.config import AgentConfig, DispatchConfig, RestartBackoff
from taskd_core.agent.hangs.config import ProgressConfig
from taskd_core.cli import build_parser
from taskd_core.errors import ConfigError
from taskd_core.launcher.environment import controller_from_env, job_id_from_env
from taskd_core.launcher.flags import OptionValues, add_node_options, node_settings
from taskd_core.launcher.settings import NodeSettings, embedded_port
from taskd_core.models import Credentials, JobPolicy, SlowRankPolicy, Strategy
from taskd_core.values import DEFAULT_CONTROLLER_PORT, join_address, parse_address


def run_settings(argv: list[str], env: dict[str, str] | None = None) -> NodeSettings:
    """The NodeSettings `taskd run ARGV -- true` builds."""
    args = build_parser().parse_args(["run", *argv, "--", "true"])
    settings = node_settings(
        OptionValues(env or {}, args), launcher="taskd", shared=f"{args.master_addr}:{args.master_port}", job_id="default",
        node_rank=args.node_rank, nnodes=args.nnodes, master_addr=args.master_addr,
    )
    # Credentials have their own tests (test_security_settings.py); the rest of the chain is compared here.
    return dataclasses.replace(settings, agent=dataclasses.replace(settings.agent, credentials=Credentials()))


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"MINDX_SERVER_IP": "10.0.0.5"}, "10.0.0.5:8899"),
        ({"MINDX_SERVER_IP": " 10.0.0.5:9000 "}, "10.0.0.5:9000"),
        ({"MINDX_SERVER_IP": "fd00::5"}, "[fd00::5]:8899"),
        ({"MINDX_SERVER_IP": "[fd00::5]:9000"}, "[fd00::5]:9000"),
        ({"MINDX_SERVER_IP": "clusterd.svc"}, "clusterd.svc:8899"),
        ({"TASKD_CONTROLLER": "ctl:7000", "MINDX_SERVER_IP": "10.0.0.5"}, "ctl:7000"),
        ({"TASKD_CONTROLLER": "ctl-0:8899, ctl-1:8899,[fd00::5]:8899"}, "ctl-0:8899,ctl-1:8899,[fd00::5]:8899"),
    ],
)
def test_controller_from_env(env: dict[str, str], expected: str | None) -> None:
    assert controller_from_env(env) == expected


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"MINDX_SERVER_IP": "bad host!"}, "MINDX_SERVER_IP"),
        ({"TASKD_CONTROLLER": "nohost"}, "TASKD_CONTROLLER"),
        ({"TASKD_CONTROLLER": "a:1,,b:2"}, "TASKD_CONTROLLER"),
        ({"TASKD_CONTROLLER": "a:1,b"}, "TASKD_CONTROLLER"),
    ],
)
def test_a_bad_controller_variable_is_named(env: dict[str, str], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        controller_from_env(env)


def test_job_id_from_env_prefers_taskd_then_the_reference() -> None:
    assert job_id_from_env({"TASKD_JOB_ID": "a", "MINDX_TASK_ID": "b"}) == "a"
    assert job_id_from_env({"MINDX_TASK_ID": "b"}) == "b"
    assert job_id_from_env({"TASKD_JOB_ID": " "}) is None


def test_embedded_port_rule() -> None:
    assert embedded_port(None, nnodes=1, controller="") == 0
    assert embedded_port(None, nnodes=2, controller="") == DEFAULT_CONTROLLER_PORT
    assert embedded_port(None, nnodes=2, controller="", multi_node=8119) == 8119
    assert embedded_port(7000, nnodes=2, controller="") == 7000
    assert embedded_port(0, nnodes=2, controller="ctl:1") == 0
    with pytest.raises(ConfigError, match="only works for one node"):
        embedded_port(0, nnodes=2, controller="")
    with pytest.raises(ConfigError, match="not a TCP port"):
        embedded_port(70000, nnodes=1, controller="")


def test_taskd_run_defaults_come_from_the_types() -> None:
    """Nothing given: every value is the default its own class defines."""
    settings = run_settings([])
    assert settings.agent == AgentConfig(job_id="default")
    assert settings.agent.dispatch == DispatchConfig()
    assert settings.policy == JobPolicy(expected_agents=1)
    assert settings.linger == NodeSettings(agent=settings.agent).linger
    assert settings.controller_port == 0


def test_taskd_run_flags_reach_every_link_of_the_chain() -> None:
    settings = run_settings(
        [
            "--nnodes", "2", "--report-deadline", "7", "--health-interval", "0.5", "--connect-timeout", "3",
            "--stop-timeout", "4", "--dump-grace", "6", "--dump-signal", "USR2", "--linger", "9",
            "--strategies", "exit", "--max-cycles", "2", "--job-id", "j1",
        ]
    )
    assert settings.agent == AgentConfig(
        job_id="j1",
        connect_timeout=3.0,
        report_deadline=7.0,
        health_interval=0.5,
        dispatch=DispatchConfig(stop_timeout=4.0, dump_signal=signal.SIGUSR2, dump_grace=6.0),
    )
    assert (settings.linger, settings.controller_port) == (9.0, DEFAULT_CONTROLLER_PORT)
    assert settings.policy == JobPolicy(strategies=(Strategy.EXIT,), max_cycles=2, expected_agents=2)


def test_taskd_run_reads_the_reference_environment() -> None:
    settings = run_settings([], {"MINDX_SERVER_IP": "10.0.0.5", "MINDX_TASK_ID": "mindx-job"})
    assert (settings.agent.controller, settings.job_id) == ("10.0.0.5:8899", "mindx-job")
    # A flag still wins over the environment.
    flagged = run_settings(["--controller", "ctl:1", "--job-id", "mine"], {"MINDX_SERVER_IP": "10.0.0.5"})
    assert (flagged.agent.controller, flagged.job_id) == ("ctl:1", "mine")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--health-interval", "0"], "argument --taskd-health-interval: '0' is not a finite number of seconds > 0"),
        (["--report-deadline", "nan"], "'nan' is not a finite number of seconds >= 0"),
        (["--report-deadline", "soon"], "'soon' is not a finite number of seconds >= 0"),
        (["--controller-port", "x"], "argument --taskd-controller-port: 'x' is not a whole number >= 0"),
    ],
)
def test_bad_values_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="t")
    add_node_options(parser, "taskd-")
    with pytest.raises(SystemExit) as excinfo:
        parser.parse_args([a.replace("--", "--taskd-", 1) if a.startswith("--") else a for a in argv])
    assert excinfo.value.code == 2
    assert message in capsys.readouterr().err


def test_node_settings_check_their_own_values() -> None:
    agent = AgentConfig(job_id="j", node_rank=2)
    with pytest.raises(ConfigError, match="node rank 2 is outside 0..1"):
        NodeSettings(agent=agent, nnodes=2)
    with pytest.raises(ConfigError, match="health interval"):
        AgentConfig(job_id="j", health_interval=0)
    with pytest.raises(ConfigError, match="job id"):
        AgentConfig(job_id="")


def test_hang_detection_flags_reach_the_agent() -> None:
    assert run_settings([]).agent.progress == ProgressConfig()
    settings = run_settings(
        ["--hang-timeout", "20", "--hang-floor", "2", "--hang-ceiling", "60", "--stopped-bound", "1",
         "--disk-sleep-bound", "30"]
    )
    assert settings.agent.progress == ProgressConfig(
        heartbeat_timeout=20.0, floor=2.0, ceiling=60.0, stopped_bound=1.0, disk_sleep_bound=30.0
    )
    assert run_settings(["--no-hang-detection"]).agent.progress == ProgressConfig(enabled=False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hang-floor", "0"], "argument --hang-floor: '0' is not a finite number of seconds > 0"),
        (["--stopped-bound", "never"], "argument --stopped-bound: 'never' is not a finite number"),
    ],
)
def test_bad_hang_flags_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        run_settings(argv)
    assert excinfo.value.code == 2
    assert message in capsys.readouterr().err


def test_hang_bounds_that_contradict_each_other_are_named() -> None:
    with pytest.raises(ConfigError, match="floor 10.0s is above ceiling 5.0s"):
        run_settings(["--hang-floor", "10", "--hang-ceiling", "5"])
def test_join_address_brackets_ipv6_hosts() -> None:
    assert parse_address(join_address("::1", 8899)) == ("::1", 8899)
    assert join_address("node1", 8899) == "node1:8899"


def test_restart_backoff_and_cycle_window_flags_reach_the_agent_and_the_policy() -> None:
    settings = run_settings(
        ["--restart-backoff", "0.5", "--restart-backoff-max", "4", "--healthy-after", "20", "--cycle-window", "600"]
    )
    assert settings.agent.restart_backoff == RestartBackoff(initial=0.5, cap=4.0, healthy_after=20.0)
    assert settings.policy.cycle_window == 600.0
    assert run_settings([]).policy.cycle_window == JobPolicy().cycle_window


@pytest.mark.parametrize("flag", ["--max-cycles", "--cycle-window"])
@pytest.mark.parametrize("env", [{}, {"TASKD_CONTROLLER": "ctl:7000"}])
def test_a_budget_flag_with_an_external_controller_is_refused(flag: str, env: dict[str, str]) -> None:
    """The budget is the controller's policy: a flag it never hears is an error, not silently ignored."""
    argv = [flag, "5"] + ([] if env else ["--controller", "ctl:7000"])
    with pytest.raises(ConfigError, match=f"{flag} sets the budget of the embedded controller.*ctl:7000"):
        run_settings(argv, env)


def test_the_slow_rank_policy_is_a_flag_of_the_embedded_controller() -> None:
    assert run_settings([]).policy.slow_rank is SlowRankPolicy.WARN
    assert run_settings(["--slow-rank", "warn"]).policy.slow_rank is SlowRankPolicy.WARN
    with pytest.raises(ConfigError, match="TASKD_SLOW_RANK: expected one of 'warn', 'replace', got 'evict'"):
        run_settings([], {"TASKD_SLOW_RANK": "evict"})
    assert run_settings([], {"TASKD_SLOW_RANK": "replace"}).policy.slow_rank is SlowRankPolicy.REPLACE
    with pytest.raises(ConfigError, match="slow-rank policy, but this job uses the controller at ctl:7000"):
        run_settings(["--slow-rank", "warn", "--controller", "ctl:7000"])
