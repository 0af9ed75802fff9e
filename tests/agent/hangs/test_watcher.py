"""The progress watcher against real worker processes: each signal is found, with the stack that shows where."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from taskd_core.agent.hangs import Hang, HangSignal, ProgressConfig, ProgressWatcher
from taskd_core.testing import wait_until

ROOT = Path(__file__).resolve().parents[3]
HANGS = Path(__file__).parents[1] / "workers" / "hangs.py"
#: Seconds the test waits for a hang at most; detection itself takes about a second here.
WAIT = 60.0
#: Small bounds, so each case is found quickly; the floor keeps the learned timeout sane on a loaded machine.
FAST = ProgressConfig(floor=1.0, ceiling=30.0, min_samples=5, window=50, stopped_bound=0.3, stack_timeout=20.0)


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

        wait_until(found, "a hang", WAIT)
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


def test_healthy_worker_with_jittery_steps_is_left_alone(watched: Watched, tmp_path: Path) -> None:
    proc = watched.spawn("healthy", str(tmp_path))
    # Long enough for the learned timeout to be in force over many 5x-varying steps.
    wait_until(lambda: "of 50)" in watched.watcher.describe(), "a window full of beat intervals", WAIT)
    (tmp_path / "finish").touch()
    assert proc.wait(timeout=WAIT) == 0
    assert watched.watcher.take_hangs() == []
