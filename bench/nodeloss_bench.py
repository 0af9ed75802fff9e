"""A node other than the store's host lost or hung, a spare waiting: taskdrun against torchrun, c10d.

Per trial, for each launcher, the same command line on three launchers::

    LAUNCHER --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT \\
        --rdzv-id=JOB --max-restarts=3 examples/train_ddp.py --steps ... --ckpt-every ...

Node A starts first (it binds the endpoint: the c10d store lives in its
launcher, as with torchrun, and with taskdrun it becomes group rank 0, which
hosts the embedded controller), then node B; the third launcher, started once
the job trains, waits (torchrun: a node waiting for the next round; taskdrun:
a spare registered with the job's controller). When every rank logged step
``--kill-step``, every process of node B's tree is, at once:

* ``kill``: SIGKILLed, as a machine dies;
* ``hang``: SIGSTOPped (sockets stay open), as a machine freezes or is cut off.

``time.time()`` is taken right before the first signal. Figure per trial: that
moment → every rank (0..3) completed a step in a process started after it
(the workers' own progress log), and the steps lost (the last step a worker started
before the fault completed, less the step training resumed from). A trial that does not get
there within ``--recovery-deadline`` counts as not recovered. Launchers:
``torchrun`` 2.13 with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (SPEC §9), and
``taskdrun`` with no TaskD option (its defaults: a node is lost when its stream
closes and does not come back within 0.5 s, or after 5 s without HealthCheck).

Targets (issue 22): kill → every rank stepping ≤ 0.1 × torchrun and ≤ 3 s; hang → ≤ 8 s.

Run::

    .venv/bin/python bench/nodeloss_bench.py --repeats 3 --json /tmp/nodeloss.json
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _common import (
    Children,
    exit_on_sigterm,
    fmt,
    free_port,
    load_average,
    machine,
    markdown_table,
    poll_until,
    ratio,
    setup_logging,
    write_json,
)
from rank0_bench import BIN, EXAMPLE, LAUNCHERS, NNODES, NPROC, WORLD, read_events, summary

from taskd_core.testing import descendants, process_running

logger = logging.getLogger(__name__)

#: What happens to node B: the signal sent to its whole process tree.
FAULTS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}
#: How often the progress log is read.
_POLL = 0.01


@dataclass(frozen=True, slots=True)
class Trial:
    steps: int
    ckpt_every: int
    kill_step: int
    step_time: float
    startup_deadline: float
    recovery_deadline: float


def listening(port: int) -> bool | None:
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


def run_trial(name: str, fault: str, trial: Trial, work: Path) -> dict[str, Any]:
    binary, env = LAUNCHERS[name]
    work.mkdir(parents=True)
    progress = work / "progress.jsonl"
    port = free_port()
    command = [
        str(BIN / binary),
        f"--nnodes={NNODES}",
        f"--nproc-per-node={NPROC}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={name}-{uuid.uuid4().hex[:8]}",
        "--max-restarts=3",
        str(EXAMPLE),
        "--steps",
        str(trial.steps),
        "--ckpt-dir",
        str(work / "ckpt"),
        "--progress",
        str(progress),
        "--ckpt-every",
        str(trial.ckpt_every),
        "--step-time",
        str(trial.step_time),
    ]
    victim_tree: set[int] = set()
    with Children(grace=5.0) as children:
        first = children.start(command, log=work / "nodeA.log", env=env)
        poll_until(lambda: listening(port), trial.startup_deadline, "node A to host the store", interval=0.05)
        second = children.start(command, log=work / "nodeB.log", env=env)

        def at_kill_step() -> bool | None:
            steps = {
                e["rank"]
                for e in read_events(progress)
                if e["event"] == "step" and e["step"] >= trial.kill_step
            }
            return True if steps >= set(range(WORLD)) else None

        poll_until(
            lambda: True if read_events(progress) else None, trial.startup_deadline, "the job to start"
        )
        spare = children.start(command, log=work / "spare.log", env=env)
        if name == "taskdrun":
            # taskdrun's spare says when it stands by; torchrun's is waiting once it has started.
            poll_until(
                lambda: True if "standing by as spare" in (work / "spare.log").read_text() else None,
                trial.startup_deadline,
                "the spare to stand by",
            )
        poll_until(at_kill_step, trial.startup_deadline, "every rank to reach the kill step", interval=_POLL)
        events = read_events(progress)
        children.adopt(int(e["pid"]) for e in events)
        rank0 = next(int(e["pid"]) for e in events if e["event"] == "start" and e["rank"] == 0)
        if rank0 in descendants(second.pid):
            # taskdrun's controller is with group rank 0, which must survive here (the rank-0 case is
            # bench/rank0_bench.py's): the trial does not count.
            return {"launcher": name, "fault": fault, "recovered": False, "all_stepped": None, "valid": False}
        old = {int(e["pid"]) for e in events}
        t_fault = time.time()
        victim_tree = signal_tree(second.pid, FAULTS[fault])
        deadline = time.monotonic() + trial.recovery_deadline
        stepped: dict[int, float] = {}
        resumed: set[int] = set()
        while time.monotonic() < deadline and len(stepped) < WORLD:
            for e in read_events(progress):
                if int(e["pid"]) in old:
                    continue
                if e["event"] == "resumed":
                    resumed.add(int(e["step"]))
                if e["event"] == "step" and e["rank"] not in stepped:
                    stepped[e["rank"]] = float(e["time"])
            time.sleep(_POLL)
        final = read_events(progress)
        seen = {int(e["pid"]) for e in final}
        # Steps the old workers completed, whenever they noticed the fault, count as done.
        last_step = max(e["step"] for e in final if e["event"] == "step" and int(e["pid"]) in old)
        children.adopt(seen | victim_tree)
        recovered = len(stepped) == WORLD
        result = {
            "launcher": name,
            "fault": fault,
            "valid": True,
            "recovered": recovered,
            "all_stepped": max(stepped.values()) - t_fault if recovered else None,
            "steps_lost": last_step - min(resumed) if recovered and resumed else None,
        }
        if fault == "hang":
            signal_tree(second.pid, signal.SIGCONT)  # so that Children's SIGTERM can end it
    result["leftovers"] = sorted(
        pid for pid in seen | victim_tree | {p.pid for p in (first, second, spare)} if process_running(pid)
    )
    logger.info("%s %s: %s", name, fault, result)
    return result


def report(results: dict[str, dict[str, dict[str, Any]]], deadline: float) -> str:
    rows = []
    for fault, by_launcher in results.items():
        for name, r in by_launcher.items():
            rows.append(
                [
                    fault,
                    name,
                    f"{r['recovered']}/{r['trials']}",
                    fmt(r["median"]) if r["median"] is not None else f"> {deadline:g} (none)",
                    f"{fmt(r['min'])}–{fmt(r['max'])}",
                    ",".join(str(s) for s in r["steps_lost"]),
                ]
            )
    table = markdown_table(
        ["fault", "launcher", "recovered", "fault → every rank stepped (median s)", "range", "steps lost"],
        rows,
    )
    lines = [table, ""]
    kill = results.get("kill", {})
    taskd, peer = kill.get("taskdrun", {}).get("median"), kill.get("torchrun", {}).get("median")
    if taskd is not None and peer is not None:
        lines.append(
            f"kill: taskdrun / torchrun {fmt(ratio(taskd, peer), 3)} (target ≤ 0.1), taskdrun {fmt(taskd)} s "
            "(target ≤ 3 s)."
        )
    hung = results.get("hang", {}).get("taskdrun", {}).get("median")
    if hung is not None:
        lines.append(f"hang: taskdrun {fmt(hung)} s after the stop (target ≤ 8 s).")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--repeats", type=int, default=3, help="trials per launcher and fault (default: %(default)s)"
    )
    p.add_argument("--launchers", default="torchrun,taskdrun", help="comma separated (default: %(default)s)")
    p.add_argument("--faults", default="kill,hang", help="comma separated (default: %(default)s)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--kill-step", type=int, default=17)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--startup-deadline", type=float, default=180.0)
    p.add_argument("--recovery-deadline", type=float, default=60.0)
    p.add_argument("--keep", type=Path, default=None, help="keep the trials' logs here")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args()
    setup_logging(args.log_level)
    exit_on_sigterm()
    names = [n.strip() for n in args.launchers.split(",") if n.strip()]
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    if any(n not in LAUNCHERS for n in names):
        p.error(f"--launchers: choose from {', '.join(LAUNCHERS)}")
    if any(f not in FAULTS for f in faults):
        p.error(f"--faults: choose from {', '.join(FAULTS)}")
    trial = Trial(
        args.steps,
        args.ckpt_every,
        args.kill_step,
        args.step_time,
        args.startup_deadline,
        args.recovery_deadline,
    )
    root = args.keep or Path(tempfile.mkdtemp(prefix="nodeloss-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    load_before = load_average()
    trials: dict[str, dict[str, list[dict[str, Any]]]] = {f: {n: [] for n in names} for f in faults}
    for i in range(args.repeats):
        for fault in faults:
            for name in names:  # interleaved: both launchers see the same load
                trials[fault][name].append(run_trial(name, fault, trial, root / f"{fault}-{name}-{i}"))
    results = {
        fault: {name: summary([t for t in ts if t["valid"]]) for name, ts in by.items()}
        for fault, by in trials.items()
    }
    out = {
        "machine": machine(),
        "load_before": load_before,
        "load_after": load_average(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "trial": asdict(trial),
        "trials": trials,
        "results": results,
    }
    write_json(args.json, out)
    print(report(results, args.recovery_deadline))
    leftovers = [
        pid for by in trials.values() for ts in by.values() for r in ts for pid in r.get("leftovers", [])
    ]
    if leftovers:
        logger.error("processes left behind: %s", leftovers)
    return 1 if leftovers else 0


if __name__ == "__main__":
    sys.exit(main())
