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
closes and does not come back within 0.5 s, or after 5 s without HealthCheck),
and ``taskdrun-live``: taskdrun running ``examples/train_live.py`` (the same job
through ``LiveSession``) with the job's token, where the survivors keep running
(same pids: a survivor counts once it completed a step the lost ranks never
did) and the spare's ranks receive the committed state from a replica.

Targets (issue 22): kill → every rank stepping ≤ 0.1 × torchrun and ≤ 3 s; hang → ≤ 8 s;
with ``LiveSession``, 0 committed steps lost.

Run::

    .venv/bin/python bench/nodeloss_bench.py --repeats 3 --json /tmp/nodeloss.json
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _nodes
from _common import (
    Children,
    fmt,
    free_port,
    load_average,
    markdown_table,
    poll_until,
    ratio,
)

from taskd_core.testing import descendants, process_running

logger = logging.getLogger(__name__)

#: What happens to node B: the signal sent to its whole process tree.
FAULTS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}


def run_trial(name: str, fault: str, trial: _nodes.Trial, work: Path) -> dict[str, Any]:
    env = _nodes.LAUNCHERS[name][1]
    work.mkdir(parents=True)
    progress = work / "progress.jsonl"
    port = free_port()
    rendezvous = _nodes.c10d_rendezvous(name, port)
    command = _nodes.launcher_command(name, rendezvous, trial, work)
    victim_tree: set[int] = set()
    with Children(grace=5.0) as children:
        first = children.start(command, log=work / "nodeA.log", env=env)
        poll_until(lambda: _nodes.listening(port), trial.startup_deadline, "node A to host the store", interval=0.05)
        second = children.start(command, log=work / "nodeB.log", env=env)
        poll_until(_nodes.started(progress), trial.startup_deadline, "the job to start")
        spare = children.start(command, log=work / "spare.log", env=env)
        if _nodes.LAUNCHERS[name][0] == "taskdrun":
            # taskdrun's spare says when it stands by; torchrun's is waiting once it has started.
            poll_until(
                lambda: True if "standing by as spare" in (work / "spare.log").read_text() else None,
                trial.startup_deadline,
                "the spare to stand by",
            )
        events, rank0 = _nodes.reach_kill_step(children, trial, progress)
        if rank0 in descendants(second.pid):
            # taskdrun's controller is with group rank 0, which must survive here (the rank-0 case is
            # bench/rank0_bench.py's): the trial does not count.
            return {"launcher": name, "fault": fault, "recovered": False, "all_stepped": None, "valid": False}
        old = {int(e["pid"]) for e in events}
        t_fault = time.time()
        victim_tree = _nodes.signal_tree(second.pid, FAULTS[fault])
        lost = old & victim_tree if name == _nodes.LIVE else None  # the survivors keep their pids
        recovery = _nodes.wait_recovery(progress, old, trial.recovery_deadline, lost=lost)
        seen = recovery.seen
        children.adopt(seen | victim_tree)
        result = {"launcher": name, "fault": fault, "valid": True, **_nodes.figures(recovery, t_fault)}
        if fault == "hang":
            _nodes.signal_tree(second.pid, signal.SIGCONT)  # so that Children's SIGTERM can end it
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
    for fault, by_launcher in results.items():
        live = by_launcher.get(_nodes.LIVE, {})
        if live.get("median") is not None:
            peer = by_launcher.get("torchrun", {}).get("median")
            against = f", / torchrun {fmt(ratio(live['median'], peer), 3)}" if peer is not None else ""
            lost = ",".join(str(s) for s in live["steps_lost"])
            lines.append(
                f"{fault}: {_nodes.LIVE} {fmt(live['median'])} s{against}; steps lost {lost} (target 0)."
            )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--repeats", type=int, default=3, help="trials per launcher and fault (default: %(default)s)"
    )
    p.add_argument("--faults", default="kill,hang", help="comma separated (default: %(default)s)")
    _nodes.add_arguments(p, steps=600, recovery_deadline=60.0, launchers=f"torchrun,taskdrun,{_nodes.LIVE}")
    args, names = _nodes.parse(p)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    if any(f not in FAULTS for f in faults):
        p.error(f"--faults: choose from {', '.join(FAULTS)}")
    trial = _nodes.Trial(*_nodes.trial_values(args))
    root = args.keep or Path(tempfile.mkdtemp(prefix="nodeloss-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    load_before = load_average()
    trials: dict[str, dict[str, list[dict[str, Any]]]] = {f: {n: [] for n in names} for f in faults}
    for i in range(args.repeats):
        for fault in faults:
            for name in names:  # interleaved: both launchers see the same load
                trials[fault][name].append(run_trial(name, fault, trial, root / f"{fault}-{name}-{i}"))
    results = {
        fault: {name: _nodes.summary([t for t in ts if t["valid"]]) for name, ts in by.items()}
        for fault, by in trials.items()
    }
    _nodes.write_results(args.json, trial, trials, results, load_before)
    print(report(results, args.recovery_deadline))
    return _nodes.exit_code(r for by in trials.values() for ts in by.values() for r in ts)


if __name__ == "__main__":
    sys.exit(main())
