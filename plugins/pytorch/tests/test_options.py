"""``taskdrun``'s TaskD options resolve through the launchers' one settings chain."""

from __future__ import annotations

import dataclasses
import signal

from taskd_core.agent.config import AgentConfig, DispatchConfig
from taskd_core.models import Credentials, JobPolicy
from taskd_pytorch.options import FLUSH_SECONDS, STOP_SIGNALS, TaskdOptions, build_parser


def options(argv: list[str], env: dict[str, str] | None = None, nnodes: int = 1) -> TaskdOptions:
    args = build_parser().parse_args([*argv, "train.py"])
    # Several nodes beyond loopback need a shared token; credentials are compared in their own test.
    got = TaskdOptions.from_args(args, {"TASKD_JOB_TOKEN": "t", **(env or {})}, nnodes=nnodes, master_addr="10.0.0.1")
    agent = dataclasses.replace(got.node.agent, credentials=Credentials())
    return dataclasses.replace(got, node=dataclasses.replace(got.node, agent=agent))


def test_the_reference_environment_is_read_as_taskd_run_reads_it() -> None:
    """MINDX_SERVER_IP names ClusterD's host (port 8899) and MINDX_TASK_ID the job, as for `taskd run`."""
    node = options([], {"MINDX_SERVER_IP": "10.0.0.5", "MINDX_TASK_ID": "mindx-job"}).node
    assert (node.agent.controller, node.job_id) == ("10.0.0.5:8899", "mindx-job")


def test_agent_settings_are_settable_and_default_from_the_types() -> None:
    agent = options([]).node.agent
    assert agent == AgentConfig(job_id=agent.job_id) and agent.job_id.startswith("taskdrun-")
    node = options(
        ["--taskd-report-deadline", "7", "--taskd-health-interval", "2", "--taskd-dump-signal", "USR2",
         "--taskd-job-id", "j", "--node-rank", "1"],
        nnodes=2,
    ).node
    assert node.agent == AgentConfig(
        job_id="j", node_rank=1, report_deadline=7.0, health_interval=2.0,
        dispatch=DispatchConfig(dump_signal=signal.SIGUSR2),
    )
    # Any free port on several nodes too: rank 0 publishes it in the rendezvous store.
    assert node.stop_signals == STOP_SIGNALS and node.controller_port == 0
    assert options(["--taskd-controller-port", "0"], nnodes=2).node.controller_port == 0


def test_the_cycle_budget_falls_back_to_max_restarts_and_the_job_to_rdzv_id() -> None:
    node = options(["--max-restarts", "4", "--rdzv-id", "r1"]).node
    assert (node.policy.max_cycles, node.job_id) == (4, "r1")
    assert options(["--max-restarts", "4", "--taskd-max-cycles", "1"]).node.policy.max_cycles == 1


def test_the_flush_window_defaults_short_under_taskdrun_and_stays_settable() -> None:
    """Restarts of the whole group (or live rounds) need no window for the peers' failures that follow a death."""
    assert options([]).node.policy.flush_seconds == FLUSH_SECONDS < JobPolicy().flush_seconds
    assert options(["--taskd-flush-seconds", "1"]).node.policy.flush_seconds == 1.0
