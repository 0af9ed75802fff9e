"""What the whole-node benches share: their launchers' command line, the lost node's signals, the progress log.

``nodeloss_bench.py`` (c10d) and ``rank0_bench.py`` (etcd-v2) run the same
job (``examples/train_ddp.py``, 2 launchers × 2 ranks and a spare; ``shrink_bench.py``:
3 launchers of ``--nnodes=2:3``, one lost) under torchrun and taskdrun (and its
``LiveSession`` twin under taskdrun, :data:`LIVE`), signal a whole node's process tree and read the
workers' progress log until every rank steps again. ``start_etcd`` is also
``failover_bench.py``'s.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import statistics
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _common import (
    PYTHON,
    REPO,
    Children,
    exit_on_sigterm,
    free_port,
    load_average,
    machine,
    poll_until,
    setup_logging,
    write_json,
)

from taskd_core.testing import descendants

logger = logging.getLogger(__name__)

EXAMPLE = REPO / "examples" / "train_ddp.py"
BIN = Path(PYTHON).parent
#: taskdrun running the job's ``LiveSession`` twin (``examples/train_live.py``, same math), with the
#: job's token that keys the state hand-over: the survivors keep running, the spare's ranks get the state.
LIVE = "taskdrun-live"
#: Each launcher's binary and the environment it runs with (torchrun's stale store: SPEC §9).
LAUNCHERS = {
    "torchrun": ("torchrun", {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
    "taskdrun": ("taskdrun", {}),
    LIVE: ("taskdrun", {"TASKD_JOB_TOKEN": "node-loss-bench-token"}),
}
NNODES, NPROC = 2, 2
WORLD = NNODES * NPROC
#: How often the progress log is read.
POLL = 0.01


@dataclass(frozen=True, slots=True)
class Trial:
    steps: int
    ckpt_every: int
    kill_step: int
    step_time: float
    startup_deadline: float
    recovery_deadline: float


def launcher_command(
    name: str, rendezvous: Sequence[str], trial: Trial, work: Path, nnodes: str = str(NNODES)
) -> list[str]:
    """``name``'s command line for one node of the trial, given its ``--rdzv-*`` flags."""
    return [
        str(BIN / LAUNCHERS[name][0]),
        f"--nnodes={nnodes}",
        f"--nproc-per-node={NPROC}",
        *rendezvous,
        "--max-restarts=3",
        str(EXAMPLE.with_name("train_live.py") if name == LIVE else EXAMPLE),
        "--steps",
        str(trial.steps),
        "--ckpt-dir",
        str(work / "ckpt"),
        "--progress",
        str(work / "progress.jsonl"),
        "--ckpt-every",
        str(trial.ckpt_every),
        "--step-time",
        str(trial.step_time),
    ]


def c10d_rendezvous(name: str, port: int) -> tuple[str, ...]:
    """torchrun's c10d rendezvous on loopback ``port``, with a run id of its own for ``name``'s trial."""
    return (
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={name}-{uuid.uuid4().hex[:8]}",
    )


def listening(port: int) -> bool | None:
    """A ``poll_until`` probe: True once something accepts connections on loopback ``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return None


def signal_tree(pid: int, sig: signal.Signals) -> set[int]:
    """``sig`` to ``pid`` and every process under it, at once; the pids signalled."""
    tree = {pid, *descendants(pid)}
    for p in tree:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    return tree


def read_events(path: Path) -> list[dict[str, Any]]:
    """The progress log's events so far (a line still being written is left for the next read)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def reach_kill_step(
    children: Children, trial: Trial, progress: Path, world: int = WORLD
) -> tuple[list[dict[str, Any]], int]:
    """Wait until every rank logged ``trial.kill_step``; the events so far (their workers adopted) and rank 0's pid."""

    def probe() -> bool | None:
        ranks = {
            e["rank"] for e in read_events(progress) if e["event"] == "step" and e["step"] >= trial.kill_step
        }
        return True if ranks >= set(range(world)) else None

    poll_until(probe, trial.startup_deadline, "every rank to reach the kill step", interval=POLL)
    events = read_events(progress)
    children.adopt(int(e["pid"]) for e in events)
    return events, next(int(e["pid"]) for e in events if e["event"] == "start" and e["rank"] == 0)


def started(progress: Path) -> Callable[[], bool | None]:
    """A ``poll_until`` probe: True once the progress log has an event."""
    return lambda: True if read_events(progress) else None


@dataclass(frozen=True, slots=True)
class Recovery:
    """What the progress log shows after a fault: when each rank stepped in a new process, and where from."""

    stepped: dict[int, float]
    resumed: set[int]
    #: every pid the log names, old and new.
    seen: set[int]
    #: the last step the old processes completed, whenever they noticed the fault (some land in the log after it).
    last_step: int


def wait_recovery(
    progress: Path, old: set[int], deadline: float, world: int = WORLD, lost: set[int] | None = None
) -> Recovery:
    """Read the log until every rank of ``world`` stepped in a process not in ``old``, or ``deadline`` seconds.

    ``lost``: the old processes that went with the node, when the others keep running (live
    recovery): a survivor counts once it completed a step the lost ones never completed (no
    step of data-parallel training completes without every rank), and steps lost count from
    the lost ones' last step.
    """
    end = time.monotonic() + deadline
    stepped: dict[int, float] = {}
    resumed: set[int] = set()
    gone = old if lost is None else lost
    while time.monotonic() < end and len(stepped) < world:
        events = read_events(progress)
        done = max((e["step"] for e in events if e["event"] == "step" and int(e["pid"]) in gone), default=0)
        for e in events:
            pid = int(e["pid"])
            if pid in gone or (pid in old and not (e["event"] == "step" and e["step"] > done)):
                continue
            if e["event"] == "resumed":
                resumed.add(int(e["step"]))
            if e["event"] == "step" and e["rank"] not in stepped:
                stepped[e["rank"]] = float(e["time"])
        time.sleep(POLL)
    final = read_events(progress)
    last_step = max(e["step"] for e in final if e["event"] == "step" and int(e["pid"]) in gone)
    return Recovery(stepped, resumed, {int(e["pid"]) for e in final}, last_step)


def figures(recovery: Recovery, t_fault: float, world: int = WORLD) -> dict[str, Any]:
    """A trial's JSON figures: whether every rank stepped again, how long after ``t_fault``, the steps lost."""
    recovered = len(recovery.stepped) == world
    return {
        "recovered": recovered,
        "all_stepped": max(recovery.stepped.values()) - t_fault if recovered else None,
        "steps_lost": recovery.last_step - min(recovery.resumed) if recovered and recovery.resumed else None,
    }


def summary(trials: Sequence[dict[str, Any]]) -> dict[str, Any]:
    times = [t["all_stepped"] for t in trials if t["recovered"]]
    return {
        "trials": len(trials),
        "recovered": len(times),
        "median": statistics.median(times) if times else None,
        "min": min(times) if times else None,
        "max": max(times) if times else None,
        "steps_lost": [t["steps_lost"] for t in trials],
    }


def start_etcd(children: Children, root: Path, *flags: str) -> str:
    """A one-member etcd on free loopback ports, given ``flags`` too; its ``HOST:PORT`` once it serves."""
    port, peer = free_port(), free_port()
    client, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
    children.start(
        [
            "/usr/bin/etcd",
            *flags,
            "--name",
            "bench",
            "--data-dir",
            str(root / "etcd"),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer_url,
            "--initial-advertise-peer-urls",
            peer_url,
            "--initial-cluster",
            f"bench={peer_url}",
            "--log-level",
            "warn",
        ],
        log=root / "etcd.log",
    )

    def serves() -> bool | None:
        try:
            with urllib.request.urlopen(f"{client}/version", timeout=1):
                return True
        except OSError:
            return None

    poll_until(serves, 60, "etcd to serve", interval=0.1)
    return f"127.0.0.1:{port}"


def add_arguments(
    p: argparse.ArgumentParser, steps: int, recovery_deadline: float, launchers: str = "torchrun,taskdrun"
) -> None:
    """The flags both benches take: launchers, the job's size and pace, deadlines, where results go."""
    p.add_argument("--launchers", default=launchers, help="comma separated (default: %(default)s)")
    p.add_argument("--steps", type=int, default=steps, help="more than a trial lasts: it is stopped after")
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--kill-step", type=int, default=17)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--startup-deadline", type=float, default=180.0)
    p.add_argument("--recovery-deadline", type=float, default=recovery_deadline)
    p.add_argument("--keep", type=Path, default=None, help="keep the trials' logs here")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--log-level", default="INFO")


def parse(p: argparse.ArgumentParser) -> tuple[argparse.Namespace, list[str]]:
    """The flags, with logging and SIGTERM set up, and ``--launchers`` as a list (an unknown name: exit 2)."""
    args = p.parse_args()
    setup_logging(args.log_level)
    exit_on_sigterm()
    names = [n.strip() for n in args.launchers.split(",") if n.strip()]
    if any(n not in LAUNCHERS for n in names):
        p.error(f"--launchers: choose from {', '.join(LAUNCHERS)}")
    return args, names


def trial_values(args: argparse.Namespace) -> tuple[int, int, int, float, float, float]:
    """``Trial``'s fields from the flags ``add_arguments`` added, in its order."""
    return (
        args.steps,
        args.ckpt_every,
        args.kill_step,
        args.step_time,
        args.startup_deadline,
        args.recovery_deadline,
    )


def write_results(
    path: Path | None, trial: Trial, trials: object, results: object, load_before: tuple[float, float, float]
) -> None:
    """The bench's JSON: the machine, its load, the command, the trial's settings, each trial and the summaries."""
    out = {
        "machine": machine(),
        "load_before": load_before,
        "load_after": load_average(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "trial": asdict(trial),
        "trials": trials,
        "results": results,
    }
    write_json(path, out)


def exit_code(trials: Iterable[dict[str, Any]]) -> int:
    """1 (logged) when a trial left a process behind, else 0."""
    leftovers = [pid for r in trials for pid in r.get("leftovers", [])]
    if leftovers:
        logger.error("processes left behind: %s", leftovers)
    return 1 if leftovers else 0
