"""Running real ``taskd run`` processes for end-to-end tests, and cleaning up after them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from taskd_core import testing
from taskd_core.forkserver._wire import SERVER_NAME
from taskd_core.testing import free_port

REPO = Path(__file__).resolve().parents[2]
TRAIN_DDP = REPO / "examples" / "train_ddp.py"
#: Ceiling of every wait in these tests: generous, for two loaded cores.
DEADLINE = 240.0


def job_processes(job_id: str, *, fork_servers: bool = True) -> list[int]:
    """Pids of live processes whose environment carries ``TASKD_JOB_ID=job_id`` (the workers of that job).

    ``/proc/<pid>/environ`` is a process's environment at ``exec``: a worker
    forked by the fork server shows the server's, which ``taskd run`` starts
    with the job id for that reason. ``fork_servers=False`` leaves the servers
    themselves (named ``taskd-forksrv``) out.
    """
    needle = f"TASKD_JOB_ID={job_id}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        server = stat[stat.find(b"(") + 1 : stat.rfind(b")")] == SERVER_NAME
        if (
            needle in environ
            and stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"Z"
            and (fork_servers or not server)
        ):
            pids.append(int(entry))
    return pids


def worker_command(tmp_path: Path, source: str, mode: str) -> list[str]:
    """The command running worker script ``source`` as ``worker.py OUT MODE`` (OUT: ``tmp_path/out``, made)."""
    script = tmp_path / "worker.py"
    script.write_text(source)
    (tmp_path / "out").mkdir(exist_ok=True)
    return [sys.executable, str(script), str(tmp_path / "out"), mode]


class TaskdRun:
    """One ``python -m taskd_core run ...`` process (one node), its output in a log file."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "taskd_core", "--log-level", "INFO", "run", *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=env,
                start_new_session=True,
            )

    def wait(self, timeout: float = DEADLINE) -> int:
        return self.proc.wait(timeout=timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM (taskd run stops its workers), then SIGKILL if it does not end."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=60)


class Cluster:
    """The ``taskd run`` processes of one test, sharing one job id; :meth:`close` leaves nothing running."""

    def __init__(self, tmp_path: Path, job_id: str, master_addr: str = "127.0.0.1") -> None:
        self.tmp_path = tmp_path
        self.job_id = job_id
        self.master_addr = master_addr
        self.runs: list[TaskdRun] = []
        self.master_port = free_port(master_addr)
        self.controller_port = free_port(master_addr)
        self.state = tmp_path / "controller.db"

    def node(self, node_rank: int, nnodes: int, nproc: int, command: list[str], *extra: str) -> TaskdRun:
        argv = [
            "--nnodes",
            str(nnodes),
            "--node-rank",
            str(node_rank),
            "--nproc",
            str(nproc),
            "--master-addr",
            self.master_addr,
            "--master-port",
            str(self.master_port),
            "--controller-port",
            str(self.controller_port),
            "--controller-state",
            str(self.state),
            "--job-id",
            self.job_id,
            "--log-dir",
            str(self.tmp_path / "logs"),
            "--flush-seconds",
            "0.3",
            "--stop-timeout",
            "10",
            "--report-timeout",
            "60",
            "--connect-timeout",
            "60",
            *extra,
            "--",
            *command,
        ]
        run = TaskdRun(argv, self.tmp_path / f"node{node_rank}.log")
        self.runs.append(run)
        return run

    def wait_all(self) -> list[int]:
        return [run.wait() for run in self.runs]

    def journal(self) -> list[tuple[str, dict[str, object]]]:
        """The controller's journal of this job, from node 0's state file: (kind, detail) oldest first."""
        db = sqlite3.connect(self.state)
        try:
            rows = db.execute("SELECT kind, detail FROM events WHERE job_id = ? ORDER BY seq", (self.job_id,))
            return [(kind, json.loads(detail)) for kind, detail in rows]
        finally:
            db.close()

    def close(self) -> None:
        for run in self.runs:
            run.stop()
        for pid in job_processes(self.job_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def diagnostics(self) -> str:
        return "\n".join(f"--- {run.log.name}\n{run.output()[-6000:]}" for run in self.runs)


def read_events(path: Path) -> list[dict[str, object]]:
    """The JSON-lines progress log (complete lines only)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_until(what: str, check: Callable[[], bool], cluster: Cluster, deadline: float = DEADLINE) -> None:
    """:func:`taskd_core.testing.wait_until` for a cluster: ends as soon as a node ended, and fails with every node's log."""

    def ended() -> str:
        gone = [r.log.name for r in cluster.runs if r.proc.poll() is not None]
        return f"ended: {gone}" if gone else ""

    testing.wait_until(check, what, deadline, interval=0.05, unless=ended, explain=cluster.diagnostics)


def cluster_fixture(tmp_path: Path, request_name: str) -> Iterator[Cluster]:
    job_id = f"e2e-{request_name}-{os.getpid()}"[:100]
    cluster = Cluster(tmp_path, job_id)
    try:
        yield cluster
    finally:
        cluster.close()
