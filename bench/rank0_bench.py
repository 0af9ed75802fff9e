"""The node hosting rank 0 lost, a spare waiting: taskdrun against torchrun, on the same etcd command line.

One real etcd (v2 API for torch's rendezvous; TaskD keeps its controller's
state in the same etcd, v3 API) on loopback. Per trial, for each launcher, the
same command line on three launchers::

    LAUNCHER --nnodes=2 --nproc-per-node=2 --rdzv-backend=etcd-v2 --rdzv-endpoint=ETCD \\
        --rdzv-id=JOB --max-restarts=3 examples/train_ddp.py --steps ... --ckpt-every ...

The first two form the job; the third, started once the job trains, waits as
a spare (torchrun: a node waiting for the next rendezvous round; taskdrun: a
spare registered with the job's controller). When every rank has logged step
``--kill-step``, the whole process tree of the launcher whose workers include
rank 0 is SIGKILLed at once (launcher, its fork server, its workers, and on
taskdrun the controller replica it runs, the leader when it leads), as a
machine dies. ``time.time()`` is taken right before the first ``kill``.

Figures per trial: kill → every rank (0..3) completed a step in a process
started after the kill (from the workers' own progress log), and the steps
lost. A trial that does not get there within ``--recovery-deadline`` counts as
not recovered. Launchers:

* ``torchrun``: torchrun 2.13 with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
  (as shipped it hangs on the restarted workers' stale store: SPEC §9);
* ``taskdrun``: the same command line, no TaskD option.

Targets (issue 22): taskdrun ≤ 0.1 × torchrun's median, and ≤ 3 s.

Run::

    .venv/bin/python bench/rank0_bench.py --repeats 3 --json /tmp/rank0.json
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _nodes
from _common import (
    Children,
    fmt,
    load_average,
    markdown_table,
    poll_until,
    ratio,
)

from taskd_core.testing import descendants, process_running

logger = logging.getLogger(__name__)

#: What a launcher's spare logs once it stands by (torchrun's says nothing: it waits in the rendezvous).
SPARE_READY = {"taskdrun": "standing by as spare"}


@dataclass(frozen=True, slots=True)
class Trial(_nodes.Trial):
    #: seconds the spare runs before the kill, whichever launcher (and until taskdrun's stands by).
    spare_settle: float
    #: the node lost: rank 0's, or (taskdrun) the one whose replica leads, or the one whose does not.
    victim: str


def run_trial(name: str, etcd: str, trial: Trial, work: Path) -> dict[str, Any]:
    env = _nodes.LAUNCHERS[name][1]
    work.mkdir(parents=True)
    progress = work / "progress.jsonl"
    job = f"{name}-{uuid.uuid4().hex[:8]}"
    rendezvous = ("--rdzv-backend=etcd-v2", f"--rdzv-endpoint={etcd}", f"--rdzv-id={job}")
    command = _nodes.launcher_command(name, rendezvous, trial, work)
    with Children(grace=5.0) as children:
        nodes = [children.start(command, log=work / f"node{n}.log", env=env) for n in range(_nodes.NNODES)]
        poll_until(_nodes.started(progress), trial.startup_deadline, "the job to start")
        spare = children.start(command, log=work / "spare.log", env=env)
        spare_started = time.monotonic()
        ready = SPARE_READY.get(name)

        def spare_settled() -> bool | None:
            if time.monotonic() - spare_started < trial.spare_settle:
                return None
            return True if ready is None or ready in (work / "spare.log").read_text() else None

        poll_until(spare_settled, trial.startup_deadline, "the spare to stand by", interval=0.1)
        events, rank0 = _nodes.reach_kill_step(children, trial, progress)
        leads = [n for n in range(_nodes.NNODES) if "this replica (" in (work / f"node{n}.log").read_text()]
        if trial.victim == "leader" and leads:
            host = nodes[leads[-1]]
        elif trial.victim == "follower" and leads:
            host = next(n for i, n in enumerate(nodes) if i != leads[-1])
        else:
            host = next(n for n in nodes if rank0 in descendants(n.pid))
        # taskdrun: whether the node lost ran the leading controller replica, and rank 0.
        victim_led = nodes.index(host) in leads if name == "taskdrun" else None
        victim_rank0 = rank0 in descendants(host.pid)
        old = {int(e["pid"]) for e in events}
        t_kill = time.time()
        _nodes.signal_tree(host.pid, signal.SIGKILL)
        recovery = _nodes.wait_recovery(progress, old, trial.recovery_deadline)
        seen = recovery.seen
        children.adopt(seen)
        result = {
            "launcher": name,
            **_nodes.figures(recovery, t_kill),
            "victim_led": victim_led,
            "victim_rank0": victim_rank0,
        }
    # Children stopped every launcher and adopted worker: nothing of the trial may be left.
    result["leftovers"] = sorted(
        pid for pid in seen | {n.pid for n in (*nodes, spare)} if process_running(pid)
    )
    logger.info("%s: %s", name, result)
    return result


def report(results: dict[str, dict[str, Any]]) -> str:
    rows = [
        [
            name,
            f"{r['recovered']}/{r['trials']}",
            fmt(r["median"]),
            f"{fmt(r['min'])}–{fmt(r['max'])}",
            ",".join("–" if s is None else str(s) for s in r["steps_lost"]),
        ]
        for name, r in results.items()
    ]
    table = markdown_table(
        ["launcher", "recovered", "kill → every rank stepped (median s)", "range", "steps lost"], rows
    )
    taskd, peer = results.get("taskdrun", {}).get("median"), results.get("torchrun", {}).get("median")
    if taskd is not None and peer is not None:
        table += f"\n\ntaskdrun / torchrun: {fmt(ratio(taskd, peer), 3)} (target ≤ 0.1), taskdrun {fmt(taskd)} s (target ≤ 3 s)"
    return table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="trials per launcher (default: %(default)s)")
    p.add_argument(
        "--spare-settle",
        type=float,
        default=20.0,
        help="seconds the spare runs before the kill, on both launchers (default: %(default)s)",
    )
    p.add_argument(
        "--victim",
        choices=("rank0", "leader", "follower"),
        default="rank0",
        help="the node lost: rank 0's, or on taskdrun the one whose controller replica leads (leader) or the "
        "one whose replica does not (follower) (torchrun: rank 0's) (default: %(default)s)",
    )
    _nodes.add_arguments(p, steps=4000, recovery_deadline=90.0)
    args, names = _nodes.parse(p)
    trial = Trial(*_nodes.trial_values(args), args.spare_settle, args.victim)
    root = args.keep or Path(tempfile.mkdtemp(prefix="rank0-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    load_before = load_average()
    trials: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with Children() as children:
        etcd = _nodes.start_etcd(children, root, "--enable-v2")
        for i in range(args.repeats):
            for name in names:  # interleaved: both launchers see the same load
                trials[name].append(run_trial(name, etcd, trial, root / f"{name}-{i}"))
    results = {name: _nodes.summary(t) for name, t in trials.items()}
    _nodes.write_results(args.json, trial, trials, results, load_before)
    print(report(results))
    return _nodes.exit_code(r for t in trials.values() for r in t)


if __name__ == "__main__":
    sys.exit(main())
