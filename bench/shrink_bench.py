"""A job of ``--nnodes=2:3`` loses one of its three nodes, no spare waiting: taskdrun against torchrun, c10d.

Per trial, for each launcher, the same command line on three launchers::

    LAUNCHER --nnodes=2:3 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT \\
        --rdzv-id=JOB --max-restarts=3 examples/train_ddp.py --steps ... --ckpt-every ...

Node A starts first (it binds the endpoint: the c10d store lives in its
launcher, and with taskdrun it becomes group rank 0, which hosts the embedded
controller), then nodes B and C; the first round admits all three (MAX came, so
torch's last call does not wait). When every rank (0..5) logged step
``--kill-step``, every process of node C's tree is SIGKILLed at once, as a
machine dies. ``time.time()`` is taken right before the first signal. Figure
per trial: that moment → every rank of the world of two nodes (0..3) completed
a step in a process started after it (the workers' own progress log), and the
steps lost (the last step a worker completed before the fault, less the step
training resumed from). A trial that does not get there within
``--recovery-deadline`` counts as not recovered; one where rank 0 ran on node
C does not count (the controller's node is rank 0's, whose loss with c10d ends
the job as with torchrun). Launchers: ``torchrun`` 2.13 with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (as shipped, it hangs when shrinking:
issue 22), torch's rendezvous defaults (``last_call_timeout`` 30 s, keep-alive
5 s × 3), and ``taskdrun`` with no TaskD option.

Target (issue 22): kill → every remaining rank stepping ≤ 0.1 × torchrun.

Run::

    .venv/bin/python bench/shrink_bench.py --repeats 3 --json /tmp/shrink.json
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
from _common import Children, fmt, free_port, load_average, markdown_table, poll_until, ratio

from taskd_core.testing import descendants, process_running

logger = logging.getLogger(__name__)

NNODES = "2:3"
#: Ranks before the loss (3 nodes) and after it (2 nodes).
BEFORE, AFTER = 3 * _nodes.NPROC, 2 * _nodes.NPROC


def run_trial(name: str, trial: _nodes.Trial, work: Path) -> dict[str, Any]:
    env = _nodes.LAUNCHERS[name][1]
    work.mkdir(parents=True)
    progress = work / "progress.jsonl"
    port = free_port()
    rendezvous = _nodes.c10d_rendezvous(name, port)
    command = _nodes.launcher_command(name, rendezvous, trial, work, nnodes=NNODES)
    victim_tree: set[int] = set()
    seen: set[int] = set()
    with Children(grace=5.0) as children:
        first = children.start(command, log=work / "nodeA.log", env=env)
        poll_until(
            lambda: _nodes.listening(port), trial.startup_deadline, "node A to host the store", interval=0.05
        )
        others = [children.start(command, log=work / f"node{n}.log", env=env) for n in "BC"]
        events, rank0 = _nodes.reach_kill_step(children, trial, progress, world=BEFORE)
        lost = others[1]
        if rank0 in descendants(lost.pid):
            return {"launcher": name, "recovered": False, "all_stepped": None, "valid": False}
        old = {int(e["pid"]) for e in events}
        t_fault = time.time()
        victim_tree = _nodes.signal_tree(lost.pid, signal.SIGKILL)
        recovery = _nodes.wait_recovery(progress, old, trial.recovery_deadline, world=AFTER)
        seen = recovery.seen
        children.adopt(seen | victim_tree)
        result = {"launcher": name, "valid": True, **_nodes.figures(recovery, t_fault, world=AFTER)}
    result["leftovers"] = sorted(
        pid for pid in seen | victim_tree | {p.pid for p in (first, *others)} if process_running(pid)
    )
    logger.info("%s: %s", name, result)
    return result


def report(results: dict[str, dict[str, Any]], deadline: float) -> str:
    rows = [
        [
            name,
            f"{r['recovered']}/{r['trials']}",
            fmt(r["median"]) if r["median"] is not None else f"> {deadline:g} (none)",
            f"{fmt(r['min'])}–{fmt(r['max'])}",
            ",".join(str(s) for s in r["steps_lost"]),
        ]
        for name, r in results.items()
    ]
    table = markdown_table(
        ["launcher", "recovered", "kill → every rank of 2 nodes stepped (median s)", "range", "steps lost"],
        rows,
    )
    lines = [table, ""]
    taskd, peer = results.get("taskdrun", {}).get("median"), results.get("torchrun", {}).get("median")
    if taskd is not None and peer is not None:
        lines.append(f"taskdrun / torchrun {fmt(ratio(taskd, peer), 3)} (target ≤ 0.1).")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="trials per launcher (default: %(default)s)")
    _nodes.add_arguments(p, steps=4000, recovery_deadline=150.0)
    args, names = _nodes.parse(p)
    trial = _nodes.Trial(*_nodes.trial_values(args))
    root = args.keep or Path(tempfile.mkdtemp(prefix="shrink-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    load_before = load_average()
    trials: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for i in range(args.repeats):
        for name in names:  # interleaved: both launchers see the same load
            trials[name].append(run_trial(name, trial, root / f"{name}-{i}"))
    results = {name: _nodes.summary([t for t in ts if t["valid"]]) for name, ts in trials.items()}
    _nodes.write_results(args.json, trial, trials, results, load_before)
    print(report(results, args.recovery_deadline))
    return _nodes.exit_code(r for ts in trials.values() for r in ts)


if __name__ == "__main__":
    sys.exit(main())
