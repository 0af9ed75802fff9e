"""``taskdrun`` as users run it: options, in-place recovery, budget, signals (workers without torch)."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
from pt_support import WORKERS, kill, records, taskdrun_exe

from taskd_core.testing import free_port, process_running, wait_until

IDLE = str(WORKERS / "idle.py")


def test_help_shows_torchrun_options_and_taskd_options() -> None:
    done = subprocess.run([taskdrun_exe(), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for option in (
        "--nproc-per-node",
        "--rdzv-endpoint",
        "--max-restarts",
        "--taskd-controller",
        "--taskd-in-place",
        "--taskd-max-cycles",
        "--taskd-strategies",
        "--taskd-stop-timeout",
    ):
        assert option in done.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--taskd-max-cycles", "-1"], "argument --taskd-max-cycles: '-1' is not a whole number >= 0"),
        (
            ["--taskd-stop-timeout", "soon"],
            "argument --taskd-stop-timeout: 'soon' is not a finite number of seconds >= 0",
        ),
        (["--taskd-strategies", "retry,bogus"], "unknown strategy 'bogus'"),
        (
            ["--taskd-slow-rank", "evict"],
            "argument --taskd-slow-rank: slow-rank: expected one of 'warn', 'replace'",
        ),
        (["--taskd-flush-seconds", "-1"], "'-1' is not a finite number of seconds >= 0"),
        (["--taskd-controller", "nowhere"], "'nowhere' is not HOST:PORT"),
        (["--taskd-controller-port", "70000"], "controller port: 70000 is not a TCP port"),
        (["--nnodes", "3:2"], "argument --nnodes: '3:2': MIN (3) is more than MAX (2); use --nnodes=MIN:MAX"),
        (["--nnodes", "0:2"], "argument --nnodes: '0' is not a whole number >= 1"),
        (
            ["--nnodes", "1:2"],
            "--nnodes=1:2 with --rdzv-backend=static: a job whose number of nodes may change needs a "
            "rendezvous with rounds; use --rdzv-backend=c10d or etcd-v2 (static is the default",
        ),
        (
            ["--nnodes", "1:2", "--rdzv-backend=etcd", "--rdzv-endpoint=127.0.0.1:1"],
            "--nnodes=1:2 with --rdzv-backend=etcd: a job whose number of nodes may change needs",
        ),
        (["--taskd-max-cycles", "99999999999"], "--taskd-max-cycles: '99999999999' is more than 2147483647"),
        (
            ["--taskd-stop-timeout", "1e308"],
            "--taskd-stop-timeout: '1e308' is more than 86400 seconds (a day)",
        ),
        (["--taskd-dump-signal", "KILL"], "--taskd-dump-signal: SIGKILL cannot be caught"),
        # torchrun's own options, which torch checks only when it uses them (with a traceback), or never.
        (["--nproc-per-node=0"], "--nproc-per-node/--nproc_per_node: '0' is not a whole number >= 1"),
        (
            ["--nproc-per-node=1000000000"],
            "--nproc-per-node/--nproc_per_node: '1000000000' is more than 1024",
        ),
        (
            ["--rdzv-backend=bogus"],
            "unknown rendezvous backend 'bogus'; use one of: c10d, etcd, etcd-v2, static",
        ),
        (["--rdzv-endpoint=::::"], "--rdzv-endpoint/--rdzv_endpoint: '::::' is not HOST[:PORT]"),
        (["--master-port=99999"], "--master-port/--master_port: '99999' is not a TCP port (0..65535)"),
        (
            ["--max-restarts=99999999999"],
            "--max-restarts/--max_restarts: '99999999999' is more than 2147483647",
        ),
        (["--monitor-interval=nan"], "--monitor-interval/--monitor_interval: 'nan' is not a finite number"),
    ],
)
def test_bad_taskd_option_values_give_a_clear_error(
    argv: list[str], message: str, tmp_path: Path, capsys
) -> None:
    from taskd_pytorch.cli import main

    with pytest.raises(SystemExit) as ended:
        main([*argv, IDLE, str(tmp_path)])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert message in err.strip().splitlines()[-1] and "Traceback" not in err


def test_a_log_dir_under_a_file_ends_taskdrun_with_one_line(tmp_path: Path) -> None:
    """The real command: nothing starts (no fork server to break its pipe), exit 2, no traceback."""
    (tmp_path / "file").write_text("")
    done = subprocess.run(
        [
            taskdrun_exe(),
            f"--log-dir={tmp_path / 'file' / 'logs'}",
            "--nproc-per-node=0",
            IDLE,
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith(f"{tmp_path / 'file'} is a file, not a directory; pick a directory")
    )


@pytest.mark.slow
def test_recover_in_place_restarts_only_the_faulty_rank(launch, out_dir: Path, tmp_path: Path) -> None:
    until = tmp_path / "finish"
    job = launch("--nproc-per-node=2", "--taskd-in-place", IDLE, str(out_dir), "--until", str(until))
    first = wait_until(lambda: len(records(out_dir)) == 2 and records(out_dir), "both workers", 60)
    pids = {r["RANK"]: r["pid"] for r in first}

    kill(pids["1"])

    again = wait_until(lambda: len(records(out_dir)) == 3 and records(out_dir), "rank 1 restarted", 60)
    new = next(r for r in again if r["pid"] not in pids.values())
    assert new["RANK"] == "1" and new["TASKD_RESTART_COUNT"] == "0"  # same environment, not a new round
    assert process_running(pids["0"])
    until.touch()
    assert job.wait(timeout=60) == 0
    assert len(records(out_dir)) == 3  # rank 0 was never restarted


def c10d(job: str, nnodes: int | str = 2) -> list[str]:
    """torchrun's elastic multi-node form: no node rank, no TaskD option."""
    return [
        f"--nnodes={nnodes}",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--rdzv-id={job}",
    ]


@pytest.mark.slow
def test_faults_past_the_budget_end_every_node_non_zero_with_no_worker_left(launch, out_dir: Path) -> None:
    common = [*c10d("budget"), "--taskd-max-cycles", "1", "--taskd-stop-timeout", "5"]
    worker = [IDLE, str(out_dir), "--only-rank", "3", "--after", "1", "--exit-code", "7"]
    nodes = [launch(*common, *worker) for n in (0, 1)]

    codes = [node.wait(timeout=180) for node in nodes]

    assert all(code != 0 for code in codes), codes
    seen = records(out_dir)
    assert {r["TASKD_RESTART_COUNT"] for r in seen} == {"0", "1"}  # one recovery, then given up
    assert not [r["pid"] for r in seen if process_running(r["pid"])]


@pytest.mark.slow
def test_etcd_rendezvous_recovers_a_killed_rank_with_a_replica_on_every_node(
    launch, out_dir: Path, tmp_path: Path, etcd_server: str
) -> None:
    until = tmp_path / "finish"
    common = [
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=etcd-v2",
        f"--rdzv-endpoint={etcd_server}",
        "--rdzv-id=etcd-job",
        "--taskd-stop-timeout",
        "5",
    ]
    nodes = [launch(*common, IDLE, str(out_dir), "--until", str(until), log=f"etcd{n}") for n in (0, 1)]
    first = wait_until(lambda: len(records(out_dir)) == 4 and records(out_dir), "all four workers", 120)

    kill(next(r["pid"] for r in first if r["RANK"] == "3"))

    again = wait_until(lambda: len(records(out_dir)) == 8 and records(out_dir), "all four workers again", 120)
    assert sorted(r["RANK"] for r in again if r["TASKD_RESTART_COUNT"] == "1") == ["0", "1", "2", "3"]
    until.touch()
    assert [node.wait(timeout=120) for node in nodes] == [0, 0]
    logs = [(tmp_path / f"etcd{n}.{n}.log").read_text() for n in (0, 1)]
    assert all("controller replica listening" in log for log in logs)
    # A replica leads; on a loaded machine its lease may lapse and the other take over, which is
    # the election working, not a fault (the job still recovered and ended 0 above).
    assert any("this replica (" in log and ") leads" in log for log in logs)


@pytest.mark.slow
def test_losing_the_node_that_hosts_the_controller_ends_the_other_node_with_a_clear_message(
    launch, out_dir: Path, tmp_path: Path
) -> None:
    common = [*c10d("lost"), "--taskd-connect-timeout", "3", "--taskd-stop-timeout", "5"]
    nodes = [launch(*common, IDLE, str(out_dir), log=f"lost{n}") for n in (0, 1)]
    seen = wait_until(lambda: len(records(out_dir)) == 4 and records(out_dir), "all four workers", 120)
    logs = [tmp_path / f"lost{n}.{n}.log" for n in (0, 1)]
    host = next(n for n in (0, 1) if "embedded controller listening" in logs[n].read_text())

    os.killpg(nodes[host].pid, signal.SIGKILL)  # the node is lost: its launcher and everything in its session
    for r in seen:
        if r["GROUP_RANK"] == "0":
            kill(r["pid"])

    assert nodes[1 - host].wait(timeout=180) == 1
    assert "the job's controller is gone" in logs[1 - host].read_text()
    # Each node said so at start, and what survives it.
    for log in logs:
        assert "the job does not survive the loss of that node" in log.read_text()
        assert "--rdzv-backend=etcd-v2" in log.read_text()
    assert not [r["pid"] for r in seen if r["GROUP_RANK"] != "0" and process_running(r["pid"])]


@pytest.mark.slow
def test_sigterm_while_waiting_in_the_rendezvous_ends_taskdrun_at_once(
    launch, out_dir: Path, tmp_path: Path
) -> None:
    # The second node never comes: torch's rendezvous would wait 600 s for it.
    node = launch(*c10d("alone"), IDLE, str(out_dir), log="alone")
    log = tmp_path / "alone.0.log"
    wait_until(
        lambda: "joining the c10d rendezvous" in log.read_text(), "taskdrun to wait in the rendezvous", 120
    )

    node.send_signal(signal.SIGTERM)

    assert node.wait(timeout=60) == 128 + signal.SIGTERM
    assert "rendezvous interrupted by signal 15" in log.read_text()
    assert records(out_dir) == []


@pytest.mark.slow
def test_sigterm_while_the_controller_cannot_be_reached_ends_taskdrun_at_once(
    launch, out_dir: Path, tmp_path: Path
) -> None:
    # Nothing listens there; without the signal taskdrun would keep trying for 600 s.
    dead = f"127.0.0.1:{free_port()}"
    node = launch(
        "--nproc-per-node=2",
        "--taskd-controller",
        dead,
        "--taskd-connect-timeout",
        "600",
        IDLE,
        str(out_dir),
        log="unreachable",
    )
    log = tmp_path / "unreachable.0.log"
    wait_until(lambda: f"controller {dead}" in log.read_text(), "taskdrun to try the controller", 120)

    node.send_signal(signal.SIGTERM)

    assert node.wait(timeout=60) == 128 + signal.SIGTERM
    assert records(out_dir) == []


@pytest.mark.slow
def test_nnodes_min_max_with_one_node_trains_on_the_nodes_that_came_by_the_last_call(
    launch, out_dir: Path
) -> None:
    """torch's own launcher test of the elastic form (``test_launch_elastic``): one node of 1:2."""
    conf = "--rdzv-conf=join_timeout=5,last_call_timeout=1,timeout=5"
    node = launch(*c10d("elastic", nnodes="1:2"), conf, IDLE, str(out_dir), "--after", "0", log="elastic")

    assert node.wait(timeout=120) == 0
    seen = records(out_dir)
    assert sorted((r["RANK"], r["WORLD_SIZE"], r["GROUP_RANK"]) for r in seen) == [
        ("0", "2", "0"),
        ("1", "2", "0"),
    ]


@pytest.mark.slow
def test_nnodes_min_max_with_no_restarts_ends_with_exit_1_when_a_worker_fails(
    launch, out_dir: Path, tmp_path: Path
) -> None:
    """torch's ``test_launch_elastic_worker_raise_exception``: ``--max-restarts=0``, a worker fails, the
    launcher exits 1 (torchrun's ChildFailedError) and says why, with no worker left behind."""
    conf = "--rdzv-conf=join_timeout=5,last_call_timeout=1,timeout=5"
    worker = [IDLE, str(out_dir), "--after", "0", "--exit-code", "3"]
    node = launch(*c10d("fails", nnodes="1:2"), conf, "--max-restarts=0", *worker, log="fails")

    assert node.wait(timeout=120) == 1
    log = (tmp_path / "fails.0.log").read_text()
    assert "failed with exit code 3" in log and "the controller gave the job up" in log
    assert not [r["pid"] for r in records(out_dir) if process_running(r["pid"])]


@pytest.mark.slow
def test_sigterm_stops_and_reaps_every_worker_and_exits_143(launch, out_dir: Path) -> None:
    job = launch("--nproc-per-node=2", IDLE, str(out_dir))
    seen = wait_until(lambda: len(records(out_dir)) == 2 and records(out_dir), "both workers", 60)

    job.send_signal(signal.SIGTERM)

    assert job.wait(timeout=60) == 128 + signal.SIGTERM
    assert not [r["pid"] for r in seen if process_running(r["pid"])]


@pytest.mark.slow
def test_sigkill_of_taskdrun_leaves_no_worker(launch, out_dir: Path) -> None:
    """taskdrun is SIGKILLed (no cleanup runs): its lifeline guard kills every worker."""
    job = launch("--nproc-per-node=2", IDLE, str(out_dir))
    seen = wait_until(lambda: len(records(out_dir)) == 2 and records(out_dir), "both workers", 60)

    job.kill()
    job.wait(timeout=60)

    # Measured well under 1 s; the wait is generous for a loaded machine.
    wait_until(
        lambda: not [r["pid"] for r in seen if process_running(r["pid"])], "workers to die with taskdrun", 5
    )


def _scratch(launcher_pid: int) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"taskd-*-{launcher_pid}-*"))


def _escaped(seen: list[dict[str, Any]]) -> list[int]:
    return [pid for record in seen for pid in record["escaped"]]


@pytest.mark.slow
@pytest.mark.parametrize("warmth", [[], ["--taskd-no-fork-server"]], ids=["forked", "exec"])
def test_children_that_left_their_group_end_with_recovery_job_and_sigkill(
    launch, out_dir: Path, warmth: list[str]
) -> None:
    """Workers leave children in sessions of their own (setsid): a recovery ends the stopped workers'
    ones, and a SIGKILLed taskdrun's guard ends the rest."""
    job = launch("--nproc-per-node=2", *warmth, IDLE, str(out_dir), "--escape")
    first = wait_until(lambda: len(records(out_dir)) == 2 and records(out_dir), "both workers", 60)
    assert all(process_running(pid) for pid in _escaped(first))
    kill(int(next(r for r in first if r["RANK"] == "1")["pid"]))
    again = wait_until(lambda: len(records(out_dir)) == 4 and records(out_dir), "both workers restarted", 60)
    assert not [pid for pid in _escaped(first) if process_running(pid)]
    assert _scratch(job.pid)  # live recovery's channel, the hang watcher's socket
    job.kill()
    job.wait(timeout=60)
    wait_until(
        lambda: not [pid for pid in _escaped(again) if process_running(pid)], "the guard to end them", 30
    )
    wait_until(lambda: not _scratch(job.pid), "the guard to remove taskdrun's temporary directories", 30)


@pytest.mark.slow
def test_children_that_left_their_group_end_with_the_job(launch, out_dir: Path) -> None:
    job = launch("--nproc-per-node=2", IDLE, str(out_dir), "--escape", "--after", "1")
    assert job.wait(timeout=120) == 0
    assert not [pid for pid in _escaped(records(out_dir)) if process_running(pid)]
    assert not _scratch(job.pid)
