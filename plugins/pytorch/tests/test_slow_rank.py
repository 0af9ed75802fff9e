"""A slow rank in a real ``taskdrun`` job (1 node x 4 ranks, gloo on CPU): the controller names it.

``examples/train_ddp.py`` reports each step's work (its time less its wait in
the all_reduce), ``examples/train_live.py``'s ``LiveSession`` measures it
without being asked; with ``--slow-rank 2`` rank 2 sleeps longer from step 15 on,
and the others wait for it in their all_reduce. The job runs against a
``taskd controller`` child process whose journal the test reads afterwards.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pt_support import EXAMPLES, Launcher, events

from taskd_core.client.query import QueryClient
from taskd_core.models import Credentials, JournalEvent
from taskd_core.testing import wait_until

pytestmark = pytest.mark.slow

WAIT = 60.0
STEPS = 70
TOKEN = "the-slow-rank-tests-job-token"


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[str]:
    """A ``taskd controller`` on loopback with a SQLite state; yields its address."""
    port_file, log = tmp_path / "controller.port", tmp_path / "controller.log"
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
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield wait_until(
            lambda: port_file.exists() and port_file.read_text().strip(),
            "controller port file",
            WAIT,
            unless=lambda: proc.poll() is not None and log.read_text(),
        )
    finally:
        proc.terminate()
        proc.wait(timeout=WAIT)


def train(
    launch: Launcher,
    controller: str,
    work: Path,
    *extra: str,
    script: str = "train_ddp.py",
    steps: int = STEPS,
) -> tuple[list[JournalEvent], list[dict]]:
    """Run the job to its end; its journal and its progress events."""
    work.mkdir()
    progress, result = work / "progress.jsonl", work / "result.json"
    node = launch(
        "--nproc-per-node=4",
        "--taskd-controller",
        controller,
        "--taskd-job-id",
        work.name,
        str(EXAMPLES / script),
        "--ckpt-dir",
        str(work / "ckpt"),
        "--progress",
        str(progress),
        "--result",
        str(result),
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
    with QueryClient(controller, Credentials(token=TOKEN)) as query:
        page = query.events(work.name)
    return list(page.events), events(progress)


@pytest.mark.parametrize("script", ["train_ddp.py", "train_live.py"], ids=["busy-argument", "live-session"])
def test_a_rank_that_works_longer_than_its_peers_is_named_with_its_evidence(
    launch: Launcher, controller: str, tmp_path: Path, script: str
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
    (detail,) = found
    pids = {e["rank"]: e["pid"] for e in progress if e["event"] == "start"}
    assert detail["pid"] == pids[2]
    assert sorted(detail["peers"]) == ["0", "1", "3"] and detail["ratio"] >= 1.6
    assert detail["work_per_step"] >= 1.6 * detail["peer_median"]
    # Found from the steps after the slowdown began, within the window and its hold.
    assert 15 < detail["since_step"] <= detail["step"] <= 15 + 20 + 10
    # Nothing else happened to the job: no fault, no restart.
    assert not [e for e in journal if e.kind == "fault"]
    assert {e["restart"] for e in progress} == {0}


def test_a_healthy_job_whose_steps_vary_5x_has_no_slow_rank(
    launch: Launcher, controller: str, tmp_path: Path
) -> None:
    # Steps of 0.1-0.5 s: on a shared 2-core machine a rank starved of CPU for a few seconds really
    # works longer, and with steps of a few ms that alone can look like a straggler.
    journal, _ = train(
        launch, controller, tmp_path / "healthy", "--step-time", "0.1", "--step-jitter", "5", steps=50
    )
    assert [e.detail for e in journal if e.kind == "slow-rank"] == []
    assert len([e for e in journal if e.kind == "worker started"]) == 4
