"""Real MindSpore 2.10 ``msrun``: two msrun processes as two nodes (2 workers each) under TaskD.

Both "nodes" run on this machine. msrun decides it is the master (and starts a
scheduler) when ``--master_addr`` is a local address, so both do; node 1 is
started once node 0's scheduler listens, and its own scheduler then fails to
bind the port and exits, leaving node 0's to serve the job, as on a real
cluster. Workers run ``examples/train.py`` (graph mode on CPU).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from taskd_core.testing import free_port, process_running, wait_until

# A missing MindSpore is a broken install (scripts/env.sh installs it), never a reason to skip.
try:
    import mindspore  # noqa: F401
except ImportError as exc:
    raise RuntimeError("MindSpore 2.10 is not installed: run scripts/env.sh; these tests need the real msrun") from exc

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.py"
MSRUN = Path(sys.executable).with_name("msrun")
STEPS = 30


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _pids_mentioning(text: str) -> list[int]:
    """Live processes whose command line mentions ``text`` (psutil-free /proc scan)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if text in proc.joinpath("cmdline").read_bytes().decode(errors="replace") and process_running(int(proc.name)):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


@dataclass
class TwoNodeJob:
    """Two msrun processes of one job, each in a session of its own so cleanup can reach everything."""

    root: Path
    env: dict[str, str] = field(default_factory=dict)
    script_args: list[str] = field(default_factory=list)
    nodes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def out(self) -> Path:
        return self.root / "out"

    def start(self) -> None:
        port = free_port()
        env = dict(
            os.environ,
            # msrun starts every process with the `python` found first on PATH.
            PATH=f"{MSRUN.parent}{os.pathsep}{os.environ.get('PATH', '')}",
            MS_ENABLE_TFT="{ARF:1}",
            TASKD_CONTROLLER_PORT=str(free_port()),
            TASKD_JOB_ID=f"ms-{port}",
            TASKD_STOP_TIMEOUT="10",
            TASKD_SCHEDULER_GRACE="30",
            GLOG_v="3",
        )
        env.update(self.env)
        for rank in (0, 1):
            log_dir = self.root / f"logs{rank}"
            cmd = [
                str(MSRUN), "--worker_num=4", "--local_worker_num=2", f"--node_rank={rank}",
                "--join=False", f"--master_port={port}", f"--log_dir={log_dir}",
                str(EXAMPLE), "--out", str(self.out), "--steps", str(STEPS), *self.script_args,
            ]
            with open(self.root / f"msrun{rank}.log", "wb") as log:
                self.nodes.append(subprocess.Popen(cmd, env=env, cwd=self.root, stdout=log,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
            if rank == 0:
                wait_until(lambda: _listening(port), deadline=60, what="node 0's scheduler")

    def progress(self) -> list[dict[str, Any]]:
        path = self.out / "progress.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def pid_of(self, rank: int) -> int:
        return [p for p in self.progress() if p["rank"] == rank][-1]["pid"]

    def wait_step(self, step: int, timeout: float = 300.0, **where: Any) -> None:
        def reached() -> bool:
            return any(p["step"] >= step and all(p[k] == v for k, v in where.items()) for p in self.progress())

        wait_until(reached, deadline=timeout, what=f"step {step} {where}")

    def exit_codes(self, timeout: float = 400.0) -> list[int]:
        deadline = time.monotonic() + timeout
        return [node.wait(timeout=max(0.1, deadline - time.monotonic())) for node in self.nodes]

    def close(self) -> None:
        for node in self.nodes:
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            node.wait()
        # Workers have sessions of their own; anything still mentioning this job's directory goes too.
        for pid in _pids_mentioning(str(self.root)):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[TwoNodeJob]:
    made = TwoNodeJob(tmp_path)
    try:
        yield made
    finally:
        made.close()


def _assert_nothing_left(job: TwoNodeJob) -> None:
    wait_until(lambda: not _pids_mentioning(str(job.root)), deadline=10, what="every job process to end")


def test_sigkilled_worker_is_recovered_and_training_resumes(job: TwoNodeJob) -> None:
    """SIGKILL of rank 3 → one recovery cycle through msrun's callbacks → all ranks resume and finish; exit 0."""
    job.start()
    job.wait_step(5, rank=3)
    victim = job.pid_of(3)
    os.kill(victim, signal.SIGKILL)
    assert job.exit_codes() == [0, 0]
    final = {r: [p for p in job.progress() if p["rank"] == r][-1] for r in range(4)}
    # Exactly one cycle: every rank runs its second life (restart counter 1) to the end.
    assert all(p["step"] == STEPS and p["restart"] == 1 and p["resumed_from"] > 0 for p in final.values())
    assert final[3]["pid"] != victim
    _assert_nothing_left(job)


def test_recover_in_place_restarts_only_the_dead_rank(job: TwoNodeJob) -> None:
    """Forced recover-in-place: rank 3 alone restarts (START_WORKER_LIST) and resumes; the others keep their pids."""
    job.env.update(ENABLE_RESTART_FAULT_PROCESS="on", TASKD_STRATEGIES="recover-in-place,exit")
    # Ranks that do no collectives after init(): a replaced peer cannot rejoin a CPU collective group.
    job.script_args = ["--no-collective", "--step-sleep", "0.5"]
    job.start()
    for rank in range(4):
        # Independent ranks progress at their own pace: each must have a checkpoint before the kill.
        job.wait_step(3, rank=rank)
    before = {r: job.pid_of(r) for r in range(4)}
    os.kill(before[3], signal.SIGKILL)
    assert job.exit_codes() == [0, 0]
    progress = job.progress()
    assert {p["pid"] for p in progress if p["rank"] != 3} == {before[0], before[1], before[2]}
    resumed = [p for p in progress if p["rank"] == 3 and p["pid"] != before[3]]
    assert resumed and resumed[0]["resumed_from"] > 0 and resumed[-1]["step"] == STEPS
    _assert_nothing_left(job)


def test_faults_beyond_the_budget_give_the_job_up(job: TwoNodeJob) -> None:
    """With one recovery cycle allowed, a second SIGKILL gives the job up: msrun exits non-zero, nothing is left."""
    job.env.update(TASKD_MAX_CYCLES="1")
    job.start()
    job.wait_step(3)
    os.kill(job.pid_of(1), signal.SIGKILL)
    wait_until(lambda: any(p["restart"] == 1 and p["rank"] == 1 for p in job.progress()), deadline=300,
               what="rank 1 restarted")
    assert all(n.poll() is None for n in job.nodes), "the first fault alone must not end the job"
    os.kill(job.pid_of(1), signal.SIGKILL)
    codes = job.exit_codes()
    assert all(code != 0 for code in codes), codes
    _assert_nothing_left(job)
