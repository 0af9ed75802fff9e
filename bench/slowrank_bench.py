"""Slow ranks: how many steps until a straggler is named, false positives, and what measuring costs.

1. **The detector** (``taskd_core.controller.slowrank``, its defaults) on
   synthetic series of 4 ranks: one rank at 2x the work per step from step
   100 on, under two noises (each rank's steps varying on their own by up to
   1.2x, and by up to 5x): steps from the slowdown to the rank being named,
   over ``--trials`` seeds; then false positives over ``--healthy-steps``
   steps with 5x jitter (each rank on its own, and every rank together) and
   with a job-wide 2x slowdown.
2. **Real jobs**: ``examples/train_live.py`` (``LiveSession`` measures the
   work itself, no script change) on ``taskd run --nproc 4``; rank 2 sleeps
   ``SLOW_SLEEP`` x the step's sleep from step ``SLOW_FROM`` on (about 2x its
   work, as every rank also works outside its sleep): the step of the controller's
   ``slow-rank`` event minus ``SLOW_FROM``, over ``--job-trials`` jobs, and a
   healthy job of ``--job-steps`` steps whose step times vary by 5x: its
   ``slow-rank`` events (must be none). The journal is read from the
   controller's state file.
3. **Replace** (``--replace-trials`` per script of ``--replace-scripts``): 2
   ``taskdrun`` nodes x 2 ranks of ``examples/train_ddp.py`` (every rank
   restarts from the checkpoint) and of ``examples/train_live.py`` (the spare's
   ranks receive the state from a replica) and a spare (c10d), ``--taskd-slow-rank replace``;
   the ranks hold before step ``REPLACE_FROM`` until the spare stands by, then
   rank 3 sleeps 2.5x: steps until its node is drained, seconds from the
   slowdown to the drain, from the drain to the new processes stepping (the
   node-loss recovery) and to the healthy pace again (rank 0's steps back
   within 10 % of before), steps lost, step times; each trial, and their
   medians per script.
4. **Overhead**: the measurement's own cost per step (``LiveSession``'s work
   clock: begin, two collectives' spans, commit; ``worker.step(n, busy=...)``
   into a real socket), timed over ``--overhead-steps`` steps, as a share of
   the real job's median step time.

Run::

    .venv/bin/python bench/slowrank_bench.py --trials 50 --job-trials 3 --json /tmp/slowrank.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import socket
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import (
    PYTHON,
    REPO,
    Children,
    fmt,
    free_port,
    markdown_table,
    poll_until,
    setup_logging,
    write_json,
)

from taskd_core.client.query import QueryClient
from taskd_core.controller.slowrank import DEFAULT_BOUND, SlowRankConfig, SlowRankDetector
from taskd_core.models import RankWork
from taskd_core.worker import ProgressReporter

logger = logging.getLogger(__name__)

TRAIN = REPO / "examples" / "train_live.py"
TOKEN = "slowrank-bench-token"
RANKS = 4
#: The synthetic straggler's start, and the real one's.
SLOW_AT = 100
SLOW_FROM = 30
#: The real job's step (seconds of sleep standing for compute), and the straggler's sleep as a
#: multiple of it: every rank also works outside the sleep, so 2.5x the sleep is about 2x the work.
STEP_TIME = 0.2
SLOW_SLEEP = 2.5
#: The real healthy job's step: its sleep varies between 1x and 5x this.
HEALTHY_STEP = 0.1
#: Targets (issue 27).
LATENCY_TARGET = 20
OVERHEAD_TARGET = 0.01

Pace = Callable[[int, int], float]


def feed(pace: Pace, steps: int) -> tuple[list[tuple[int, int]], float | None]:
    """(rank, step) of every slow rank the default detector names over ``steps`` steps of ``pace``,
    and the bound it learned (None: not learned by then)."""
    detector = SlowRankDetector()
    found = []
    for step in range(1, steps + 1):
        samples = [RankWork(r, 100 + r, step, 1, pace(r, step)) for r in range(RANKS)]
        found += [(f.rank, f.step) for f in detector.feed(samples, float(step))]
    return found, round(detector.bound, 3) if detector.bound_learned else None


def own_jitter(rng: random.Random, spread: float) -> Pace:
    table: dict[tuple[int, int], float] = {}
    return lambda r, s: table.setdefault((r, s), 0.1 * rng.uniform(1.0, spread))


def bench_detector(trials: int, healthy_steps: int) -> dict[str, Any]:
    latency: dict[str, list[int | None]] = {}
    #: the bound each straggler run learned over its healthy steps before the slowdown.
    learned: dict[str, list[float | None]] = {}
    #: healthy ranks named in the straggler runs (their first 100 steps, and 3 of 4 ranks after, are healthy).
    beside: dict[str, int] = {}
    for spread in (1.2, 5.0):
        named: list[int | None] = []
        bounds: list[float | None] = []
        beside[f"{spread:g}x"] = 0
        for seed in range(trials):
            noise = own_jitter(random.Random(seed), spread)
            found, bound = feed(
                lambda r, s, n=noise: n(r, s) * (2.0 if r == 2 and s >= SLOW_AT else 1.0), SLOW_AT + 200
            )
            bounds.append(bound)
            first = next((step for rank, step in found if rank == 2 and step >= SLOW_AT), None)
            named.append(None if first is None else first - SLOW_AT)
            wrong = [(rank, step) for rank, step in found if rank != 2 or step < SLOW_AT]
            if wrong:
                logger.warning("seed %s, %gx: named while healthy (rank, step): %s", seed, spread, wrong)
            beside[f"{spread:g}x"] += len(wrong)
        latency[f"{spread:g}x"] = named
        learned[f"{spread:g}x"] = bounds
    half = healthy_steps // 2
    false: dict[str, int] = {"own_5x": 0, "common_5x": 0, "job_wide_2x": 0}
    for seed in range(trials):
        false["own_5x"] += len(feed(own_jitter(random.Random(seed), 5.0), healthy_steps)[0])
        rng = random.Random(seed)
        common = {s: rng.uniform(1.0, 5.0) for s in range(1, healthy_steps + 1)}
        false["common_5x"] += len(feed(lambda r, s, c=common: 0.1 * c[s], healthy_steps)[0])
        noise = own_jitter(random.Random(seed), 1.2)
        false["job_wide_2x"] += len(
            feed(lambda r, s, n=noise: n(r, s) * (2.0 if s > half else 1.0), healthy_steps)[0]
        )
    config = SlowRankConfig()
    return {
        "trials": trials,
        "healthy_steps": healthy_steps,
        # The policy gives none: learned per run (``learned``), this until then.
        "bound": DEFAULT_BOUND,
        "learned": learned,
        "window": config.window,
        "hold": config.steps_held,
        "latency": latency,
        "false_beside_straggler": beside,
        "false_positives": false,
    }


def taskd_run(children: Children, work: Path, job: str, *train: str) -> Any:
    """``train_live.py`` on 4 ranks under ``taskd run``, its controller's journal in ``work/controller.db``."""
    args = [
        PYTHON, "-m", "taskd_core", "--log-level", "INFO", "run", "--nproc", str(RANKS), "--job-id", job,
        "--controller-port", str(free_port()), "--master-port", str(free_port()),
        "--controller-state", str(work / "controller.db"), "--log-dir", str(work / "logs"), "--",
        PYTHON, str(TRAIN), "--ckpt-dir", str(work / "ckpt"), "--ckpt-every", "1000",
        "--progress", str(work / "progress.jsonl"), *train,
    ]  # fmt: skip
    return children.start(args, log=work / "taskd.log", cwd=REPO, env={"TASKD_JOB_TOKEN": TOKEN})


def slow_events(work: Path, job: str) -> list[dict[str, Any]]:
    db = sqlite3.connect(work / "controller.db")
    try:
        rows = db.execute(
            "SELECT detail FROM events WHERE job_id = ? AND kind = 'slow-rank' ORDER BY seq", (job,)
        )
        return [json.loads(d) for (d,) in rows.fetchall()]
    finally:
        db.close()


def step_times(work: Path) -> list[float]:
    """Rank 0's wall time between consecutive steps, from the progress log."""
    lines = (work / "progress.jsonl").read_text().splitlines()
    stamps = [json.loads(x)["time"] for x in lines if x.endswith("}") and '"step"' in x and '"rank": 0' in x]
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def run_job(root: Path, name: str, *train: str) -> tuple[int, list[dict[str, Any]], list[float]]:
    work = root / name
    work.mkdir()
    job = f"slowrank-{name}-{os.getpid()}"
    with Children(grace=30.0) as children:
        code = taskd_run(children, work, job, *train).wait(600)
    return code, slow_events(work, job), step_times(work)


def bench_jobs(trials: int, steps: int, root: Path) -> dict[str, Any]:
    slowed: list[dict[str, Any]] = []
    times: list[float] = []
    for trial in range(trials):
        code, found, step_wall = run_job(
            root, f"slow{trial}", "--steps", str(SLOW_FROM + 60), "--step-time", str(STEP_TIME),
            "--slow-rank", "2", "--slow-from", str(SLOW_FROM), "--slow-step-time", str(SLOW_SLEEP * STEP_TIME),
        )  # fmt: skip
        first = found[0] if found else None
        slowed.append({
            "exit": code,
            "named": [d["ranks"] for d in found],
            "steps_to_name": None if first is None else first["step"] - SLOW_FROM,
            "ratio": None if first is None else first["evidence"][0]["ratio"],
            "bound": None if first is None else first["bound"],
            "bound_learned": None if first is None else first.get("bound_learned", False),
        })  # fmt: skip
        times += step_wall[: SLOW_FROM - 1]
    code, found, _ = run_job(
        root, "healthy", "--steps", str(steps), "--step-time", "0.01", "--step-jitter", "5"
    )
    return {
        "trials": slowed,
        "healthy": {"exit": code, "steps": steps, "false_positives": len(found)},
        "step_seconds": statistics.median(times) if times else None,
    }


#: The replace trial: ranks hold before this step until the spare stands by, and rank 3 slows from it on.
REPLACE_FROM = 20
REPLACE_STEPS = 120
#: A checkpoint restart of every rank, and LiveSession's hand-over of the state to the spare's ranks.
REPLACE_SCRIPTS = ("train_ddp.py", "train_live.py")


def progress_events(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def replace_trial(work: Path, script: str) -> dict[str, Any]:
    """2 taskdrun nodes x 2 ranks of ``script`` and a spare (c10d), ``--taskd-slow-rank replace``: rank 3
    (node B) sleeps 2.5x from step ``REPLACE_FROM`` on; its node is drained onto the spare. Steps to the
    drain, seconds from it to the new processes stepping (every rank's with a checkpoint restart, the
    spare's two with ``LiveSession``) and to the healthy pace, steps lost, the step time before and after."""
    work.mkdir()
    progress, go = work / "progress.jsonl", work / "go"
    port = free_port()
    command = [
        str(Path(PYTHON).parent / "taskdrun"),
        "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=slowrank-replace-{os.getpid()}", "--taskd-slow-rank", "replace", "--taskd-log-level", "INFO",
        str(REPO / "examples" / script), "--steps", str(REPLACE_STEPS), "--ckpt-dir", str(work / "ckpt"),
        "--progress", str(progress), "--ckpt-every", "5", "--step-time", "0.1",
        "--hold-at-step", str(REPLACE_FROM), "--hold-file", str(go),
        "--slow-rank", "3", "--slow-from", str(REPLACE_FROM), "--slow-step-time", "0.25",
    ]  # fmt: skip
    logs = [work / f"{n}.log" for n in ("nodeA", "nodeB", "spare")]
    with Children(grace=10.0) as children:
        node_a = children.start(command, log=logs[0])
        poll_until(lambda: "joining the c10d rendezvous" in logs[0].read_text() or None, 120, "node A")
        node_b = children.start(command, log=logs[1])
        poll_until(lambda: len({e["rank"] for e in progress_events(progress)}) == 4 or None, 120, "4 ranks")
        spare = children.start(command, log=logs[2])
        poll_until(lambda: "standing by as spare" in logs[2].read_text() or None, 120, "the spare")
        found = re.search(r"embedded controller listening on (\S+) ", logs[0].read_text())
        assert found is not None, "node A hosts the controller"
        before = {int(e["pid"]) for e in progress_events(progress)}
        released = time.time()  # the ranks leave the hold within 50 ms: rank 3's slowdown starts
        go.touch()

        def drained() -> dict[str, Any] | None:
            with QueryClient(found.group(1)) as query:
                page = query.events(f"slowrank-replace-{os.getpid()}")
            return next(
                (e for e in page.events if e.kind == "slow-rank" and e.detail["action"] == "replace"), None
            )

        event = poll_until(drained, 120, "the slow rank's node to be drained", interval=0.2)
        codes = [p.wait(300) for p in (node_a, spare)]
        events = progress_events(progress)
        children.adopt(int(e["pid"]) for e in events)
        node_b.wait(60)
    new = [e for e in events if int(e["pid"]) not in before]
    first_steps = {}
    for e in new:
        if e["event"] == "step":
            first_steps.setdefault(e["rank"], float(e["time"]))
    # The processes replaced: the drained node's, and with a checkpoint restart the survivors' too.
    replaced = {int(e["pid"]) for e in events if int(e["pid"]) in before and e["rank"] in first_steps}
    resumed = [int(e["step"]) for e in new if e["event"] == "resumed"]
    reached = max((int(e["step"]) for e in events if e["event"] == "step" and int(e["pid"]) in replaced), default=0)
    stepping = max(first_steps.values()) if {2, 3} <= set(first_steps) else None

    def stamps(rows: list[dict[str, Any]]) -> list[float]:
        return [float(e["time"]) for e in rows if e["event"] == "step" and e["rank"] == 0]

    def pace(rows: list[dict[str, Any]]) -> float | None:
        gaps = [b - a for a, b in zip(stamps(rows), stamps(rows)[1:], strict=False)]
        return statistics.median(gaps) if gaps else None

    # Rank 0 before the slowdown, slowed until the drain, and once the new processes step.
    healthy = pace([e for e in events if int(e["pid"]) in before and e["step"] < REPLACE_FROM])
    slowed = [e for e in events if e["step"] > REPLACE_FROM and float(e["time"]) < event.time]
    after = [] if stepping is None else [e for e in events if float(e["time"]) >= min(first_steps.values())]
    back = None if healthy is None else healthy_again(stamps(after), healthy)
    return {
        "script": script,
        "exit_codes": codes,
        "node_b_exit": node_b.returncode,
        "steps_to_drain": int(event.detail["step"]) - REPLACE_FROM,
        "ratio": float(event.detail["evidence"][0]["ratio"]),
        "slowdown_to_drain": event.time - released,
        "drain_to_all_stepping": None if stepping is None else stepping - event.time,
        "drain_to_healthy": None if back is None else back - event.time,
        "slowdown_to_healthy": None if back is None else back - released,
        "steps_lost": max(0, reached - min(resumed)) if resumed else None,
        "step_before": healthy,
        "step_slow": pace(slowed),
        "step_after": pace(after),
    }


#: The healthy pace is back once this many steps in a row take at most PACE_SLACK x the step before.
PACE_STEPS = 5
PACE_SLACK = 1.1


def healthy_again(stamps: list[float], healthy: float) -> float | None:
    """When rank 0's steps (``stamps``, in its new process) keep the ``healthy`` pace again: the start
    of the first :data:`PACE_STEPS` steps whose median is within :data:`PACE_SLACK` of it."""
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    for first in range(len(gaps) - PACE_STEPS + 1):
        if statistics.median(gaps[first : first + PACE_STEPS]) <= PACE_SLACK * healthy:
            return stamps[first]
    return None


def bench_overhead(steps: int, root: Path) -> dict[str, Any]:
    # The live session's clock lives in the pytorch adapter; imported here only (it imports torch).
    from taskd_pytorch.live._work import WorkClock

    path = root / "agent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as agent:
        agent.bind(str(path))
        agent.setblocking(False)
        reporter = ProgressReporter(str(path))
        clock = WorkClock()
        began = time.perf_counter()
        for n in range(1, steps + 1):
            clock.begin()
            now = clock.now()
            clock.pending(now, now)
            clock.pending(now, now)
            reporter.step(n, busy=clock.commit())
            if n % 1000 == 0:  # the agent's side of the socket keeps up, as the watcher's thread does
                while True:
                    try:
                        agent.recv(512)
                    except BlockingIOError:
                        break
        seconds = time.perf_counter() - began
        reporter.close()
    return {"steps": steps, "seconds_per_step": seconds / steps}


def report(data: dict[str, Any]) -> str:
    d, jobs, over = data["detector"], data["jobs"], data["overhead"]
    rows = []
    for noise, values in d["latency"].items():
        named = [v for v in values if v is not None]
        p50 = statistics.median(named) if named else None
        rows.append([
            f"detector, 1 of 4 ranks at 2x, each rank's steps varying by up to {noise}",
            f"{fmt(p50, 0)} (max {max(named) if named else 'N/A'})",
            f"{len(values) - len(named)} of {len(values)}",
            bounds_seen(d.get("learned", {}).get(noise, [])),
        ])  # fmt: skip
    real = [t["steps_to_name"] for t in jobs["trials"] if t["steps_to_name"] is not None]
    rows.append([
        f"real job: train_live.py, 4 ranks, rank 2 sleeping {SLOW_SLEEP:g}x the {STEP_TIME * 1000:.0f} ms step from step {SLOW_FROM}",
        f"{fmt(statistics.median(real) if real else None, 0)} (max {max(real) if real else 'N/A'})",
        f"{len(jobs['trials']) - len(real)} of {len(jobs['trials'])}",
        bounds_seen([t.get("bound") if t.get("bound_learned") else None for t in jobs["trials"]]),
    ])  # fmt: skip
    latency = markdown_table(
        ["straggler", "steps until named: p50 (max)", "never named", "bound learned: min / p50 / max"], rows
    )
    fp = d["false_positives"]
    n, steps = d["trials"], d["healthy_steps"]
    healthy = markdown_table(
        ["healthy run", "slow-rank events"],
        [
            [f"detector: {n} x {steps} steps, each rank's steps varying by up to 5x", str(fp["own_5x"])],
            [f"detector: {n} x {steps} steps, every rank's steps varying together by up to 5x", str(fp["common_5x"])],
            [f"detector: {n} x {steps} steps, every rank 2x slower from the middle on", str(fp["job_wide_2x"])],
            [f"real job: train_live.py, {jobs['healthy']['steps']} steps varying by 5x", str(jobs["healthy"]["false_positives"])],
            *[
                [f"detector: the straggler runs above, while healthy, steps varying by up to {noise}", str(count)]
                for noise, count in d.get("false_beside_straggler", {}).items()
            ],
        ],
    )  # fmt: skip
    step = jobs["step_seconds"]
    cost = over["seconds_per_step"]
    overhead = markdown_table(
        ["measurement per step", "µs", "share of the real job's median step"],
        [[f"work clock + worker.step(n, busy=...), {over['steps']} steps", fmt(cost * 1e6, 2),
          f"{fmt(100 * cost / step, 4)} % of {fmt(step * 1000, 1)} ms" if step else "N/A"]],
    )  # fmt: skip
    def replace_row(name: str, t: dict[str, Any]) -> list[str]:
        return [
            name, fmt(t["steps_to_drain"], 0), fmt(t["ratio"]), fmt(t["slowdown_to_drain"]),
            fmt(t["drain_to_all_stepping"]), fmt(t["drain_to_healthy"]), fmt(t["slowdown_to_healthy"]),
            fmt(t["steps_lost"], 0), f"{fmt(t['step_before'], 3)} / {fmt(t['step_slow'], 3)} / {fmt(t['step_after'], 3)}",
        ]  # fmt: skip

    rows = []
    for script, trials in by_script(data.get("replace", [])).items():
        rows += [replace_row(f"{script} {n + 1}", t) for n, t in enumerate(trials)]
        if len(trials) > 1:
            rows.append(replace_row(f"{script}, p50 of {len(trials)}", medians(trials)))
    replaced = markdown_table(
        ["replace trial", "steps to the drain", "ratio", "slowdown → drain (s)",
         "drain → new processes stepping (s)", "drain → healthy pace (s)", "slowdown → healthy pace (s)",
         "steps lost", "step before / slowed / after (s)"],
        rows,
    )  # fmt: skip
    return "\n\n".join([latency, healthy, overhead, replaced])


def bounds_seen(bounds: list[float | None]) -> str:
    """The learned bounds of runs (None: named before it was learned, on the default) in a cell."""
    known = [b for b in bounds if b is not None]
    spread = " / ".join(f"{b:.2f}" for b in (min(known), statistics.median(known), max(known))) if known else "none"
    unlearned = len(bounds) - len(known)
    return f"{spread}{f' ({unlearned} of {len(bounds)} on {DEFAULT_BOUND:g}, not learned yet)' if unlearned else ''}"


def by_script(trials: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The replace trials of each training script, in the order they ran."""
    scripts: dict[str, list[dict[str, Any]]] = {}
    for t in trials:
        scripts.setdefault(t["script"], []).append(t)
    return scripts


def medians(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the replace trials that have it (None where none has)."""
    keys = [k for k, v in trials[0].items() if isinstance(v, int | float) or v is None]
    values = {k: [t[k] for t in trials if isinstance(t.get(k), int | float)] for k in keys}
    return {k: statistics.median(v) if v else None for k, v in values.items()}


def verdicts(data: dict[str, Any]) -> list[list[str]]:
    d, jobs, over = data["detector"], data["jobs"], data["overhead"]
    named = [v for v in d["latency"]["1.2x"] if v is not None]
    p50 = statistics.median(named) if named else None
    real = [t["steps_to_name"] for t in jobs["trials"] if t["steps_to_name"] is not None]
    real_p50 = statistics.median(real) if real else None
    fp = d["false_positives"]
    real_fp = jobs["healthy"]["false_positives"]
    step = jobs["step_seconds"]
    share = over["seconds_per_step"] / step if step else None
    every = len(named) == len(d["latency"]["1.2x"]) and len(real) == len(jobs["trials"])
    on_time = p50 is not None and real_p50 is not None and max(p50, real_p50) <= LATENCY_TARGET
    met = "met" if every and on_time else "missed"
    beside = sum(d.get("false_beside_straggler", {}).values())
    quiet = fp["own_5x"] == fp["common_5x"] == fp["job_wide_2x"] == real_fp == beside == 0
    replace_rows = [replace_verdict(script, t) for script, t in by_script(data.get("replace", [])).items()]
    return [
        [
            f"slow rank (1 of 4 at 2x) named within {LATENCY_TARGET} steps, p50",
            f"{fmt(p50, 0)} steps (detector), {fmt(real_p50, 0)} (real jobs)",
            met,
        ],
        [
            "0 false slow ranks: 5x jitter (per rank, together), job-wide 2x slowdown, a real healthy job, "
            "healthy stretches of the straggler runs",
            f"{fp['own_5x']}, {fp['common_5x']}, {fp['job_wide_2x']}, {real_fp}, {beside}",
            "met" if quiet else "missed",
        ],
        [
            f"measurement overhead ≤ {OVERHEAD_TARGET:.0%} of the step time",
            f"{fmt(100 * share, 4)} %" if share is not None else "N/A",
            "met" if share is not None and share <= OVERHEAD_TARGET else "missed",
        ],
        *(replace_rows or [replace_verdict("train_ddp.py", [])]),
    ]


def replace_verdict(script: str, trials: list[dict[str, Any]]) -> list[str]:
    """The replace target for one script's trials: the steps to the drain by their median, and every
    trial back to its pace (with ``LiveSession``, also none losing a step)."""
    p = medians(trials) if trials else {}
    live = script == "train_live.py"
    back = [t for t in trials if t["drain_to_healthy"] is not None]
    lossless = not live or all(t["steps_lost"] == 0 for t in trials)
    on_pace = bool(trials) and len(back) == len(trials) and p["steps_to_drain"] <= LATENCY_TARGET and lossless
    return [
        f"replace + a spare ({script}): from the slowdown to the healthy pace again ≤ {LATENCY_TARGET} steps + "
        f"the node-loss recovery{', 0 steps lost' if live else ''} (p50 of {len(trials)} trials; the pace: "
        f"{PACE_STEPS} steps in a row within {PACE_SLACK - 1:.0%} of the step before)",
        f"{fmt(p['steps_to_drain'], 0)} steps to the drain ({fmt(p['slowdown_to_drain'])} s), then "
        f"{fmt(p['drain_to_all_stepping'])} s to the new processes stepping (node-loss recovery) and "
        f"{fmt(p['drain_to_healthy'])} s to the healthy pace: {fmt(p['slowdown_to_healthy'])} s in all; steps "
        f"lost {', '.join(fmt(t['steps_lost'], 0) for t in trials)}; {len(trials) - len(back)} never back to pace"
        if trials
        else "not run",
        "met" if on_pace else "missed",
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=50, help="seeds of the synthetic straggler and healthy runs")
    p.add_argument("--healthy-steps", type=int, default=1000, help="steps of each synthetic healthy run")
    p.add_argument("--job-trials", type=int, default=3, help="real jobs with a straggler")
    p.add_argument("--job-steps", type=int, default=300, help="steps of the real healthy job")
    p.add_argument("--overhead-steps", type=int, default=100_000)
    p.add_argument(
        "--replace-trials", type=int, default=5, help="2 x 2 jobs with a spare and the replace policy, per script"
    )
    p.add_argument(
        "--replace-scripts",
        type=lambda text: text.split(","),
        default=list(REPLACE_SCRIPTS),
        help=f"the replace trials' training scripts in examples/ (default: {','.join(REPLACE_SCRIPTS)})",
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args()
    setup_logging(args.log_level)
    with tempfile.TemporaryDirectory(prefix="taskd-slowrank-") as tmp:
        root = Path(tmp)
        data = {
            "load_at_start": list(os.getloadavg()),
            "detector": bench_detector(args.trials, args.healthy_steps),
            "jobs": bench_jobs(args.job_trials, args.job_steps, root),
            "overhead": bench_overhead(args.overhead_steps, root),
            # Interleaved, so that a change of the machine's load falls on both scripts alike.
            "replace": [
                replace_trial(root / f"replace{n}-{script}", script)
                for n in range(args.replace_trials)
                for script in args.replace_scripts
            ],
            "load_at_end": list(os.getloadavg()),
        }
    write_json(args.json, data)
    print(report(data))
    for row in verdicts(data):
        print(" | ".join(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
