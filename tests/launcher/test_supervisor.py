"""Real child processes through the supervisor: graceful stop, SIGKILL escalation, grandchildren, reaping."""

from __future__ import annotations

import signal
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from taskd_core.launcher.supervisor import WorkerProcess, group_alive, stop_processes
from taskd_core.testing import is_unreaped_child, process_running, wait_for_file

#: Writes its pid to argv[1] once its SIGTERM handler is in place, then sleeps.
SLEEPER = textwrap.dedent(
    """
    import os, signal, sys, time
    mode = sys.argv[2]
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(sys.argv[1], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
    """
)

#: Starts a grandchild (which ignores SIGTERM when asked), writes its pid to argv[1], sleeps.
PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[3], sys.argv[1], sys.argv[2]])
    time.sleep(120)
    """
)


def spawn(tmp_path: Path, name: str, script: str, *args: str) -> tuple[WorkerProcess, Path]:
    pid_file = tmp_path / f"{name}.pid"
    proc = WorkerProcess(
        name,
        [sys.executable, "-c", script, str(pid_file), *args],
        {"TASKD_TEST": name},
        tmp_path / name / "out.log",
    )
    return proc, pid_file


@pytest.fixture
def started() -> Iterator[list[WorkerProcess]]:
    """Every WorkerProcess a test starts; all are SIGKILLed and reaped afterwards, whatever happened."""
    procs: list[WorkerProcess] = []
    yield procs
    stop_processes(procs, timeout=0)


def test_graceful_stop_reaps_and_closes_logs(tmp_path: Path, started: list[WorkerProcess]) -> None:
    """SIGTERM ends well-behaved workers before the deadline; they are reaped and their logs closed."""
    pairs = [spawn(tmp_path, f"w{i}", SLEEPER, "normal") for i in range(2)]
    started.extend(p for p, _ in pairs)
    for _, pid_file in pairs:
        wait_for_file(pid_file)
    stop_processes(started, timeout=60)
    for proc in started:
        assert proc.returncode == -signal.SIGTERM
        assert not is_unreaped_child(proc.pid)
        assert not group_alive(proc.pid)
    assert started[0]._log is None


def test_sigterm_ignoring_worker_is_killed_at_deadline(tmp_path: Path, started: list[WorkerProcess]) -> None:
    """A worker ignoring SIGTERM gets SIGKILL at the shared deadline; the polite one keeps SIGTERM's code."""
    stubborn, stubborn_pid = spawn(tmp_path, "stubborn", SLEEPER, "ignore-term")
    polite, polite_pid = spawn(tmp_path, "polite", SLEEPER, "normal")
    started.extend([stubborn, polite])
    wait_for_file(stubborn_pid)
    wait_for_file(polite_pid)
    stop_processes(started, timeout=0.5)
    assert stubborn.returncode == -signal.SIGKILL
    assert polite.returncode == -signal.SIGTERM
    assert not is_unreaped_child(stubborn.pid)


@pytest.mark.parametrize("grandchild_mode", ["normal", "ignore-term"])
def test_stop_leaves_no_grandchild(
    tmp_path: Path, started: list[WorkerProcess], grandchild_mode: str
) -> None:
    """Stopping a worker also ends the grandchild it spawned, even one that ignores SIGTERM."""
    proc, pid_file = spawn(tmp_path, "parent", PARENT, grandchild_mode, SLEEPER)
    started.append(proc)
    grandchild = int(wait_for_file(pid_file))
    assert process_running(grandchild)
    stop_processes([proc], timeout=0.5)
    assert not process_running(grandchild)
    assert not group_alive(proc.pid)
    assert not is_unreaped_child(proc.pid)


def test_orphaned_grandchild_is_killed_after_leader_exit(
    tmp_path: Path, started: list[WorkerProcess]
) -> None:
    """A group whose leader already exited is still signalled: its orphan does not survive the stop."""
    script = PARENT.replace("time.sleep(120)", "sys.exit(3)")
    proc, pid_file = spawn(tmp_path, "leader", script, "ignore-term", SLEEPER)
    started.append(proc)
    grandchild = int(wait_for_file(pid_file))
    assert proc.wait(60) == 3
    assert process_running(grandchild)
    stop_processes([proc], timeout=0.5)
    assert not process_running(grandchild)


def test_stop_of_exited_worker_is_quiet(tmp_path: Path, started: list[WorkerProcess]) -> None:
    """Stopping a worker that already exited sends nothing and keeps its exit code."""
    proc = WorkerProcess("done", [sys.executable, "-c", "raise SystemExit(5)"], {}, None)
    started.append(proc)
    assert proc.wait(60) == 5
    stop_processes([proc], timeout=5)
    assert proc.returncode == 5


def test_worker_sees_env_and_writes_log(tmp_path: Path, started: list[WorkerProcess]) -> None:
    """The worker's environment is the launcher's plus the updates; its output lands in its log file."""
    log = tmp_path / "deep" / "dir" / "w.log"
    proc = WorkerProcess(
        "env",
        [sys.executable, "-c", "import os; print(os.environ['TASKD_X'], os.environ['PATH'] != '')"],
        {"TASKD_X": "hello"},
        log,
    )
    started.append(proc)
    assert proc.wait(60) == 0
    assert log.read_text().split() == ["hello", "True"]
