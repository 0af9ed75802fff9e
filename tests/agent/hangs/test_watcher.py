"""The progress watcher against real worker processes: each signal is found, with the stack that shows where."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from taskd_core.agent.hangs import watcher as progress_mod
from taskd_core.agent.hangs.watcher import Hang, HangSignal, LearnedTimeout, ProgressConfig, ProgressWatcher
from taskd_core.errors import ConfigError
from taskd_core.worker import ProgressReporter

ROOT = Path(__file__).resolve().parents[3]
HANGS = Path(__file__).parents[1] / "workers" / "hangs.py"
#: Seconds the test waits for a hang at most; detection itself takes about a second here.
WAIT = 60.0
#: Small bounds, so each case is found quickly; the floor keeps the learned timeout sane on a loaded machine.
FAST = ProgressConfig(floor=1.0, ceiling=30.0, min_samples=5, window=50, stopped_bound=0.3, stack_timeout=20.0)


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"no {what} within {timeout}s"
        time.sleep(0.05)


class Watched:
    """A started watcher, its hangs, and the workers a test started under it."""

    def __init__(self, config: ProgressConfig) -> None:
        self.woken = threading.Event()
        self.watcher = ProgressWatcher(config, self.woken.set)
        self.hangs: list[Hang] = []
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, mode: str, *args: str, rank: int = 0) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen([sys.executable, str(HANGS), mode, *args], env=env, stdout=subprocess.PIPE)
        self.procs.append(proc)
        self.watcher.track({p.pid: (i, rank + i) for i, p in enumerate(self.procs)})
        return proc

    def wait_hang(self) -> Hang:
        def found() -> bool:
            self.hangs += self.watcher.take_hangs()
            return bool(self.hangs)

        wait_until(found, WAIT, "a hang")
        return self.hangs[0]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
            assert proc.stdout is not None
            proc.stdout.close()
        self.watcher.close()


@pytest.fixture
def watched() -> Iterator[Watched]:
    w = Watched(FAST)
    w.watcher.start()
    try:
        yield w
    finally:
        w.close()


def test_stopped_worker_is_hung_with_its_stack(watched: Watched) -> None:
    proc = watched.spawn("stop")
    # Garbage on the socket (not from a worker API) is ignored, not fatal to the watch.
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as junk:
        for data in (b"", b"x", b"12 nan beat", b"abc 1 beat", f"{proc.pid} 1 enter".encode(), b"\xff" * 400):
            junk.sendto(data, str(watched.watcher.socket_path))
    assert proc.stdout is not None and proc.stdout.readline() == b"waiting for SIGSTOP\n"
    os.kill(proc.pid, signal.SIGSTOP)
    hang = watched.wait_hang()
    assert (hang.pid, hang.signal, hang.learned) == (proc.pid, HangSignal.STOPPED, False)
    assert "wait_for_stop" in hang.stack
    assert "hung: stopped" in hang.evidence()


def test_spinning_worker_without_heartbeat_is_hung_after_the_learned_timeout(watched: Watched) -> None:
    proc = watched.spawn("spin")
    hang = watched.wait_hang()
    assert (hang.pid, hang.signal, hang.name, hang.learned) == (proc.pid, HangSignal.HEARTBEAT, "heartbeat", True)
    # The beats came every ~0.05 s: the learned timeout is the floor, unless the machine stalled the beats.
    assert FAST.floor <= hang.timeout < FAST.ceiling and hang.waited >= hang.timeout
    assert "spin_without_heartbeat" in hang.stack
    assert "heartbeat " in watched.watcher.describe() and "(learned: p99" in watched.watcher.describe()


def test_sleeping_silent_worker_gets_a_second_timeout(watched: Watched) -> None:
    """Asleep and silent is what a rank blocked in a collective looks like: it is declared only after twice the
    timeout (a real deadlock), leaving the first timeout for finding the busy or stopped culprit."""
    proc = watched.spawn("sleep")
    hang = watched.wait_hang()
    assert (hang.pid, hang.signal) == (proc.pid, HangSignal.HEARTBEAT)
    assert hang.waited >= 2 * hang.timeout
    assert "sleep_without_heartbeat" in hang.stack


def test_section_with_its_own_timeout(watched: Watched) -> None:
    proc = watched.spawn("section")
    hang = watched.wait_hang()
    assert (hang.pid, hang.signal, hang.name, hang.timeout, hang.learned) == (
        proc.pid, HangSignal.SECTION, "load", 0.5, False,
    )
    assert "stuck_in_section" in hang.stack


def test_torch_file_timer_protocol(tmp_path: Path) -> None:
    """A request in torch's FileTimerClient format on TORCHELASTIC_TIMER_FILE; the heartbeat floor is far away."""
    w = Watched(ProgressConfig(floor=20.0, min_samples=5))
    w.watcher.start()
    try:
        assert os.environ["TORCHELASTIC_TIMER_FILE"] == w.watcher.timer_file
        proc = w.spawn("timer")
        hang = w.wait_hang()
        assert (hang.pid, hang.signal, hang.name) == (proc.pid, HangSignal.TIMER, "step")
        assert "overrun_timer" in hang.stack
    finally:
        w.close()
    assert "TORCHELASTIC_TIMER_FILE" not in os.environ and "TASKD_PROGRESS_SOCKET" not in os.environ


def test_faulthandler_dump_without_py_spy(watched: Watched, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress_mod, "py_spy", lambda: None)
    watched.spawn("spin")
    hang = watched.wait_hang()
    assert hang.stack.startswith("(faulthandler dump)") and "spin_without_heartbeat" in hang.stack


def test_a_stuck_py_spy_leaves_the_rest_of_the_budget_to_the_faulthandler_dump(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """py-spy is cut off at its share of the stack budget; the hang is still declared, with the dump's stack."""
    stuck = tmp_path / "py-spy"
    stuck.write_text("#!/bin/sh\nexec sleep 600\n")
    stuck.chmod(0o755)
    monkeypatch.setattr(progress_mod, "py_spy", lambda: str(stuck))
    w = Watched(ProgressConfig(floor=1.0, ceiling=30.0, min_samples=5, window=50, stack_timeout=4.0))
    w.watcher.start()
    try:
        w.spawn("spin")
        hang = w.wait_hang()
    finally:
        w.close()
    assert hang.stack.startswith("(faulthandler dump)") and "spin_without_heartbeat" in hang.stack
    assert "stack taken in " in hang.evidence()


def test_py_spy_is_installed_for_the_tests() -> None:
    assert progress_mod.py_spy() is not None


def test_healthy_worker_with_jittery_steps_is_left_alone(watched: Watched, tmp_path: Path) -> None:
    proc = watched.spawn("healthy", str(tmp_path))
    # Long enough for the learned timeout to be in force over many 5x-varying steps.
    wait_until(lambda: "of 50)" in watched.watcher.describe(), WAIT, "a window full of beat intervals")
    (tmp_path / "finish").touch()
    assert proc.wait(timeout=WAIT) == 0
    assert watched.watcher.take_hangs() == []


def test_learned_timeout_follows_the_samples() -> None:
    config = ProgressConfig(floor=1.0, ceiling=100.0, multiplier=5.0, min_samples=3, window=10)
    learned = LearnedTimeout(config)
    assert learned.value == 100.0 and "learning: 0/3" in learned.describe()
    for _ in range(10):
        learned.add(0.01)
    assert learned.value == 1.0  # the floor
    learned.add(4.0)  # one slow step in a window of 10 is above its p99
    assert learned.value == 20.0
    for _ in range(10):
        learned.add(0.5)  # the slow sample left the window
    assert learned.value == 2.5
    learned.add(1000.0)
    assert learned.value == 100.0  # the ceiling


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"floor": 0.0}, "floor must be a positive number"),
        ({"stopped_bound": float("nan")}, "stopped bound"),
        ({"floor": 10.0, "ceiling": 5.0}, "above ceiling"),
        ({"heartbeat_timeout": -1.0}, "heartbeat timeout must be a positive number"),
        ({"min_samples": 50, "window": 10}, "min samples"),
    ],
)
def test_bad_bounds_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ProgressConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "timeout", "message"),
    [("", None, "section name"), ("a b", None, "section name"), ("x" * 65, None, "section name"),
     ("step", 0.0, "positive"), ("step", float("inf"), "positive")],
)
def test_worker_api_refuses_bad_sections(name: str, timeout: float | None, message: str) -> None:
    reporter = ProgressReporter(None)
    with pytest.raises(ConfigError, match=message):
        reporter.enter(name, timeout)


def test_beats_closer_than_the_gap_are_not_sent(tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as agent:
        agent.bind(str(tmp_path / "agent.sock"))
        agent.settimeout(5)
        reporter = ProgressReporter(str(tmp_path / "agent.sock"))
        for _ in range(50):
            reporter.heartbeat()
        reporter.done()
        pid, _, op = agent.recv(512).decode().split()
        assert (int(pid), op) == (os.getpid(), "beat")
        assert agent.recv(512).decode().split()[2] == "done"
        reporter.close()


def test_worker_api_outside_taskd_does_nothing() -> None:
    reporter = ProgressReporter(None)
    reporter.heartbeat()
    with reporter.section("step"):
        pass
    reporter.close()


@pytest.mark.parametrize("first_closed", [0, 1])
def test_two_watchers_in_one_process_keep_their_own_files_and_leave_the_environment_as_found(first_closed: int) -> None:
    """Two node agents in one process (tests do this): the second must not take the first's timer FIFO for
    a user's, and whichever closes last must not put back a path of the other's, gone with its directory."""
    watchers = [ProgressWatcher(ProgressConfig(), lambda: None) for _ in range(2)]
    for w in watchers:
        w.start()
    assert watchers[0].timer_file != watchers[1].timer_file
    assert os.environ["TORCHELASTIC_TIMER_FILE"] == watchers[1].timer_file
    watchers[first_closed].close()
    watchers[1 - first_closed].close()
    assert "TORCHELASTIC_TIMER_FILE" not in os.environ and "TASKD_PROGRESS_SOCKET" not in os.environ
