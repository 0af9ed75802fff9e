"""Helpers shared by the pytorch adapter's tests (kept out of conftest so they import by a unique name)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from taskd_core.testing import descendants, free_port, process_running

WORKERS = Path(__file__).parent / "workers"
#: The token the agents of the ``make_agent`` fixture hand their workers (as a one-node taskdrun makes one).
JOB_TOKEN = "the launch's own token"
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
#: The training job of the DDP tests (``examples/train_ddp.py`` or its live twin) and its options.
STEPS = 30
TRAIN_ARGS = ("--steps", str(STEPS), "--ckpt-every", "3", "--step-time", "0.1")


def records(out: Path) -> list[dict[str, str]]:
    """What every worker started so far wrote about itself (``workers/idle.py``)."""
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def kill(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    os.kill(pid, sig)


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

    def __call__(
        self,
        *argv: str,
        log: str = "taskdrun",
        env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = (),
    ) -> subprocess.Popen[bytes]:
        """``taskdrun ARGV`` (run through ``prefix``, e.g. ``ip netns exec NS``, which execs it)."""
        with open(self.root / f"{log}.{len(self.started)}.log", "wb") as out:
            proc = subprocess.Popen(
                [*prefix, taskdrun_exe(), "--taskd-log-level", "INFO", *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.root,
                env=None if env is None else {**os.environ, **env},
            )
        self.started.append(proc)
        return proc

    def cleanup(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for pid in worker_pids(self.root):
            if process_running(pid):
                os.kill(pid, signal.SIGKILL)


def events(progress: Path) -> list[dict[str, Any]]:
    """The training job's progress events so far."""
    lines = progress.read_text().splitlines() if progress.exists() else []
    # The last line may still be being written by a worker.
    return [json.loads(line) for line in lines if line.endswith("}")]


def restores(progress: Path) -> dict[int, tuple[str, int]]:
    """Each rank's restore after its first life: (source, step)."""
    out = {}
    for e in events(progress):
        if e["event"].startswith("restored-from-") and e["restart"] > 0:
            out[e["rank"]] = (e["event"].removeprefix("restored-from-"), e["step"])
    return out


def workers(node: subprocess.Popen[bytes], progress: Path) -> dict[int, int]:
    """rank -> pid of the workers of the first life that still run."""
    alive = set(descendants(node.pid))
    return {
        e["rank"]: e["pid"]
        for e in events(progress)
        if e["event"] == "start" and e["restart"] == 0 and e["pid"] in alive
    }


def last_step(progress: Path) -> int:
    return max((e["step"] for e in events(progress) if e["event"] == "step" and e["restart"] == 0), default=0)


def example(script: str, work: Path) -> tuple[list[str], Path, Path]:
    """``examples/<script>`` writing its checkpoints, progress log and result in ``work`` (made here).

    :returns: the script's command line (its own options follow), the progress log and the result file.
    """
    work.mkdir()
    progress, result = work / "progress.jsonl", work / "result.json"
    argv = [str(EXAMPLES / script), "--ckpt-dir", str(work / "ckpt"), "--progress", str(progress), "--result", str(result)]
    return argv, progress, result


def one_node_job(
    launch: Launcher, work: Path, script: str, *args: str, taskd: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """Start ``examples/<script>`` on one ``taskdrun`` node of 4 workers in ``work``: launcher, progress, result."""
    example_argv, progress, result = example(script, work)
    node = launch(
        "--standalone",
        "--nproc-per-node=4",
        *taskd,
        *example_argv,
        *args,
        log=work.name,
    )
    return node, progress, result


def finish_one(node: subprocess.Popen[bytes], result: Path) -> dict[str, Any]:
    """The launcher's exit code must be 0; returns the job's result file."""
    assert node.wait(timeout=240) == 0
    return dict(json.loads(result.read_text()))


#: torchrun's two multi-node forms; ``run_job`` gives taskdrun exactly torchrun's arguments in either.
FORMS = ("c10d", "static")


def run_job(
    launch: Launcher,
    work: Path,
    *extra: str,
    script: str = "train_ddp.py",
    form: str = "c10d",
    max_cycles: int | None = None,
    taskd: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> tuple[list[subprocess.Popen[bytes]], Path, Path]:
    """Start the two ``taskdrun`` nodes (2 workers each) of one training job in ``work``.

    ``form`` is torchrun's command line: ``c10d``, the elastic form most
    clusters use, with no node rank (the rendezvous decides who hosts the
    controller); ``static``, ``--node-rank`` with ``--master-addr``/``--master-port``.
    No TaskD option is given unless ``max_cycles`` or ``taskd`` ask for one;
    ``env`` adds to both launchers' environment.

    :returns: the two launchers, the progress log and the result file.
    """
    example_argv, progress, result = example(script, work)
    port = free_port()
    common = ["--nnodes=2", "--nproc-per-node=2", *taskd]
    if max_cycles is not None:
        common += ["--taskd-max-cycles", str(max_cycles)]
    per_node: list[list[str]]
    if form == "c10d":
        common += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={work.name}"]
        per_node = [[], []]
    else:
        common += ["--master-addr=127.0.0.1", f"--master-port={port}"]
        per_node = [[f"--node-rank={n}"] for n in (0, 1)]
    job = [
        *example_argv,
        *TRAIN_ARGS,
        *extra,
    ]
    return (
        [launch(*common, *per_node[n], *job, log=f"{work.name}{n}", env=env) for n in (0, 1)],
        progress,
        result,
    )


def finish(nodes: list[subprocess.Popen[bytes]], result: Path) -> dict[str, Any]:
    """Both launchers' exit codes must be 0; returns the job's result file."""
    assert [node.wait(timeout=300) for node in nodes] == [0, 0]
    return dict(json.loads(result.read_text()))


def worker_pids(root: Path) -> set[int]:
    """Every worker pid any test file under ``root`` recorded (and the children it left, with ``--escape``)."""
    pids = set()
    for path in root.rglob("rank*.json"):
        record = json.loads(path.read_text())
        pids |= {int(record["pid"]), *record.get("escaped", [])}
    for progress in root.rglob("*.jsonl"):
        pids |= {int(json.loads(line)["pid"]) for line in progress.read_text().splitlines() if line.strip()}
    return pids
