"""Hang detection: hang → fault reported, and hang → every rank stepping again, per signal.

Everything runs as real ``taskd run`` jobs (one node, embedded controller, its
journal in a state file read at the end); the fault's arrival is the
controller's ``fault`` journal time, the hang's start a wall-clock time the
worker (or the bench, for signals from outside) writes down.

1. **Per signal** (``--trials`` hangs each, one job per signal, restarted by
   TaskD after each hang): ``bench/hang_worker.py`` on 2 ranks beats every
   50 ms, then rank 0 hangs: ``stopped`` (SIGSTOP, /proc state, bound 0.5 s),
   ``heartbeat`` (spins silently; learned timeout), ``section`` (spins in a
   section with a 1 s timeout), ``timer`` (spins past a torch file timer of
   1 s, written in ``FileTimerClient``'s protocol).
2. **DDP** (``--torch-trials`` each): ``examples/train_ddp.py`` on 1 node x 2
   ranks; rank 1 spins without its heartbeat at step 20, or is SIGSTOPped, or
   — for comparison — SIGKILLed; hang → fault, fault → every rank stepping again.
3. **No false positives**: ``--healthy-steps`` steps of ``train_ddp.py`` whose
   step times vary by 5x; the faults the controller saw (must be none) and the
   learned timeout the agent reported (``taskd status``).

Run::

    .venv/bin/python bench/hang_bench.py --trials 20 --torch-trials 3 --healthy-steps 1000 --json /tmp/hang.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    PYTHON,
    REPO,
    Children,
    fmt,
    free_port,
    job_status,
    markdown_table,
    percentile,
    poll_until,
    setup_logging,
    write_json,
)

from taskd_core.errors import TaskdError

logger = logging.getLogger(__name__)

SIGNALS = ("stopped", "heartbeat", "section", "timer")
TORCH_KINDS = ("heartbeat", "stopped", "death")
WORKER = REPO / "bench" / "hang_worker.py"
TRAIN = REPO / "examples" / "train_ddp.py"
#: Issue 11's targets.
OVER_TIMEOUT_P99 = 0.5
SIGSTOP_P99 = 1.0
LEARNED_TARGET = 5.0
#: Peers' defaults (SPEC §10), for the table beside ours.
PEERS = [
    ["gloo collective timeout", "1800 s", "collective times out"],
    ["NCCL collective timeout + watchdog", "600 s + 480 s", "collective times out"],
    ["DLRover hang detection", "600 s", "no step progress"],
    ["NVIDIA ft_launcher", "2700 s", "missing heartbeats"],
    ["NVIDIA in-process wrapper", "30 s heartbeat / 60 s soft", "missing heartbeats"],
    ["torchft Lighthouse", "5 s", "heartbeat of a whole replica group"],
]
#: The columns of the phases table, in the order they happen.
PHASES = ("fault reports", "faults", "cycle started", "stopped", "strategies", "strategy chosen", "restarted",
          "stepping", "stack taken in", "cycles")
_STACK_TIME = re.compile(r"stack taken in ([0-9.]+)s")
_TIMEOUT = re.compile(r"no progress for ([0-9.]+)s \(timeout ([0-9.]+)s, (learned|configured)\)")
#: The job token every bench job runs with, so the bench may read the job's status.
TOKEN = "hang-bench-token"


def taskd_run(
    children: Children, work: Path, job: str, command: list[str], cycles: int, controller_port: int = 0
) -> Any:
    """One node (2 ranks) of ``job`` under ``taskd run`` with its controller's journal in ``work/controller.db``."""
    args = [
        PYTHON, "-m", "taskd_core", "--log-level", "INFO", "run", "--nproc", "2", "--job-id", job,
        "--controller-port", str(controller_port or free_port()), "--master-port", str(free_port()),
        "--controller-state", str(work / "controller.db"), "--log-dir", str(work / "logs"),
        "--max-cycles", str(cycles), "--stop-timeout", "5", "--", *command,
    ]
    return children.start(args, log=work / "taskd.log", cwd=REPO, env={"TASKD_JOB_TOKEN": TOKEN})


def journal(work: Path, job: str) -> list[tuple[float, str, dict[str, Any]]]:
    """(controller time, kind, detail) of every event the job's journal holds, oldest first."""
    db = sqlite3.connect(work / "controller.db")
    try:
        query = "SELECT time, kind, detail FROM events WHERE job_id = ? ORDER BY seq"
        rows = db.execute(query, (job,)).fetchall()
    finally:
        db.close()
    return [(t, kind, json.loads(d)) for t, kind, d in rows]


def faults(work: Path, job: str) -> list[tuple[float, dict[str, Any]]]:
    """(controller time, detail) of every fault the job's journal holds, oldest first."""
    return [(t, detail) for t, kind, detail in journal(work, job) if kind == "fault"]


def phases(work: Path, job: str, stepping: float) -> dict[str, float]:
    """When each step of the first recovery happened, in seconds after its first fault report.

    ``faults``: the last fault report before the cycle's stopTrain (the hang's, then
    the peers' deaths; ``fault reports`` counts them); ``stopped``, ``strategies``,
    ``restarted``: the last agent's answer to stopTrain, globalFault, changeStrategy;
    ``stepping``: every rank stepped again; ``cycles``: recovery cycles in the run.
    """
    entries = journal(work, job)
    found = [(t, detail) for t, kind, detail in entries if kind == "fault"]
    first, evidence = found[0][0], str(found[0][1].get("evidence", ""))
    out: dict[str, float] = {"fault reports": 0, "cycles": 0}
    answers = {"stop": "stopped", "strategies": "strategies", "status": "restarted"}
    for t, kind, detail in entries:
        if kind == "cycle started":
            out["cycles"] += 1
            out.setdefault("cycle started", t - first)
        elif out["cycles"] > 1:
            continue
        elif kind == "fault":
            out["fault reports"] += 1
            out["faults"] = t - first
        elif kind == "report" and detail.get("step") in answers:
            out[answers[detail["step"]]] = t - first
        elif kind == "strategy chosen":
            out.setdefault("strategy chosen", t - first)
    out["stepping"] = stepping - first
    stack = _STACK_TIME.search(evidence)
    if stack is not None:
        out["stack taken in"] = float(stack.group(1))
    return out


def events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def first_steps(evts: list[dict[str, Any]], restart: int) -> dict[int, float]:
    """Each rank's first step after start number ``restart``."""
    out: dict[int, float] = {}
    for e in evts:
        if e["event"] == "step" and e["restart"] == restart:
            out.setdefault(int(e["rank"]), float(e["time"]))
    return out


def evidence_of(detail: dict[str, Any]) -> tuple[float, float, bool]:
    """(silence when declared, timeout, learned) as the agent wrote them into the hang's evidence."""
    found = _TIMEOUT.search(str(detail.get("evidence", "")))
    if found is None:
        raise RuntimeError(f"fault without hang evidence: {detail}")
    return float(found.group(1)), float(found.group(2)), found.group(3) == "learned"


def bench_signal(kind: str, trials: int, root: Path) -> dict[str, Any]:
    work = root / f"light-{kind}"
    work.mkdir()
    trace = work / "events.jsonl"
    job = f"hang-{kind}-{os.getpid()}"
    with Children(grace=30.0) as children:
        proc = taskd_run(children, work, job, [PYTHON, str(WORKER), kind, str(trials), str(trace)], trials + 1)
        code = proc.wait(120 + 30 * trials)
    if code != 0:
        raise RuntimeError(f"{kind}: taskd run exited {code}; see {work / 'taskd.log'}")
    evts, seen = events(trace), faults(work, job)
    hangs = {e["restart"]: float(e["time"]) for e in evts if e["event"] == "hang"}
    detect, over, declared, again, timeouts, learned = [], [], [], [], [], False
    for k, (arrived, detail) in enumerate(seen):
        waited, timeout, learned = evidence_of(detail)
        steps = first_steps(evts, k + 1)
        detect.append(arrived - hangs[k])
        over.append(arrived - hangs[k] - timeout)
        # The /proc bound runs from when the agent first saw the state, so its silence is the bench's.
        declared.append((arrived - hangs[k] if kind == "stopped" else waited) - timeout)
        timeouts.append(timeout)
        if len(steps) == 2:
            again.append(max(steps.values()) - hangs[k])
    return {"trials": len(seen), "timeout": percentile(timeouts, 50), "learned": learned,
            "detect": detect, "over": over, "declared": declared, "again": again}


def bench_torch(kind: str, root: Path, trial: int) -> dict[str, float]:
    work = root / f"ddp-{kind}-{trial}"
    work.mkdir()
    progress = work / "progress.jsonl"
    job = f"hang-ddp-{kind}-{trial}-{os.getpid()}"
    command = [PYTHON, str(TRAIN), "--steps", "40", "--ckpt-every", "10", "--step-time", "0.05",
               "--ckpt-dir", str(work / "ckpt"), "--progress", str(progress)]
    if kind == "heartbeat":
        command += ["--hang-at-step", "20", "--hang-rank", "1"]
    with Children(grace=30.0) as children:
        proc = taskd_run(children, work, job, command, 3)
        if kind == "heartbeat":
            t0 = poll_until(
                lambda: next((float(e["time"]) for e in events(progress)
                              if e["event"] == "step" and e["rank"] == 1 and e["step"] == 20), None),
                300, "rank 1 at step 20")
        else:
            poll_until(lambda: any(e["step"] >= 20 for e in events(progress)) or None, 300, "step 20")
            pid = next(e["pid"] for e in events(progress) if e["event"] == "start" and e["rank"] == 1)
            t0 = time.time()
            os.kill(pid, signal.SIGSTOP if kind == "stopped" else signal.SIGKILL)
        code = proc.wait(300)
    if code != 0:
        raise RuntimeError(f"ddp {kind}: taskd run exited {code}; see {work / 'taskd.log'}")
    arrived = faults(work, job)[0][0]
    stepping = max(first_steps(events(progress), 1).values())
    return {"detect": arrived - t0, "recover": stepping - arrived, "again": stepping - t0,
            "phases": phases(work, job, stepping)}


def bench_torch_interleaved(trials: int, root: Path) -> dict[str, list[dict[str, float]]]:
    """Every kind once per round, so a busy spell of the machine hits all kinds alike."""
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in TORCH_KINDS} if trials else {}
    for i in range(trials):
        for kind in TORCH_KINDS:
            runs[kind].append(bench_torch(kind, root, i))
    return runs


def bench_healthy(steps: int, root: Path) -> dict[str, Any]:
    work = root / "healthy"
    work.mkdir()
    job = f"hang-healthy-{os.getpid()}"
    command = [PYTHON, str(TRAIN), "--steps", str(steps), "--ckpt-every", "100", "--step-time", "0.01",
               "--step-jitter", "5", "--ckpt-dir", str(work / "ckpt"), "--progress", str(work / "progress.jsonl")]
    port = free_port()
    shown = ""
    with Children(grace=30.0) as children:
        proc = taskd_run(children, work, job, command, 3, port)
        deadline = time.monotonic() + 60 + steps
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(2.0)
            try:
                view = job_status(f"127.0.0.1:{port}", job, events=0, token=TOKEN)
            except TaskdError as exc:  # not up yet, or already gone: the last line read stands
                logger.info("no status yet: %s", exc)
                continue
            lines = [a.hang_timeouts for a in view.agents] if view is not None else []
            shown = next((p for p in lines if "heartbeat" in p), shown)
        code = proc.wait(60)
    learned = re.search(r"heartbeat ([0-9.]+)s \(learned", shown)
    steps_done = sum(1 for e in events(work / "progress.jsonl") if e["event"] == "step" and e["rank"] == 0)
    return {"exit": code, "steps": steps_done, "false_positives": len(faults(work, job)),
            "learned": float(learned.group(1)) if learned else None, "status_line": shown}


def _p(values: list[float], q: float) -> str:
    return fmt(percentile(values, q)) if values else "—"


def report(data: dict[str, Any]) -> str:
    light = [
        [
            kind, r["trials"], f"{fmt(r['timeout'])} s ({'learned' if r['learned'] else 'configured'})",
            f"{_p(r['declared'], 50)} / {_p(r['declared'], 99)}",
            f"{_p(r['detect'], 50)} / {_p(r['detect'], 99)}", f"{_p(r['over'], 50)} / {_p(r['over'], 99)}",
            _p(r["again"], 50),
        ]
        for kind, r in data["signals"].items()
    ]
    parts = [
        "Per signal (2 light ranks, rank 0 hangs; seconds):",
        markdown_table(["signal", "hangs", "timeout", "declared beyond the timeout p50 / p99",
                        "hang → fault reported p50 / p99", "reported beyond the timeout p50 / p99",
                        "hang → every rank stepping p50"], light),
        (
            "Declared: when the agent's watcher decided (from its evidence; for SIGSTOP from the bench's clock);"
            " reported adds taking the stack (py-spy) and the RPC."
        ),
    ]
    if data["torch"]:
        rows = [
            [kind, len(r), _p([x["detect"] for x in r], 50), _p([x["recover"] for x in r], 50),
             _p([x["again"] for x in r], 50)]
            for kind, r in data["torch"].items()
        ]
        parts += ["`examples/train_ddp.py`, 1 node x 2 ranks, rank 1 hangs or dies at step 20 (medians, seconds):",
                  markdown_table(["fault", "trials", "→ fault reported", "fault → every rank stepping",
                                  "→ every rank stepping"], rows)]
        seen = {k for r in data["torch"].values() for x in r for k in x["phases"]}
        columns = [c for c in PHASES if c in seen]
        phase_rows = [
            [kind, *(_p([x["phases"][c] for x in r if c in x["phases"]], 50) for c in columns)]
            for kind, r in data["torch"].items()
        ]
        parts += ["The recovery's phases, seconds after the first fault report (medians; `faults`: the last"
                  " report before the cycle began; one report means the peer had not died by itself when the"
                  " restart came, and the restart stopped it):", markdown_table(["fault", *columns], phase_rows)]
    h = data["healthy"]
    if h:
        parts.append(
            f"Healthy `train_ddp.py`, {h['steps']} steps of 10–50 ms (5x jitter), 2 ranks: {h['false_positives']}"
            f" fault(s) reported; the agent's line in `taskd status`: `{h['status_line'] or '—'}`."
        )
    parts += ["Peers' defaults (what a hang costs without TaskD):",
              markdown_table(["system", "default", "signal"], PEERS)]
    return "\n\n".join(parts) + "\n"


def verdicts(data: dict[str, Any]) -> list[list[str]]:
    rows = []
    for column, what in (("declared", "detected"), ("over", "reported")):
        over = {k: percentile(r[column], 99) for k, r in data["signals"].items() if r[column]}
        worst = max(over, key=lambda k: over[k]) if over else None
        if worst is not None:
            rows.append([f"hang {what} within timeout + {OVER_TIMEOUT_P99:g} s (p99), every signal",
                         f"worst {worst}: +{fmt(over[worst])} s",
                         "met" if over[worst] <= OVER_TIMEOUT_P99 else "missed"])
    stopped = data["signals"].get("stopped")
    if stopped and stopped["detect"]:
        p99 = percentile(stopped["detect"], 99)
        rows.append([f"SIGSTOP found in /proc within {SIGSTOP_P99:g} s (p99)", f"{fmt(p99)} s",
                     "met" if p99 <= SIGSTOP_P99 else "missed"])
    h = data["healthy"]
    if h:
        learned = h["learned"]
        rows.append([f"learned timeout on train_ddp.py under {LEARNED_TARGET:g} s",
                     f"{fmt(learned)} s" if learned is not None else "not reported",
                     "met" if learned is not None and learned < LEARNED_TARGET else "missed"])
        rows.append([f"no false positive over {h['steps']} healthy steps with 5x jitter",
                     f"{h['false_positives']} fault(s)", "met" if h["false_positives"] == 0 and h["exit"] == 0 else "missed"])
    torch_runs = data["torch"]
    if torch_runs.get("death"):
        death = percentile([x["recover"] for x in torch_runs["death"]], 50)
        for kind in ("heartbeat", "stopped"):
            if torch_runs.get(kind):
                again = percentile([x["again"] for x in torch_runs[kind]], 50)
                bound = percentile([x["detect"] for x in torch_runs[kind]], 50) + death
                # Detection is on both sides, so this compares the recoveries after the report; the
                # rounds ran interleaved, so each hang is also held against the death of its round.
                paired = [h["recover"] - d["recover"] for h, d in zip(torch_runs[kind], torch_runs["death"], strict=False)]
                rows.append([f"DDP {kind} hang → every rank stepping ≤ detection + a death's recovery (medians)",
                             f"{fmt(again)} s vs {fmt(bound)} s (recovery after the report minus the same"
                             f" round's death: median {percentile(paired, 50):+.2f} s)",
                             "met" if again <= bound else "missed"])
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20, help="hangs per signal in the light part")
    p.add_argument("--torch-trials", type=int, default=3, help="DDP runs per fault kind (0: skip)")
    p.add_argument("--healthy-steps", type=int, default=1000, help="steps of the healthy run (0: skip)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep", type=Path, default=None, help="run in this (new) folder and keep the jobs' logs")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args()
    setup_logging(args.log_level)
    with contextlib.ExitStack() as stack:
        if args.keep is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hang-bench-")))
        else:
            root = args.keep
            root.mkdir(parents=True)
        data: dict[str, Any] = {
            "signals": {kind: bench_signal(kind, args.trials, root) for kind in SIGNALS if args.trials},
            "torch": bench_torch_interleaved(args.torch_trials, root),
            "healthy": bench_healthy(args.healthy_steps, root) if args.healthy_steps else None,
        }
    print(report(data))
    for row in verdicts(data):
        print(" | ".join(row))
    write_json(args.json, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
