"""Recovery time of a DDP job after a SIGKILLed rank: taskdrun against torchrun, in one invocation.

The job is ``examples/train_ddp.py`` (gloo, CPU) with a checkpoint every
``--ckpt-every`` steps, on 2 and 4 workers of one node and on 2 nodes × 2
workers (two launcher processes on loopback), in two forms (``--jobs``):
``ddp``, the example's written-out update, and ``sgd``, the same math through
``DistributedDataParallel`` + ``torch.optim.SGD``, whose first step pays the
lazy ``torch._dynamo`` import. The bench watches the job's
progress log and SIGKILLs rank ``--kill-rank`` (default: the last rank) the
moment that rank logs step ``--kill-step``, taking ``time.time()`` right before
``os.kill``. Launchers, ``--repeats`` trials each:

* ``torchrun``: as shipped, ``--max-restarts`` restarts;
* ``torchrun-noshare``: the same with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
  (SPEC §9: as shipped, restarted workers often meet a stale rendezvous store);
* ``taskdrun``: the PyTorch adapter with its embedded controller, workers
  forked from the node's fork server (the default);
* ``taskdrun-nofork``: the same with ``--taskd-no-fork-server`` (every start execs);
* ``taskdrun-live``: taskdrun (fork server) on ``examples/train_live.py``, the same
  job through :mod:`taskd_pytorch.live`: the healthy ranks keep running and the
  replacement receives the state from a live replica (``recover-live``);
* ``taskd-run`` (only when asked for): ``taskd run`` with the plain process adapter.

Per trial, from timestamps the workers and launchers write themselves (the
JSON lines of ``--progress``; the launchers' logs; the controller's journal):

* kill → fault known: taskd's journal ``fault`` event; torchrun's
  ``failed (exitcode: ...)`` log line (glog format, local time);
* kill → first replacement forked (``/proc/<pid>/stat`` start time of the first
  new worker pid, read while it runs) and → its ``start`` event (after ``import torch``);
* kill → every rank resumed: the example logs ``resumed`` after
  ``init_process_group``, the checkpoint load and a barrier; it has no event of
  its own right after ``init_process_group``, so that point is bounded by this one;
* kill → every rank completed a new step; steps lost (last step before the kill
  − step resumed from).

A trial counts as recovered when every rank completes a step in a new process
within ``--recovery-deadline`` seconds (live recovery: when every rank completes
a step after the replacement joined, in the processes it has then). Each trial also gives the fault-free
step time (median interval between rank 0's steps before the kill).
``--server-idle`` measures the fork server itself once: its RSS/PSS and its CPU
over a window while the job trains (after the workers' module reports). A separate micro-run (``--phases``)
times each phase of a restarted worker: interpreter start, ``import torch``,
``init_process_group``, checkpoint load, first step, with 1, 2 and 4 processes
starting at once, plus ``python -X importtime`` of torch.

Run::

    .venv/bin/python bench/recovery_bench.py --repeats 5 --json /tmp/recovery.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from _common import (
    PYTHON,
    REPO,
    Children,
    cpu_seconds,
    exit_on_sigterm,
    fmt,
    fmt_range,
    free_port,
    job_events,
    machine,
    markdown_table,
    ratio,
    setup_logging,
    start_time,
    summarize,
    write_json,
)

from taskd_core.forkserver._server import LEARN_AFTER
from taskd_core.models import JobPolicy, JournalEvent

logger = logging.getLogger(__name__)

EXAMPLE = REPO / "examples" / "train_ddp.py"
EXAMPLE_LIVE = REPO / "examples" / "train_live.py"
BIN = Path(PYTHON).parent
#: torchrun logs a dead worker as ``E1130 01:41:22.657000 4098 .../api.py:1002] failed (exitcode: -9) ...``.
_TORCHRUN_FAULT = re.compile(r"^[EWI](\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+) +\d+ \S+\] failed \(exitcode")
#: Poll interval of the progress log; bounds how late after step S the kill lands.
_POLL = 0.005
#: The figures of a trial, in report order: key, label.
FIGURES = (
    ("fault_known", "kill → fault known"),
    ("restart_ordered", "kill → restart ordered (taskd: strategy chosen)"),
    ("first_fork", "kill → first replacement forked"),
    ("first_start", "kill → first replacement's `start` event"),
    ("all_started", "kill → every rank's `start` event (after `import torch`)"),
    ("all_resumed", "kill → every rank resumed (past init_process_group + ckpt load)"),
    ("all_stepped", "kill → every rank completed a new step"),
    ("steps_lost", "steps lost"),
    ("restarts_seen", "processes started after the kill"),
    ("step_time", "fault-free step time (rank 0, before the kill)"),
)
#: The jobs: extra arguments of ``examples/train_ddp.py``.
JOBS = {"ddp": (), "sgd": ("--optimizer", "sgd")}


@dataclass(frozen=True, slots=True)
class Topology:
    nnodes: int
    nproc: int

    @property
    def name(self) -> str:
        return f"{self.nnodes}x{self.nproc}"

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc


@dataclass(frozen=True, slots=True)
class TrialConfig:
    ckpt_every: int
    kill_step: int
    kill_rank: int
    step_time: float
    max_restarts: int
    startup_deadline: float
    recovery_deadline: float


@dataclass(frozen=True, slots=True)
class Ports:
    rendezvous: int
    controller: int


@dataclass(frozen=True, slots=True)
class Launcher:
    name: str
    label: str
    #: the executable in the venv's bin directory that must exist.
    binary: str
    #: (topology, node rank, ports, job id, max restarts) → the launcher's command line before the script.
    command: Callable[[Topology, int, Ports, str, int], list[str]]
    env: dict[str, str] = field(default_factory=dict)
    #: whether the launcher hosts a TaskD controller (at ``Ports.controller``) whose journal can be read.
    controller: bool = False
    #: the job recovers live: healthy ranks keep their processes, only the victim is replaced.
    live: bool = False


def _torchrun_args(topo: Topology, node: int, ports: Ports, job_id: str, restarts: int) -> list[str]:
    if topo.nnodes == 1:
        placement = ["--standalone", "--nnodes", "1"]
    else:
        # torchrun's elastic form as clusters use it: no node rank, the rendezvous assigns it.
        placement = [
            "--nnodes",
            str(topo.nnodes),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{ports.rendezvous}",
            "--rdzv-id",
            job_id,
        ]
    return [*placement, "--nproc-per-node", str(topo.nproc), "--max-restarts", str(restarts)]


def _torchrun(topo: Topology, node: int, ports: Ports, job_id: str, restarts: int) -> list[str]:
    return [str(BIN / "torchrun"), *_torchrun_args(topo, node, ports, job_id, restarts), str(EXAMPLE)]


def _taskdrun(topo: Topology, node: int, ports: Ports, job_id: str, restarts: int) -> list[str]:
    # Only so that the bench knows where to read the journal. On several nodes the job id is
    # --rdzv-id already; --standalone makes up a run id of its own, so one node names the job.
    taskd = ["--taskd-controller-port", str(ports.controller)]
    if topo.nnodes == 1:
        taskd += ["--taskd-job-id", job_id]
    return [str(BIN / "taskdrun"), *_torchrun_args(topo, node, ports, job_id, restarts), *taskd, str(EXAMPLE)]


def _taskdrun_nofork(topo: Topology, node: int, ports: Ports, job_id: str, restarts: int) -> list[str]:
    command = _taskdrun(topo, node, ports, job_id, restarts)
    return [*command[:-1], "--taskd-no-fork-server", command[-1]]


def _taskdrun_live(topo: Topology, node: int, ports: Ports, job_id: str, restarts: int) -> list[str]:
    return [*_taskdrun(topo, node, ports, job_id, restarts)[:-1], str(EXAMPLE_LIVE)]


def _taskd_run(topo: Topology, node: int, ports: Ports, job_id: str, restarts: int) -> list[str]:
    return [
        str(BIN / "taskd"),
        "run",
        "--nproc",
        str(topo.nproc),
        "--nnodes",
        str(topo.nnodes),
        "--node-rank",
        str(node),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(ports.rendezvous),
        "--controller-port",
        str(ports.controller),
        "--job-id",
        job_id,
        "--max-cycles",
        str(restarts),
        "--",
        PYTHON,
        str(EXAMPLE),
    ]


LAUNCHERS = {
    launcher.name: launcher
    for launcher in (
        Launcher("torchrun", "torchrun (as shipped)", "torchrun", _torchrun),
        Launcher(
            "torchrun-noshare",
            "torchrun, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
            "torchrun",
            _torchrun,
            env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        ),
        Launcher("taskdrun", "taskdrun (fork server)", "taskdrun", _taskdrun, controller=True),
        Launcher(
            "taskdrun-nofork", "taskdrun --taskd-no-fork-server", "taskdrun", _taskdrun_nofork, controller=True
        ),
        Launcher(
            "taskdrun-live",
            "taskdrun, examples/train_live.py (live recovery)",
            "taskdrun",
            _taskdrun_live,
            controller=True,
            live=True,
        ),
        Launcher(
            "taskd-run",
            "taskd run (process adapter, embedded controller)",
            "taskd",
            _taskd_run,
            controller=True,
        ),
    )
}
#: The TaskD launcher the ratios are computed for, and the torchrun runs they are computed against.
TASKD = "taskdrun"
PEERS = ("torchrun", "torchrun-noshare", "taskdrun-nofork")


# --- one trial ---------------------------------------------------------------------------------------


class ProgressLog:
    """Incremental reader of the job's JSON-lines progress log; notes each new worker's fork time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[dict[str, Any]] = []
        self.forked: dict[int, float | None] = {}
        self._offset = 0
        self._partial = b""

    def poll(self) -> None:
        """Read what was appended since the last call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        new = [json.loads(line) for line in lines if line.strip()]
        for event in new:
            if event["event"] == "start" and event["pid"] not in self.forked:
                self.forked[event["pid"]] = start_time(event["pid"])  # the worker runs: it just wrote this
        self.events.extend(new)

    def step(self, rank: int, step: int) -> dict[str, Any] | None:
        """The ``step`` event of ``rank`` for ``step``, if it was logged."""
        return next(
            (e for e in self.events if e["event"] == "step" and e["rank"] == rank and e["step"] == step), None
        )


def _torchrun_fault_times(logs: Sequence[Path], year: int) -> list[float]:
    times = []
    for path in logs:
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            m = _TORCHRUN_FAULT.match(line)
            if m:
                stamp = datetime.strptime(f"{year}-{m[1]}-{m[2]} {m[3]}", "%Y-%m-%d %H:%M:%S.%f")
                times.append(stamp.timestamp())
    return times


def _wait(
    log: ProgressLog, procs: Sequence[subprocess.Popen[bytes]], done: Callable[[], bool], deadline: float
) -> str:
    """Poll the log until ``done()``: "ok", "exited" (every launcher ended first) or "timeout"."""
    end = time.monotonic() + deadline
    while True:
        log.poll()
        if done():
            return "ok"
        if all(p.poll() is not None for p in procs):
            log.poll()
            return "ok" if done() else "exited"
        if time.monotonic() >= end:
            return "timeout"
        time.sleep(_POLL)


def run_trial(
    launcher: Launcher, topo: Topology, job: str, cfg: TrialConfig, workdir: Path, trial: int
) -> dict[str, Any]:
    """One job, one kill; the trial's figures in seconds after the kill (None where unknown)."""
    job_id = f"{launcher.name}-{topo.name}-{job}-{trial}"
    tdir = workdir / job_id
    tdir.mkdir(parents=True)
    progress = tdir / "progress.jsonl"
    ports = Ports(free_port(), free_port())
    # The launchers' job token, so the bench may read the controller's journal (torchrun ignores it).
    token = secrets.token_hex(16)
    script = [
        "--ckpt-dir",
        str(tdir / "ckpt"),
        "--ckpt-every",
        str(cfg.ckpt_every),
        "--steps",
        "1000000",
        "--step-time",
        str(cfg.step_time),
        "--progress",
        str(progress),
        *JOBS[job],
    ]
    victim = cfg.kill_rank if cfg.kill_rank >= 0 else topo.world - 1
    logs = [tdir / f"node{n}.log" for n in range(topo.nnodes)]
    result: dict[str, Any] = {"trial": trial, "outcome": "", "launcher_exit": []}
    log = ProgressLog(progress)
    with Children() as children:
        procs = [
            children.start(
                [*launcher.command(topo, n, ports, job_id, cfg.max_restarts), *script],
                log=logs[n],
                env={**launcher.env, "TASKD_JOB_TOKEN": token},
                cwd=REPO,
            )
            for n in range(topo.nnodes)
        ]

        state = _wait(log, procs, lambda: log.step(victim, cfg.kill_step) is not None, cfg.startup_deadline)
        target = log.step(victim, cfg.kill_step)
        if target is None:
            result["outcome"] = f"no kill: job {state} before step {cfg.kill_step}"
            result["launcher_exit"] = [p.poll() for p in procs]
            children.adopt(e["pid"] for e in log.events)
            return result
        old_pids = {e["pid"] for e in log.events}
        t_kill = time.time()
        os.kill(target["pid"], signal.SIGKILL)
        result["kill_lag"] = t_kill - target["time"]

        def every_rank_stepped() -> bool:
            return len(_stepped_after(log.events, old_pids, launcher.live)) == topo.world

        state = _wait(log, procs, every_rank_stepped, cfg.recovery_deadline)
        result["outcome"] = {
            "ok": "recovered",
            "exited": "failed: launcher exited",
            "timeout": "failed: timeout",
        }[state]
        result["launcher_exit"] = [p.poll() for p in procs]
        events: list[JournalEvent] = []
        if launcher.controller:
            try:
                events = [
                    e for e in job_events(f"127.0.0.1:{ports.controller}", job_id, events=200, token=token)
                    if e.time >= t_kill
                ]
            except Exception as exc:  # noqa: BLE001 - the controller died with its launcher: N/A
                logger.warning("%s: no journal: %s", job_id, exc)
        children.adopt(e["pid"] for e in log.events)
    if launcher.controller:
        faults = [e.time for e in events if e.kind == "fault"]
    else:
        faults = [
            t for t in _torchrun_fault_times(logs, datetime.fromtimestamp(t_kill).year) if t >= t_kill - 0.01
        ]
    result.update(_figures(log, old_pids, t_kill, faults, topo.world, launcher.live))
    result["restart_ordered"] = _after([e.time for e in events if e.kind == "strategy chosen"], t_kill)
    logger.info(
        "%s: %s, every rank stepped %s s after the kill",
        job_id,
        result["outcome"],
        fmt(result["all_stepped"]),
    )
    return result


def _after(times: Sequence[float | None], t_kill: float) -> float | None:
    """Seconds from the kill to the earliest of ``times`` (None when there is none)."""
    present = [t for t in times if t is not None]
    return min(present) - t_kill if present else None


def _stepped_after(events: Sequence[dict[str, Any]], old_pids: set[int], live: bool) -> dict[int, float]:
    """Each rank's first step of the recovered job: in a new process, or (live) after the replacement joined."""
    if live:
        joined = [e["time"] for e in events if e["event"] == "resumed" and e["pid"] not in old_pids]
        if not joined:
            return {}
        steps = [e for e in events if e["event"] == "step" and e["time"] >= min(joined)]
    else:
        steps = [e for e in events if e["event"] == "step" and e["pid"] not in old_pids]
    first: dict[int, float] = {}
    for e in steps:
        first.setdefault(e["rank"], e["time"])
    return first


def _figures(
    log: ProgressLog, old_pids: set[int], t_kill: float, faults: list[float], world: int, live: bool = False
) -> dict[str, Any]:
    new = [e for e in log.events if e["pid"] not in old_pids]
    # Live recovery starts only the victims again; the others keep their processes.
    started = len({e["rank"] for e in new if e["event"] == "start"}) if live else world

    def all_ranks(kind: str) -> float | None:
        first: dict[int, float] = {}
        for e in new:
            if e["event"] == kind:
                first.setdefault(e["rank"], e["time"])
        return max(first.values()) - t_kill if first and len(first) == started else None

    stepped = _stepped_after(log.events, old_pids, live)
    resumed = [e["step"] for e in new if e["event"] == "resumed"]
    before = [
        e["step"]
        for e in log.events
        if e["event"] == "step" and e["pid"] in old_pids and (not live or e["time"] < t_kill)
    ]
    rank0 = [e["time"] for e in log.events if e["event"] == "step" and e["pid"] in old_pids and e["rank"] == 0]
    intervals = [b - a for a, b in itertools.pairwise(t for t in rank0 if t < t_kill)]
    return {
        "fault_known": _after(faults, t_kill),
        "first_fork": _after([log.forked.get(e["pid"]) for e in new if e["event"] == "start"], t_kill),
        "first_start": _after([e["time"] for e in new if e["event"] == "start"], t_kill),
        "all_started": all_ranks("start"),
        "all_resumed": all_ranks("resumed"),
        "all_stepped": max(stepped.values()) - t_kill if len(stepped) == world else None,
        "steps_lost": float(max(before) - min(resumed)) if before and resumed else None,
        "restarts_seen": len({e["pid"] for e in new if e["event"] == "start"}),
        "step_time": summarize(intervals[1:]).median if len(intervals) > 1 else None,
    }


# --- the fork server itself ---------------------------------------------------------------------------


def _memory_kib(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``Pss`` (the share of pages it holds with its children counted pro rata) of ``pid``."""
    out = {}
    for name, key in ((f"/proc/{pid}/status", "VmRSS:"), (f"/proc/{pid}/smaps_rollup", "Pss:")):
        with open(name, encoding="ascii") as f:
            out[key.rstrip(":").lower()] = next(int(line.split()[1]) for line in f if line.startswith(key))
    return out


def measure_fork_server(cfg: TrialConfig, workdir: Path, window: float) -> dict[str, Any]:
    """RSS/PSS and idle CPU of a 1x2 taskdrun job's fork server while the job trains (no kill)."""
    tdir = workdir / "fork-server"
    tdir.mkdir()
    progress = tdir / "progress.jsonl"
    ports = Ports(free_port(), free_port())
    script = ["--ckpt-dir", str(tdir / "ckpt"), "--steps", "1000000", "--step-time", "0.2", "--progress", str(progress)]
    log = ProgressLog(progress)
    with Children() as children:
        proc = children.start(
            [*_taskdrun(Topology(1, 2), 0, ports, "fork-server", 0), *script], log=tdir / "node0.log", cwd=REPO
        )
        state = _wait(log, [proc], lambda: log.step(1, 3) is not None, cfg.startup_deadline)
        children.adopt(e["pid"] for e in log.events)
        if state != "ok":
            raise RuntimeError(f"fork server measurement: job {state} before step 3")
        worker = log.step(1, 3)["pid"]  # type: ignore[index]
        with open(f"/proc/{worker}/stat", encoding="ascii") as f:
            server = int(f.read().rsplit(")", 1)[1].split()[1])
        time.sleep(LEARN_AFTER[-1] + 1.0)  # past the workers' last module report: the server is idle from now
        cpu0, t0 = cpu_seconds(server), time.monotonic()
        time.sleep(window)
        cpu1, t1 = cpu_seconds(server), time.monotonic()
        memory = _memory_kib(server)
    return {"window": t1 - t0, "cpu_percent": 100.0 * (cpu1 - cpu0) / (t1 - t0), **memory}


def fork_server_report(server: dict[str, Any]) -> str:
    return (
        f"Fork server (1x2 taskdrun job, preloaded torch, after the workers' module reports): RSS"
        f" {server['vmrss'] / 1024:.0f} MiB, PSS {server['pss'] / 1024:.0f} MiB (pages shared with its forked"
        f" workers counted pro rata); CPU {server['cpu_percent']:.3f} % of a core over {server['window']:.0f} s"
        f" (one tick, 10 ms, is {100 * 0.01 / server['window']:.3f} %)."
    )


# --- phases of a restarted worker ---------------------------------------------------------------------


def phase_child(ckpt: Path) -> None:
    """One worker's phases as wall-clock stamps, printed as one JSON line (run by :func:`measure_phases`)."""
    stamps = {"main": time.time()}
    # Imported here on purpose: these imports are what is being timed.
    import torch

    stamps["import_torch"] = time.time()
    import torch.distributed as dist

    sys.path.insert(0, str(EXAMPLE.parent))
    import train_ddp

    stamps["import_example"] = time.time()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    stamps["init_process_group"] = time.time()
    model = train_ddp.make_model()
    velocity = [torch.zeros_like(p) for p in model.parameters()]
    train_ddp.load_checkpoint(ckpt, model, velocity)
    stamps["checkpoint_load"] = time.time()
    dist.barrier()
    stamps["barrier"] = time.time()
    x, y = train_ddp.batch(0, rank)
    torch.nn.MSELoss()(model(x), y).backward()
    train_ddp.sgd_step(model, velocity, world)
    stamps["first_step"] = time.time()
    if rank == 0 and not ckpt.exists():
        train_ddp.save_checkpoint(ckpt, 1, model, velocity)
    import torch._dynamo  # what torch.optim's first step would add; the example avoids it

    stamps["import_dynamo"] = time.time()
    dist.destroy_process_group()
    print(json.dumps(stamps), flush=True)


PHASES = (
    ("import_torch", "main", "`import torch`"),
    ("import_example", "import_torch", "import the example (torch.distributed, train_ddp)"),
    ("init_process_group", "import_example", "`init_process_group` (gloo)"),
    ("checkpoint_load", "init_process_group", "model + checkpoint load"),
    ("barrier", "checkpoint_load", "barrier (waits for the slowest rank)"),
    ("first_step", "barrier", "first step (forward, backward, all_reduce)"),
    ("import_dynamo", "first_step", "`import torch._dynamo` (not in the example; torch.optim pays it)"),
)


def _phase_round(n: int, ckpt: Path, timeout: float) -> list[dict[str, float]]:
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(n)}
    procs = []
    try:
        for rank in range(n):
            procs.append(
                subprocess.Popen(
                    [PYTHON, __file__, "--phase-child", str(ckpt)],
                    env={**env, "RANK": str(rank)},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5.0)
    return [json.loads(out.decode().strip().splitlines()[-1]) for out in outs]


def _interpreter_start(repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([PYTHON, "-c", "pass"], check=True, timeout=30)
        times.append(time.perf_counter() - t0)
    return times


def _import_profile(top: int) -> dict[str, Any]:
    """``python -X importtime -c 'import torch'``: total and the ``top`` biggest direct parts (seconds)."""
    proc = subprocess.run(
        [PYTHON, "-X", "importtime", "-c", "import torch"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    rows = []
    for line in proc.stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[0].strip().isdigit():
            rows.append((int(parts[1]) / 1e6, parts[2].rstrip()))
    total = next(cum for cum, name in rows if name.strip() == "torch")
    # Direct children of torch are indented by two more spaces than "torch" itself.
    depth = next(len(name) - len(name.lstrip()) for cum, name in rows if name.strip() == "torch")
    children = [(cum, name.strip()) for cum, name in rows if len(name) - len(name.lstrip()) == depth + 2]
    children.sort(reverse=True)
    return {"total": total, "top": [{"module": name, "seconds": cum} for cum, name in children[:top]]}


def measure_phases(sizes: Sequence[int], repeats: int, workdir: Path) -> dict[str, Any]:
    ckpt = workdir / "phases-ckpt.pt"
    _phase_round(
        1, ckpt, 300.0
    )  # writes the checkpoint and warms the page cache, as the first start of a job does
    rounds: dict[str, Any] = {}
    for n in sizes:
        samples: dict[str, list[float]] = {key: [] for key, _, _ in PHASES}
        for _ in range(repeats):
            for stamps in _phase_round(n, ckpt, 300.0):
                for key, since, _ in PHASES:
                    samples[key].append(stamps[key] - stamps[since])
        rounds[str(n)] = {key: summarize(v).as_dict() for key, v in samples.items()}
    return {
        "interpreter_start": summarize(_interpreter_start(5)).as_dict(),
        "import_torch_profile": _import_profile(6),
        "concurrent": rounds,
    }


# --- report --------------------------------------------------------------------------------------------


def summarize_trials(trials: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [t for t in trials if t["outcome"] == "recovered"]
    return {
        "trials": len(trials),
        "recovered": len(ok),
        "failures": sorted({t["outcome"] for t in trials if t["outcome"] != "recovered"}),
        **{key: summarize(t[key] for t in ok).as_dict() for key, _ in FIGURES},
    }


def report(results: dict[str, dict[str, Any]], launchers: Sequence[str]) -> str:
    """Markdown: one table per topology (medians with min–max over recovered trials, ratios)."""
    out = []
    for topo, by_launcher in results.items():
        peers = [p for p in PEERS if p in by_launcher and TASKD in by_launcher]
        headers = [
            "figure (s)",
            *[LAUNCHERS[n].label for n in launchers if n in by_launcher],
            *[f"{TASKD}/{p}" for p in peers],
        ]
        rows: list[list[object]] = [
            [
                "recovered",
                *[
                    f"{by_launcher[n]['recovered']}/{by_launcher[n]['trials']}"
                    for n in launchers
                    if n in by_launcher
                ],
                *["" for _ in peers],
            ]
        ]
        for key, label in FIGURES:
            digits = 1 if key == "steps_lost" else 2
            cells = [fmt_range(by_launcher[n][key], digits) for n in launchers if n in by_launcher]
            ratios = [
                fmt(ratio(by_launcher[TASKD][key]["median"], by_launcher[p][key]["median"])) for p in peers
            ]
            rows.append([label, *cells, *ratios])
        out.append(f"**{topo}** (nodes × workers per node)\n\n" + markdown_table(headers, rows))
    return "\n\n".join(out)


def phases_report(phases: dict[str, Any]) -> str:
    sizes = list(phases["concurrent"])
    rows: list[list[object]] = [
        [
            "interpreter start (`python -c pass`)",
            *[fmt(phases["interpreter_start"]["median"]) if n == "1" else "" for n in sizes],
        ]
    ]
    for key, _, label in PHASES:
        rows.append([label, *[fmt_range(phases["concurrent"][n][key], 2) for n in sizes]])
    table = markdown_table(
        ["phase (s), median (min–max)", *[f"{n} process(es) at once" for n in sizes]], rows
    )
    profile = phases["import_torch_profile"]
    parts = ", ".join(f"{p['module']} {p['seconds']:.2f}" for p in profile["top"])
    importtime = "`python -X importtime -c 'import torch'`"
    return f"{table}\n\n{importtime} (one process): {profile['total']:.2f} s; largest parts: {parts}."


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--repeats", type=int, default=5, help="trials per launcher and topology (default: %(default)s)"
    )
    p.add_argument("--topologies", default="1x2,1x4,2x2", help="NODESxWORKERS list (default: %(default)s)")
    p.add_argument(
        "--launchers",
        default="torchrun,torchrun-noshare,taskdrun-nofork,taskdrun,taskdrun-live",
        help=f"comma separated, from {', '.join(LAUNCHERS)} (default: %(default)s)",
    )
    p.add_argument("--jobs", default=",".join(JOBS), help=f"from {', '.join(JOBS)} (default: %(default)s)")
    p.add_argument(
        "--server-idle",
        type=float,
        default=20.0,
        help="seconds of the fork server's idle CPU window, measured once on a 1x2 taskdrun job; 0: skip"
        " (default: %(default)s)",
    )
    p.add_argument(
        "--ckpt-every", type=int, default=10, help="checkpoint every K steps (default: %(default)s)"
    )
    p.add_argument(
        "--kill-step", type=int, default=15, help="kill right after this step (default: %(default)s)"
    )
    p.add_argument(
        "--kill-rank", type=int, default=-1, help="rank to kill; -1: the last (default: %(default)s)"
    )
    p.add_argument(
        "--step-time", type=float, default=0.05, help="extra seconds per step (default: %(default)s)"
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="torchrun --max-restarts / taskd cycles (default: %(default)s)",
    )
    p.add_argument("--startup-deadline", type=float, default=180.0, help="seconds to reach the kill step")
    p.add_argument(
        "--recovery-deadline",
        type=float,
        default=30.0,
        help="seconds after the kill for every rank to step again, else it failed (default: %(default)s)",
    )
    p.add_argument(
        "--phases",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the phases of a restarted worker (default: on)",
    )
    p.add_argument(
        "--phase-repeats", type=int, default=3, help="rounds per process count of the phase micro-run"
    )
    p.add_argument(
        "--keep", type=Path, default=None, help="keep trial logs in this directory (default: a temporary one)"
    )
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--phase-child", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase_child is not None:
        phase_child(args.phase_child)
        return 0
    setup_logging(args.log_level)
    exit_on_sigterm()
    launchers = [n.strip() for n in args.launchers.split(",") if n.strip()]
    unknown = [n for n in launchers if n not in LAUNCHERS]
    if unknown:
        p.error(f"unknown launchers {unknown}; choose from {', '.join(LAUNCHERS)}")
    missing = [n for n in launchers if not shutil.which(LAUNCHERS[n].binary, path=str(BIN))]
    if missing:
        p.error(f"launchers not installed in {BIN}: {missing}")
    try:
        topologies = [Topology(*(int(x) for x in t.split("x"))) for t in args.topologies.split(",")]
    except (TypeError, ValueError):
        p.error(f"--topologies {args.topologies!r}: expected e.g. 1x2,2x2")
    jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    if not jobs or any(j not in JOBS for j in jobs):
        p.error(f"--jobs {args.jobs!r}: choose from {', '.join(JOBS)}")
    if args.kill_step < args.ckpt_every:
        p.error("--kill-step must be at least --ckpt-every, so that a checkpoint exists when the rank dies")
    cfg = TrialConfig(
        args.ckpt_every,
        args.kill_step,
        args.kill_rank,
        args.step_time,
        args.max_restarts,
        args.startup_deadline,
        args.recovery_deadline,
    )
    info = machine()
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        raw: dict[str, dict[str, list[dict[str, Any]]]] = {}
        # Interleave launchers within each repeat, so slow drifts of the machine's load hit all of them alike.
        for topo in topologies:
            for job in jobs:
                key = f"{topo.name} {job}"
                raw[key] = {n: [] for n in launchers}
                for trial in range(args.repeats):
                    for name in launchers:
                        raw[key][name].append(run_trial(LAUNCHERS[name], topo, job, cfg, workdir, trial))
        server = measure_fork_server(cfg, workdir, args.server_idle) if args.server_idle > 0 else None
        phases = measure_phases((1, 2, 4), args.phase_repeats, workdir) if args.phases else None
    results = {topo: {n: summarize_trials(trials) for n, trials in by.items()} for topo, by in raw.items()}
    print(report(results, launchers))
    if server is not None:
        print()
        print(fork_server_report(server))
    if phases is not None:
        print()
        print(phases_report(phases))
    write_json(
        args.json,
        {
            "bench": "recovery",
            "machine": info,
            "loadavg_at_end": os.getloadavg(),
            "config": {**asdict(cfg), "taskd_flush_seconds": JobPolicy().flush_seconds},
            "launchers": {n: LAUNCHERS[n].label for n in launchers},
            "command": sys.argv,
            "results": results,
            "trials": raw,
            "phases": phases,
            "fork_server": server,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
