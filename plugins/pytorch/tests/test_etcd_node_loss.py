"""Rank 0's machine lost on torchrun's etcd-v2 command line, a spare waiting: nothing of rank 0 was special.

Two real ``taskdrun`` nodes (2 x 2 gloo ranks of ``examples/train_ddp.py``)
and a third launcher with the same command line, started once the job has
both (a spare), on a real etcd: the rendezvous, the controller's state and its
replicas' roster are all in it. Rank 0's node (launcher, fork server, workers,
its controller replica, the workers' store it hosted as group rank 0) is
SIGKILLed at once, as a machine dies.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pt_support import STEPS, TRAIN_ARGS, Launcher, events, example

from taskd_core.testing import descendants, process_running, wait_until
from tests.etcd_server import EtcdServer

pytestmark = pytest.mark.slow

WAIT = 120.0
#: Slower steps than the fault-free run's (the same math: only the sleep differs), so that the spare
#: is standing by before the job ends.
STEP_TIME = ("--step-time", "1.0")


@dataclass
class EtcdJob:
    """Two nodes and a standing-by spare of one job on etcd, and where they log."""

    nodes: list[subprocess.Popen[bytes]]
    logs: list[Path]
    spare: subprocess.Popen[bytes]
    spare_log: Path
    progress: Path
    result: Path

    def text(self, n: int) -> str:
        return self.logs[n].read_text(errors="replace")


def start_job(launch: Launcher, etcd: EtcdServer, tmp_path: Path, name: str) -> EtcdJob:
    """The two nodes, then the spare once the first round formed; returns when every rank trains."""
    work = tmp_path / name
    example_argv, progress, result = example("train_ddp.py", work)
    argv = [
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=etcd-v2",
        f"--rdzv-endpoint={etcd.endpoint}",
        f"--rdzv-id={name}",
        "--taskd-node-lost-timeout",
        "3",
        *example_argv,
        *TRAIN_ARGS,
        *STEP_TIME,
    ]
    nodes = [launch(*argv, log="node") for _ in range(2)]
    logs = [tmp_path / f"node.{n}.log" for n in range(2)]
    wait_until(
        lambda: any(re.search(rf"job {name} node 0(?: of \d+)?: 2 workers", p.read_text()) for p in logs),
        "the first round",
        WAIT,
    )
    spare = launch(*argv, log="spare")
    spare_log = tmp_path / "spare.2.log"
    wait_until(
        lambda: "standing by as spare" in spare_log.read_text(), "the third launcher to stand by", WAIT
    )
    wait_until(
        lambda: {e["rank"] for e in events(progress) if e["event"] == "step"} == {0, 1, 2, 3},
        "every rank to train",
        WAIT,
    )
    return EtcdJob(nodes, logs, spare, spare_log, progress, result)


def test_rank_0s_node_lost_the_spare_takes_its_ranks_and_the_job_ends_as_without_a_fault(
    launch: Launcher, etcd_v2: EtcdServer, tmp_path: Path, fault_free: dict[str, Any]
) -> None:
    job = start_job(launch, etcd_v2, tmp_path, "rank0")
    nodes, logs, spare, spare_log, progress, result = (
        job.nodes, job.logs, job.spare, job.spare_log, job.progress, job.result
    )
    rank0 = next(int(e["pid"]) for e in events(progress) if e["event"] == "start" and e["rank"] == 0)
    host = next(n for n in (0, 1) if rank0 in descendants(nodes[n].pid))
    survivor = 1 - host
    tree = {nodes[host].pid, *descendants(nodes[host].pid)}
    before = len(events(progress))
    for pid in tree:  # the machine dies: everything at once
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    assert nodes[survivor].wait(timeout=WAIT) == 0, logs[survivor].read_text()[-3000:]
    assert spare.wait(timeout=WAIT) == 0, spare_log.read_text()[-3000:]
    spare_text = spare_log.read_text()
    assert (
        f"takes the place of lost node {host}" in spare_text or "takes the place of lost node 0" in spare_text
    )
    after = events(progress)[before:]
    # Every rank stepped again, the lost ones (0 and 1) in the spare's processes, warm.
    spare_pids = set(descendants(spare.pid)) | {int(e["pid"]) for e in after if e["rank"] in (0, 1)}
    assert {e["rank"] for e in after if e["event"] == "step"} == {0, 1, 2, 3}
    assert not spare_pids & tree
    # The spare is group rank 0 now: it hosts the workers' store of the round after the loss.
    assert re.search(
        r"restart round \d+: workers meet at \S+ \(this node, group rank 0, hosts the store\)", spare_text
    )
    final = json.loads(result.read_text())
    assert final["steps"] == STEPS and final["sha256"] == fault_free["sha256"]
    everyone = {int(e["pid"]) for e in events(progress)} | tree
    wait_until(
        lambda: not [p for p in everyone if process_running(p)], "no process of the job to be left", 60
    )


def test_the_leading_replicas_node_hung_is_replaced_and_its_survivor_follows_the_new_leader(
    launch: Launcher, etcd_v2: EtcdServer, tmp_path: Path, fault_free: dict[str, Any]
) -> None:
    """Every process of the node whose controller replica leads SIGSTOPped (its sockets open): the
    survivor's agent, whose stream to that leader stays open, must follow the new leader (its own
    node's replica) in time, or that leader counts the survivor lost too and spends the spare on it."""
    job = start_job(launch, etcd_v2, tmp_path, "hungleader")
    # The leader: the node whose replica took the newest generation.
    generations = {
        n: max((int(g) for g in re.findall(r"this replica \(\S+\) leads, generation (\d+)", job.text(n))), default=-1)
        for n in (0, 1)
    }
    hung = max(generations, key=lambda n: generations[n])
    survivor = 1 - hung
    assert generations[hung] >= 0, "one of the two nodes' replicas leads"
    tree = {job.nodes[hung].pid, *descendants(job.nodes[hung].pid)}
    before = len(events(job.progress))
    for pid in tree:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(
            lambda: "takes the place of lost node" in job.spare_log.read_text(), "the spare to take a seat", WAIT
        )
        wait_until(
            lambda: {e["rank"] for e in events(job.progress)[before:] if e["event"] == "step"} == {0, 1, 2, 3},
            "every rank to step again",
            WAIT,
        )
    finally:
        for pid in tree:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert "was declared lost" not in job.text(survivor)
    assert job.nodes[hung].wait(timeout=WAIT) == 1 and "was declared lost" in job.text(hung)
    assert job.nodes[survivor].wait(timeout=WAIT) == 0, job.text(survivor)[-3000:]
    assert job.spare.wait(timeout=WAIT) == 0, job.spare_log.read_text()[-3000:]
    final = json.loads(job.result.read_text())
    assert final["steps"] == STEPS and final["sha256"] == fault_free["sha256"]
    everyone = {int(e["pid"]) for e in events(job.progress)} | tree
    wait_until(
        lambda: not [p for p in everyone if process_running(p)], "no process of the job to be left", 60
    )
