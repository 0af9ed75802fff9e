"""Chaos of whole machines: one ``taskdrun`` job loses a node again and again, a spare taking each place.

One real etcd on loopback (torch's ``etcd-v2`` rendezvous; the job's
controller replicas keep their state in it, so no node is special), and
``--nnodes`` launchers × ``--nproc`` ranks of ``examples/train_ddp.py`` with a
checkpoint every ``--ckpt-every`` steps, plus ``--spares`` launchers with the
same command line started once the job trains (they stand by as spares)::

    taskdrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=etcd-v2 --rdzv-endpoint=ETCD \\
        --rdzv-id=JOB --max-restarts=LOSSES+10 examples/train_ddp.py --steps ... --ckpt-every ...

(``--rdzv c10d`` instead: the store's host, the first launcher, is never lost.)
Then ``--losses`` times in a row: a node that hosts ranks is drawn at random
(rank 0's and the leading controller replica's included), and a fault of
``--faults`` (each alike): at once every process of its tree is

* ``kill``: SIGKILLed, as a machine dies;
* ``hang-kill``: SIGSTOPped (sockets open), as a machine freezes; once the job
  recovered without it, the bench SIGKILLs the stopped tree, as an operator would;
* ``hang-cont``: SIGSTOPped the same way, then SIGCONTed once the job recovered:
  the node must be fenced (its launcher ends with exit code 1 saying it was
  declared lost, every process of it gone) and the job must go on.

A loss counts as recovered when every rank completed a step in a process
started after the signal (the workers' own progress log) within
``--recovery-deadline``; its time is the signal → that last first step. After
each loss the bench starts a new launcher with the job's command line and waits
until it stands by as a spare, then a random 1-3 s, then the next loss. The
first unrecovered loss ends the chaos. Then the job is let finish at full speed
(``train_ddp.py --rush-file``: the same math, no pause), its final parameters
are compared with those of a fault-free run of the same steps, and every
process that carries the run's environment marker (``TASKD_NODES_CHAOS``:
launchers, fork servers, workers, lifeline guards) must be gone.

Target (issue 22): 50 losses, 100 % recovered, parameters identical, 0 leftovers.

Run::

    .venv/bin/python bench/nodes_chaos_bench.py --losses 50 --json /tmp/nodes_chaos.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import _nodes
from _common import (
    Children,
    exit_on_sigterm,
    fmt,
    load_average,
    machine,
    markdown_table,
    percentile,
    poll_until,
    processes_with_env,
    setup_logging,
    write_json,
)

from taskd_core.testing import descendants, free_port, process_running

logger = logging.getLogger(__name__)

FAULTS = ("kill", "hang-kill", "hang-cont")
#: The environment variable that marks every process of one run (what the leftover scan looks for).
MARKER = "TASKD_NODES_CHAOS"
SPARE_READY = "standing by as spare"
_LEADS = re.compile(r"this replica \(\S+\) leads, generation (\d+)")
#: Seconds a lost node's processes (and, at the end, the run's) get to be gone.
GONE_WITHIN = 60.0


@dataclass(frozen=True, slots=True)
class Settings:
    losses: int
    nnodes: int
    nproc: int
    spares: int
    rdzv: str
    steps: int
    step_time: float
    ckpt_every: int
    faults: tuple[str, ...]
    seed: int
    recovery_deadline: float
    startup_deadline: float

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc


class Progress:
    """The workers' progress log, read on from where the last read stopped (the log grows to many MB)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = b""

    def poll(self) -> None:
        """Take the events logged since the last call (a line still being written waits for the next)."""
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        self.events.extend(json.loads(line) for line in lines if line.strip())


@dataclass(eq=False)
class Node:
    """One launcher of the job (a node or a spare) and its log."""

    proc: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tree(self) -> set[int]:
        return {self.proc.pid, *descendants(self.proc.pid)}


@dataclass
class Job:
    """One run of the job in ``work``: its command line, its launchers, its progress log."""

    settings: Settings
    work: Path
    children: Children
    rendezvous: tuple[str, ...]
    run_id: str
    #: the steps' pause; 0 for the fault-free run (its math is the same).
    step_time: float
    nodes: list[Node] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.progress = Progress(self.work / "progress.jsonl")

    @property
    def rush(self) -> Path:
        return self.work / "rush"

    def command(self) -> list[str]:
        s = self.settings
        paced = ("--progress", str(self.progress.path), "--rush-file", str(self.rush)) if self.step_time else ()
        return [
            str(_nodes.BIN / "taskdrun"),
            f"--nnodes={s.nnodes}",
            f"--nproc-per-node={s.nproc}",
            *self.rendezvous,
            f"--max-restarts={s.losses + 10}",  # torchrun's flag: the cycle budget, one cycle per loss
            str(_nodes.EXAMPLE),
            "--steps",
            str(s.steps),
            "--ckpt-dir",
            str(self.work / "ckpt"),
            "--result",
            str(self.work / "result.json"),
            "--ckpt-every",
            str(s.ckpt_every),
            "--step-time",
            str(self.step_time),
            *paced,
        ]

    def start(self, name: str) -> Node:
        log = self.work / f"{len(self.nodes):02d}-{name}.log"
        proc = self.children.start(self.command(), log=log, env={MARKER: self.run_id})
        node = Node(proc, log)
        self.nodes.append(node)
        return node

    def start_nodes(self) -> None:
        """The job's ``--nnodes`` launchers; with c10d the first one alone until it hosts the store."""
        self.start("node")
        if self.settings.rdzv == "c10d":
            port = int(self.rendezvous[1].rsplit(":", 1)[1])
            poll_until(lambda: _nodes.listening(port), self.settings.startup_deadline, "node 0 to host the store")
        for _ in range(1, self.settings.nnodes):
            self.start("node")

    def start_spare(self) -> float:
        """A new launcher with the job's command line; the seconds until it stood by as a spare."""
        began = time.monotonic()
        node = self.start("spare")

        def ready() -> bool | None:
            if node.proc.poll() is not None:
                raise RuntimeError(f"a spare ended with exit code {node.proc.returncode} ({node.log})")
            return True if SPARE_READY in node.text() else None

        poll_until(ready, self.settings.startup_deadline, "the new spare to stand by", interval=0.1)
        return time.monotonic() - began

    def hosts(self) -> dict[int, Node]:
        """rank → the launcher whose process tree runs the rank's newest worker."""
        self.progress.poll()
        newest = {int(e["rank"]): int(e["pid"]) for e in self.progress.events if e["event"] == "start"}
        trees = [(n, n.tree()) for n in self.nodes if n.proc.poll() is None]
        return {rank: n for rank, pid in newest.items() for n, tree in trees if pid in tree}

    def leader(self) -> Node | None:
        """The live launcher whose controller replica took the newest leadership (etcd), if any."""
        best: tuple[int, Node | None] = (-1, None)
        for n in self.nodes:
            if n.proc.poll() is None:
                for generation in _LEADS.findall(n.text()):
                    if int(generation) > best[0]:
                        best = (int(generation), n)
        return best[1]

    def wait_recovery(self, old: set[int], deadline: float) -> tuple[dict[int, float], set[int]]:
        """Read the log until every rank stepped in a process not in ``old``: rank → when; the steps resumed from."""
        end = time.monotonic() + deadline
        stepped: dict[int, float] = {}
        resumed: set[int] = set()
        seen = len(self.progress.events)
        while time.monotonic() < end and len(stepped) < self.settings.world:
            self.progress.poll()
            for e in self.progress.events[seen:]:
                if int(e["pid"]) in old:
                    continue
                if e["event"] == "resumed":
                    resumed.add(int(e["step"]))
                if e["event"] == "step" and e["rank"] not in stepped:
                    stepped[int(e["rank"])] = float(e["time"])
            seen = len(self.progress.events)
            time.sleep(_nodes.POLL)
        return stepped, resumed

    def reach_all_ranks(self) -> None:
        poll_until(
            lambda: len(self.hosts()) == self.settings.world or None,
            self.settings.startup_deadline,
            "every rank to start",
            interval=0.1,
        )


def signal_all(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def still_running(pids: Iterable[int], deadline: float) -> list[int]:
    """Wait up to ``deadline`` seconds for ``pids`` to end; those still running then."""
    pids = set(pids)
    end = time.monotonic() + deadline
    while (left := sorted(p for p in pids if process_running(p))) and time.monotonic() < end:
        time.sleep(0.1)
    return left


def lose_node(job: Job, rng: random.Random, index: int) -> dict[str, Any]:
    """One loss: draw the victim and the fault, signal its whole tree, wait for the recovery, settle the victim."""
    s = job.settings
    hosts = job.hosts()
    candidates = sorted({id(n): n for n in hosts.values()}.values(), key=lambda n: n.proc.pid)
    if s.rdzv == "c10d":  # the store lives in the first launcher's process: its loss ends the job
        candidates = [n for n in candidates if n is not job.nodes[0]]
    victim = rng.choice(candidates)
    kind = rng.choice(s.faults)
    hang = kind != "kill"
    leader = job.leader()
    ranks = sorted(r for r, n in hosts.items() if n is victim)
    old = {int(e["pid"]) for e in job.progress.events}
    tree = victim.tree()
    t_fault = time.time()
    signal_all(tree, signal.SIGSTOP if hang else signal.SIGKILL)
    stepped, resumed = job.wait_recovery(old, s.recovery_deadline)
    recovered = len(stepped) == s.world
    last_old = max(int(e["step"]) for e in job.progress.events if e["event"] == "step" and int(e["pid"]) in old)
    result: dict[str, Any] = {
        "index": index,
        "kind": kind,
        "ranks": ranks,
        "victim_rank0": 0 in ranks,
        "victim_led": None if leader is None else leader is victim,
        "recovered": recovered,
        "seconds": max(stepped.values()) - t_fault if recovered else None,
        "steps_lost": last_old - min(resumed) if recovered and resumed else None,
    }
    if kind == "hang-cont":
        t_cont = time.time()
        signal_all(tree, signal.SIGCONT)
        try:
            code: int | None = victim.proc.wait(s.recovery_deadline)
        except subprocess.TimeoutExpired:
            code = None
        job.progress.poll()
        result["fenced_exit"] = code
        result["fenced_said"] = "was declared lost" in victim.text()
        # Steps its old workers logged once resumed (one in flight when they were stopped may land).
        result["fenced_steps"] = sum(
            1
            for e in job.progress.events
            if e["event"] == "step" and int(e["pid"]) in tree and float(e["time"]) >= t_cont
        )
    else:  # hang-kill: the operator's SIGKILL of the stopped tree (a killed tree is gone already)
        signal_all(tree, signal.SIGKILL)
    result["left"] = still_running(tree, GONE_WITHIN)
    signal_all(result["left"], signal.SIGKILL)
    signal_all(result["left"], signal.SIGCONT)
    victim.proc.wait(30)
    job.children.adopt(tree)
    logger.info("loss %d: %s", index + 1, result)
    return result


def finish(job: Job, deadline: float) -> dict[str, Any]:
    """Let the job run to its end at full speed: every launcher's exit code and the final parameters."""
    job.rush.touch()
    codes: list[int | None] = []
    end = time.monotonic() + deadline
    for n in job.nodes:
        try:
            codes.append(n.proc.wait(max(1.0, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    result = job.work / "result.json"
    return {"exit_codes": codes, "sha256": json.loads(result.read_text())["sha256"] if result.exists() else None}


def rendezvous(s: Settings, etcd: str | None, name: str) -> tuple[str, ...]:
    if s.rdzv == "c10d":
        return ("--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={name}")
    return ("--rdzv-backend=etcd-v2", f"--rdzv-endpoint={etcd}", f"--rdzv-id={name}")


def fault_free(s: Settings, root: Path, etcd: str | None, run_id: str, deadline: float) -> str | None:
    """The final parameter hash of the same job with no fault and no pause, on launchers of its own."""
    with Children(grace=10.0) as children:
        job = Job(s, root / "fault-free", children, rendezvous(s, etcd, f"free-{run_id}"), run_id, 0.0)
        job.start_nodes()
        outcome = finish(job, deadline)
    if outcome["exit_codes"] != [0] * s.nnodes:
        logger.error("the fault-free run ended with %s (logs in %s)", outcome["exit_codes"], job.work)
    return outcome["sha256"]


def run(s: Settings, root: Path) -> dict[str, Any]:
    rng = random.Random(s.seed)
    run_id = uuid.uuid4().hex[:12]
    losses: list[dict[str, Any]] = []
    spare_seconds: list[float] = []
    stopped: str | None = None
    with Children(grace=10.0) as outer:
        etcd = _nodes.start_etcd(outer, root, "--enable-v2") if s.rdzv == "etcd-v2" else None
        with Children(grace=10.0) as children:
            job = Job(s, root / "chaos", children, rendezvous(s, etcd, f"chaos-{run_id}"), run_id, s.step_time)
            job.start_nodes()
            job.reach_all_ranks()
            spare_seconds += [job.start_spare() for _ in range(s.spares)]
            t0 = time.monotonic()
            for i in range(s.losses):
                loss = lose_node(job, rng, i)
                losses.append(loss)
                if not loss["recovered"]:
                    stopped = f"loss {i + 1} was not recovered within {s.recovery_deadline:g} s"
                    break
                if max(int(e["step"]) for e in job.progress.events if e["event"] == "step") >= s.steps - 20:
                    stopped = f"the job reached its last steps after {i + 1} losses (raise --steps)"
                    break
                try:
                    spare_seconds.append(job.start_spare())
                except (TimeoutError, RuntimeError) as exc:
                    stopped = f"after loss {i + 1}: {exc}"
                    break
                time.sleep(rng.uniform(1.0, 3.0))
            chaos_seconds = time.monotonic() - t0
            if stopped:
                logger.error("the chaos stopped early: %s", stopped)
            outcome = finish(job, s.recovery_deadline + s.steps * 0.05)
            children.adopt(int(e["pid"]) for e in job.progress.events)
        reference = fault_free(s, root, etcd, run_id, s.startup_deadline + s.steps * 0.05)
    leftovers = still_running(processes_with_env(f"{MARKER}={run_id}"), GONE_WITHIN)
    return {
        "settings": asdict(s),
        "losses": losses,
        "stopped": stopped,
        "chaos_seconds": chaos_seconds,
        "spare_seconds": spare_seconds,
        "exit_codes": outcome["exit_codes"],
        "sha256": outcome["sha256"],
        "fault_free_sha256": reference,
        "params_equal": outcome["sha256"] is not None and outcome["sha256"] == reference,
        "leftovers": leftovers,
    }


def _row(name: str, rows: list[dict[str, Any]]) -> list[object]:
    times = [r["seconds"] for r in rows if r["recovered"]]
    return [
        name,
        len(rows),
        sum(r["recovered"] for r in rows),
        fmt(percentile(times, 50)),
        fmt(percentile(times, 95)),
        fmt(max(times) if times else None),
    ]


def report(data: dict[str, Any]) -> str:
    """The bench's tables: losses by fault and by victim, then the job's outcome."""
    losses = data["losses"]
    rows = [_row(kind, [r for r in losses if r["kind"] == kind]) for kind in FAULTS]
    rows.append(_row("rank 0's node", [r for r in losses if r["victim_rank0"]]))
    rows.append(_row("the leading replica's node", [r for r in losses if r["victim_led"]]))
    rows.append(_row("all", losses))
    table = markdown_table(
        ["node lost", "losses", "recovered", "→ every rank stepped p50 (s)", "p95 (s)", "max (s)"],
        [r for r in rows if r[1]],
    )
    conts = [r for r in losses if r["kind"] == "hang-cont"]
    fenced = sum(r["fenced_exit"] == 1 and r["fenced_said"] and not r["left"] for r in conts)
    outcome = markdown_table(
        ["launchers' exit codes", "final parameters = fault-free", "resumed nodes fenced", "leftover processes"],
        [
            [
                ",".join("–" if c is None else str(c) for c in data["exit_codes"]),
                "yes" if data["params_equal"] else "NO",
                f"{fenced}/{len(conts)}",
                len(data["leftovers"]) + sum(len(r["left"]) for r in losses),
            ]
        ],
    )
    return f"{table}\n\n{outcome}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--losses", type=int, default=50, help="node losses in a row (default: %(default)s)")
    p.add_argument("--nnodes", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2, help="ranks per node")
    p.add_argument("--spares", type=int, default=1, help="spares standing by before each loss")
    p.add_argument("--rdzv", choices=("etcd-v2", "c10d"), default="etcd-v2")
    p.add_argument("--steps", type=int, default=None, help="the job's steps (default: 500 per loss)")
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument(
        "--faults", default=",".join(FAULTS), help="comma separated, each drawn alike (default: %(default)s)"
    )
    p.add_argument("--seed", type=int, default=22)
    p.add_argument("--recovery-deadline", type=float, default=120.0)
    p.add_argument("--startup-deadline", type=float, default=300.0)
    p.add_argument("--keep", type=Path, default=None, help="keep the run's logs here")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args()
    if args.losses < 1 or args.nnodes < 2 or args.nproc < 1 or args.spares < 1:
        p.error("--losses, --nproc and --spares must be at least 1, --nnodes at least 2")
    faults = tuple(f.strip() for f in args.faults.split(",") if f.strip())
    if not faults or any(f not in FAULTS for f in faults):
        p.error(f"--faults: choose from {', '.join(FAULTS)}")
    setup_logging(args.log_level)
    exit_on_sigterm()
    s = Settings(
        args.losses,
        args.nnodes,
        args.nproc,
        args.spares,
        args.rdzv,
        args.steps or 500 * args.losses,
        args.step_time,
        args.ckpt_every,
        faults,
        args.seed,
        args.recovery_deadline,
        args.startup_deadline,
    )
    root = args.keep or Path(tempfile.mkdtemp(prefix="nodes-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    load_before = load_average()
    data = run(s, root)
    data.update(
        machine=machine(),
        load_before=load_before,
        load_after=load_average(),
        command=" ".join([Path(sys.executable).name, *sys.argv]),
    )
    write_json(args.json, data)
    print(report(data))
    if data["stopped"]:
        print(f"\nThe chaos stopped early: {data['stopped']}.")
    ok = (
        not data["stopped"]
        and all(r["recovered"] for r in data["losses"])
        and data["params_equal"]
        and not data["leftovers"]
        and data["exit_codes"] == [0] * len(data["exit_codes"])
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
