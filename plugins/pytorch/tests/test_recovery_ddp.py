"""Real DDP training (torch 2.13 CPU, gloo) on 2 nodes x 2 workers under ``taskdrun``, with faults.

The job is ``examples/train_ddp.py``: deterministic, checkpointing atomically
and resuming on every start, so a recovered run must end with exactly the
parameters of a fault-free one.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from pt_support import Launcher, free_port, kill, pid_alive, wait_for

TRAIN = str(Path(__file__).resolve().parents[3] / "examples" / "train_ddp.py")
STEPS = 30
TRAIN_ARGS = ("--steps", str(STEPS), "--ckpt-every", "3", "--step-time", "0.1")

pytestmark = pytest.mark.slow


def events(progress: Path) -> list[dict[str, object]]:
    lines = progress.read_text().splitlines() if progress.exists() else []
    # The last line may still be being written by a worker.
    return [json.loads(line) for line in lines if line.endswith("}")]


def run_job(
    launch: Launcher, work: Path, *extra: str, max_cycles: int = 4
) -> tuple[list[subprocess.Popen[bytes]], Path, Path]:
    """Start the two ``taskdrun`` nodes of one training job in ``work``; returns them, the progress log and result."""
    work.mkdir()
    progress, result = work / "progress.jsonl", work / "result.json"
    common = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
              f"--rdzv-id={work.name}", "--taskd-controller-port", str(free_port()),
              "--taskd-max-cycles", str(max_cycles), "--taskd-stop-timeout", "5"]
    job = [TRAIN, "--ckpt-dir", str(work / "ckpt"), "--progress", str(progress), "--result", str(result), *TRAIN_ARGS,
           *extra]
    return [launch(*common, f"--node-rank={n}", *job, log=f"{work.name}{n}") for n in (0, 1)], progress, result


def finish(nodes: list[subprocess.Popen[bytes]], result: Path) -> dict[str, object]:
    assert [node.wait(timeout=300) for node in nodes] == [0, 0]
    return json.loads(result.read_text())


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """Final parameters of the job without faults."""
    launcher = Launcher(tmp_path_factory.mktemp("fault_free"))
    try:
        nodes, progress, result = run_job(launcher, launcher.root / "job")
        done = finish(nodes, result)
        assert {e["restart"] for e in events(progress)} == {0}
        yield done
    finally:
        launcher.cleanup()


def pids_of_round(progress: Path, restart: int) -> dict[int, int]:
    return {int(e["rank"]): int(e["pid"]) for e in events(progress) if e["event"] == "start" and e["restart"] == restart}


def test_repeated_sigkills_recover_all_ranks_every_time_and_match_a_fault_free_run(
    launch, tmp_path: Path, fault_free: dict[str, object]
) -> None:
    nodes, progress, result = run_job(launch, tmp_path / "killed")
    # A different victim each round, rank 0 (the host of the workers' store) included.
    victims = (3, 0, 1)
    for restart, victim in enumerate(victims):
        wait_for(
            lambda: len(pids_of_round(progress, restart)) == 4
            and any(e["event"] == "step" and e["restart"] == restart and int(e["step"]) >= 6 * restart + 5
                    for e in events(progress)),
            120, f"round {restart} to train",
        )
        kill(pids_of_round(progress, restart)[victim], signal.SIGKILL)

    final = finish(nodes, result)

    for restart in range(1, len(victims) + 1):
        before, after = pids_of_round(progress, restart - 1), pids_of_round(progress, restart)
        assert sorted(after) == [0, 1, 2, 3]
        assert not set(before.values()) & set(after.values())  # every rank restarted, once per fault
        resumed = {int(e["step"]) for e in events(progress) if e["event"] == "resumed" and e["restart"] == restart}
        assert len(resumed) == 1 and min(resumed) > 0  # every rank resumed from the same checkpoint
    assert {e["restart"] for e in events(progress)} == set(range(len(victims) + 1))
    assert final["steps"] == STEPS
    assert final["sha256"] == fault_free["sha256"]
    assert not [pid for r in range(len(victims) + 1) for pid in pids_of_round(progress, r).values() if pid_alive(pid)]


def test_a_rank_that_raises_is_recovered_like_a_killed_one(launch, tmp_path: Path, fault_free: dict[str, object]) -> None:
    nodes, progress, result = run_job(launch, tmp_path / "raised", "--fail-at-step", "7", "--fail-rank", "2")

    final = finish(nodes, result)

    assert {e["restart"] for e in events(progress)} == {0, 1}
    assert len(pids_of_round(progress, 1)) == 4
    assert [int(e["step"]) for e in events(progress) if e["event"] == "resumed"] == [6] * 4
    assert final["sha256"] == fault_free["sha256"]
