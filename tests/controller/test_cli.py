"""``taskd controller`` and ``taskd status`` as a user runs them."""

from __future__ import annotations

import json

import grpc
import pytest

from taskd_core.cli import main


def test_status_prints_jobs_agents_cycle_and_events(controller, make_agent, capsys):
    agent = make_agent(controller.address, "job-s", "node-0", node_rank=0, rank_ids=(0, 1)).join()
    agent.fault({1: 1})
    agent.expect("stopTrain")
    assert main(["status", "--controller", controller.address, "--events", "5"]) == 0
    out = capsys.readouterr().out
    assert "job job-s" in out and "wait-stop" in out and "node-0" in out and "up" in out
    assert "1:1" in out and "transition" in out

    assert main(["status", "--controller", controller.address, "--job", "job-s", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (job,) = data["jobs"]
    assert job["state"] == "wait-stop" and job["agents"][0]["agentId"] == "node-0"


def test_status_of_an_unknown_job_or_a_missing_controller_exits_2(controller, capsys):
    assert main(["status", "--controller", controller.address, "--job", "nope"]) == 2
    assert main(["status", "--controller", "127.0.0.1:1", "--timeout", "0.5"]) == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["--listen", "nonsense"],
        ["--listen", "127.0.0.1:99999"],
        ["--strategies", "teleport"],
        ["--report-timeout", "0"],
    ],
)
def test_controller_rejects_bad_arguments_with_exit_2(argv, caplog):
    assert main(["controller", "--state", ":memory:", *argv]) == 2
    assert caplog.records and caplog.records[-1].levelname == "ERROR"


def test_controller_refuses_a_port_another_controller_holds(controller, caplog):
    assert main(["controller", "--state", ":memory:", "--listen", controller.address]) == 2
    assert "cannot bind" in caplog.records[-1].getMessage()


def test_controller_rejects_a_bad_policy_file_with_exit_2(tmp_path, caplog):
    policy = tmp_path / "policy.toml"
    policy.write_text("[defaults]\nmax_cycles = -1\n")
    assert (
        main(["controller", "--state", ":memory:", "--listen", "127.0.0.1:0", "--policy", str(policy)]) == 2
    )
    assert "max_cycles" in caplog.records[-1].getMessage()


def test_controller_daemon_stops_gracefully_on_sigterm(tmp_path, make_agent, controller_process):
    child = controller_process(tmp_path / "s.db")
    agent = make_agent(child.address, "job-t").join()
    assert child.terminate() == 0
    end = agent.stream_end()
    assert end is None or end.code() == grpc.StatusCode.UNAVAILABLE
    log = child.log.read_text()
    assert f"listening on {child.address}" in log and "stopped" in log
