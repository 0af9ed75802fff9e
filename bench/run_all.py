"""Run every TaskD benchmark with one command and write ``docs/benchmarks.md`` from their results.

Runs, one after the other (never in parallel: they would disturb each other's
timings), each as a child process writing JSON:

1. ``detect_bench.py``: SIGKILL → ``ReportProcessFault`` at the controller, pidfd agent vs polling;
2. ``recovery_bench.py``: taskdrun vs torchrun recovering a SIGKILLed DDP rank, plus the phase micro-run;
3. ``idle_bench.py``: idle CPU of agents and controller, controller memory with 1000 jobs.

Then renders the machine, versions, the exact command, the tables, the
targets and whether they are met into the Markdown report. The default sizes
take about 20-25 minutes on 2 cores; ``--quick`` is a smoke run of a few minutes
(its figures are not worth publishing).

Run::

    .venv/bin/python bench/run_all.py                 # full run, writes docs/benchmarks.md
    .venv/bin/python bench/run_all.py --quick --out /tmp/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import detect_bench
import idle_bench
import recovery_bench
from _common import PYTHON, REPO, Children, exit_on_sigterm, fmt, machine, markdown_table, setup_logging

logger = logging.getLogger(__name__)

BENCH = Path(__file__).resolve().parent


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    script: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    #: deadline of the whole step, seconds.
    timeout: float


STEPS = (
    Step("detect", "detect_bench.py", ("--kills", "50"), ("--kills", "10", "--jitter", "0.3"), 900.0),
    Step(
        "recovery",
        "recovery_bench.py",
        ("--repeats", "5"),
        ("--repeats", "1", "--topologies", "1x2,2x2", "--phase-repeats", "1", "--recovery-deadline", "40"),
        2400.0,
    ),
    Step(
        "idle",
        "idle_bench.py",
        ("--seconds", "60", "--jobs", "1000"),
        ("--seconds", "10", "--jobs", "200"),
        600.0,
    ),
)


def run_step(step: Step, quick: bool, results: Path) -> tuple[dict[str, Any] | None, list[str], float]:
    """Run one bench; its JSON (None when it failed), its command line and its duration."""
    out = results / f"{step.name}.json"
    cmd = [PYTHON, str(BENCH / step.script), *(step.quick if quick else step.full), "--json", str(out)]
    logger.info("running %s", shlex.join(cmd))
    t0 = time.monotonic()
    with Children(grace=30.0) as children:
        proc = children.start(cmd, log=results / f"{step.name}.log", cwd=REPO)
        try:
            code = proc.wait(step.timeout)
        except subprocess.TimeoutExpired:
            logger.error("%s did not finish within %.0fs; stopping it", step.name, step.timeout)
            code = None
    elapsed = time.monotonic() - t0
    if code != 0 or not out.exists():
        logger.error("%s failed (exit %s); see %s", step.name, code, results / f"{step.name}.log")
        return None, cmd, elapsed
    logger.info("%s done in %.0fs", step.name, elapsed)
    return json.loads(out.read_text(encoding="utf-8")), cmd, elapsed


def _shown(cmd: list[str]) -> str:
    """``cmd`` as a shell line, with paths inside the repository made relative to it."""
    return shlex.join(os.path.relpath(c, REPO) if c.startswith(str(REPO)) else c for c in cmd)


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for dist in ("torch", "grpcio", "taskd-core", "taskd-pytorch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    out["taskd commit"] = commit.stdout.strip() or "unknown"
    return out


# --- the report -----------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{fmt(seconds * 1e3, 1)} ms"


def detect_section(data: dict[str, Any] | None) -> tuple[str, list[list[str]]]:
    if data is None:
        return "## 1. Detection\n\nThe detect bench failed in this run; see its log.", []
    r = data["results"]
    taskd, fast, slow = r["taskd"], r["poll-0.1s"], r["poll-1s"]
    met = data["target"]["met"]
    text = f"""## 1. Detection: SIGKILL → `ReportProcessFault` at the controller

`bench/detect_bench.py`: a real `EmbeddedController`, `ProcessAdapter` with {data["workers"]} `sleep` workers and
`NodeAgent`, all in the bench process. Before each of {data["kills"]} kills per agent the bench waits until the job
is idle with every worker running, then a random 0–{data["jitter"]:g} s more (kills land at random phases of a
polling loop); the kill time is `time.time()` right before `os.kill`, the arrival time the wall-clock time of the
controller's `fault` journal event (read through `QueryStatus`: no library code is wrapped). The polling baselines
are the same NodeAgent with its pidfd wait replaced by a plain sleep of 0.1 s (torchrun's monitor interval) or 1 s
(the reference agent's), after which it calls MONITOR and reports through the same client.

{detect_bench.report(r)}

The pidfd agent's median is {_ms(taskd["median"])} against {_ms(fast["median"])} for a 0.1 s poll
({fmt(fast["median"] / taskd["median"], 0)}×) and {_ms(slow["median"])} for a 1 s poll
({fmt(slow["median"] / taskd["median"], 0)}×). Its remaining time is the report itself: MONITOR, one gRPC call,
the controller's state machine and a SQLite commit, on a machine shared with other work (the bench, agent and
controller share one process and its GIL). A polling agent's latency is spread evenly over its interval, so its
median is about half the interval and its p99 close to the whole interval.
"""
    target = [
        f"detection p50 < {detect_bench.TARGET_P50 * 1e3:g} ms",
        _ms(taskd["median"]),
        "met" if met else f"missed by {_ms(taskd['median'] - detect_bench.TARGET_P50)}",
    ]
    return text, [target]


def _median(results: dict[str, Any], topo: str, launcher: str, key: str) -> float:
    return float(results.get(topo, {}).get(launcher, {}).get(key, {}).get("median", math.nan))


def recovery_section(data: dict[str, Any] | None) -> tuple[str, list[list[str]]]:
    if data is None:
        return "## 2. Recovery\n\nThe recovery bench failed in this run; see its log.", []
    cfg, results = data["config"], data["results"]
    launchers = list(data["launchers"])
    tables = recovery_bench.report(results, launchers)
    taskd = recovery_bench.TASKD
    recovered = [
        (topo, by[taskd]["recovered"], by[taskd]["trials"]) for topo, by in results.items() if taskd in by
    ]
    all_ok = all(ok == n for _, ok, n in recovered)
    shipped = [
        (topo, by["torchrun"]["recovered"], by["torchrun"]["trials"], by["torchrun"]["failures"])
        for topo, by in results.items()
        if "torchrun" in by
    ]
    shipped_text = "; ".join(
        f"{topo}: {ok}/{n} ({', '.join(f) or 'no failure'})" for topo, ok, n, f in shipped
    )
    flush = [
        _median(results, t, taskd, "restart_ordered") - _median(results, t, taskd, "fault_known")
        for t in results
    ]
    flush_text = ", ".join(fmt(f) for f in flush)
    text = f"""## 2. Recovery of a SIGKILLed rank: taskdrun against torchrun

`bench/recovery_bench.py`, one invocation for all launchers: `examples/train_ddp.py` (gloo, CPU), a checkpoint
every {cfg["ckpt_every"]} steps, {cfg["step_time"]:g} s extra per step; rank {cfg["kill_rank"]} (-1: the last)
is SIGKILLed by the bench the moment it logs step {cfg["kill_step"]} (`time.time()` right before `os.kill`);
torchrun `--max-restarts {cfg["max_restarts"]}`, taskdrun with its defaults (embedded controller, {cfg["max_restarts"]}
cycles, flush window 1 s). Trials of the launchers are interleaved. A trial counts as recovered when every rank
completes a step in a new process within {cfg["recovery_deadline"]:g} s of the kill. Figures are medians
(min–max) in seconds over the recovered trials, counted from the kill; ratios are taskdrun's median over the
other's. Sources: the workers' own JSON-lines progress log (`start` is written after `import torch`, `resumed`
after `init_process_group`, the checkpoint load and a barrier: the example has no event right after
`init_process_group`), `/proc/<pid>/stat` start times of new worker pids (read while they run, 10 ms
resolution), taskd's journal (`fault`, `strategy chosen`) and torchrun's own log line
`failed (exitcode: -9)` (glog time stamps).

{tables}

**Every trial recovered with taskdrun: {"yes" if all_ok else "NO"}**
({", ".join(f"{t}: {ok}/{n}" for t, ok, n in recovered)}). torchrun as shipped: {shipped_text}. This is SPEC §9's
stale rendezvous store: the restarted workers read the dead workers' addresses from the agents' shared store and
fail in `connectFullMesh` (using up a restart) or block in `init_process_group`;
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` avoids it.

**Where taskdrun's extra time goes.** Detection is immediate (kill → fault known is a few ms), then the
controller's flush window collects the faults of the other ranks (their collectives fail when the peer dies):
fault → restart ordered took {flush_text} s (median per topology, in the order of the tables), that is the 1 s
`flush_seconds` default plus the stop / strategy negotiation. torchrun has no such window: it restarts on the
first failure it sees (it polls every 0.1 s). The rest, from the replacement's fork to its first step, is the
same for both launchers: interpreter start, `import torch`, `init_process_group`, checkpoint load, as the phase
micro-run below shows. Shortening the flush window (not configurable in `taskdrun`; `taskd controller
--flush-seconds` is) would remove most of the difference.
"""
    if data.get("phases"):
        text += f"""
**Phases of a restarted worker** (micro-run: N processes started at once, each timing its own phases with the
example's own functions; one warm-up round first, as a job's first start warms the page cache):

{recovery_bench.phases_report(data["phases"])}
"""
    target = [
        "taskdrun recovers every trial",
        ", ".join(f"{t}: {ok}/{n}" for t, ok, n in recovered),
        "met" if all_ok else "missed",
    ]
    return text, [target]


def idle_section(data: dict[str, Any] | None) -> tuple[str, list[list[str]]]:
    if data is None:
        return "## 3. Idle cost\n\nThe idle bench failed in this run; see its log.", []
    r = data["results"]
    agents = [s for s in idle_bench.SUBJECTS if s.agent]
    worst = max(r["launchers"][s.name]["cpu_percent"] for s in agents)
    clients = r["clients"]
    text = f"""## 3. Idle cost of agents and controller

`bench/idle_bench.py`: every launcher runs {data["workers"]} sleeping workers; all run at once for one
{data["seconds"]:g} s window after a settling time, and each launcher's own CPU is the `utime + stime` delta of
its pid in `/proc/<pid>/stat` (threads included, workers not; one tick is 10 ms, so ±{100 * 0.01 / data["seconds"]:.2f}
% per process). The "by thread" column is the same reading per thread: `main` is the node agent's supervision
loop, threads named like the process are Python threads (the signal stream, the HealthCheck loop, and in the
embedded case the controller's event loop), `event_engine`/`grpc_global_tim` are gRPC's core threads.

{idle_bench.report(r["launchers"], clients, r["many_jobs"])}

The second table is the profile of an idle agent's gRPC client alone, one child process per mode measuring its own
`time.process_time()`: an open channel (gRPC's threads and the 3 s keep-alive pings the client configures) costs
{fmt(clients["channel"])} %, the signal stream with the controller's 5 s keep-alive signals
{fmt(clients["stream"] - clients["channel"])} % more, and the client's HealthCheck every second
{fmt(clients["stream+health"] - clients["stream"])} % more.
"""
    if worst >= idle_bench.AGENT_TARGET:
        text += f"""
**Target missed** by {fmt(worst - idle_bench.AGENT_TARGET)} percentage points at worst ({fmt(worst)} % against
{idle_bench.AGENT_TARGET:g} %). Nearly all of it is gRPC, not TaskD's own loop (the `main` thread above, which
wakes once a second to call MONITOR): the client's channel with its 3 s keep-alive pings, the signal stream, and
the `HealthCheck` RPC that `DLRecoverManager` sends every second (`health_interval=1.0`). The node agent does not
need a one-second HealthCheck to notice a lost controller (the stream breaks, and gRPC's keep-alive pings detect
a dead peer within seconds); a 5-10 s interval would roughly halve the client's cost. In the embedded case the
controller's own event loop adds to the same process.
"""
    jobs = r["many_jobs"]
    rows = [
        [
            f"idle agent < {idle_bench.AGENT_TARGET:g} % of one core",
            f"{fmt(worst)} % (worst agent)",
            "met"
            if worst < idle_bench.AGENT_TARGET
            else f"missed by {fmt(worst - idle_bench.AGENT_TARGET)} points",
        ]
    ]
    if jobs:
        rows.append(
            [
                f"controller RSS with {int(jobs['jobs'])} jobs (no target)",
                f"{fmt(jobs['rss_mib_after'], 1)} MiB ({fmt(jobs['rss_kib_per_job'], 1)} KiB per job)",
                "—",
            ]
        )
    return text, rows


def render(
    sections: dict[str, tuple[str, list[list[str]]]],
    info: dict[str, Any],
    vers: dict[str, str],
    commands: list[str],
    durations: dict[str, float],
    quick: bool,
    loads: list[tuple[float, ...]],
) -> str:
    total = sum(durations.values())
    targets = [row for _, rows in sections.values() for row in rows]
    targets.append(
        [
            "`run_all.py` well under 30 min on 2 cores",
            f"{total / 60:.1f} min",
            "met" if total < 1500 else "missed",
        ]
    )
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    steps = ", ".join(f"{name} {seconds / 60:.1f} min" for name, seconds in durations.items())
    load_text = "; ".join(
        f"{name} {' / '.join(f'{x:.2f}' for x in load)}"
        for name, load in zip(("at the start", "at the end"), loads, strict=False)
    )
    return f"""# TaskD benchmarks

Written by `bench/run_all.py` on {when}{
        " (**--quick smoke run: too few samples to publish**)" if quick else ""
    }.
Nothing here is a test: no figure is asserted anywhere.

**Noise.** The machine has {
        info["nproc"]
    } cores and was shared with other engineers' builds and tests while this
ran (load average 1/5/15 min {load_text}). Figures that involve starting torch processes (section 2) are the
most sensitive to that; rerun on a quiet machine before comparing small differences.

## Machine and versions

{
        markdown_table(
            ["", ""],
            [
                ["cores (nproc)", info["nproc"]],
                ["CPU", info["cpu"]],
                ["memory", f"{info['memory_gib']} GiB"],
                ["kernel", info["kernel"]],
                *[[k, v] for k, v in vers.items()],
            ],
        )
    }

Command: `{_shown([PYTHON, str(Path(sys.argv[0]).resolve()), *sys.argv[1:]])}` ({total / 60:.1f} min in all: {
        steps
    }). Its steps:

{chr(10).join(f"    {c}" for c in commands)}

## Targets

{markdown_table(["target", "measured", "verdict"], targets)}

{sections["detect"][0]}
{sections["recovery"][0]}
{sections["idle"][0]}"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run of a few minutes with tiny sample sizes")
    p.add_argument(
        "--out", type=Path, default=REPO / "docs" / "benchmarks.md", help="the report (default: %(default)s)"
    )
    p.add_argument("--results", type=Path, default=None, help="keep the JSON results and logs here")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args()
    setup_logging(args.log_level)
    exit_on_sigterm()
    info, vers = machine(), versions()
    data: dict[str, dict[str, Any] | None] = {}
    commands, durations = [], {}
    with tempfile.TemporaryDirectory(prefix="taskd-bench-") as tmp:
        results = args.results or Path(tmp)
        results.mkdir(parents=True, exist_ok=True)
        for step in STEPS:
            data[step.name], cmd, durations[step.name] = run_step(step, args.quick, results)
            commands.append(_shown(cmd[:-2]))
    sections = {
        "detect": detect_section(data["detect"]),
        "recovery": recovery_section(data["recovery"]),
        "idle": idle_section(data["idle"]),
    }
    loads = [tuple(info["loadavg_at_start"]), os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        render(sections, info, vers, commands, durations, args.quick, loads), encoding="utf-8"
    )
    logger.info("wrote %s", args.out)
    return 0 if all(d is not None for d in data.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
