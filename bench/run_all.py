"""Run every TaskD benchmark with one command and write ``docs/benchmarks.md`` from their results.

Runs, one after the other (never in parallel: they would disturb each other's
timings), each as a child process writing JSON:

1. ``detect_bench.py``: SIGKILL → ``ReportProcessFault`` at the controller, pidfd agent vs polling;
2. ``recovery_bench.py``: taskdrun (with and without its fork server) vs torchrun recovering a SIGKILLed
   DDP rank, on two jobs, plus the fork server's own cost and the phase micro-run;
3. ``idle_bench.py``: idle CPU of agents and controller, controller memory with 1000 jobs;
4. ``security_bench.py``: what TLS and job tokens add to fault → strategy latency and idle CPU;
5. ``metrics_bench.py``: the controller with Prometheus metrics on vs off, and scrapes of 1000 jobs;
6. ``hang_bench.py``: hang → fault reported and → every rank stepping again, per signal;
7. ``signal_bench.py``: SIGTERM → launcher gone, taskdrun vs torchrun, in the rendezvous and with workers.
8. ``chaos_bench.py``: one job under 120 random faults of its workers and of TaskD itself.
9. ``transfer_bench.py``: a live replica's state handed over loopback;
10. ``first_start_bench.py``: a job's first start, taskdrun and ``taskd run`` against torchrun;
11. ``mindspore_bench.py``: real msrun, kill → the rank stepping again against a cold start of the same job;
12. ``failover_bench.py``: controller replicas on a real etcd: fail-over, etcd against SQLite, 2048 agents, chaos.
13. ``slowrank_bench.py``: steps until a slow rank is named, false alarms, the cost of measuring work per step.
14. ``snapshot_bench.py``: memory snapshots of FSDP2 every step against none and ``dcp.async_save`` to disk.
15. ``nodeloss_bench.py``: a node (not the store's host) SIGKILLed or SIGSTOPped with a spare waiting, against torchrun
    (taskdrun with and without ``LiveSession``).
16. ``rank0_bench.py``: rank 0's node SIGKILLed with a spare waiting, on etcd, against torchrun.
17. ``nodes_chaos_bench.py``: one job on etcd through many node losses in a row (kill or hang), spares restarted.
18. ``shrink_bench.py``: a job of ``--nnodes=2:3`` loses one of its three nodes with no spare, against torchrun.

Then writes the Markdown report: the machine, versions, the exact command,
the targets and each bench's section. The prose is in ``bench/templates/``
(one template per section, filled by :mod:`_report`); one renderer per bench
here turns its results into the template's named fields and its target rows,
so every figure and every verdict in the report is computed from the results. The default sizes
take about 20-25 minutes on 2 cores; ``--quick`` is a smoke run of a few
minutes (its figures are not worth publishing). With ``--results DIR`` the
JSON results and logs are kept, and ``--render-only --results DIR`` rewrites
the report from them without running anything again.

Run::

    .venv/bin/python bench/run_all.py                 # full run, writes docs/benchmarks.md
    .venv/bin/python bench/run_all.py --quick --out /tmp/benchmarks.md
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import _nodes
import chaos_bench
import detect_bench
import failover_bench
import first_start_bench
import hang_bench
import idle_bench
import metrics_bench
import mindspore_bench
import nodeloss_bench
import nodes_chaos_bench
import rank0_bench
import recovery_bench
import security_bench
import shrink_bench
import signal_bench
import slowrank_bench
import snapshot_bench
import transfer_bench
from _common import (
    PYTHON,
    REPO,
    Children,
    exit_on_sigterm,
    fmt,
    machine,
    markdown_table,
    ratio,
    setup_logging,
    summarize,
)
from _report import Value, fill, heading

from taskd_core.agent.hangs.watcher import ProgressConfig

logger = logging.getLogger(__name__)

BENCH = Path(__file__).resolve().parent
#: What ``run_all.py`` itself must stay under on 2 cores, seconds ("well under 30 minutes").
BUDGET = 25 * 60.0
#: Issue 9: kill → every rank stepped with the fork server, as a share of torchrun-noshare's.
WARM_TARGET = 0.15
#: Issue 10: kill → every rank stepped with live recovery, as a fraction of torchrun-noshare's.
LIVE_TARGET = 0.10
#: Issue 10: GB/s of a live replica's state hand-over over loopback.
TRANSFER_TARGET = 1.0
#: Issue 9: the fork server's CPU while the job trains, % of one core.
SERVER_CPU_TARGET = 0.1


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
        # 4 launchers x 3 topologies x 2 jobs: 24 trials per repeat.
        ("--repeats", "3"),
        ("--repeats", "1", "--topologies", "1x2,2x2", "--phase-repeats", "1", "--server-idle", "5"),
        3600.0,
    ),
    Step(
        "idle",
        "idle_bench.py",
        ("--seconds", "60", "--jobs", "1000"),
        ("--seconds", "10", "--jobs", "200"),
        600.0,
    ),
    Step(
        "security",
        "security_bench.py",
        ("--cycles", "200", "--seconds", "20"),
        ("--cycles", "20", "--seconds", "5"),
        900.0,
    ),
    Step(
        "metrics",
        "metrics_bench.py",
        ("--jobs", "1000", "--cycles", "200", "--seconds", "30", "--scrapes", "50", "--rounds", "3"),
        ("--jobs", "200", "--cycles", "30", "--seconds", "3", "--scrapes", "10", "--rounds", "1"),
        900.0,
    ),
    Step(
        "hang",
        "hang_bench.py",
        ("--trials", "15", "--torch-trials", "5", "--healthy-steps", "1000"),
        ("--trials", "3", "--torch-trials", "1", "--healthy-steps", "200"),
        1800.0,
    ),
    Step("signals", "signal_bench.py", ("--repeats", "5"), ("--repeats", "1"), 600.0),
    Step("chaos", "chaos_bench.py", ("--faults", "120"), ("--faults", "20"), 1800.0),
    Step(
        "transfer",
        "transfer_bench.py",
        ("--gib", "1", "--trials", "3"),
        ("--gib", "0.25", "--trials", "1"),
        900.0,
    ),
    Step(
        "first_start",
        "first_start_bench.py",
        ("--repeats", "5"),
        ("--repeats", "1", "--cases", "launched,train_ddp"),
        1800.0,
    ),
    Step(
        "mindspore",
        "mindspore_bench.py",
        ("--trials", "5"),
        ("--trials", "1", "--modes", "fork", "--server-window", "5"),
        2400.0,
    ),
    Step(
        "failover",
        "failover_bench.py",
        (),
        (
            "--failovers",
            "3",
            "--cycles",
            "20",
            "--agents",
            "128",
            "--procs",
            "2",
            "--kills",
            "3",
            "--freezes",
            "2",
        ),
        2400.0,
    ),
    Step(
        "slowrank",
        "slowrank_bench.py",
        ("--trials", "50", "--job-trials", "3", "--job-steps", "300"),
        ("--trials", "5", "--job-trials", "1", "--job-steps", "60", "--overhead-steps", "20000", "--replace-trials", "1"),
        1500.0,
    ),
    Step(
        "nodeloss",
        "nodeloss_bench.py",
        ("--repeats", "3"),
        ("--repeats", "1"),
        1800.0,
    ),
    Step(
        "rank0",
        "rank0_bench.py",
        ("--repeats", "3"),
        ("--repeats", "1", "--spare-settle", "5"),
        1200.0,
    ),
    Step(
        "nodes_chaos",
        "nodes_chaos_bench.py",
        ("--losses", "50"),
        ("--losses", "3"),
        5400.0,
    ),
    Step(
        "shrink",
        "shrink_bench.py",
        ("--repeats", "3"),
        ("--repeats", "1"),
        1200.0,
    ),
    Step(
        "snapshots",
        "snapshot_bench.py",
        ("--repeats", "3", "--mib", "256"),
        (
            "--repeats",
            "1",
            "--mib",
            "32",
            "--steps",
            "16",
            "--big-steps",
            "6",
            "--kill-at",
            "10",
            "--ckpt-every",
            "4",
        ),
        2400.0,
    ),
)

Section = tuple[str, list[list[str]]]


def run_step(step: Step, quick: bool, results: Path) -> tuple[str, float]:
    """Run one bench, which writes ``<results>/<name>.json``; its command line and its duration."""
    cmd = [PYTHON, str(BENCH / step.script), *(step.quick if quick else step.full)]
    (results / f"{step.name}.json").unlink(missing_ok=True)  # a failed step must not leave an older result
    logger.info("running %s", shlex.join(cmd))
    t0 = time.monotonic()
    with Children(grace=30.0) as children:
        proc = children.start(
            [*cmd, "--json", str(results / f"{step.name}.json")], log=results / f"{step.name}.log", cwd=REPO
        )
        try:
            code = proc.wait(step.timeout)
        except subprocess.TimeoutExpired:
            logger.error("%s did not finish within %.0fs; stopping it", step.name, step.timeout)
            code = None
    elapsed = time.monotonic() - t0
    if code != 0:
        logger.error("%s failed (exit %s); see %s", step.name, code, results / f"{step.name}.log")
    else:
        logger.info("%s done in %.0fs", step.name, elapsed)
    return _shown(cmd), elapsed


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
#
# One renderer per bench turns its results into the fields of its template (bench/templates/<name>.md)
# and the rows it adds to the targets table. The templates hold only what each bench does; every figure
# and every word that depends on an outcome comes from here.

#: What one renderer gives: its template's fields and its rows of the targets table.
Rendered = tuple[dict[str, Value], list[list[str]]]


def _ms(seconds: float) -> str:
    return f"{fmt(seconds * 1e3, 1)} ms"


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def detect_fields(data: dict[str, Any]) -> Rendered:
    r = data["results"]
    taskd, fast, slow = r["taskd"], r["poll-0.1s"], r["poll-1s"]

    def share(variant: dict[str, Any], key: str) -> str:
        return f"{fmt(100 * variant[key] / variant['interval'], 0)} %"

    fields: dict[str, Value] = {
        "workers": str(data["workers"]),
        "kills": str(data["kills"]),
        "jitter": f"{data['jitter']:g}",
        "table": detect_bench.report(r),
        "taskd_p50": _ms(taskd["median"]),
        "taskd_p99": _ms(taskd["p99"]),
        "fast_p50": _ms(fast["median"]),
        "slow_p50": _ms(slow["median"]),
        "fast_ratio": fmt(fast["median"] / taskd["median"], 0),
        "slow_ratio": fmt(slow["median"] / taskd["median"], 0),
        "fast_p50_share": share(fast, "median"),
        "fast_p99_share": share(fast, "p99"),
        "slow_p50_share": share(slow, "median"),
        "slow_p99_share": share(slow, "p99"),
    }
    target = detect_bench.TARGET_P50
    met = taskd["median"] < target
    verdict = "met" if met else f"missed by {_ms(taskd['median'] - target)}"
    return fields, [[f"detection p50 < {target * 1e3:g} ms", _ms(taskd["median"]), verdict]]


def _median(by_launcher: dict[str, Any], launcher: str, key: str) -> float:
    return float(by_launcher.get(launcher, {}).get(key, {}).get("median", float("nan")))


def _split_table(results: dict[str, Any], launchers: list[str]) -> str:
    """kill → first fork, → every rank started, → every rank stepped: medians per topology and launcher."""
    rows = []
    for topo, by in results.items():
        for name in launchers:
            fork, started, stepped = (
                _median(by, name, k) for k in ("first_fork", "all_started", "all_stepped")
            )
            label = recovery_bench.LAUNCHERS[name].label
            rows.append([topo, label, fmt(fork), fmt(started - fork), fmt(stepped - started), fmt(stepped)])
    headers = [
        "topology",
        "launcher",
        "kill → first fork",
        "→ every rank started",
        "→ every rank stepped",
        "total",
    ]
    return markdown_table(headers, rows)


def recovery_fields(data: dict[str, Any]) -> Rendered:
    cfg, results = data["config"], data["results"]
    launchers = [n for n in recovery_bench.LAUNCHERS if n in data["launchers"]]
    taskd = recovery_bench.TASKD
    recovered = [
        (topo, by[taskd]["recovered"], by[taskd]["trials"]) for topo, by in results.items() if taskd in by
    ]
    all_ok = all(ok == n for _, ok, n in recovered)
    counts = ", ".join(f"{t}: {ok}/{n}" for t, ok, n in recovered)
    shipped = "; ".join(
        f"{topo}: {by['torchrun']['recovered']}/{by['torchrun']['trials']}"
        f" ({', '.join(by['torchrun']['failures']) or 'no failure'})"
        for topo, by in results.items()
        if "torchrun" in by
    )
    negotiation = ", ".join(
        f"{topo} {fmt(_median(by, taskd, 'restart_ordered') - _median(by, taskd, 'fault_known'))} s"
        for topo, by in results.items()
    )
    known = ", ".join(f"{topo} {_ms(_median(by, taskd, 'fault_known'))}" for topo, by in results.items())
    lag = summarize(
        t["kill_lag"]
        for by in data["trials"].values()
        for trials in by.values()
        for t in trials
        if "kill_lag" in t
    )
    jobs = sorted({key.split()[-1] for key in results})
    described = {
        "ddp": "`ddp` (its written-out update)",
        "sgd": "`sgd` (`--optimizer sgd`: `DistributedDataParallel` + `torch.optim.SGD`, whose first step imports"
        " `torch._dynamo`)",
    }
    named = " and ".join(described.get(j, f"`{j}`") for j in jobs)
    server = data.get("fork_server")
    phases = data.get("phases")
    fields: dict[str, Value] = {
        "jobs": f"{len(jobs)} jobs, {named}" if len(jobs) > 1 else f"the job {named}",
        "ckpt_every": str(cfg["ckpt_every"]),
        "step_time": f"{cfg['step_time']:g}",
        "victim": "the last rank" if cfg["kill_rank"] < 0 else f"rank {cfg['kill_rank']}",
        "kill_step": str(cfg["kill_step"]),
        "max_restarts": str(cfg["max_restarts"]),
        "flush": f"{cfg['taskd_flush_seconds']:g}",
        "deadline": f"{cfg['recovery_deadline']:g}",
        "kill_lag_median": _ms(lag.median),
        "kill_lag_max": _ms(lag.high),
        "table": recovery_bench.report(results, launchers),
        "all_recovered": _yes(all_ok),
        "counts": counts,
        "shipped": shipped or "not run",
        "torchrun_failed": any(by["torchrun"]["failures"] for by in results.values() if "torchrun" in by),
        "fault_known": known,
        "negotiation": negotiation,
        "split": _split_table(
            results, [n for n in (taskd, "taskdrun-nofork", "torchrun-noshare") if n in launchers]
        ),
        "fork_server": bool(server),
        "fork_server_report": recovery_bench.fork_server_report(server) if server else None,
        "phases": bool(phases),
        "phases_table": recovery_bench.phases_report(phases) if phases else None,
    }
    rows = [["taskdrun recovers every trial (SPEC §9)", counts, _met(all_ok)], _ratio_row(results)]
    rows += _warm_rows(results, server)
    rows += _live_rows(results)
    return fields, rows


def _live_rows(results: dict[str, Any]) -> list[list[str]]:
    """Issue 10's targets: live recovery ≤ 0.10 × torchrun-noshare and below the warm restart; no step lost."""
    live = "taskdrun-live"
    ratios, misses, lost, trials, shown_overhead = [], [], [], [], []
    overhead: list[float] = []
    all_live = True
    for key, by in results.items():
        if live not in by:
            continue
        # Live: only the victim is started again; any more processes mean a fallback restart.
        live_ok = by[live]["recovered"] if _median(by, live, "restarts_seen") == 1 else 0
        trials.append(f"{key} {live_ok}/{by[live]['trials']}")
        all_live = all_live and live_ok == by[live]["trials"]
        ours, peer = _median(by, live, "all_stepped"), _median(by, "torchrun-noshare", "all_stepped")
        warm = _median(by, recovery_bench.TASKD, "all_stepped")
        ratios.append(f"{key} {fmt(ours / peer)}")
        if not (ours <= LIVE_TARGET * peer and ours < warm):
            misses.append(f"{key} ({fmt(ours)} s; target {fmt(LIVE_TARGET * peer)} s, warm {fmt(warm)} s)")
        lost.append(f"{key} {fmt(_median(by, live, 'steps_lost'), 0)}")
        step, base = _median(by, live, "step_time"), _median(by, recovery_bench.TASKD, "step_time")
        overhead.append(100 * (step / base - 1))
        shown_overhead.append(f"{key} {fmt(overhead[-1], 1)} %")
    if not ratios:
        return []
    return [
        [
            f"kill → every rank stepped, live/torchrun-noshare ≤ {LIVE_TARGET:g} and below the warm restart",
            ", ".join(ratios),
            "met" if not misses else "missed: " + ", ".join(misses),
        ],
        [
            "trials recovered live (only the victim started again): 100 %",
            ", ".join(trials),
            "met" if all_live else "missed",
        ],
        [
            "steps lost by live recovery (median): 0",
            ", ".join(lost),
            "met" if all(item.endswith(" 0") for item in lost) else "missed",
        ],
        [
            "fault-free step time, live API vs the plain script under the same launcher ≤ 3 % (steps include"
            " the bench's --step-time pause)",
            ", ".join(shown_overhead),
            "met" if all(o <= 3 for o in overhead) else "missed",
        ],
    ]


def _warm_rows(results: dict[str, Any], server: dict[str, Any] | None) -> list[list[str]]:
    """Issue 9's targets: kill → every rank stepped ≤ 0.15 × torchrun-noshare; step time; fork server cost."""
    ratios, misses, steps = [], [], []
    for key, by in results.items():
        ours, peer = (
            _median(by, recovery_bench.TASKD, "all_stepped"),
            _median(by, "torchrun-noshare", "all_stepped"),
        )
        ratios.append(f"{key} {fmt(ours / peer)}")
        if not ours <= WARM_TARGET * peer:
            misses.append(f"{key} by {fmt(ours - WARM_TARGET * peer)} s")
        fork, execd = (
            _median(by, recovery_bench.TASKD, "step_time"),
            _median(by, "taskdrun-nofork", "step_time"),
        )
        steps.append(f"{key} {fmt(fork * 1e3, 1)}/{fmt(execd * 1e3, 1)}")
    rows = [
        [
            f"kill → every rank stepped, taskdrun (fork server)/torchrun-noshare ≤ {WARM_TARGET:g}",
            ", ".join(ratios),
            "met" if not misses else "missed: " + ", ".join(misses),
        ],
        ["fault-free step time, ms, fork server/exec (within noise; no hard target)", ", ".join(steps), "—"],
    ]
    if server:
        cpu = server["cpu_percent"]
        rows.append(
            [
                f"fork server idle CPU < {SERVER_CPU_TARGET:g} % of a core",
                f"{cpu:.3f} %",
                "met" if cpu < SERVER_CPU_TARGET else "missed",
            ]
        )
        memory = f"RSS {server['vmrss'] / 1024:.0f} MiB, PSS {server['pss'] / 1024:.0f} MiB"
        rows.append(["fork server memory (no target)", memory, "—"])
    return rows


def _ratio_row(results: dict[str, Any]) -> list[str]:
    """Issue 6's speed target: kill → every rank stepped, taskdrun no slower than torchrun, per topology.

    The peer is torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: as shipped it mostly does not recover.
    """
    ratios, misses = [], []
    for topo, by in results.items():
        ours = _median(by, recovery_bench.TASKD, "all_stepped")
        peer = _median(by, "torchrun-noshare", "all_stepped")
        ratios.append(f"{topo} {fmt(ours / peer)}")
        if ours > peer:
            misses.append(f"{topo} by {fmt(ours - peer)} s")
    verdict = "met" if not misses else "missed: " + ", ".join(misses)
    return ["kill → every rank stepped, taskdrun/torchrun-noshare ≤ 1.0", ", ".join(ratios), verdict]


def idle_fields(data: dict[str, Any]) -> Rendered:
    r = data["results"]
    agents = [s for s in idle_bench.SUBJECTS if s.agent]
    worst = max(r["launchers"][s.name]["cpu_percent"] for s in agents)
    clients = r["clients"]
    target = idle_bench.AGENT_TARGET
    call = r["health_call"]
    idle_call, hot_call = call["after_idle"], call["back_to_back"]
    share = functools.partial(idle_bench.client_share, clients)
    mode_window = data["seconds"] / 4
    fields: dict[str, Value] = {
        "workers": str(data["workers"]),
        "seconds": f"{data['seconds']:g}",
        "tick_share": f"{100 * 0.01 / data['seconds']:.2f}",
        "table": idle_bench.report(r["launchers"], clients, call, r["many_jobs"]),
        "channel": fmt(clients["channel"]),
        "stream": fmt(share("stream")),
        "agent_health": f"{idle_bench.AGENT_HEALTH:g}",
        "health_agent": fmt(share("stream+health-agent")),
        "health_1s": fmt(share("stream+health-1s")),
        "idle_call_wall": fmt(idle_call["wall_ms"], 1),
        "idle_call_cpu": fmt(idle_call["cpu_ms"], 1),
        "hot_call_wall": fmt(hot_call["wall_ms"], 1),
        "hot_call_cpu": fmt(hot_call["cpu_ms"], 1),
        "mode_window": f"{mode_window:g}",
        "mode_tick_share": f"{100 * 0.01 / mode_window:.2f}",
        "missed": worst >= target,
        "gap": fmt(worst - target),
        "worst": fmt(worst),
        "target": f"{target:g}",
    }
    verdict = "met" if worst < target else f"missed by {fmt(worst - target)} points"
    rows = [[f"idle agent < {target:g} % of one core", f"{fmt(worst)} % (worst agent)", verdict]]
    jobs = r["many_jobs"]
    if jobs:
        memory = f"{fmt(jobs['rss_mib_after'], 1)} MiB ({fmt(jobs['rss_kib_per_job'], 1)} KiB per job)"
        rows.append([f"controller RSS with {int(jobs['jobs'])} jobs (no target)", memory, "—"])
    return fields, rows


def security_fields(data: dict[str, Any]) -> Rendered:
    fields: dict[str, Value] = {
        "cycles": str(data["cycles"]),
        "seconds": f"{data['seconds']:g}",
        "agent_health": f"{security_bench.AGENT_HEALTH:g}",
        "calls": str(security_bench.CALLS),
        "rounds": str(data["rounds"]),
        "table": security_bench.report(data["results"]),
    }
    return fields, security_bench.verdicts(data["results"])


def metrics_fields(data: dict[str, Any]) -> Rendered:
    s, added, hooks = data["summary"], data["added_percent"], data["hooks"]
    off, on = s["off"], s["on"]
    step = data.get("worker_step")

    def ab(key: str, low: str, high: str, unit: str) -> str:
        return (
            f"off {fmt(off[key])} ({fmt(off[low])}–{fmt(off[high])}), on {fmt(on[key])}"
            f" ({fmt(on[low])}–{fmt(on[high])}) {unit}"
        )

    def within_noise(key: str, low: str, high: str) -> bool:
        return bool(off[low] <= on[key] <= off[high] or on[low] <= off[key] <= on[high])

    latency_noise = within_noise("latency_p50_ms", "latency_p50_low_ms", "latency_p50_high_ms")
    fields: dict[str, Value] = {
        "rounds": str(data["rounds"]),
        "cycles": str(data["cycles"]),
        "jobs": str(data["jobs"]),
        "seconds": f"{data['seconds']:g}",
        "scrapes": str(data["scrapes"]),
        "scrape_kib": fmt(on["scrape_kib"], 1),
        "table": metrics_bench.report(data),
        "entries_per_cycle": str(hooks["entries_per_cycle"]),
        "rpcs_per_cycle": str(hooks["rpcs_per_cycle"]),
        "us_per_cycle": fmt(hooks["us_per_cycle"], 1),
        "hooks_share": fmt(added["hooks_of_latency_p50"], 1),
        "worker_step": step is not None,
        "held_us": fmt(step["held_us"], 2) if step else None,
        "sent_us": fmt(step["sent_us"], 1) if step else None,
        "latency_within_noise": latency_noise,
    }
    scrape = on["scrape_p50_ms"]
    target_ms, target_pct = metrics_bench.SCRAPE_TARGET_MS, metrics_bench.ADDED_TARGET_PERCENT
    idle_noise = within_noise("idle_cpu_percent", "idle_cpu_low", "idle_cpu_high")
    idle_verdict = "met" if added["idle_cpu"] < target_pct else "within noise" if idle_noise else "missed"
    end_to_end = (
        ""
        if added["latency_p50"] < target_pct
        else ("; end to end within noise" if latency_noise else "; end to end missed")
    )
    hooks_verdict = ("met (hooks)" if added["hooks_of_latency_p50"] < target_pct else "missed") + end_to_end
    rows = [
        [
            f"scrape of {data['jobs']} jobs < {target_ms:g} ms",
            f"{fmt(scrape, 1)} ms p50, {fmt(on['scrape_p99_ms'], 1)} ms p99",
            _met(scrape < target_ms),
        ],
        [
            f"metrics add < {target_pct:g} % to the controller's idle CPU",
            ab("idle_cpu_percent", "idle_cpu_low", "idle_cpu_high", "% of one core"),
            idle_verdict,
        ],
        [
            f"metrics add < {target_pct:g} % to fault → strategy latency",
            f"hooks {fmt(hooks['us_per_cycle'], 1)} µs = {fmt(added['hooks_of_latency_p50'], 1)} % of p50; end to end "
            + ab("latency_p50_ms", "latency_p50_low_ms", "latency_p50_high_ms", "ms"),
            hooks_verdict,
        ],
    ]
    return fields, rows


def chaos_fields(data: dict[str, Any]) -> Rendered:
    fields: dict[str, Value] = {
        "injected": str(data["injected"]),
        "seed": str(data["seed"]),
        "quiet_faults": str(data["quiet_faults"]),
        "minutes": fmt(data["chaos_seconds"] / 60, 1),
        "table": chaos_bench.report(data),
    }
    res = data["resources"]
    growth = ", ".join(
        f"{name} {res['after'][name]['fds'] - res['before'][name]['fds']:+.0f} fds,"
        f" {res['after'][name]['rss_mib'] - res['before'][name]['rss_mib']:+.1f} MiB"
        for name in ("controller", "agent")
        if name in res["before"]
    )
    finished = data["params_equal"] and data["jobs_finished"] == 1
    rows = [
        [
            "chaos: 100 % of faults recovered",
            f"{data['recovered']}/{data['injected']}",
            _met(data["recovered"] == data["injected"]),
        ],
        [
            "chaos: final parameters identical to fault-free, job finished",
            f"{'identical' if data['params_equal'] else 'DIFFERENT'}, {data['jobs_finished']}/1 finished",
            _met(finished),
        ],
        [
            "chaos: 0 leftover processes",
            str(data["leftover_processes"]),
            _met(data["leftover_processes"] == 0),
        ],
        ["chaos: no growth of descriptors or memory beyond noise", growth, "see section 8"],
    ]
    return fields, rows


def hang_fields(data: dict[str, Any]) -> Rendered:
    defaults = ProgressConfig()
    fields: dict[str, Value] = {
        "stopped_bound": f"{defaults.stopped_bound:g}",
        "multiplier": f"{defaults.multiplier:g}",
        "floor": f"{defaults.floor:g}",
        "ceiling": f"{defaults.ceiling:g}",
        "poll": f"{defaults.poll:g}",
        "table": hang_bench.report(data),
    }
    return fields, hang_bench.verdicts(data)


def signal_fields(data: dict[str, Any]) -> Rendered:
    fields: dict[str, Value] = {
        "repeats": str(data["repeats"]),
        "table": signal_bench.report(data["results"]),
    }
    return fields, signal_bench.verdicts(data["results"])


def transfer_fields(data: dict[str, Any]) -> Rendered:
    size = data["bytes"] / 2**30
    wire, total = data["wire_gb_s_median"], data["end_to_end_gb_s_median"]
    first = data["end_to_end_gb_s_first"]
    table = markdown_table(
        ["rate", "GB/s"],
        [
            ["wire (sent → received, checksum verified)", fmt(wire)],
            ["end to end (state → loaded on the receiver)", fmt(total)],
            ["end to end, first trial", fmt(first)],
        ],
    )
    rows = [
        [
            f"state transfer ≥ {TRANSFER_TARGET:g} GB/s over loopback ({size:.2f} GiB state)",
            f"wire {fmt(wire)}, end to end {fmt(total)} (first trial {fmt(first)}) GB/s",
            _met(min(wire, total) >= TRANSFER_TARGET),
        ]
    ]
    return {"gib": f"{size:.2f}", "tensors": str(transfer_bench.TENSORS), "table": table}, rows


def _loads(load: list[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in load)


def first_start_fields(data: dict[str, Any]) -> Rendered:
    bench = first_start_bench
    cells, ratios, overall = data["cells"], data["ratios"], data["median_ratio"]
    cases = [c for c in bench.CASES if any(key.startswith(f"{c.name}/") for key in cells)]
    launchers = [n for n in bench.LAUNCHERS if any(key.endswith(f"/{n}") for key in cells)]
    failed = {key: cell for key, cell in cells.items() if cell["failures"]}
    failures = "; ".join(
        f"{key} {cell['trials'] - cell['done']['n']} of {cell['trials']} ({', '.join(bench.failure_reasons(cell))})"
        for key, cell in failed.items()
    )
    # Cases where torchrun's median rests on every trial: the ratio over them alone.
    clean = [c.name for c in cases if f"{c.name}/torchrun" in cells and f"{c.name}/torchrun" not in failed]
    ours = ratios.get("taskdrun", {})
    clean_ratios = [ours[c]["done"] for c in clean if c in ours]
    torchrun_failed = any(key.endswith("/torchrun") for key in failed)
    fields: dict[str, Value] = {
        "repeats": str(max(cell["trials"] for cell in cells.values())),
        "load_before": _loads(data["load_before"]),
        "load_after": _loads(data["load_after"]),
        "table": bench.table(data, cases, launchers),
        "overall": "; ".join(
            f"{name} {fmt(overall[name]['done'])} / {fmt(overall[name]['exit'])}"
            for name in launchers
            if name in overall
        ),
        "failed": bool(failed),
        "failures": failures or None,
        "torchrun_failed": torchrun_failed,
        "clean_cases": ", ".join(clean) if torchrun_failed else None,
        "clean_ratio": fmt(statistics.median(clean_ratios)) if torchrun_failed and clean_ratios else None,
    }
    rows = []
    for name, label in (("taskdrun", "taskdrun"), ("taskd-run", "`taskd run`")):
        if name not in overall:
            continue
        median = overall[name]["done"]
        per_case = ", ".join(
            f"{c.name} {fmt(ratios[name][c.name]['done'])}" for c in cases if c.name in ratios[name]
        )
        base = (
            "; torchrun's from "
            + ", ".join(
                f"{key.split('/')[0]} {cell['done']['n']}/{cell['trials']} trials"
                for key, cell in failed.items()
                if key.endswith("/torchrun")
            )
            if torchrun_failed
            else ""
        )
        rows.append(
            [
                f"first start, {label}/torchrun (launch → workers done), median over the cases ≤ {bench.TARGET:g}",
                f"{fmt(median)} ({per_case}{base})",
                _met(median <= bench.TARGET),
            ]
        )
    return fields, rows


def mindspore_fields(data: dict[str, Any]) -> Rendered:
    bench, settings = mindspore_bench, data["settings"]
    target = bench.TARGET
    jobs, modes = list(bench.JOBS), list(bench.MODES)

    def order(key: str) -> tuple[int, int]:
        job, mode = key.split(" / ")
        return jobs.index(job), modes.index(mode)

    # The JSON's keys come back sorted by name: the bench's own order of jobs, modes and kills reads better.
    runs = {}
    for key in sorted(data["runs"], key=order):
        res = data["runs"][key]
        if "kills" in res:
            kinds = list(bench.JOBS[key.split(" / ")[0]].kills)
            res = {
                **res,
                "kills": {kind: res["kills"][kind] for kind in sorted(res["kills"], key=kinds.index)},
            }
        runs[key] = res

    def stepped_ratio(res: dict[str, Any], kind: str) -> float:
        done = [t["stepped"] for t in res["kills"].get(kind, []) if t["recovered"]]
        return ratio(summarize(done).median, res["cold_start"])

    fork = {key.split(" / ")[0]: res for key, res in runs.items() if key.endswith(" / fork")}
    server = next((res["fork_server"] for res in fork.values() if "fork_server" in res), None)
    measured = server is not None and "cpu_percent" in server
    fields: dict[str, Value] = {
        "mindspore": data["mindspore"],
        "step_sleep": f"{settings['step_sleep']:g}",
        "trials": str(settings["trials"]),
        "settle": f"{settings['settle']:g}",
        "deadline": f"{settings['recovery_deadline']:g}",
        "load_start": _loads(data["machine"]["loadavg_at_start"]),
        "load_end": _loads(data["loadavg_at_end"]),
        "table": bench.table({**data, "runs": runs}),
        "median_ratio": fmt(data["median_ratio_fork"]),
        "server": measured,
        "server_cpu": f"{server['cpu_percent']:.3f}" if measured else None,
        "server_window": f"{server['window']:.0f}" if measured else None,
        "server_tick": f"{100 * 0.01 / server['window']:.3f}" if measured else None,
        "server_rss": f"{server['vmrss'] / 1024:.0f}" if measured else None,
        "server_pss": f"{server['pss'] / 1024:.0f}" if measured else None,
    }
    rows = []
    for kind, what in (
        ("kill1", "kill of rank 1 → it stepped again"),
        ("kill-all", "whole-node restart (both ranks killed)"),
    ):
        got = {job: stepped_ratio(res, kind) for job, res in fork.items() if kind in res.get("kills", {})}
        if got:
            rows.append(
                [
                    f"MindSpore (fork server), {what} ≤ {target:g} × the job's cold start (medians)",
                    ", ".join(f"{job} {fmt(r)}" for job, r in got.items()),
                    _met(all(r <= target for r in got.values())),
                ]
            )
    counts, all_ok = [], True
    for key, res in runs.items():
        if "error" in res:
            counts.append(f"{key}: {res['error']}")
            all_ok = False
            continue
        trials = [t for kind in res["kills"].values() for t in kind]
        ok = sum(t["recovered"] for t in trials)
        all_ok = all_ok and ok == len(trials)
        counts.append(f"{key} {ok}/{len(trials)}")
    rows.append(["MindSpore: 100 % of kills recovered (every job and mode)", ", ".join(counts), _met(all_ok)])
    if measured:
        cpu = server["cpu_percent"]
        rows.append(
            [
                f"MindSpore fork server idle CPU < {bench.SERVER_CPU_TARGET:g} % of a core",
                f"{cpu:.3f} % over {server['window']:.0f} s",
                _met(cpu < bench.SERVER_CPU_TARGET),
            ]
        )
        rows.append(
            [
                "MindSpore fork server memory (no target)",
                f"RSS {server['vmrss'] / 1024:.0f} MiB, PSS {server['pss'] / 1024:.0f} MiB",
                "—",
            ]
        )
    return fields, rows


def failover_fields(data: dict[str, Any]) -> Rendered:
    bench = failover_bench
    names = ("failover", "latency", "scale", "chaos")
    errors = {part: data[part]["error"] for part in names if "error" in data.get(part, {})}
    fo, lat, sc, ch = (data.get(part) if part not in errors else None for part in names)
    fields: dict[str, Value] = {
        "etcd": data["etcd"].removeprefix("etcd Version: "),
        "load_start": _loads(data["machine"]["loadavg_at_start"]),
        "load_end": _loads(data["loadavg_at_end"]),
        "table": bench.table(data),
        "failover": fo is not None,
        "ttl": str(fo["lease_ttl_s"]) if fo else None,
        "failovers": str(fo["trials"]) if fo else None,
        "latency": lat is not None,
        "cycles": str(lat["sqlite"]["n"]) if lat else None,
        "scale": sc is not None,
        "agents": str(sc["agents"]) if sc else None,
        "procs": str(sc["procs"]) if sc else None,
        "join_s": fmt(sc["join_all_s"]) if sc else None,
        "followed": bool(sc and sc["followed"]),
        "follow_p50": fmt(sc["follow_s"]["median"]) if sc and sc["followed"] else None,
        "moved": bool(sc and sc.get("leader_moved_during_cycle") is True),
        "chaos": ch is not None,
        "kills": str(ch["kills"]) if ch else None,
        "freezes": str(ch["freezes"]) if ch else None,
        "chaos_cycles": str(ch["cycles"]) if ch else None,
        "agent_exit": str(ch["agent_exit"]) if ch else None,
        "leftover": str(ch["leftover_processes"]) if ch else None,
        "errors": bool(errors),
        "error_list": "; ".join(f"{part}: {error}" for part, error in errors.items()) or None,
    }
    rows = [[f"failover_bench's {part} part finishes", error, "missed"] for part, error in errors.items()]
    if fo:
        serve, taken = fo["kill_to_serving_s"], fo["serving_to_report_taken_s"]
        rows.append(
            [
                f"leader SIGKILLed → a standby SERVING ≤ {bench.SERVE_TARGET:g} s (p50 over {fo['trials']} fail-overs)",
                f"p50 {fmt(serve['median'])} s, max {fmt(serve['max'])} s (lease {fo['lease_ttl_s']} s)",
                _met(serve["median"] <= bench.SERVE_TARGET),
            ]
        )
        all_taken = taken["n"] == fo["trials"]
        rows.append(
            [
                f"SERVING → the agent's report taken ≤ {bench.REPORT_TARGET:g} s (p50)",
                f"p50 {fmt(taken['median'])} s, max {fmt(taken['max'])} s ({taken['n']}/{fo['trials']} reports taken)",
                _met(all_taken and taken["median"] <= bench.REPORT_TARGET),
            ]
        )
    if lat:
        rows.append(
            [
                f"fault → changeStrategy on etcd ≤ {bench.LATENCY_RATIO_TARGET:g} × SQLite (p50, same run)",
                f"{fmt(lat['ratio_p50'])} × (etcd {fmt(lat['etcd']['p50_ms'])} ms, SQLite {fmt(lat['sqlite']['p50_ms'])} ms)",
                _met(lat["ratio_p50"] <= bench.LATENCY_RATIO_TARGET),
            ]
        )
    if sc:
        stop, agents = sc["fault_to_stop_train_s"], sc["agents"]
        rows.append(
            [
                f"{agents} agents: one node's fault → stopTrain at every agent, p99 ≤ {bench.FANOUT_P99_TARGET:g} s",
                f"p99 {fmt(stop['p99'], 3)} s, p50 {fmt(stop['median'], 3)} s ({sc['stop_train_received']}/{agents} received)",
                _met(sc["stop_train_received"] == agents and stop["p99"] <= bench.FANOUT_P99_TARGET),
            ]
        )
        rows.append(
            [
                f"leader RSS and etcd database with {agents} agents (no target)",
                f"{fmt(sc['leader_rss_mib'], 1)} MiB, {fmt(sc['etcd_db_mib'])} MiB",
                "—",
            ]
        )
        follow = sc["kill_to_every_agent_following_s"]
        rows.append(
            [
                f"fail-over with {agents} agents attached: every agent following the new leader ≤ {bench.FOLLOW_TARGET:g} s",
                f"{fmt(follow)} s ({sc['followed']}/{agents} followed)"
                if sc["followed"]
                else f"no agent subscribed again after the kill (0/{agents})",
                _met(follow is not None and sc["followed"] == agents and follow <= bench.FOLLOW_TARGET)
                if sc["followed"]
                else "not measured",
            ]
        )
    if ch:
        total = ch["kills"] + ch["freezes"]
        ok = (
            ch["jobs_lost"] == 0
            and ch["cycles_started_twice"] == 0
            and ch["params_equal"]
            and ch["recovered"] == total
        )
        rows.append(
            [
                f"chaos, {ch['kills']} leader kills + {ch['freezes']} freezes: every recovery done, 0 jobs lost,"
                " 0 cycles twice, parameters identical to fault-free",
                f"{ch['recovered']}/{total} recovered, {ch['jobs_lost']} lost, {ch['cycles_started_twice']} twice,"
                f" {ch['extra_restarts']} extra restarts, parameters {'identical' if ch['params_equal'] else 'DIFFERENT'}",
                _met(ok),
            ]
        )
    return fields, rows


def slowrank_fields(data: dict[str, Any]) -> Rendered:
    detector, jobs = data["detector"], data["jobs"]
    ratios = [t["ratio"] for t in jobs["trials"] if t["ratio"] is not None]
    fields: dict[str, Value] = {
        "bound": f"{detector['bound']:g}",
        "window": str(detector["window"]),
        "hold": str(detector["hold"]),
        "trials": str(detector["trials"]),
        "healthy_steps": str(detector["healthy_steps"]),
        "step_ms": f"{slowrank_bench.STEP_TIME * 1000:.0f}",
        "slow_sleep": f"{slowrank_bench.SLOW_SLEEP:g}",
        "healthy_ms": f"{slowrank_bench.HEALTHY_STEP * 1000:.0f}",
        "slow_from": str(slowrank_bench.SLOW_FROM),
        "replace_from": str(slowrank_bench.REPLACE_FROM),
        "pace_steps": str(slowrank_bench.PACE_STEPS),
        "pace_slack": f"{slowrank_bench.PACE_SLACK - 1:.0%}",
        "real_ratio": ", ".join(f"{r:.2f}" for r in ratios) or "none",
        "load_start": _loads(data["load_at_start"]),
        "load_end": _loads(data["load_at_end"]),
        "table": slowrank_bench.report(data),
    }
    return fields, slowrank_bench.verdicts(data)


def _node_trial_fields(data: dict[str, Any], repeats: int) -> dict[str, Value]:
    """What every node-loss bench's report says of its trials (bench/_nodes.py): the job, its pace, the run."""
    trial = data["trial"]
    return {
        "nproc": str(_nodes.NPROC),
        "kill_step": str(trial["kill_step"]),
        "step_ms": f"{trial['step_time'] * 1000:.0f}",
        "ckpt_every": str(trial["ckpt_every"]),
        "deadline": f"{trial['recovery_deadline']:g}",
        "repeats": str(repeats),
        "load_start": _loads(data["load_before"]),
        "load_end": _loads(data["load_after"]),
    }


def nodeloss_fields(data: dict[str, Any]) -> Rendered:
    trial, results = data["trial"], data["results"]
    repeats = max(len(ts) for by in data["trials"].values() for ts in by.values())
    fields: dict[str, Value] = {
        **_node_trial_fields(data, repeats),
        "table": nodeloss_bench.report(results, trial["recovery_deadline"]),
    }
    rows = []
    kill = results.get("kill", {})
    taskd, peer = kill.get("taskdrun", {}).get("median"), kill.get("torchrun", {}).get("median")
    if taskd is not None and peer is not None:
        rows.append(
            [
                "node lost, a spare waiting: kill → every rank stepping ≤ 0.1 × torchrun and ≤ 3 s",
                f"{fmt(taskd)} s, {fmt(ratio(taskd, peer), 3)} × torchrun",
                _met(taskd <= 3.0 and ratio(taskd, peer) <= 0.1),
            ]
        )
    hung = results.get("hang", {}).get("taskdrun", {})
    if hung:
        ok = hung["median"] is not None and hung["recovered"] == hung["trials"] and hung["median"] <= 8.0
        rows.append(
            [
                "hung node (SIGSTOP of its tree), a spare waiting: every rank stepping ≤ 8 s after the stop",
                f"{fmt(hung['median'])} s median, {hung['recovered']}/{hung['trials']} recovered",
                _met(ok),
            ]
        )
    live = [results[f][_nodes.LIVE] for f in ("kill", "hang") if _nodes.LIVE in results.get(f, {})]
    if live:
        lost = [s for r in live for s in r["steps_lost"]]
        rows.append(
            [
                "with LiveSession, a node lost or hung, a spare waiting: 0 committed steps lost",
                f"steps lost {','.join(str(s) for s in lost)}",
                _met(all(s == 0 for s in lost) and all(r["recovered"] == r["trials"] for r in live)),
            ]
        )
    return fields, rows


def shrink_fields(data: dict[str, Any]) -> Rendered:
    trial, results = data["trial"], data["results"]
    fields: dict[str, Value] = {
        **_node_trial_fields(data, max(len(ts) for ts in data["trials"].values())),
        "table": shrink_bench.report(results, trial["recovery_deadline"]),
    }
    rows = []
    taskd, peer = results.get("taskdrun", {}).get("median"), results.get("torchrun", {}).get("median")
    if taskd is not None and peer is not None:
        rows.append(
            [
                "shrink 3 → 2 nodes (`--nnodes=2:3`): kill → every remaining rank stepping ≤ 0.1 × torchrun",
                f"{fmt(taskd)} s, {fmt(ratio(taskd, peer), 3)} × torchrun",
                _met(ratio(taskd, peer) <= 0.1),
            ]
        )
    return fields, rows


def rank0_fields(data: dict[str, Any]) -> Rendered:
    trial, results = data["trial"], data["results"]
    taskd_trials = data["trials"].get("taskdrun", [])
    led = [t["all_stepped"] for t in taskd_trials if t["recovered"] and t["victim_led"]]
    other = [t["all_stepped"] for t in taskd_trials if t["recovered"] and not t["victim_led"]]
    victims = {
        "leader": "the node whose controller replica leads (torchrun: rank 0's node)",
        "follower": "the node whose controller replica does not lead (torchrun: rank 0's node)",
    }
    fields: dict[str, Value] = {
        **_node_trial_fields(data, max((len(ts) for ts in data["trials"].values()), default=0)),
        "spare_settle": f"{trial['spare_settle']:g}",
        "victim": victims.get(trial["victim"], "rank 0's node"),
        "table": rank0_bench.report(results),
        # Only a run with both cases says what the leading replica's loss costs.
        "split": bool(led and other),
        "led": str(len(led)),
        "taskd_trials": str(len(taskd_trials)),
        "led_times": ", ".join(fmt(t) for t in led),
        "other_times": ", ".join(fmt(t) for t in other),
    }
    rows = []
    taskd, peer = results.get("taskdrun", {}).get("median"), results.get("torchrun", {}).get("median")
    if taskd is not None and peer is not None:
        lost = {"leader": "the leading replica's node", "follower": "a standby replica's node"}.get(
            trial["victim"], "rank 0's node"
        )
        rows.append(
            [
                f"{lost} lost (etcd), a spare waiting: kill → every rank stepping ≤ 0.1 × torchrun and ≤ 3 s",
                f"{fmt(taskd)} s, {fmt(ratio(taskd, peer), 3)} × torchrun",
                _met(taskd <= 3.0 and ratio(taskd, peer) <= 0.1),
            ]
        )
    return fields, rows


def nodes_chaos_fields(data: dict[str, Any]) -> Rendered:
    s, losses = data["settings"], data["losses"]
    recovered = sum(r["recovered"] for r in losses)
    spare = data["spare_seconds"]
    fields: dict[str, Value] = {
        "nnodes": str(s["nnodes"]),
        "nproc": str(s["nproc"]),
        "rdzv": s["rdzv"],
        "step_ms": f"{s['step_time'] * 1000:.0f}",
        "ckpt_every": str(s["ckpt_every"]),
        "steps": str(s["steps"]),
        "spares": str(s["spares"]),
        "losses": str(s["losses"]),
        "seed": str(s["seed"]),
        "faults": ", ".join(s["faults"]),
        "victims": "rank 0's and the leading controller replica's included"
        if s["rdzv"] == "etcd-v2"
        else "never the first launcher, which hosts the c10d store",
        "deadline": f"{s['recovery_deadline']:g}",
        "minutes": fmt(data["chaos_seconds"] / 60, 1),
        "spare_p50": fmt(statistics.median(spare)) if spare else "N/A",
        "load_start": _loads(data["load_before"]),
        "load_end": _loads(data["load_after"]),
        "table": nodes_chaos_bench.report(data),
        "stopped": bool(data["stopped"]),
        "stopped_why": data["stopped"] or "",
    }
    left = len(data["leftovers"]) + sum(len(r["left"]) for r in losses)
    ok_end = data["params_equal"] and all(c == 0 for c in data["exit_codes"])
    rows = [
        [
            f"node chaos: {s['losses']} node losses in a row, 100 % recovered",
            f"{recovered}/{len(losses)} of {s['losses']}",
            _met(recovered == s["losses"]),
        ],
        [
            "node chaos: final parameters identical to fault-free, every launcher exit 0",
            f"{'identical' if data['params_equal'] else 'DIFFERENT'}, exit codes "
            + ",".join("–" if c is None else str(c) for c in data["exit_codes"]),
            _met(ok_end),
        ],
        ["node chaos: 0 leftover processes", str(left), _met(left == 0)],
    ]
    return fields, rows


def snapshot_fields(data: dict[str, Any]) -> Rendered:
    cfg, steps, lost = data["config"], data["steps"], data["lost"]
    sizes = sorted(steps, key=lambda size: size != "example")  # the example first, whatever the JSON's order
    example, big = steps[sizes[0]], steps[sizes[-1]]
    target = data["target"]
    rows = []
    for size in sizes:
        modes = steps[size]["modes"]
        cost = modes["memory"]["median_s"] / modes["none"]["median_s"] - 1
        disk = modes["disk"]["median_s"] / modes["none"]["median_s"] - 1
        rows.append(
            [
                f"memory snapshot every step: step time +≤ {target * 100:g} % ({size})",
                f"{cost * 100:+.1f} % (dcp.async_save to disk: {disk * 100:+.1f} %)",
                _met(cost <= target),
            ]
        )
    memory = lost["memory"]
    rows.append(
        [
            "a SIGKILLed rank of a 4-rank FSDP2 job loses ≤ 1 step",
            f"{memory['lost']} lost, restored from {memory['source']} (none: {lost['none']['lost']}, "
            f"disk every step: {lost['disk']['lost']})",
            _met(memory["lost"] <= 1 and memory["source"] == "memory"),
        ]
    )
    cold = lost["torchrun-disk"]["recovery_s"]
    warm = memory["recovery_s"]
    if warm is not None and cold:
        rows.append(
            [
                "kill → every rank stepping ≤ 0.1 × torchrun's cold restart (4-rank FSDP2)",
                f"{fmt(warm, 2)} s, {fmt(warm / cold, 2)} × torchrun ({fmt(cold, 2)} s)",
                _met(warm / cold <= 0.1),
            ]
        )
    bw = data["bandwidth"]["median_gb_s"]
    rows.append(
        [
            "snapshot copy bandwidth, against a plain memcpy",
            f"write {fmt(bw['slot'])} GB/s (CRC-32 {fmt(bw['crc32'])} GB/s), memcpy {fmt(bw['memcpy'])} GB/s, "
            f"peer copy {fmt(bw['peer'])} GB/s",
            "reported",
        ]
    )
    fields: dict[str, Value] = {
        "example_ranks": str(example["ranks"]),
        "example_params": str(example["modes"]["none"]["params"]),
        "big_ranks": str(big["ranks"]),
        "mib": f"{cfg['mib']:g}",
        "warmup": str(cfg["warmup"]),
        "repeats": str(cfg["repeats"]),
        "kill_at": str(cfg["kill_at"]),
        "ckpt_every": str(cfg["ckpt_every"]),
        "load": " → ".join(_loads(load) for load in data["loads"]),
        "table": snapshot_bench.report(data),
    }
    return fields, rows


@dataclass(frozen=True, slots=True)
class Part:
    """One section of the report: the step whose results it reads, its template and its renderer."""

    step: str
    template: str
    fields: Callable[[dict[str, Any]], Rendered]


#: The report's sections, in order.
PARTS = (
    Part("detect", "detect", detect_fields),
    Part("recovery", "recovery", recovery_fields),
    Part("idle", "idle", idle_fields),
    Part("security", "security", security_fields),
    Part("metrics", "metrics", metrics_fields),
    Part("hang", "hang", hang_fields),
    Part("signals", "signals", signal_fields),
    Part("chaos", "chaos", chaos_fields),
    Part("transfer", "transfer", transfer_fields),
    Part("first_start", "first_start", first_start_fields),
    Part("mindspore", "mindspore", mindspore_fields),
    Part("failover", "failover", failover_fields),
    Part("slowrank", "slowrank", slowrank_fields),
    Part("snapshots", "snapshots", snapshot_fields),
    Part("nodeloss", "nodeloss", nodeloss_fields),
    Part("rank0", "rank0", rank0_fields),
    Part("nodes_chaos", "nodes_chaos", nodes_chaos_fields),
    Part("shrink", "shrink", shrink_fields),
)


def section(part: Part, data: dict[str, Any] | None) -> Section:
    """The section's Markdown and its target rows; a bench without results gets its heading and a note."""
    if data is None:
        return fill("failed", {"heading": heading(part.template)}), []
    fields, rows = part.fields(data)
    return fill(part.template, fields), rows


def load_note(cores: int, loads: list[list[float]], shown: str) -> str:
    """What the load averages say about other work on the machine, and nothing they do not show."""
    busiest = max(max(load) for load in loads)
    fields: dict[str, Value] = {
        "cores": str(cores),
        "loads": shown,
        "overloaded": busiest > cores,
        "busiest": f"{busiest:.2f}",
    }
    return fill("load", fields).rstrip("\n")


def render(sections: list[Section], run: dict[str, Any]) -> str:
    info, durations = run["machine"], run["durations"]
    total = sum(durations.values())
    targets = [row for _, rows in sections for row in rows]
    targets.append(
        [
            f"`run_all.py` under {BUDGET / 60:.0f} min on 2 cores",
            f"{total / 60:.1f} min",
            _met(total < BUDGET),
        ]
    )
    loads = "; ".join(
        f"{when} {' / '.join(f'{x:.2f}' for x in load)}"
        for when, load in zip(("at the start", "at the end"), run["loads"], strict=True)
    )
    machine_rows = [
        ["cores (nproc)", info["nproc"]],
        ["CPU", info["cpu"]],
        ["memory", f"{info['memory_gib']} GiB"],
        ["kernel", info["kernel"]],
        *[[k, v] for k, v in run["versions"].items()],
    ]
    head: dict[str, Value] = {
        "finished": run["finished"],
        "quick": bool(run["quick"]),
        "load": load_note(info["nproc"], run["loads"], loads),
        "machine": markdown_table(["", ""], machine_rows),
        "command": run["command"],
        "minutes": f"{total / 60:.1f}",
        "steps": ", ".join(f"{name} {seconds / 60:.1f} min" for name, seconds in durations.items()),
        "commands": "\n".join(f"    {c}" for c in run["commands"]),
        "targets": markdown_table(["target", "measured", "verdict"], targets),
    }
    return fill("head", head) + "\n" + "\n".join(text for text, _ in sections)


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def run_everything(quick: bool, results: Path) -> dict[str, Any]:
    """Run the steps; what the report says about the run itself (also kept as ``run.json``)."""
    info, vers = machine(), versions()
    commands, durations = [], {}
    for step in STEPS:
        cmd, durations[step.name] = run_step(step, quick, results)
        commands.append(cmd)
    run = {
        "machine": info,
        "versions": vers,
        "command": _shown([PYTHON, str(Path(sys.argv[0]).resolve()), *sys.argv[1:]]),
        "commands": commands,
        "durations": durations,
        "loads": [info["loadavg_at_start"], os.getloadavg()],
        "quick": quick,
        "finished": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    (results / "run.json").write_text(json.dumps(run, indent=2), encoding="utf-8")
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run of a few minutes with tiny sample sizes")
    p.add_argument(
        "--out", type=Path, default=REPO / "docs" / "benchmarks.md", help="the report (default: %(default)s)"
    )
    p.add_argument("--results", type=Path, default=None, help="keep the JSON results and logs here")
    p.add_argument(
        "--render-only", action="store_true", help="only rewrite the report from --results of a past run"
    )
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args()
    setup_logging(args.log_level)
    exit_on_sigterm()
    if args.render_only and args.results is None:
        p.error("--render-only needs --results DIR of an earlier run")
    with tempfile.TemporaryDirectory(prefix="taskd-bench-") as tmp:
        results = args.results or Path(tmp)
        results.mkdir(parents=True, exist_ok=True)
        if args.render_only:
            run = json.loads((results / "run.json").read_text(encoding="utf-8"))
        else:
            run = run_everything(args.quick, results)
        data = {step.name: _load(results / f"{step.name}.json") for step in STEPS}
    sections = [section(part, data[part.step]) for part in PARTS]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(sections, run), encoding="utf-8")
    logger.info("wrote %s", args.out)
    return 0 if all(d is not None for d in data.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
