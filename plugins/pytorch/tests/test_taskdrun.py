"""``taskdrun`` as users run it: options, in-place recovery, budget, signals (workers without torch)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
from pt_support import WORKERS, free_port, kill, pid_alive, records, taskdrun_exe, wait_for

IDLE = str(WORKERS / "idle.py")


def test_help_shows_torchrun_options_and_taskd_options() -> None:
    done = subprocess.run([taskdrun_exe(), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for option in ("--nproc-per-node", "--rdzv-endpoint", "--max-restarts", "--taskd-controller", "--taskd-in-place",
                   "--taskd-max-cycles", "--taskd-strategies", "--taskd-stop-timeout"):
        assert option in done.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--taskd-max-cycles", "-1"], "argument --taskd-max-cycles: '-1' is not a whole number >= 0"),
        (["--taskd-stop-timeout", "soon"], "argument --taskd-stop-timeout: 'soon' is not a finite number of seconds >= 0"),
        (["--taskd-strategies", "retry,bogus"], "unknown strategy 'bogus'"),
        (["--taskd-flush-seconds", "-1"], "'-1' is not a finite number of seconds >= 0"),
        (["--taskd-controller", "nowhere"], "'nowhere' is not HOST:PORT"),
        (["--nnodes", "2", "--taskd-controller-port", "0"], "controller port 0 only works for one node"),
    ],
)
def test_bad_taskd_option_values_give_a_clear_error(argv: list[str], message: str, tmp_path: Path, capsys) -> None:
    from taskd_pytorch.cli import main

    with pytest.raises(SystemExit) as ended:
        main([*argv, IDLE, str(tmp_path)])
    assert ended.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_recover_in_place_restarts_only_the_faulty_rank(launch, out_dir: Path, tmp_path: Path) -> None:
    until = tmp_path / "finish"
    job = launch("--nproc-per-node=2", "--taskd-in-place", IDLE, str(out_dir), "--until", str(until))
    first = wait_for(lambda: len(records(out_dir)) == 2 and records(out_dir), 60, "both workers")
    pids = {r["RANK"]: r["pid"] for r in first}

    kill(pids["1"])

    again = wait_for(lambda: len(records(out_dir)) == 3 and records(out_dir), 60, "rank 1 restarted")
    new = next(r for r in again if r["pid"] not in pids.values())
    assert new["RANK"] == "1" and new["TASKD_RESTART_COUNT"] == "0"  # same environment, not a new round
    assert pid_alive(pids["0"])
    until.touch()
    assert job.wait(timeout=60) == 0
    assert len(records(out_dir)) == 3  # rank 0 was never restarted


@pytest.mark.slow
def test_faults_past_the_budget_end_every_node_non_zero_with_no_worker_left(launch, out_dir: Path) -> None:
    rdzv, ctl = f"127.0.0.1:{free_port()}", str(free_port())
    common = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv}", "--rdzv-id=budget",
              "--taskd-controller-port", ctl, "--taskd-max-cycles", "1", "--taskd-stop-timeout", "5"]
    worker = [IDLE, str(out_dir), "--only-rank", "3", "--after", "1", "--exit-code", "7"]
    nodes = [launch(*common, f"--node-rank={n}", *worker) for n in (0, 1)]

    codes = [node.wait(timeout=180) for node in nodes]

    assert all(code != 0 for code in codes), codes
    seen = records(out_dir)
    assert {r["TASKD_RESTART_COUNT"] for r in seen} == {"0", "1"}  # one recovery, then given up
    assert not [r["pid"] for r in seen if pid_alive(r["pid"])]


@pytest.mark.slow
def test_sigterm_stops_and_reaps_every_worker_and_exits_143(launch, out_dir: Path) -> None:
    job = launch("--nproc-per-node=2", IDLE, str(out_dir))
    seen = wait_for(lambda: len(records(out_dir)) == 2 and records(out_dir), 60, "both workers")

    job.send_signal(signal.SIGTERM)

    assert job.wait(timeout=60) == 128 + signal.SIGTERM
    assert not [r["pid"] for r in seen if pid_alive(r["pid"])]
