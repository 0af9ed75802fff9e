"""Metrics cost: the controller with ``--metrics-port`` against the same controller without it.

For each mode (``off``, ``on``), in alternating rounds, a fresh ``taskd controller``:

1. fault → changeStrategy latency of one agent over ``--cycles`` recovery cycles
   (``controller_bench.single_agent``: every counter and histogram moves on each cycle);
2. ``--jobs`` jobs registered and subscribed, one agent each: the controller's RSS;
3. its idle CPU over ``--seconds`` while it keeps those streams alive (``utime + stime``);
4. with metrics on: ``--scrapes`` GETs of ``/metrics`` with those jobs (wall time per
   scrape, from this process, and the exposition's size).

On a shared two-core machine the end-to-end differences between the modes are
smaller than the spread between rounds, so the bench also measures the hooks
themselves, in this process: the CPU time ``ControllerMetrics`` spends on one
recovery cycle's journal entries and RPC observations (``--hook-cycles`` cycles),
and what ``taskd_core.worker.step(n)`` costs a training loop: one call between two
datagrams (most calls, when steps are < 0.1 s apart) and one call that sends its
datagram to a real socket, which the bench reads back as the agent would.

Run::

    .venv/bin/python bench/metrics_bench.py --jobs 1000 --cycles 200 --seconds 20 --json /tmp/metrics.json
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import controller_bench
from _common import (
    Children,
    cpu_seconds,
    exit_on_sigterm,
    fmt,
    free_port,
    machine,
    markdown_table,
    percentile,
    rss_mib,
    setup_logging,
    write_json,
)

from taskd_core.controller.machine import JournalEntry
from taskd_core.controller.metrics import ControllerMetrics
from taskd_core.worker import ProgressReporter

logger = logging.getLogger(__name__)

MODES = ("off", "on")
#: Targets of issue 12: scrape of 1000 jobs, and what metrics may add to idle CPU and fault → strategy.
SCRAPE_TARGET_MS = 100.0
ADDED_TARGET_PERCENT = 5.0


def _cycle_journal() -> list[JournalEntry]:
    """The journal entries of one recovery cycle of one agent, as the controller writes them."""
    worker = {"agent": "a0", "rank": 0, "local_rank": 0}
    kinds: list[tuple[str, dict[str, Any]]] = [
        ("fault", {"agent": "a0", "pending": False, "ranks": {"0": "1"}}),
        ("worker exited", {**worker, "pid": 10, "at": 1.0, "exit_code": -9, "step": 25}),
        ("transition", {"source": "idle", "target": "wait-stop"}),
        ("cycle started", {"uuid": "u", "members": ["a0"], "faults": {"0": "1"}}),
        ("signal", {"type": "stopTrain", "seq": 1, "actions": ["stop_train"], "strategy": "", "extra": ""}),
        ("report", {"agent": "a0", "step": "stop", "code": 0}),
        ("signal", {"type": "globalFault", "seq": 2, "actions": ["on_global_rank"], "strategy": "", "extra": ""}),
        ("transition", {"source": "wait-stop", "target": "wait-strategies"}),
        ("report", {"agent": "a0", "step": "strategies", "strategies": ["recover", "exit"]}),
        ("strategy chosen", {"strategy": "recover", "reported": ["exit", "recover"], "after": ""}),
        ("signal", {"type": "changeStrategy", "seq": 3, "actions": ["change_strategy"], "strategy": "recover"}),
        ("transition", {"source": "wait-strategies", "target": "wait-status"}),
        ("report", {"agent": "a0", "step": "status", "code": 0, "strategy": "recover"}),
        ("cycle succeeded", {"strategy": "recover", "uuid": "u"}),
        ("transition", {"source": "wait-status", "target": "idle"}),
        # What a worker that reports its steps (taskd_core.worker) adds to the cycle.
        ("worker started", {**worker, "pid": 11, "at": 1.2}),
        ("worker resumed", {**worker, "pid": 11, "at": 1.9, "step": 20}),
        ("worker stepping", {**worker, "pid": 11, "at": 2.0, "step": 21}),
    ]
    return [JournalEntry(kind, 1, detail) for kind, detail in kinds]


def hook_cost(cycles: int) -> dict[str, float]:
    """CPU microseconds ``ControllerMetrics`` spends per recovery cycle (median of 5 batches)."""
    metrics = ControllerMetrics()
    journal = _cycle_journal()
    rpcs = ("ReportProcessFault", "ReportStopComplete", "ReportRecoverStrategy", "ReportRecoverStatus")
    batches = []
    for _ in range(5):
        t0 = time.process_time()
        for i in range(cycles):
            for entry in journal:  # the controller journals a cycle over several transitions
                metrics.journalled(f"job-{i % 1000}", [entry], float(i))
            for rpc in rpcs:
                metrics.observe_rpc(rpc, "0", 0.001)
        batches.append((time.process_time() - t0) / cycles * 1e6)
    return {"us_per_cycle": percentile(batches, 50), "entries_per_cycle": len(journal), "rpcs_per_cycle": len(rpcs)}


def step_cost(calls: int) -> dict[str, float]:
    """Wall microseconds of one ``ProgressReporter.step`` call: held back by the beat gap, and sending."""
    with tempfile.TemporaryDirectory(prefix="taskd-step-bench-") as tmp, socket.socket(
        socket.AF_UNIX, socket.SOCK_DGRAM
    ) as agent:
        path = f"{tmp}/agent.sock"
        agent.bind(path)
        reporter = ProgressReporter(path)
        try:
            reporter.step(0)  # the gap now holds the calls below back
            t0 = time.perf_counter()
            for n in range(1, calls + 1):
                reporter.step(n)
            held = (time.perf_counter() - t0) / calls * 1e6
            sends = max(1, calls // 100)
            t0 = time.perf_counter()
            for n in range(sends):
                reporter.resumed(n)  # due at once: the next step always sends
                reporter.step(n + 1)
                agent.recv(512)
                agent.recv(512)
            sent = (time.perf_counter() - t0) / (2 * sends) * 1e6
        finally:
            reporter.close()
    return {"held_us": held, "sent_us": sent}


def _scrape(port: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        size = len(reply.read())
    return time.perf_counter() - t0, size


async def _measure(
    address: str, pid: int, metrics_port: int | None, jobs: int, cycles: int, seconds: float, scrapes: int
) -> dict[str, Any]:
    bench = controller_bench.Bench(address, timeout=300.0)
    try:
        latency = await controller_bench.single_agent(bench, cycles)
        await bench.start_agents([(f"bench-job-{i}", "a0") for i in range(jobs)])
        await asyncio.sleep(2.0)  # let the joins settle before the idle window
        rss = rss_mib(pid)
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(seconds)
        idle = 100.0 * (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
        times, size = [], 0
        if metrics_port is not None:
            for _ in range(scrapes):
                took, size = await asyncio.to_thread(_scrape, metrics_port)
                times.append(took)
        return {
            "fault_to_change_strategy": latency,
            "rss_mib": rss,
            "idle_cpu_percent": idle,
            "scrape_ms": [t * 1e3 for t in times],
            "scrape_bytes": size,
        }
    finally:
        await bench.close()


def one_run(mode: str, jobs: int, cycles: int, seconds: float, scrapes: int, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True)
    port = free_port() if mode == "on" else None
    extra = ["--metrics-port", str(port)] if port is not None else []
    with Children() as children:
        controller, address = controller_bench.start_controller(workdir, extra)
        children.own(controller)
        return asyncio.run(_measure(address, controller.pid, port, jobs, cycles, seconds, scrapes))


def _median(values: list[float]) -> float:
    return percentile(values, 50)


def summarize_modes(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per mode, the median over rounds of each figure (scrapes pooled)."""
    out = {}
    for mode, rounds in runs.items():
        scrapes = [t for r in rounds for t in r["scrape_ms"]]
        out[mode] = {
            "latency_p50_ms": _median([r["fault_to_change_strategy"]["p50_ms"] for r in rounds]),
            "latency_p50_low_ms": min(r["fault_to_change_strategy"]["p50_ms"] for r in rounds),
            "latency_p50_high_ms": max(r["fault_to_change_strategy"]["p50_ms"] for r in rounds),
            "idle_cpu_low": min(r["idle_cpu_percent"] for r in rounds),
            "idle_cpu_high": max(r["idle_cpu_percent"] for r in rounds),
            "latency_p99_ms": _median([r["fault_to_change_strategy"]["p99_ms"] for r in rounds]),
            "idle_cpu_percent": _median([r["idle_cpu_percent"] for r in rounds]),
            "rss_mib": _median([r["rss_mib"] for r in rounds]),
            "scrape_p50_ms": percentile(scrapes, 50),
            "scrape_p99_ms": percentile(scrapes, 99),
            "scrape_max_ms": max(scrapes) if scrapes else float("nan"),
            "scrape_kib": rounds[-1]["scrape_bytes"] / 1024,
        }
    return out


def added_percent(summary: dict[str, dict[str, float]], key: str) -> float:
    off, on = summary["off"][key], summary["on"][key]
    return 100.0 * (on - off) / off if off else float("nan")


def report(data: dict[str, Any]) -> str:
    s = data["summary"]
    rows = [
        [
            mode,
            (
                f"{fmt(s[mode]['latency_p50_ms'], 2)} ({fmt(s[mode]['latency_p50_low_ms'], 2)}–"
                f"{fmt(s[mode]['latency_p50_high_ms'], 2)})"
            ),
            fmt(s[mode]["latency_p99_ms"], 2),
            f"{fmt(s[mode]['idle_cpu_percent'], 2)} ({fmt(s[mode]['idle_cpu_low'], 2)}–{fmt(s[mode]['idle_cpu_high'], 2)})",
            fmt(s[mode]["rss_mib"], 1),
            "—" if mode == "off" else f"{fmt(s[mode]['scrape_p50_ms'], 1)} / {fmt(s[mode]['scrape_p99_ms'], 1)}",
        ]
        for mode in MODES
    ]
    return markdown_table(
        [
            "metrics",
            "fault → changeStrategy p50 ms (rounds' range)",
            "p99 ms",
            f"idle CPU % ({data['jobs']} jobs; range)",
            "RSS MiB",
            f"scrape p50 / p99 ms ({data['jobs']} jobs)",
        ],
        rows,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--cycles", type=int, default=200, help="recovery cycles for the latency figure")
    p.add_argument("--seconds", type=float, default=20.0, help="idle CPU window per run")
    p.add_argument("--scrapes", type=int, default=50)
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs (alternating, medians reported)")
    p.add_argument("--hook-cycles", type=int, default=2000, help="cycles for the in-process hook cost")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args()
    setup_logging(args.log_level)
    exit_on_sigterm()
    hooks = hook_cost(args.hook_cycles)
    logger.info("metrics hooks: %.1f us of CPU per recovery cycle", hooks["us_per_cycle"])
    steps = step_cost(100 * args.hook_cycles)
    logger.info("worker.step(): %.2f us held back, %.1f us sent", steps["held_us"], steps["sent_us"])
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="taskd-metrics-bench-") as tmp:
        for i in range(args.rounds):
            for mode in MODES:
                logger.info("round %d, metrics %s", i + 1, mode)
                result = one_run(mode, args.jobs, args.cycles, args.seconds, args.scrapes, Path(tmp) / f"{mode}{i}")
                runs[mode].append(result)
    summary = summarize_modes(runs)
    data = {
        "machine": machine(),
        "jobs": args.jobs,
        "cycles": args.cycles,
        "seconds": args.seconds,
        "scrapes": args.scrapes,
        "rounds": args.rounds,
        "runs": runs,
        "summary": summary,
        "hooks": hooks,
        "worker_step": steps,
        "added_percent": {
            "idle_cpu": added_percent(summary, "idle_cpu_percent"),
            "latency_p50": added_percent(summary, "latency_p50_ms"),
            "hooks_of_latency_p50": 100.0 * hooks["us_per_cycle"] / 1e3 / summary["off"]["latency_p50_ms"],
        },
    }
    print(report(data))
    write_json(args.json, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
