"""Live recovery on 2 nodes x 2 gloo workers under ``taskdrun``: healthy ranks keep running, nothing is lost.

The job is ``examples/train_live.py`` (``train_ddp.py`` adapted to
:mod:`taskd_pytorch.live`); both are deterministic, so a run with faults must
end with exactly the parameters of a fault-free ``train_ddp.py`` run.
"""

from __future__ import annotations

import itertools
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pt_support import STEPS, Launcher, events, finish, kill, run_job

from taskd_core.testing import free_port, process_running, wait_until

pytestmark = pytest.mark.slow

#: The job's token, the same on both nodes.
TOKEN = {"TASKD_JOB_TOKEN": "s3cret"}


def current_pids(progress: Path) -> dict[int, int]:
    """Each rank's latest incarnation (the pid of its last ``start`` event)."""
    return {int(e["rank"]): int(e["pid"]) for e in events(progress) if e["event"] == "start"}


def stepped_since(progress: Path, pids: dict[int, int], step: int) -> bool:
    """Every given incarnation logged a step beyond ``step``."""
    done = {int(e["pid"]) for e in events(progress) if e["event"] == "step" and int(e["step"]) > step}
    return set(pids.values()) <= done


def last_step(progress: Path) -> int:
    return max((int(e["step"]) for e in events(progress) if e["event"] == "step"), default=0)


def samples(port: int) -> dict[str, float]:
    """The controller's /metrics samples without labels, by name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def test_every_loss_is_repaired_live_and_the_run_matches_a_fault_free_one(
    launch: Launcher, tmp_path: Path, fault_free: dict[str, Any]
) -> None:
    # Ranks killed together must land in one cycle even on a loaded machine: a fault that
    # arrives after the strategy was chosen makes the round fail and the job restart whole.
    metrics = free_port()  # served by the node that hosts the controller
    nodes, progress, result = run_job(
        # The last steps are slow: the controller (and its /metrics) lives as long as the job.
        launch, tmp_path / "live", "--slow-from", "18", "--slow-step-time", "0.5", script="train_live.py",
        max_cycles=8, taskd=("--taskd-flush-seconds", "1", "--taskd-metrics-port", str(metrics)),
        env=TOKEN,  # keys the state hand-over: a job of several nodes recovers live only with one
    )
    wait_until(lambda: len(current_pids(progress)) == 4 and last_step(progress) >= 3, "every rank to train", 180)
    # Rank 3, then rank 0 (store host and state source of the first start), then one rank of each
    # node together, then every rank of node 1, then a rank that is stopped first and killed a moment later.
    faults = (((3,), False), ((0,), False), ((1, 2), False), ((2, 3), False), ((3,), True))
    for victims, stop_first in faults:
        before = current_pids(progress)
        at = last_step(progress)
        for victim in victims:
            if stop_first:
                kill(before[victim], signal.SIGSTOP)
                time.sleep(0.5)
            kill(before[victim], signal.SIGKILL)
        wait_until(
            lambda before=before, victims=victims, at=at: all(current_pids(progress)[v] != before[v] for v in victims)
            and stepped_since(progress, current_pids(progress), at + 1),
            f"ranks {victims} to be replaced and every rank to step again", 180,
        )
        after = current_pids(progress)
        assert {r: p for r, p in after.items() if r not in victims} == {r: p for r, p in before.items() if r not in victims}

    # Every replacement resumed where its lost rank was (the workers report steps through
    # taskd_core.worker, from the live session): the faults cost time, no step.
    killed = sum(len(victims) for victims, _ in faults)
    wait_until(lambda: samples(metrics).get("taskd_kill_to_resumed_seconds_count") == killed, "resumed ranks", 120)
    assert samples(metrics)["taskd_steps_lost_total"] == 0

    final = finish(nodes, result)

    assert final["steps"] == STEPS and final["sha256"] == fault_free["sha256"]
    log = events(progress)
    assert {e["restart"] for e in log} == {0}  # never a whole-group restart
    # A dead rank's agent started its replacement before the controller chose the strategy.
    assert "again early" in "".join(p.read_text() for p in tmp_path.glob("live*.log"))
    assert len([e for e in log if e["event"] == "start"]) == 4 + sum(len(victims) for victims, _ in faults)
    for rank in range(4):
        steps = [int(e["step"]) for e in log if e["event"] == "step" and int(e["rank"]) == rank]
        # The committed step never goes back; at most the interrupted step runs again.
        assert all(b >= a for a, b in itertools.pairwise(steps)), steps
        assert steps[-1] == STEPS
    assert not [pid for pid in current_pids(progress).values() if process_running(pid)]


def test_a_round_that_cannot_form_in_time_falls_back_to_a_full_restart(
    launch: Launcher, tmp_path: Path, fault_free: dict[str, Any]
) -> None:
    nodes, progress, result = run_job(
        launch, tmp_path / "fallback", script="train_live.py",
        # Hang detection would find the stopped rank (/proc state T) and have it replaced live too.
        taskd=("--taskd-live-timeout", "5", "--taskd-no-hang-detection"), env=TOKEN,
    )
    wait_until(lambda: len(current_pids(progress)) == 4 and last_step(progress) >= 3, "every rank to train", 180)
    before = current_pids(progress)
    # Rank 1 is stopped, not dead, and nobody notices: it cannot join the round that replaces rank 3.
    kill(before[1], signal.SIGSTOP)
    kill(before[3], signal.SIGKILL)

    final = finish(nodes, result)

    assert final["steps"] == STEPS and final["sha256"] == fault_free["sha256"]
    restarted = {int(e["rank"]) for e in events(progress) if e["event"] == "start" and e["restart"] == 1}
    assert restarted == {0, 1, 2, 3}  # the fallback restarted every rank from the checkpoint
    assert not process_running(before[1])


def test_a_ddp_job_is_repaired_live_when_ranks_away_from_the_lost_one_are_blocked_in_backward(
    launch: Launcher, tmp_path: Path
) -> None:
    """``DistributedDataParallel`` reduces inside ``backward()``: with rank 3 lost, rank 1 (whose ring
    neighbours 0 and 2 survive) waits there; with rank 0 stopped, every peer does. The session's DDP
    comm hook leaves that wait when the agent announces the next round, so every healthy rank stays
    and only the lost one starts again."""
    nodes, progress, result = run_job(
        launch, tmp_path / "ddp", "--optimizer", "sgd", script="train_live.py", env=TOKEN
    )
    wait_until(lambda: len(current_pids(progress)) == 4 and last_step(progress) >= 3, "every rank to train", 180)
    # Rank 3 killed; then rank 0 (the state's usual source) stopped first and killed a moment later.
    for victim, stop_first in ((3, False), (0, True)):
        before = current_pids(progress)
        at = last_step(progress)
        if stop_first:
            kill(before[victim], signal.SIGSTOP)
            time.sleep(0.5)
        kill(before[victim], signal.SIGKILL)
        wait_until(
            lambda before=before, victim=victim, at=at: current_pids(progress)[victim] != before[victim]
            and stepped_since(progress, current_pids(progress), at + 1),
            f"rank {victim} to be replaced and every rank to step again", 180,
        )
        after = current_pids(progress)
        assert {r: p for r, p in after.items() if r != victim} == {r: p for r, p in before.items() if r != victim}

    final = finish(nodes, result)

    assert final["steps"] == STEPS
    log = events(progress)
    assert {e["restart"] for e in log} == {0}  # live: never a whole-group restart
    assert len([e for e in log if e["event"] == "start"]) == 6
    for rank in range(4):
        steps = [int(e["step"]) for e in log if e["event"] == "step" and int(e["rank"]) == rank]
        assert all(b >= a for a, b in itertools.pairwise(steps)), steps  # the committed step never goes back
