"""A whole node lost from a ``LiveSession`` job, on 2 real ``taskdrun`` nodes x 2 workers (and a spare).

With a spare, the survivors keep running and the spare's new ranks receive
the committed state from a surviving replica: no step is lost, the final
parameters are a fault-free run's. The hand-over cases give every rank
256 MiB of extra live state (``--ballast-mb``), so that it lasts long enough
to lose the receiving node in the middle of it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pt_support import STEPS, Launcher, events, run_job
from test_node_loss import WAIT, Job, kill_tree, no_leftovers, signal_tree, start_nodes
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from taskd_core.testing import descendants, process_running, wait_until
from tests.etcd_server import EtcdServer

pytestmark = pytest.mark.slow

TOKEN = {"TASKD_JOB_TOKEN": "s3cret"}
#: The first live round's address key (restart 0, round 1; a PrefixStore joins with "/").
TRANSFER_KEY = "taskd/live/0/1//state-transfer"


@pytest.mark.parametrize("lost", ["receiver", "replica"])
def test_a_node_lost_during_the_hand_over_ends_the_job_on_the_other_node_with_a_clear_message(
    launch: Launcher, tmp_path: Path, lost: str
) -> None:
    """The node lost holds the replacement that receives the state, or the replica that sends it
    (both of the other node's ranks were lost, so only the lost node's ranks are replicas)."""
    nodes, progress, _ = run_job(
        launch,
        tmp_path / "loss",
        "--ballast-mb",
        "256",
        script="train_live.py",
        env=TOKEN,
        taskd=("--taskd-live-timeout", "10", "--taskd-dump-grace", "5", "--taskd-no-hang-detection"),
    )
    logs = [tmp_path / f"loss{n}.{n}.log" for n in (0, 1)]
    wait_until(
        lambda: len({e["rank"] for e in events(progress) if e["event"] == "step"}) == 4,
        "every rank to train",
        240,
    )
    # The node that hosts the controller (and the workers' store) survives; the other one is lost.
    survivor = next(n for n in (0, 1) if "embedded controller listening" in logs[n].read_text())
    victim = 1 - survivor
    found = re.search(r"restart round 0: workers meet at (\S+):(\d+)", logs[survivor].read_text())
    assert found is not None
    store = TCPStore(found.group(1), int(found.group(2)), is_master=False, timeout=timedelta(seconds=30))
    starts = {int(e["pid"]): int(e["rank"]) for e in events(progress) if e["event"] == "start"}
    victim_ranks = sorted(rank for pid, rank in starts.items() if pid in set(descendants(nodes[victim].pid)))
    assert len(victim_ranks) == 2
    if lost == "receiver":
        # One of the victim's ranks dies: its replacement, on the victim node, receives the state ...
        os.kill(next(pid for pid, rank in starts.items() if rank == victim_ranks[1]), signal.SIGKILL)
    else:
        # Both of the survivor's ranks die: their replacements take the state from a victim's rank ...
        for pid in [pid for pid, rank in starts.items() if rank not in victim_ranks]:
            os.kill(pid, signal.SIGKILL)
    wait_until(lambda: store.check([TRANSFER_KEY]), "the replica to publish where it serves the state", 120)
    # ... and the whole node goes while the state is on its way.
    tree = {nodes[victim].pid} | set(descendants(nodes[victim].pid))
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    lost_at = time.monotonic()

    # Within the stream grace (30 s), the dump grace and a stop: not the rendezvous' 600 s, nor for ever.
    assert nodes[survivor].wait(timeout=240) == 1
    took = time.monotonic() - lost_at
    text = logs[survivor].read_text()
    assert "left the job during recovery cycle 1" in text, text[-3000:]
    assert "every restart needs all of the job's nodes" in text
    print(f"the surviving node ended {took:.1f}s after the other node was lost")
    everyone = set(starts) | {int(e["pid"]) for e in events(progress)} | tree
    wait_until(
        lambda: not [pid for pid in everyone if process_running(pid)], "no process of the job to be left", 60
    )


def starts(job: Job) -> dict[int, int]:
    """Each rank's latest incarnation (the pid of its last ``start`` event)."""
    return {int(e["rank"]): int(e["pid"]) for e in events(job.progress) if e["event"] == "start"}


def holding(job: Job) -> int:
    """Wait until every rank holds at the job's hold step (its committed step while held); returns it."""
    held = STEPS // 2
    wait_until(
        lambda: {e["rank"] for e in events(job.progress) if e["event"] == "step" and e["step"] == held}
        == {0, 1, 2, 3},
        f"every rank to hold after step {held}",
        WAIT,
    )
    return held


@pytest.mark.parametrize("loss", ["killed", "hung"])
def test_a_lost_node_is_replaced_live_by_the_spare_and_no_committed_step_is_lost(
    launch: Launcher, tmp_path: Path, fault_free: dict[str, Any], loss: str
) -> None:
    """Every process of node 1 SIGKILLed (or SIGSTOPped: declared lost after 3 s without a HealthCheck,
    and fenced when it comes back): node 0's workers keep running, the spare's receive the state."""
    job = Job(
        launch,
        tmp_path / loss,
        "--taskd-node-lost-timeout",
        "3",
        script="train_live.py",
        env=TOKEN,
        steps=STEPS,  # the fault-free run's job
        hold_at=STEPS // 2,  # the ranks wait there until the node is lost
    )
    node0, node1, spare = start_nodes(job)
    before = starts(job)
    held = holding(job)
    tree = {node1.pid, *descendants(node1.pid)}
    if loss == "killed":
        kill_tree(node1.pid)
    else:
        signal_tree(tree, signal.SIGSTOP)
    job.release()


    def recovered() -> list[Any] | None:
        # Read while the job runs: the journal is node 0's embedded controller's.
        journal = job.journal()
        return journal if any(e.kind == "cycle succeeded" for e in journal) else None

    try:
        journal = wait_until(recovered, "the recovery cycle to succeed", WAIT)
    finally:
        signal_tree(tree, signal.SIGCONT)
    assert node0.wait(timeout=WAIT) == 0, job.log(0)[-3000:]
    assert spare.wait(timeout=WAIT) == 0, job.log(2)[-3000:]
    assert node1.wait(timeout=WAIT) in (-signal.SIGKILL, 1)
    final = json.loads(job.result.read_text())
    assert final["steps"] == STEPS and final["sha256"] == fault_free["sha256"]
    after = starts(job)
    # The survivors never restarted; the lost ranks started once more, on the spare.
    assert {r: after[r] for r in (0, 1)} == {r: before[r] for r in (0, 1)}
    assert not {after[2], after[3]} & ({before[2], before[3]} | tree)
    resumed = [e for e in events(job.progress) if e["event"] == "resumed"]
    assert [(e["rank"], e["step"]) for e in sorted(resumed, key=lambda e: e["rank"])] == [(2, held), (3, held)]
    replaced = [e.detail for e in journal if e.kind == "node replaced"]
    assert [(d["lost"], d["ranks"]) for d in replaced] == [("node-1", [2, 3])], replaced
    chosen = [e.detail["strategy"] for e in journal if e.kind == "strategy chosen"]
    assert chosen == ["recover-live"], chosen
    if loss == "hung":
        assert "was declared lost and spare" in job.log(1)
    no_leftovers(job, tree)


def test_a_slow_ranks_node_replaced_by_the_spare_loses_no_committed_step(launch: Launcher, tmp_path: Path) -> None:
    """``--taskd-slow-rank replace``: rank 3 slows down on its first life, node 1 is drained onto the
    spare through the lost-node path, live: the survivors never restart nor run a committed step again."""
    job = Job(launch, tmp_path / "slow", "--taskd-slow-rank", "replace", script="train_live.py", env=TOKEN)
    job.argv[job.argv.index("--steps") + 1] = "80"
    job.argv += ["--slow-rank", "3", "--slow-from", "10", "--slow-step-time", "0.4"]
    node0, node1, spare = start_nodes(job)  # the ranks hold before step 30 until released
    before = starts(job)
    job.release()  # the spare stands by now: rank 3, still slow, is replaced with the next reports
    assert node0.wait(timeout=WAIT) == 0, job.log(0)[-3000:]
    assert spare.wait(timeout=WAIT) == 0, job.log(2)[-3000:]
    assert node1.wait(timeout=WAIT) == 1, job.log(1)[-3000:]
    assert "was declared lost and spare" in job.log(1)
    assert json.loads(job.result.read_text())["steps"] == 80
    after = starts(job)
    assert {r: after[r] for r in (0, 1)} == {r: before[r] for r in (0, 1)}
    progress = events(job.progress)
    for rank in (0, 1):
        done = [e["step"] for e in progress if e["rank"] == rank and e["event"] == "step"]
        assert done == list(range(1, 81)), f"rank {rank} ran a committed step again: {done}"
    old = {before[2], before[3]}
    reached = max(e["step"] for e in progress if e["event"] == "step" and int(e["pid"]) in old)
    resumed = sorted((e["rank"], e["step"]) for e in progress if e["event"] == "resumed")
    # The spare's ranks go on from the survivors' committed step, which the old ranks reached too.
    assert [rank for rank, _ in resumed] == [2, 3] and resumed[0][1] == resumed[1][1] >= reached, resumed
    no_leftovers(job, {node1.pid})


def test_a_node_lost_during_the_hand_over_is_replaced_by_the_spare_and_the_hand_over_starts_again(
    launch: Launcher, tmp_path: Path, fault_free: dict[str, Any]
) -> None:
    """Rank 3 dies, its replacement on node 1 receives the state from node 0's replica, and node 1 is
    lost in the middle of it: the next cycle's round takes the spare in, and the replica hands the state
    over again, to the spare's ranks; no committed step is lost."""
    job = Job(
        launch,
        tmp_path / "again",
        "--taskd-no-hang-detection",
        script="train_live.py",
        env=TOKEN,
        steps=STEPS,  # the fault-free run's job
        hold_at=STEPS // 2,
    )
    job.argv += ["--ballast-mb", "256"]
    node0, node1, spare = start_nodes(job)
    held = holding(job)
    found = re.search(r"restart round 0: workers meet at (\S+):(\d+)", job.log(0))
    assert found is not None
    store = TCPStore(found.group(1), int(found.group(2)), is_master=False, timeout=timedelta(seconds=30))
    before = starts(job)
    os.kill(before[3], signal.SIGKILL)  # its replacement, on node 1, will receive the state ...
    job.release()
    wait_until(lambda: store.check([TRANSFER_KEY]), "the replica to publish where it serves the state", WAIT)
    tree = kill_tree(node1.pid)  # ... and node 1 goes while the state is on its way
    assert node0.wait(timeout=WAIT) == 0, job.log(0)[-3000:]
    assert spare.wait(timeout=WAIT) == 0, job.log(2)[-3000:]
    final = json.loads(job.result.read_text())
    assert final["steps"] == STEPS and final["sha256"] == fault_free["sha256"]
    after = starts(job)
    assert {r: after[r] for r in (0, 1)} == {r: before[r] for r in (0, 1)}
    assert not {after[2], after[3]} & tree
    resumed = {(e["rank"], e["step"]) for e in events(job.progress) if e["event"] == "resumed"}
    assert {(2, held), (3, held)} <= resumed, resumed
    assert "takes the place of lost node 1" in job.log(2)
    no_leftovers(job, tree)


def test_on_etcd_v2_a_lost_node_is_replaced_live_by_the_spare(
    launch: Launcher, etcd_v2: EtcdServer, tmp_path: Path, fault_free: dict[str, Any]
) -> None:
    """torchrun's etcd-v2 command line (every node runs a controller replica in that etcd): the node
    of ranks 2 and 3 SIGKILLed, its ranks resume on the spare with the committed state, 0 steps lost."""
    job = Job(launch, tmp_path / "onetcd", script="train_live.py", env=TOKEN, steps=STEPS, hold_at=STEPS // 2)
    job.argv = [a for a in job.argv if not a.startswith(("--rdzv-backend=", "--rdzv-endpoint="))]
    job.argv[:0] = ["--rdzv-backend=etcd-v2", f"--rdzv-endpoint={etcd_v2.endpoint}"]
    nodes = [job.start(), job.start()]
    wait_until(lambda: "job onetcd node 0: 2 workers" in job.log(0) + job.log(1), "the first round", WAIT)
    spare = job.start()
    wait_until(lambda: "standing by as spare" in job.log(2), "the third launcher to stand by", WAIT)
    held = holding(job)
    before = starts(job)
    # Group rank 0's node hosts the workers' store (live recovery needs it): the other node is lost.
    victim = next(n for n in (0, 1) if before[2] in descendants(nodes[n].pid))
    tree = kill_tree(nodes[victim].pid)
    job.release()
    assert nodes[1 - victim].wait(timeout=WAIT) == 0, job.log(1 - victim)[-3000:]
    assert spare.wait(timeout=WAIT) == 0, job.log(2)[-3000:]
    final = json.loads(job.result.read_text())
    assert final["steps"] == STEPS and final["sha256"] == fault_free["sha256"]
    after = starts(job)
    assert {r: after[r] for r in (0, 1)} == {r: before[r] for r in (0, 1)}
    resumed = sorted((e["rank"], e["step"]) for e in events(job.progress) if e["event"] == "resumed")
    assert resumed == [(2, held), (3, held)], resumed
    no_leftovers(job, tree)
