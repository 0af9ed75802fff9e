"""The issue's acceptance tests: examples/train_ddp.py on 2 nodes x 2 workers, two ``taskd run`` processes.

Node 0 hosts the embedded controller (journal in a state file the tests read
afterwards). Training is deterministic, so a recovered run must end with the
very parameters of a fault-free one.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import TRAIN_DDP, Cluster, cluster_fixture, job_processes, read_events, wait_until

pytestmark = pytest.mark.slow

STEPS = 40
CKPT_EVERY = 10


def train(tmp_path: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(TRAIN_DDP),
        "--steps",
        str(STEPS),
        "--ckpt-every",
        str(CKPT_EVERY),
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
        "--progress",
        str(tmp_path / "progress.jsonl"),
        "--result",
        str(tmp_path / "result.json"),
        *extra,
    ]


def start_two_nodes(cluster: Cluster, command: list[str], *extra: str) -> None:
    for node in (0, 1):
        cluster.node(node, 2, 2, command, *extra)


def changed_strategies(cluster: Cluster) -> list[tuple[object, object]]:
    """(strategy, extraParams) of every changeStrategy signal the controller sent, in order."""
    return [
        (d["strategy"], d["extra"])
        for kind, d in cluster.journal()
        if kind == "signal" and d["type"] == "changeStrategy"
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """Final parameters of a fault-free run of the same job (one node x 4 workers: same ranks, same data)."""
    tmp_path = tmp_path_factory.mktemp("reference")
    for cluster in cluster_fixture(tmp_path, "reference"):
        cluster.node(0, 1, 4, train(tmp_path))
        assert cluster.wait_all() == [0], cluster.diagnostics()
        yield json.loads((tmp_path / "result.json").read_text())


@pytest.mark.parametrize("fault", ["sigkill", "raise"])
def test_faulty_worker_is_recovered_with_identical_result(
    tmp_path: Path, cluster: Cluster, reference: dict[str, object], fault: str
) -> None:
    """One worker dies mid-training (SIGKILL from outside, or an exception): one `recover` cycle restarts
    every worker, training resumes from the last checkpoint and ends with the fault-free run's parameters."""
    progress = tmp_path / "progress.jsonl"
    extra = ["--step-time", "0.1"]
    if fault == "raise":
        extra += ["--fail-at-step", "15", "--fail-rank", "2", "--fail-mode", "raise"]
    start_two_nodes(cluster, train(tmp_path, *extra))
    if fault == "sigkill":
        wait_until("step 15", lambda: any(e["step"] >= 15 for e in read_events(progress)), cluster)
        victim = next(e["pid"] for e in read_events(progress) if e["event"] == "start" and e["rank"] == 3)
        os.kill(victim, signal.SIGKILL)  # type: ignore[arg-type]
    assert cluster.wait_all() == [0, 0], cluster.diagnostics()

    events = read_events(progress)
    resumed = [e for e in events if e["event"] == "resumed"]
    assert sorted(e["rank"] for e in resumed) == [0, 1, 2, 3]
    assert {e["restart"] for e in resumed} == {1}
    resumed_at = {e["step"] for e in resumed}
    assert len(resumed_at) == 1 and resumed_at.pop() % CKPT_EVERY == 0  # type: ignore[operator]
    assert max(e["restart"] for e in events) == 1  # type: ignore[type-var]
    assert json.loads((tmp_path / "result.json").read_text())["sha256"] == reference["sha256"]
    assert changed_strategies(cluster) == [("recover", "")]
    assert "job finished" in [kind for kind, _ in cluster.journal()]
    assert job_processes(cluster.job_id) == []


def test_dump_then_exit_policy(tmp_path: Path, cluster: Cluster) -> None:
    """With --strategies dump,exit the surviving workers get the save signal, save and exit; the job ends
    non-zero and the controller's journal shows dump, then exit."""
    progress = tmp_path / "progress.jsonl"
    # A long step leaves the healthy ranks in their compute (not in a collective
    # the dead peer breaks) while the controller negotiates the dump.
    command = train(
        tmp_path, "--step-time", "4", "--fail-at-step", "1", "--fail-rank", "1", "--fail-mode", "kill"
    )
    start_two_nodes(cluster, command, "--strategies", "dump,exit", "--dump-grace", "60")
    codes = cluster.wait_all()
    dumped = sorted(e["rank"] for e in read_events(progress) if e["event"] == "dump")
    assert dumped == [0, 2, 3], cluster.diagnostics()
    assert changed_strategies(cluster) == [("dump", ""), ("exit", "dump_exit")]
    assert "job given up" in [kind for kind, _ in cluster.journal()]
    assert (tmp_path / "ckpt" / "ckpt.pt").exists()
    assert job_processes(cluster.job_id) == []
    assert all(code != 0 for code in codes), f"exit codes {codes}\n{cluster.diagnostics()}"
