"""Slow ranks in real ``taskdrun`` jobs (gloo on CPU): the controller names them, and only them.

``examples/train_ddp.py`` reports each step's work (its time less its wait in
the all_reduce), ``examples/train_live.py``'s ``LiveSession`` measures it
without being asked; with ``--slow-rank 2`` rank 2 sleeps longer from step 15 on,
and the others wait for it in their all_reduce (1 node x 4 ranks). On 2 nodes x
2 ranks, one job goes through per-rank jitter, a job-wide slowdown and a slow
node (``--slow-rank 2,3``). The jobs run against a ``taskd controller`` child
process whose journal, ``taskd status --json`` and /metrics the tests read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pt_support import Launcher, events, example, finish, run_job
from test_node_loss import Job, no_leftovers, start_nodes

from taskd_core.client.query import QueryClient
from taskd_core.models import Credentials, JournalEvent
from taskd_core.testing import descendants, free_port, wait_until
from tests.controller.test_metrics import scrape

pytestmark = pytest.mark.slow

WAIT = 60.0
STEPS = 70
#: A job with a spare: launchers take 10-20 s to start on a loaded machine.
REPLACE_WAIT = 120.0
TOKEN = "the-slow-rank-tests-job-token"


@dataclass(frozen=True)
class Controller:
    address: str
    metrics_port: int


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[Controller]:
    """A ``taskd controller`` on loopback with a SQLite state and its /metrics."""
    port_file, log = tmp_path / "controller.port", tmp_path / "controller.log"
    metrics = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "taskd_core",
                "controller",
                "--listen",
                "127.0.0.1:0",
                "--state",
                str(tmp_path / "state.db"),
                "--port-file",
                str(port_file),
                "--metrics-port",
                str(metrics),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        address = wait_until(
            lambda: port_file.exists() and port_file.read_text().strip(),
            "controller port file",
            WAIT,
            unless=lambda: proc.poll() is not None and log.read_text(),
        )
        yield Controller(address, metrics)
    finally:
        proc.terminate()
        proc.wait(timeout=WAIT)


def train(
    launch: Launcher,
    controller: Controller,
    work: Path,
    *extra: str,
    script: str = "train_ddp.py",
    steps: int = STEPS,
) -> tuple[list[JournalEvent], list[dict]]:
    """Run the job to its end; its journal and its progress events."""
    example_argv, progress, result = example(script, work)
    node = launch(
        "--nproc-per-node=4",
        "--taskd-controller",
        controller.address,
        "--taskd-job-id",
        work.name,
        *example_argv,
        "--steps",
        str(steps),
        "--ckpt-every",
        "10",
        *extra,
        log=work.name,
        env={"TASKD_JOB_TOKEN": TOKEN},
    )
    assert node.wait(timeout=300) == 0
    assert json.loads(result.read_text())["steps"] == steps
    with QueryClient(controller.address, Credentials(token=TOKEN)) as query:
        page = query.events(work.name)
    return list(page.events), events(progress)


@pytest.mark.parametrize("script", ["train_ddp.py", "train_live.py"], ids=["busy-argument", "live-session"])
def test_a_rank_that_works_longer_than_its_peers_is_named_with_its_evidence(
    launch: Launcher, controller: Controller, tmp_path: Path, script: str
) -> None:
    """``train_ddp.py`` reports its work (``worker.step(n, busy=...)``); ``LiveSession`` measures it unasked."""
    journal, progress = train(
        launch,
        controller,
        tmp_path / "slow",
        "--step-time",
        "0.05",
        "--slow-rank",
        "2",
        "--slow-from",
        "15",
        "--slow-step-time",
        "0.25",
        script=script,
    )
    found = [e.detail for e in journal if e.kind == "slow-rank"]
    assert [d["ranks"] for d in found] == [[2]], found
    ((detail, evidence),) = [(d, e) for d in found for e in d["evidence"]]
    pids = {e["rank"]: e["pid"] for e in progress if e["event"] == "start"}
    assert evidence["pid"] == pids[2]
    assert sorted(evidence["peers"]) == ["0", "1", "3"] and evidence["ratio"] >= 1.6
    assert evidence["work_per_step"] >= 1.6 * evidence["peer_median"]
    # Found from the steps after the slowdown began, within the window and its hold.
    assert 15 < evidence["since_step"] <= detail["step"] <= 15 + 20 + 10
    # Nothing else happened to the job: no fault, no restart.
    assert not [e for e in journal if e.kind == "fault"]
    assert {e["restart"] for e in progress} == {0}


#: The 2-node job's phases: every rank's steps twice as long from JOB_SLOW on, node 1's ranks
#: (2 and 3) 2.5x their peers' from NODE_SLOW on; each rank's steps vary 3x on their own throughout.
JOB_SLOW, NODE_SLOW, PHASED_STEPS = 20, 50, 80


def test_a_slow_node_is_one_event_naming_both_ranks_and_a_job_wide_slowdown_with_jitter_none(
    launch: Launcher, controller: Controller, tmp_path: Path
) -> None:
    """2 taskdrun nodes x 2 ranks: per-rank jitter, then a job-wide 2x slowdown, then a slow node."""
    job = tmp_path / "phases"
    nodes, progress, result = run_job(
        launch,
        job,
        "--steps", str(PHASED_STEPS), "--step-time", "0.05", "--step-jitter", "3", "--jitter-per-rank",
        "--job-slow-from", str(JOB_SLOW), "--job-slow-factor", "2",
        "--slow-rank", "2,3", "--slow-from", str(NODE_SLOW), "--slow-step-time", "0.125",
        taskd=("--taskd-controller", controller.address, "--taskd-job-id", job.name),
        env={"TASKD_JOB_TOKEN": TOKEN},
    )  # fmt: skip
    assert finish(nodes, result)["steps"] == PHASED_STEPS
    with QueryClient(controller.address, Credentials(token=TOKEN)) as query:
        journal = query.events(job.name).events
    (found,) = [e.detail for e in journal if e.kind == "slow-rank"]
    # Nothing before the node slowed (jitter, the job-wide slowdown); then one event for its two ranks.
    assert found["ranks"] == [2, 3] and found["action"] == "warn", found
    pids = {e["rank"]: e["pid"] for e in events(progress) if e["event"] == "start"}
    assert [(f["rank"], f["pid"]) for f in found["evidence"]] == [(2, pids[2]), (3, pids[3])]
    for evidence in found["evidence"]:
        assert NODE_SLOW < evidence["since_step"] <= found["step"] <= NODE_SLOW + 20 + 10, found
        assert evidence["ratio"] >= 1.6 and evidence["work_per_step"] >= 1.6 * evidence["peer_median"]
        assert len(evidence["peers"]) == 3
    (view,) = status(controller.address, job.name)["jobs"]
    assert [(r["rank"], r["pid"]) for r in view["slow_ranks"]] == [(2, pids[2]), (3, pids[3])]
    # (The event's "agent" is whichever node's report completed the step: timing, not the finding.)
    assert scrape(controller.metrics_port)["taskd_slow_ranks_found_total{action=warn}"] == 2
    assert not [e for e in journal if e.kind == "fault"] and {e["restart"] for e in events(progress)} == {0}


def status(address: str, job: str) -> dict[str, Any]:
    """What ``taskd status --json`` prints about ``job``."""
    done = subprocess.run(
        [str(Path(sys.executable).with_name("taskd")), "status", "--controller", address, "--job", job, "--json"],
        capture_output=True,
        text=True,
        timeout=WAIT,
        env={**os.environ, "TASKD_JOB_TOKEN": TOKEN},
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_with_replace_a_slow_ranks_node_is_drained_onto_the_spare_and_not_taken_back(
    launch: Launcher, tmp_path: Path
) -> None:
    """2 nodes x 2 ranks and a spare (c10d): rank 3 slows down on its first life; ``--taskd-slow-rank
    replace`` drains node 1 through the lost-node path, the spare runs ranks 2 and 3, node 1 is fenced."""
    job = Job(launch, tmp_path / "slowspare", "--taskd-slow-rank", "replace")
    job.argv[job.argv.index("--steps") + 1] = "80"
    job.argv += ["--slow-rank", "3", "--slow-from", "10", "--slow-step-time", "0.4"]
    node0, node1, spare = start_nodes(job)  # the ranks hold before step 30 until released
    node1_tree = {node1.pid, *descendants(node1.pid)}
    first_life = {e["rank"]: int(e["pid"]) for e in events(job.progress) if e["event"] == "start"}
    job.release()  # the spare stands by now: rank 3, still slow, is replaced with the next reports

    def replaced() -> list[dict[str, object]] | None:
        slow = [e.detail for e in job.journal() if e.kind == "slow-rank"]
        return slow if any(d["action"] == "replace" for d in slow) else None

    slow = wait_until(replaced, "rank 3's node to be replaced", REPLACE_WAIT)
    assert [(d["ranks"], d["node"]) for d in slow if d["action"] == "replace"] == [([3], "node-1")], slow
    # Found before the spare stood by (a loaded machine starts it late), it was reported first; found
    # after, it was replaced at once.
    assert [(d["ranks"], d["action"]) for d in slow] in ([([3], "warn"), ([3], "replace")], [([3], "replace")]), slow
    assert all(d["reason"] == "no hot spare stands by (yet)" for d in slow[:-1])
    assert node1.wait(timeout=REPLACE_WAIT) == 1, job.log(1)[-3000:]
    assert "was declared lost and spare" in job.log(1)
    assert node0.wait(timeout=REPLACE_WAIT) == 0, job.log(0)[-3000:]
    assert spare.wait(timeout=REPLACE_WAIT) == 0, job.log(2)[-3000:]
    assert "takes the place of lost node 1" in job.log(2)
    assert json.loads(job.result.read_text())["steps"] == 80
    # Ranks 2 and 3 finished on the spare, in new processes, none of node 1's.
    last = {e["rank"]: int(e["pid"]) for e in events(job.progress) if e["event"] == "start"}
    assert not {last[2], last[3]} & (node1_tree | {first_life[2], first_life[3]})
    no_leftovers(job, node1_tree)
