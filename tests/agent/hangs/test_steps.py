"""Steps from real worker processes: ``worker.resumed`` and ``worker.step`` through the agent's socket."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from taskd_core import worker as worker_mod
from taskd_core.agent.hangs import ProgressConfig, ProgressWatcher
from taskd_core.agent.hangs.steps import StepTracker, WorkerId
from taskd_core.errors import ConfigError
from taskd_core.models import WorkerEventKind
from taskd_core.testing import wait_until
from taskd_core.worker import MAX_STEP, ProgressReporter

ROOT = Path(__file__).resolve().parents[3]
WAIT = 60.0

#: Resumes from argv[1], steps to argv[2] 0.01 s apart (most steps fall inside the beat gap),
#: says it is done, then touches argv[3] and waits to be killed.
WORKER = textwrap.dedent(
    """
    import pathlib, sys, time
    from taskd_core import worker
    start, stop, flag = int(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3])
    worker.resumed(start)
    for n in range(start + 1, stop + 1):
        time.sleep(0.01)
        worker.step(n)
    worker.done()
    flag.touch()
    time.sleep(120)
    """
)


def spawn(tmp_path: Path, start: int, stop: int) -> tuple[subprocess.Popen[bytes], Path]:
    flag = tmp_path / f"done-{start}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(start), str(stop), str(flag)], env=env)
    return proc, flag


@pytest.mark.parametrize("track_first", [True, False], ids=["tracked", "resumed-before-tracked"])
def test_a_worker_reports_where_it_resumed_its_first_step_and_its_last(
    tmp_path: Path, track_first: bool
) -> None:
    watcher = ProgressWatcher(ProgressConfig(), lambda: None)
    watcher.start()
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc, flag = spawn(tmp_path, 40, 65)
        if track_first:
            watcher.track({proc.pid: (1, 3)})
        wait_until(flag.exists, "worker done", WAIT)
        # A worker can resume before the agent's next look: its datagrams wait for the tracking.
        watcher.track({proc.pid: (1, 3)})
        proc.kill()
        proc.wait(timeout=WAIT)
        # The ledger asks for a dead worker's last step before it is forgotten.
        assert watcher.last_step(proc.pid) == 65  # done() sent the step the beat gap held back
        events = watcher.take_worker_events()
        assert [(e.kind, e.step, e.rank, e.local_rank, e.pid) for e in events] == [
            (WorkerEventKind.RESUMED, 40, 3, 1, proc.pid),
            (WorkerEventKind.STEPPING, 41, 3, 1, proc.pid),
        ]
        assert events[0].time <= events[1].time <= time.time()
        assert watcher.take_worker_events() == []
        watcher.track({})
        assert watcher.last_step(proc.pid) is None
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=WAIT)
        watcher.close()


def sent_ops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, drive: Callable[[ProgressReporter], None]) -> list[list[str]]:
    """What ``drive`` makes a reporter send, every call inside one beat gap: each datagram's op and args."""
    monkeypatch.setattr(worker_mod.time, "monotonic", lambda: 1000.0)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as agent:
        agent.bind(str(tmp_path / "agent.sock"))
        agent.setblocking(False)
        reporter = ProgressReporter(str(tmp_path / "agent.sock"))
        drive(reporter)
        reporter.close()
        ops = []
        with contextlib.suppress(BlockingIOError):
            while True:
                ops.append(agent.recv(512).decode().split()[2:])
        return ops


def test_steps_within_the_beat_gap_ride_on_the_next_datagram(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def drive(reporter: ProgressReporter) -> None:
        reporter.resumed(10)
        for n in range(11, 31):
            reporter.step(n)
        reporter.done()

    # resumed, the first step at once (it dates the stepping phase), the rest held back until done.
    assert sent_ops(tmp_path, monkeypatch, drive) == [["resumed", "10"], ["step", "11"], ["step", "30"], ["done"]]


def test_busy_time_of_held_back_steps_rides_on_the_next_datagram(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def drive(reporter: ProgressReporter) -> None:
        reporter.resumed(0)
        reporter.step(1, busy=0.5)
        for n in range(2, 5):
            reporter.step(n, busy=0.25)
        reporter.step(5)  # not measured: adds no figure
        reporter.done()

    assert sent_ops(tmp_path, monkeypatch, drive) == [
        ["resumed", "0"],
        ["step", "1", "0.500000", "1"],
        ["step", "5", "0.750000", "3"],
        ["done"],
    ]


@pytest.mark.parametrize("bad", [-1, 1.5, "7", True, None, MAX_STEP + 1])
def test_bad_step_counts_are_refused(bad: object) -> None:
    reporter = ProgressReporter(None)
    for call in (reporter.step, reporter.resumed):
        with pytest.raises(ConfigError, match="step count must be an integer"):
            call(bad)  # type: ignore[arg-type]


def test_malformed_step_datagrams_are_ignored() -> None:
    tracker = StepTracker(wall=lambda: 100.0, monotonic=lambda: 50.0)
    who = WorkerId(7, 0, 2)
    for op, text in (("step", "-3"), ("step", "x"), ("resumed", "9" * 30), ("beat", "5")):
        tracker.record(who, op, text, 49.0)
    assert tracker.last_step(7) is None and tracker.take_events() == []
    tracker.record(who, "resumed", "12", 49.5)
    (event,) = tracker.take_events()
    assert (event.kind, event.step, event.time) == (WorkerEventKind.RESUMED, 12, 99.5)
