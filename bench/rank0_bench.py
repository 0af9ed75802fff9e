"""The node hosting rank 0 lost, a spare waiting: taskdrun against torchrun, on the same etcd command line.

One real etcd (v2 API for torch's rendezvous; TaskD keeps its controller's
state in the same etcd, v3 API) on loopback. Per trial, for each launcher, the
same command line on three launchers::

    LAUNCHER --nnodes=2 --nproc-per-node=2 --rdzv-backend=etcd-v2 --rdzv-endpoint=ETCD \\
        --rdzv-id=JOB --max-restarts=3 examples/train_ddp.py --steps ... --ckpt-every ...

The first two form the job; the third, started once the job trains, waits as
a spare (torchrun: a node waiting for the next rendezvous round; taskdrun: a
spare registered with the job's controller). When rank 0 logs step
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
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _common import (
    PYTHON,
    REPO,
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

from taskd_core.testing import descendants, process_running

logger = logging.getLogger(__name__)

EXAMPLE = REPO / "examples" / "train_ddp.py"
BIN = Path(PYTHON).parent
LAUNCHERS = {
    "torchrun": ("torchrun", {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
    "taskdrun": ("taskdrun", {}),
}
#: What a launcher's spare logs once it stands by (torchrun's says nothing: it waits in the rendezvous).
SPARE_READY = {"taskdrun": "standing by as spare"}
NNODES, NPROC = 2, 2
WORLD = NNODES * NPROC
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
    #: seconds the spare runs before the kill, whichever launcher (and until taskdrun's stands by).
    spare_settle: float
    #: the node lost: rank 0's, or (taskdrun) the one whose replica leads.
    victim: str


def start_etcd(children: Children, root: Path) -> str:
    """A one-member etcd serving the v2 API too (torch's etcd-v2 rendezvous); its ``HOST:PORT``."""
    port, peer = free_port(), free_port()
    client, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
    children.start(
        [
            "/usr/bin/etcd",
            "--enable-v2",
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


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def kill_tree(pid: int) -> set[int]:
    """SIGKILL ``pid`` and every process under it, at once; the pids signalled."""
    tree = {pid, *descendants(pid)}
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return tree


def run_trial(name: str, etcd: str, trial: Trial, work: Path) -> dict[str, Any]:
    binary, env = LAUNCHERS[name]
    work.mkdir(parents=True)
    progress = work / "progress.jsonl"
    job = f"{name}-{uuid.uuid4().hex[:8]}"
    command = [
        str(BIN / binary),
        f"--nnodes={NNODES}",
        f"--nproc-per-node={NPROC}",
        "--rdzv-backend=etcd-v2",
        f"--rdzv-endpoint={etcd}",
        f"--rdzv-id={job}",
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
    with Children(grace=5.0) as children:
        nodes = [children.start(command, log=work / f"node{n}.log", env=env) for n in range(NNODES)]

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
        spare_started = time.monotonic()
        ready = SPARE_READY.get(name)

        def spare_settled() -> bool | None:
            if time.monotonic() - spare_started < trial.spare_settle:
                return None
            return True if ready is None or ready in (work / "spare.log").read_text() else None

        poll_until(spare_settled, trial.startup_deadline, "the spare to stand by", interval=0.1)
        poll_until(at_kill_step, trial.startup_deadline, "every rank to reach the kill step", interval=_POLL)
        events = read_events(progress)
        children.adopt(int(e["pid"]) for e in events)
        rank0 = next(int(e["pid"]) for e in events if e["event"] == "start" and e["rank"] == 0)
        leads = [n for n in range(NNODES) if "this replica (" in (work / f"node{n}.log").read_text()]
        if trial.victim == "leader" and leads:
            host = nodes[leads[-1]]
        else:
            host = next(n for n in nodes if rank0 in descendants(n.pid))
        # taskdrun: whether the node lost ran the leading controller replica, and rank 0.
        victim_led = nodes.index(host) in leads if name == "taskdrun" else None
        victim_rank0 = rank0 in descendants(host.pid)
        old = {int(e["pid"]) for e in events}
        t_kill = time.time()
        kill_tree(host.pid)
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
        # The last step the lost processes completed: some land in the log after the events read above.
        last_step = max(e["step"] for e in final if e["event"] == "step" and int(e["pid"]) in old)
        seen = {int(e["pid"]) for e in final}
        children.adopt(seen)
        recovered = len(stepped) == WORLD
        result = {
            "launcher": name,
            "recovered": recovered,
            "all_stepped": max(stepped.values()) - t_kill if recovered else None,
            "steps_lost": last_step - min(resumed) if recovered and resumed else None,
            "victim_led": victim_led,
            "victim_rank0": victim_rank0,
        }
    # Children stopped every launcher and adopted worker: nothing of the trial may be left.
    result["leftovers"] = sorted(
        pid for pid in seen | {n.pid for n in (*nodes, spare)} if process_running(pid)
    )
    logger.info("%s: %s", name, result)
    return result


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


def report(results: dict[str, dict[str, Any]]) -> str:
    rows = [
        [
            name,
            f"{r['recovered']}/{r['trials']}",
            fmt(r["median"]),
            f"{fmt(r['min'])}–{fmt(r['max'])}",
            ",".join(str(s) for s in r["steps_lost"]),
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
    p.add_argument("--launchers", default="torchrun,taskdrun", help="comma separated (default: %(default)s)")
    p.add_argument("--steps", type=int, default=4000, help="more than a trial lasts: it is stopped after")
    p.add_argument(
        "--spare-settle",
        type=float,
        default=20.0,
        help="seconds the spare runs before the kill, on both launchers (default: %(default)s)",
    )
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--kill-step", type=int, default=17)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--startup-deadline", type=float, default=180.0)
    p.add_argument("--recovery-deadline", type=float, default=90.0)
    p.add_argument(
        "--victim",
        choices=("rank0", "leader"),
        default="rank0",
        help="the node lost: rank 0's, or on taskdrun the one whose controller replica leads (torchrun: rank "
        "0's) (default: %(default)s)",
    )
    p.add_argument("--keep", type=Path, default=None, help="keep the trials' logs here")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args()
    setup_logging(args.log_level)
    exit_on_sigterm()
    names = [n.strip() for n in args.launchers.split(",") if n.strip()]
    if any(n not in LAUNCHERS for n in names):
        p.error(f"--launchers: choose from {', '.join(LAUNCHERS)}")
    trial = Trial(
        args.steps,
        args.ckpt_every,
        args.kill_step,
        args.step_time,
        args.startup_deadline,
        args.recovery_deadline,
        args.spare_settle,
        args.victim,
    )
    root = args.keep or Path(tempfile.mkdtemp(prefix="rank0-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    load_before = load_average()
    trials: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with Children() as children:
        etcd = start_etcd(children, root)
        for i in range(args.repeats):
            for name in names:  # interleaved: both launchers see the same load
                trials[name].append(run_trial(name, etcd, trial, root / f"{name}-{i}"))
    results = {name: summary(t) for name, t in trials.items()}
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
    print(report(results))
    leftovers = [pid for t in trials.values() for r in t for pid in r["leftovers"]]
    if leftovers:
        logger.error("processes left behind: %s", leftovers)
    return 1 if leftovers else 0


if __name__ == "__main__":
    sys.exit(main())
