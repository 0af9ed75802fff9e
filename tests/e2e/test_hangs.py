"""Issue 11's acceptance tests: a hung rank of examples/train_ddp.py (2 nodes x 2 ranks under ``taskd run``)
is found, its stack is in the controller's journal, and the job recovers to the fault-free parameters.

Each signal once: (a) SIGSTOP from outside (/proc state); (b) and (d) in one run: a rank that spins without
its heartbeat, found by the timeout learned after the step time changed; (c) torch's ``FileTimerClient`` timer
overrun (``plugins/pytorch/tests`` runs the same under ``taskdrun``).
The fault-free reference run varies its step times by 5x and must see no hang.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import REPO, TRAIN_DDP, Cluster, cluster_fixture, job_processes, read_events, wait_until

pytestmark = pytest.mark.slow

STEPS = 30
HANG_STEP = 15


def train(tmp_path: Path, *extra: str) -> list[str]:
    return [
        sys.executable, str(TRAIN_DDP), "--steps", str(STEPS), "--ckpt-every", "10",
        "--ckpt-dir", str(tmp_path / "ckpt"), "--progress", str(tmp_path / "progress.jsonl"),
        "--result", str(tmp_path / "result.json"), *extra,
    ]


def faults(cluster: Cluster) -> list[dict[str, object]]:
    return [detail for kind, detail in cluster.journal() if kind == "fault"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Parameters of a fault-free run (1 node x 4 ranks), whose steps vary by 5x: no hang may be declared."""
    tmp_path = tmp_path_factory.mktemp("reference")
    for cluster in cluster_fixture(tmp_path, "hang-reference"):
        cluster.node(0, 1, 4, train(tmp_path, "--step-time", "0.03", "--step-jitter", "5"))
        assert cluster.wait_all() == [0], cluster.diagnostics()
        assert faults(cluster) == [], "a healthy job was declared hung"
        yield str(json.loads((tmp_path / "result.json").read_text())["sha256"])


def start(cluster: Cluster, tmp_path: Path, *extra: str) -> None:
    for node in (0, 1):
        cluster.node(node, 2, 2, train(tmp_path, *extra))


def recovered(tmp_path: Path, cluster: Cluster, reference: str, victim: int) -> str:
    """Waits for the end; checks one hang of ``victim`` and a full recovery; the journal's evidence of the hang."""
    assert cluster.wait_all() == [0, 0], cluster.diagnostics()
    hangs = [f for f in faults(cluster) if "3" in f["ranks"].values()]  # type: ignore[attr-defined]
    assert [h["ranks"] for h in hangs] == [{str(victim): "3"}], cluster.journal()
    # The peers whose collective broke when the hung rank was killed end in the same cycle: one recovery.
    assert [kind for kind, _ in cluster.journal()].count("cycle started") == 1, cluster.journal()
    events = read_events(tmp_path / "progress.jsonl")
    assert sorted(e["rank"] for e in events if e["event"] == "resumed") == [0, 1, 2, 3]
    assert json.loads((tmp_path / "result.json").read_text())["sha256"] == reference
    assert "job finished" in [kind for kind, _ in cluster.journal()]
    assert job_processes(cluster.job_id) == []
    log = (tmp_path / "logs" / f"rank{victim}" / "restart0.log").read_text()
    assert "=== taskd: rank" in log and "(train_ddp.py:" in log  # the stack is in the rank's own log too
    evidence = str(hangs[0]["evidence"])
    assert f"rank {victim} (pid " in evidence and "(train_ddp.py:" in evidence
    return evidence


def test_sigstopped_rank(tmp_path: Path, cluster: Cluster, reference: str) -> None:
    """(a) SIGSTOP from outside: found through /proc, with no code in the worker."""
    progress = tmp_path / "progress.jsonl"
    start(cluster, tmp_path, "--step-time", "0.05")
    wait_until("step 15", lambda: any(e["step"] >= HANG_STEP for e in read_events(progress)), cluster)
    victim = next(e["pid"] for e in read_events(progress) if e["event"] == "start" and e["rank"] == 3)
    os.kill(victim, signal.SIGSTOP)  # type: ignore[arg-type]
    evidence = recovered(tmp_path, cluster, reference, victim=3)
    assert "stopped 'state T'" in evidence and "main (train_ddp.py:" in evidence


def test_torch_file_timer_overrun(tmp_path: Path, cluster: Cluster, reference: str) -> None:
    """(c) the script arms torch's FileTimerClient around each step (no TaskD heartbeat) and one step overruns."""
    start(
        cluster, tmp_path, "--step-time", "0.05", "--no-heartbeat", "--timer", "3",
        "--hang-at-step", str(HANG_STEP), "--hang-rank", "1",
    )
    evidence = recovered(tmp_path, cluster, reference, victim=1)
    assert "timer 'step'" in evidence and "spin_forever (train_ddp.py:" in evidence


def test_spinning_rank_found_by_the_timeout_learned_after_a_step_time_change(
    tmp_path: Path, cluster: Cluster, reference: str
) -> None:
    """(b)+(d) steps slow down from 0.03 s to 0.8 s at step 10: the learned timeout follows (no false hang at the
    change); at step 20 rank 0 stops beating and spins in a Python loop while its peers wait in the all_reduce:
    only rank 0 is found, by that learned timeout; ``taskd status`` shows the timeout while the job runs."""
    start(
        cluster, tmp_path, "--step-time", "0.03", "--slow-from", "10", "--slow-step-time", "0.8",
        "--hang-at-step", "20", "--hang-rank", "0",
    )
    progress = tmp_path / "progress.jsonl"
    wait_until("step 16", lambda: any(e["step"] >= 16 for e in read_events(progress)), cluster)
    status = ""

    def status_shows_learned_timeout() -> bool:
        nonlocal status
        status = subprocess.run(
            [sys.executable, "-m", "taskd_core", "status", "--controller", f"127.0.0.1:{cluster.controller_port}",
             "--job", cluster.job_id],
            capture_output=True, text=True, cwd=REPO, timeout=60, check=False,
        ).stdout
        shown = re.search(r"hang timeouts: .*heartbeat ([0-9.]+)s \(learned", status)
        return shown is not None and float(shown.group(1)) > 3.0  # above the floor: the slow steps count

    wait_until("taskd status showing the learned heartbeat timeout", status_shows_learned_timeout, cluster)
    evidence = recovered(tmp_path, cluster, reference, victim=0)
    timeout = float(re.search(r"timeout ([0-9.]+)s, learned", evidence).group(1))  # type: ignore[union-attr]
    assert timeout > 3.0, evidence  # above the floor: learned from the slow steps
    assert "heartbeat 'heartbeat'" in evidence and "spin_forever (train_ddp.py:" in evidence
