"""``taskdrun --nnodes=MIN:MAX``: real launchers (3 x 2 gloo ranks), each its own process tree, one lost.

With no spare standing by, the lost node shrinks the job: the two nodes left
restart warm as a world of 4 ranks, renumbered contiguously, and resume from
the checkpoint; the controller journals the shrink. A launcher started later
with the job's command line grows it back to 3 nodes (MAX) at once, and the
job finishes. Over etcd-v2 the lost node may be rank 0's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pt_support import Launcher, events
from test_node_loss import HOLD_AT, WAIT, Job, kill_tree, no_leftovers

from taskd_core.testing import descendants, wait_until

pytestmark = pytest.mark.slow

#: Long enough after the shrink for a late launcher to start and join before the job ends.
STEPS = 400


def held(job: Job) -> set[int]:
    """Ranks that stepped up to the hold (the checkpoint of that step is written)."""
    return {e["rank"] for e in events(job.progress) if e["event"] == "step" and e["step"] == HOLD_AT}


def test_a_lost_node_with_no_spare_shrinks_the_job_and_a_late_node_grows_it_back(
    launch: Launcher, tmp_path: Path
) -> None:
    job = Job(launch, tmp_path / "shrink", "--taskd-stop-timeout", "5", nnodes="2:3", steps=STEPS)
    first = job.start()
    wait_until(lambda: "joining the c10d rendezvous" in job.log(0), "node 0 to reach the rendezvous", WAIT)
    nodes = [first, job.start(), job.start()]
    # All three came before torch's last call: every one of them trains (MAX is 3).
    wait_until(lambda: held(job) == set(range(6)), "every rank of the three nodes to reach the hold", WAIT)
    assert "embedded controller listening" in job.log(0)
    # The node of ranks 2 and 3 is lost: the one after it must take its node rank and ranks.
    lost = next(
        n
        for n in (1, 2)
        if any(int(e["pid"]) in descendants(nodes[n].pid) for e in events(job.progress) if e["rank"] == 2)
    )
    survivor = 3 - lost
    before = len(events(job.progress))
    killed = kill_tree(nodes[lost].pid)
    job.release()

    def resumed() -> list[dict[str, object]]:
        return [e for e in events(job.progress)[before:] if e["event"] == "resumed"]

    wait_until(lambda: {e["rank"] for e in resumed()} == {0, 1, 2, 3}, "the four ranks left to resume", WAIT)
    shrunk = [e for e in job.journal() if e.kind == "job shrunk"]
    assert len(shrunk) == 1 and shrunk[0].detail["nodes"] == 2, shrunk
    after = resumed()
    # Every rank left resumed from the same checkpoint step, the one written before the loss.
    assert {e["step"] for e in after} == {HOLD_AT} and {e["world"] for e in after} == {4}
    assert not {e["rank"] for e in events(job.progress)[before:]} & {4, 5}

    shrunk_at = len(events(job.progress))
    late = job.start()  # the job's own command line, while it has 2 of its 3 nodes

    def regrown() -> list[dict[str, object]]:
        return [e for e in events(job.progress)[shrunk_at:] if e["event"] == "resumed"]

    wait_until(
        lambda: {e["rank"] for e in regrown()} == set(range(6)), "the job to train on 3 nodes again", WAIT
    )
    assert {e["world"] for e in regrown()} == {6} and len({e["step"] for e in regrown()}) == 1
    grown = [e for e in job.journal() if e.kind == "job grown"]
    assert len(grown) == 1 and (grown[0].detail["nodes"], grown[0].detail["node_rank"]) == (3, 2), grown
    assert nodes[0].wait(timeout=WAIT) == 0, job.log(0)[-3000:]
    assert nodes[survivor].wait(timeout=WAIT) == 0, job.log(survivor)[-3000:]
    assert late.wait(timeout=WAIT) == 0, job.log(3)[-3000:]
    assert json.loads(job.result.read_text())["steps"] == STEPS
    assert "has 2 nodes now: node 2 is node 1" in job.log(survivor)
    no_leftovers(job, killed, {late.pid})


def test_with_etcd_the_loss_of_rank_0s_node_shrinks_the_job_too(
    launch: Launcher, tmp_path: Path, etcd_server: str
) -> None:
    """etcd-v2 keeps the rendezvous and the controller replicas off the nodes: rank 0's node is no special one."""
    job = Job(launch, tmp_path / "etcd-shrink", "--taskd-stop-timeout", "5", nnodes="2:3", steps=200)
    rendezvous = ("--rdzv-backend=", "--rdzv-endpoint=")
    job.argv = [a for a in job.argv if not a.startswith(rendezvous)]
    job.argv[1:1] = ["--rdzv-backend=etcd-v2", f"--rdzv-endpoint={etcd_server}"]
    nodes = [job.start() for _ in range(3)]
    wait_until(lambda: held(job) == set(range(6)), "every rank of the three nodes to reach the hold", WAIT)
    rank0 = next(int(e["pid"]) for e in events(job.progress) if e["rank"] == 0)
    lost = next(n for n in range(3) if rank0 in descendants(nodes[n].pid))
    before = len(events(job.progress))
    killed = kill_tree(nodes[lost].pid)
    job.release()

    survivors = [n for n in range(3) if n != lost]
    for n in survivors:
        assert nodes[n].wait(timeout=WAIT) == 0, job.log(n)[-3000:]
    after = [e for e in events(job.progress)[before:] if e["event"] == "resumed"]
    assert {e["rank"] for e in after} == {0, 1, 2, 3} and {e["step"] for e in after} == {HOLD_AT}
    assert {e["world"] for e in after} == {4}
    assert any("has 2 nodes now: node 1 is node 0" in job.log(n) for n in survivors)
    assert json.loads(job.result.read_text())["steps"] == 200
    no_leftovers(job, killed)
