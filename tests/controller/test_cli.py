"""``taskd controller`` and ``taskd status`` as a user runs them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import WAIT, wait_until
from taskd_core.cli import main

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize("argv", [
    ["--listen", "nonsense"],
    ["--listen", "127.0.0.1:99999"],
    ["--strategies", "teleport"],
    ["--report-timeout", "0"],
])
def test_controller_rejects_bad_arguments_with_exit_2(argv, caplog):
    assert main(["controller", "--state", ":memory:", *argv]) == 2
    assert caplog.records and caplog.records[-1].levelname == "ERROR"


def test_controller_rejects_a_bad_policy_file_with_exit_2(tmp_path, caplog):
    policy = tmp_path / "policy.toml"
    policy.write_text("[defaults]\nmax_cycles = -1\n")
    assert main(["controller", "--state", ":memory:", "--listen", "127.0.0.1:0", "--policy", str(policy)]) == 2
    assert "max_cycles" in caplog.records[-1].getMessage()


def test_controller_daemon_stops_gracefully_on_sigterm(tmp_path, make_agent):
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "taskd_core", "controller", "--listen", "127.0.0.1:0", "--state",
         str(tmp_path / "s.db"), "--port-file", str(port_file)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        wait_until(lambda: port_file.exists() or proc.poll() is not None, what="port file")
        address = port_file.read_text().strip()
        agent = make_agent(address, "job-t").join()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT) == 0
        end = agent.stream_end()
        assert end is None or "UNAVAILABLE" in str(end.code())
        assert f"listening on {address}" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)
        proc.stdout.close()
