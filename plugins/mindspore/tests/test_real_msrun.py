"""Real MindSpore 2.10 ``msrun`` under TaskD: two nodes of 2 workers, and one node of 2 workers.

The two "nodes" run on this machine. msrun decides it is the master (and
starts a scheduler) when ``--master_addr`` is a local address, so both do;
node 1 is started once node 0's scheduler listens, and its own scheduler then
fails to bind the port and exits, leaving node 0's to serve the job, as on a
real cluster. Workers run ``examples/train.py`` (graph mode on CPU) and are
forked from each node's MindSpore fork server (``taskd_mindspore.warm``).
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

from taskd_core.testing import descendants, free_port, process_running, wait_until

# A missing MindSpore is a broken install (scripts/env.sh installs it), never a reason to skip.
try:
    import mindspore  # noqa: F401
except ImportError as exc:
    raise RuntimeError("MindSpore 2.10 is not installed: run scripts/env.sh; these tests need the real msrun") from exc

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.py"
MSRUN = Path(sys.executable).with_name("msrun")
STEPS = 30
SERVER_NAME = "taskd-forksrv"


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _stat(pid: int) -> tuple[str, int]:
    """(command name, parent pid) of a live process."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    name, _, rest = stat.partition(" (")[2].rpartition(") ")
    return name, int(rest.split()[1])


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
class MsrunJob:
    """One msrun process per node of one job, each in a session of its own so cleanup can reach everything."""

    root: Path
    nnodes: int = 2
    env: dict[str, str] = field(default_factory=dict)
    script_args: list[str] = field(default_factory=list)
    nodes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    #: every process ever seen below the msrun processes (for cleanup).
    seen: set[int] = field(default_factory=set)

    @property
    def out(self) -> Path:
        return self.root / "out"

    @property
    def world(self) -> int:
        return 2 * self.nnodes

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
        for rank in range(self.nnodes):
            log_dir = self.root / f"logs{rank}"
            cmd = [
                str(MSRUN), f"--worker_num={self.world}", "--local_worker_num=2", f"--node_rank={rank}",
                "--join=False", f"--master_port={port}", f"--log_dir={log_dir}",
                str(EXAMPLE), "--out", str(self.out), "--steps", str(STEPS), *self.script_args,
            ]
            with open(self.root / f"msrun{rank}.log", "wb") as log:
                self.nodes.append(subprocess.Popen(cmd, env=env, cwd=self.root, stdout=log,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
            if rank == 0 and self.nnodes > 1:
                wait_until(lambda: _listening(port), deadline=60, what="node 0's scheduler")

    def events(self, kind: str = "step") -> list[dict[str, Any]]:
        path = self.out / "progress.jsonl"
        if not path.exists():
            return []
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
        return [e for e in lines if e.get("event") == kind]

    def pid_of(self, rank: int) -> int:
        return [p for p in self.events() if p["rank"] == rank][-1]["pid"]

    def wait_step(self, step: int, timeout: float = 300.0, **where: Any) -> None:
        def reached() -> bool:
            return any(p["step"] >= step and all(p[k] == v for k, v in where.items()) for p in self.events())

        wait_until(reached, deadline=timeout, what=f"step {step} {where}")

    def wait_new_pids(self, ranks: list[int], old: set[int], timeout: float = 300.0) -> dict[int, int]:
        """Each rank's pid once it completed a step in a process not in ``old``."""

        def stepped() -> dict[int, int] | None:
            new = {p["rank"]: p["pid"] for p in self.events() if p["pid"] not in old}
            return new if all(r in new for r in ranks) else None

        wait_until(lambda: stepped() is not None, deadline=timeout, what=f"ranks {ranks} stepping in new processes")
        found = stepped()
        assert found is not None
        return found

    def fork_servers(self) -> list[int]:
        self.watch()
        return [p for p in descendants(self.nodes[0].pid) if _stat(p)[0] == SERVER_NAME]

    def watch(self) -> None:
        for node in self.nodes:
            self.seen.update(descendants(node.pid))

    def exit_codes(self, timeout: float = 400.0) -> list[int]:
        deadline = time.monotonic() + timeout
        return [node.wait(timeout=max(0.1, deadline - time.monotonic())) for node in self.nodes]

    def close(self) -> None:
        self.watch()
        for node in self.nodes:
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            node.wait()
        # Workers and the fork server have sessions of their own.
        for pid in {*self.seen, *_pids_mentioning(str(self.root))}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def job(tmp_path: Path) -> Iterator[MsrunJob]:
    made = MsrunJob(tmp_path)
    try:
        yield made
    finally:
        made.close()


def _assert_nothing_left(job: MsrunJob) -> None:
    def gone() -> bool:
        return not _pids_mentioning(str(job.root)) and not any(process_running(p) for p in job.seen)

    wait_until(gone, deadline=10, what="every job process (workers, scheduler, fork server) to end")


def test_sigkilled_worker_is_recovered_and_training_resumes(job: MsrunJob) -> None:
    """SIGKILL of rank 3 → one recovery cycle through msrun's callbacks → all ranks resume and finish; exit 0.
    The workers are forked from each node's fork server, with the 1 s heartbeat TaskD sets."""
    job.start()
    job.wait_step(5, rank=3)
    assert len(job.fork_servers()) == 1
    victim = job.pid_of(3)
    os.kill(victim, signal.SIGKILL)
    assert job.exit_codes() == [0, 0]
    final = {r: [p for p in job.events() if p["rank"] == r][-1] for r in range(4)}
    # Exactly one cycle: every rank runs its second life (restart counter 1) to the end.
    assert all(p["step"] == STEPS and p["restart"] == 1 and p["resumed_from"] > 0 for p in final.values())
    assert final[3]["pid"] != victim
    assert all(p["heartbeat"] == {"MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1"} for p in final.values())
    starts = {e["pid"]: e for e in job.events("start")}
    # Forked: the parent of each worker of the second life is a fork server, not msrun.
    assert all(starts[p["pid"]]["ppid"] not in {n.pid for n in job.nodes} for p in final.values())
    _assert_nothing_left(job)


def test_recover_in_place_restarts_only_the_dead_rank(job: MsrunJob) -> None:
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
    progress = job.events()
    assert {p["pid"] for p in progress if p["rank"] != 3} == {before[0], before[1], before[2]}
    resumed = [p for p in progress if p["rank"] == 3 and p["pid"] != before[3]]
    assert resumed and resumed[0]["resumed_from"] > 0 and resumed[-1]["step"] == STEPS
    _assert_nothing_left(job)


def test_faults_beyond_the_budget_give_the_job_up(job: MsrunJob) -> None:
    """With one recovery cycle allowed, a second SIGKILL gives the job up: msrun exits non-zero, nothing is left."""
    job.env.update(TASKD_MAX_CYCLES="1")
    job.start()
    job.wait_step(3)
    os.kill(job.pid_of(1), signal.SIGKILL)
    wait_until(lambda: any(p["restart"] == 1 and p["rank"] == 1 for p in job.events()), deadline=300,
               what="rank 1 restarted")
    assert all(n.poll() is None for n in job.nodes), "the first fault alone must not end the job"
    job.watch()
    os.kill(job.pid_of(1), signal.SIGKILL)
    codes = job.exit_codes()
    assert all(code != 0 for code in codes), codes
    _assert_nothing_left(job)


def test_one_node_survives_its_ranks_and_its_fork_server_keeping_the_users_heartbeat(job: MsrunJob) -> None:
    """One node, one job, in turn: a script that forks by itself; SIGKILL of a rank and the fork server together
    (the restart finds no server ready: msrun's own start; a new server comes up), then of rank 1, then of both
    ranks; the heartbeat bounds the user set are the ones every worker sees; the job ends at the stop step, exit 0.
    The server goes first: a first failure in a row is restarted at once (later ones after a crash-loop backoff,
    which a new server may outlast)."""
    job.nnodes = 1
    stop = job.root / "stop-at"
    job.env.update(MS_RETRY_INTERVAL_LOWER="1", MS_RETRY_INTERVAL_UPPER="2", TASKD_MAX_CYCLES="10")
    job.script_args = ["--steps", "100000", "--step-sleep", "0.1", "--fork-child", "--stop-file", str(stop)]
    job.start()
    job.wait_step(3, rank=1)
    children = job.events("child")
    assert sorted(c["rank"] for c in children) == [0, 1] and all(c["value"] == 10.0 for c in children)
    msrun = job.nodes[0].pid
    assert {e["ppid"] for e in job.events("start")} == set(job.fork_servers())  # forked from the first start

    # The fork server dies with a rank (its forked workers with it): the restart finds no server ready.
    servers = job.fork_servers()
    old = {p["pid"] for p in job.events()}
    started = {e["pid"] for e in job.events("start")}
    os.kill(job.pid_of(0), signal.SIGKILL)
    os.kill(servers[0], signal.SIGKILL)
    job.wait_new_pids([0, 1], old)
    assert {e["ppid"] for e in job.events("start") if e["pid"] not in started} == {msrun}, "not msrun's own start"
    wait_until(lambda: job.fork_servers() and job.fork_servers() != servers, deadline=120, what="a new fork server")

    old = {p["pid"] for p in job.events()}
    os.kill(job.pid_of(1), signal.SIGKILL)
    job.wait_new_pids([0, 1], old)

    old = {p["pid"] for p in job.events()}
    for rank in (0, 1):
        os.kill(job.pid_of(rank), signal.SIGKILL)
    job.wait_new_pids([0, 1], old)

    last = max(p["step"] for p in job.events())
    stop.write_text(str(last + 30))
    assert job.exit_codes() == [0]
    done = job.events("done")
    assert sorted(d["rank"] for d in done) == [0, 1] and {d["step"] for d in done} == {last + 30}
    assert all(p["heartbeat"] == {"MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "2"} for p in job.events())
    _assert_nothing_left(job)


def test_dump_saves_the_last_step_and_the_worker_exits_0(job: MsrunJob) -> None:
    """With TASKD_STRATEGIES=dump,exit a SIGKILLed rank makes the controller choose dump: the surviving rank saves
    its last completed step at the next step boundary and exits 0 (taskd_mindspore.dump); the job is given up."""
    job.nnodes = 1
    job.env.update(TASKD_STRATEGIES="dump,exit", TASKD_DUMP_GRACE="60")
    # A long step: the surviving rank is between steps, not in a collective with the dead one, when asked.
    job.script_args = ["--steps", "1000", "--step-sleep", "2", "--ckpt-every", "1000"]
    job.start()
    job.wait_step(3, rank=1)
    os.kill(job.pid_of(1), signal.SIGKILL)
    codes = job.exit_codes()
    assert codes != [0], codes
    dumps = job.events("dump")
    assert [d["rank"] for d in dumps] == [0]
    last = max(p["step"] for p in job.events() if p["rank"] == 0)
    assert dumps[0]["step"] == last and dumps[0]["pid"] == job.pid_of(0)
    saved = mindspore.load_checkpoint(str(job.out / "rank0.ckpt"))
    assert int(saved["global_step"].asnumpy()) == last
    log = (job.root / "msrun0.log").read_text()
    assert f"asking rank 0 (pid {dumps[0]['pid']}) to save" in log
    _assert_nothing_left(job)
