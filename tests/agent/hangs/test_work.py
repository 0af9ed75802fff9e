"""Work per step from real worker processes: ``worker.step(n, busy=...)`` through the agent's socket."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from taskd_core.agent.hangs import ProgressConfig, ProgressWatcher
from taskd_core.agent.hangs.work import WorkSamples, parse_work
from taskd_core.errors import ConfigError
from taskd_core.testing import wait_until
from taskd_core.worker import ProgressReporter

ROOT = Path(__file__).resolve().parents[3]
WAIT = 60.0

#: Steps 1..argv[1] 0.01 s apart, each saying it worked argv[2] seconds, then touches argv[3].
WORKER = textwrap.dedent(
    """
    import pathlib, sys, time
    from taskd_core import worker
    stop, busy, flag = int(sys.argv[1]), float(sys.argv[2]), pathlib.Path(sys.argv[3])
    worker.resumed(0)
    for n in range(1, stop + 1):
        time.sleep(0.01)
        worker.step(n, busy=busy)
    worker.done()
    flag.touch()
    time.sleep(120)
    """
)


def test_a_workers_busy_seconds_reach_the_agent_as_work_per_step(tmp_path: Path) -> None:
    watcher = ProgressWatcher(ProgressConfig(), lambda: None)
    watcher.start()
    flag = tmp_path / "done"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", WORKER, "60", "0.004", str(flag)], env=env)
    try:
        watcher.track({proc.pid: (1, 5)})
        wait_until(flag.exists, "worker done", WAIT)
        wait_until(lambda: watcher.last_step(proc.pid) == 60, "the last step", WAIT)
        work = watcher.take_work()
        # Every step is covered once, by samples that fold the steps of one beat gap together.
        assert {(w.rank, w.pid) for w in work} == {(5, proc.pid)}
        assert sum(w.steps for w in work) == 60 and work[-1].step == 60
        assert all(w.busy == pytest.approx(0.004 * w.steps, abs=1e-5) for w in work)
        assert len(work) < 60  # the beat gap holds most steps back
        assert watcher.take_work() == []
    finally:
        proc.kill()
        proc.wait(timeout=WAIT)
        watcher.close()


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), 1e9])
def test_bad_busy_seconds_are_refused(bad: float) -> None:
    with pytest.raises(ConfigError, match="worker.step: busy must be"):
        ProgressReporter(None).step(1, busy=bad)


@pytest.mark.parametrize(
    ("busy", "steps"),
    [("x", "1"), ("0.1", "0"), ("0.1", "-2"), ("nan", "1"), ("-1", "1"), ("1e12", "1"), ("1", "y")],
)
def test_malformed_work_is_ignored(busy: str, steps: str) -> None:
    assert parse_work(busy, steps) is None


def test_work_is_due_for_a_report_at_most_every_half_second() -> None:
    samples = WorkSamples(report_every=0.5)
    assert not samples.due(10.0)
    samples.record(0, 42, 3, 0.3, 3)
    assert samples.due(10.0)
    assert [w.step for w in samples.take(10.0)] == [3]
    samples.record(0, 42, 4, 0.1, 1)
    assert not samples.due(10.2) and samples.due(10.5)
