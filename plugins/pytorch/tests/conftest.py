"""Fixtures for the pytorch adapter: real torch elastic agents driving plain python workers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> object:
    """Poll ``predicate`` until it returns something truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def records(out: Path) -> list[dict[str, str]]:
    """What every worker started so far wrote about itself (``workers/idle.py``)."""
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def make_agent(tmp_path: Path) -> Iterator[Callable[..., object]]:
    """Build ``TaskdElasticAgent`` s on a one-node c10d rendezvous; every worker is stopped at teardown."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from taskd_pytorch.elastic import TaskdElasticAgent

    made: list[TaskdElasticAgent] = []

    def make(*worker_args: str, nproc: int = 2, script: str = "idle.py") -> TaskdElasticAgent:
        handler = get_rendezvous_handler(
            RendezvousParameters(
                backend="c10d", endpoint="127.0.0.1:0", run_id=uuid.uuid4().hex, min_nodes=1, max_nodes=1
            )
        )
        spec = WorkerSpec(
            role="trainer",
            local_world_size=nproc,
            rdzv_handler=handler,
            entrypoint=sys.executable,
            args=("-u", str(WORKERS / script), *worker_args),
            local_addr="127.0.0.1",
        )
        agent = TaskdElasticAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path / "logs")), stop_timeout=5.0)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.stop(None, timeout=1.0)
        agent.get_worker_group().spec.rdzv_handler.shutdown()


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


def kill(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    os.kill(pid, sig)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def taskdrun_exe() -> str:
    return str(Path(sys.executable).with_name("taskdrun"))


class Launcher:
    """Starts ``taskdrun`` processes in ``root``; :meth:`cleanup` kills what is left of them and of their workers.

    Workers run in sessions of their own, so their pids are collected from the
    records they write (``*.json`` of ``idle.py``, ``pid`` of progress lines).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[subprocess.Popen[bytes]] = []

    def __call__(self, *argv: str, log: str = "taskdrun") -> subprocess.Popen[bytes]:
        with open(self.root / f"{log}.{len(self.started)}.log", "wb") as out:
            proc = subprocess.Popen(
                [taskdrun_exe(), "--taskd-log-level", "INFO", *argv], stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=self.root,
            )
        self.started.append(proc)
        return proc

    def cleanup(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for pid in worker_pids(self.root):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path)
    yield launcher
    launcher.cleanup()


def worker_pids(root: Path) -> set[int]:
    """Every worker pid any test file under ``root`` recorded."""
    pids = {int(json.loads(p.read_text())["pid"]) for p in root.rglob("rank*.json")}
    for progress in root.rglob("*.jsonl"):
        pids |= {int(json.loads(line)["pid"]) for line in progress.read_text().splitlines() if line.strip()}
    return pids
