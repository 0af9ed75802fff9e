"""Idle cost: CPU of agents and controller over a healthy job; the controller's memory with many jobs.

Part 1, one ``--seconds`` window, all at once (each launcher runs ``--workers``
sleeping workers: what is measured is the launcher's own cost):

* ``taskd run --controller ADDR``: the node agent alone;
* ``taskdrun --taskd-controller ADDR``: the PyTorch adapter's agent alone;
* ``taskd controller`` at ADDR, a separate process serving those two agents;
* ``taskd run`` with its embedded controller (agent + controller in one process);
* ``torchrun``, the peer, as shipped (it polls its workers every 0.1 s).

CPU is the ``utime + stime`` delta of each launcher's own pid in
``/proc/<pid>/stat`` (threads included, workers not), as % of one core.

Part 2, where an idle agent's CPU goes: one child process per mode holds a
real ``DLRecoverManager`` against a ``taskd controller`` and measures its own
``time.process_time()`` over ``--seconds / 4``: ``channel`` (Init + Register
only: gRPC's threads and the channel's keep-alive pings), ``stream`` (+ the
signal stream with the controller's keep-alive signals), and ``stream`` plus
HealthCheck calls at the node agent's interval or at the client's default 1 s. A
further child times single HealthCheck calls, after 1 s without calls and
back to back (wall time and the calling thread's CPU). The agent's own
supervision loop is the ``main`` thread of part 1.

Part 3: a fresh ``taskd controller`` with ``--jobs`` jobs registered and
subscribed, one agent each (``Bench.start_agents`` of ``controller_bench.py``):
its RSS before and after, and its CPU over ``--seconds / 4`` while it keeps
those streams alive.

Run::

    .venv/bin/python bench/idle_bench.py --seconds 60 --jobs 1000 --json /tmp/idle.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import controller_bench
import grpc
from _common import (
    PYTHON,
    Children,
    cpu_seconds,
    exit_on_sigterm,
    fmt,
    machine,
    markdown_table,
    percentile,
    pid_alive,
    rss_mib,
    setup_logging,
    thread_cpu_seconds,
    write_json,
)

from taskd_core.agent.config import AgentConfig
from taskd_core.client.manager import DLRecoverManager
from taskd_core.rpc import recover_pb2 as pb
from taskd_core.rpc import recover_pb2_grpc

logger = logging.getLogger(__name__)

BIN = Path(PYTHON).parent
#: Seconds the launchers get to start their workers (taskdrun and torchrun import torch) before measuring.
_SETTLE = 15.0
#: The target: an idle agent's share of one core, in percent.
AGENT_TARGET = 1.0
#: HealthCheck calls per case in the call-cost child of part 2.
_CALLS = 10
#: The node agent's HealthCheck interval (its AgentConfig default).
AGENT_HEALTH = AgentConfig(job_id="idle-bench").health_interval
#: Client modes of part 2: the HealthCheck interval of the subscription, None for no subscription.
CLIENT_MODES: dict[str, float | None] = {
    "channel": None,
    "stream": 1e9,
    "stream+health-agent": AGENT_HEALTH,
    "stream+health-1s": 1.0,
}
#: What each client mode adds to, and how the report names it.
_MODE_BASE = {
    "channel": None,
    "stream": "channel",
    "stream+health-agent": "stream",
    "stream+health-1s": "stream",
}
_MODE_LABEL = {
    "channel": "channel (Init + Register only)",
    "stream": "+ signal stream",
    "stream+health-agent": f"+ HealthCheck every {AGENT_HEALTH:g} s (the node agent's interval)",
    "stream+health-1s": "+ HealthCheck every 1 s (DLRecoverManager's default)",
}


@dataclass(frozen=True, slots=True)
class Subject:
    name: str
    label: str
    #: whether it is a TaskD agent the < 1 % target applies to.
    agent: bool


def _commands(address: str, workers: int) -> dict[str, list[str]]:
    sleeper = ["sleep", "100000"]
    n = str(workers)
    return {
        "taskd-run": [
            str(BIN / "taskd"),
            "run",
            "--controller",
            address,
            "--job-id",
            "idle-taskd-run",
            "--nproc",
            n,
            "--",
            *sleeper,
        ],
        "taskdrun": [
            str(BIN / "taskdrun"),
            "--standalone",
            "--nproc-per-node",
            n,
            "--taskd-controller",
            address,
            "--taskd-job-id",
            "idle-taskdrun",
            "--no-python",
            *sleeper,
        ],
        "taskd-run-embedded": [
            str(BIN / "taskd"),
            "run",
            "--job-id",
            "idle-embedded",
            "--nproc",
            n,
            "--",
            *sleeper,
        ],
        "torchrun": [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", n, "--no-python", *sleeper],
    }


SUBJECTS = (
    Subject("taskd-run", "`taskd run` node agent (external controller)", agent=True),
    Subject("taskdrun", "`taskdrun` node agent (external controller)", agent=True),
    Subject("controller", "`taskd controller` serving the two agents above", agent=False),
    Subject("taskd-run-embedded", "`taskd run` with embedded controller (agent + controller)", agent=True),
    Subject("torchrun", "`torchrun` (peer, polls every 0.1 s)", agent=False),
)


def _sample(pids: dict[str, int], seconds: float) -> dict[str, dict[str, Any]]:
    """CPU % of one core (in total and by thread kind) and RSS of each pid over ``seconds``."""
    before = {name: thread_cpu_seconds(pid) for name, pid in pids.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    out = {}
    for name, pid in pids.items():
        if not pid_alive(pid):
            raise RuntimeError(f"{name} (pid {pid}) ended during the measurement")
        after = thread_cpu_seconds(pid)
        threads = {
            kind: 100.0 * (used - before[name].get(kind, 0.0)) / elapsed for kind, used in after.items()
        }
        out[name] = {
            "cpu_percent": sum(threads.values()),
            "threads_cpu_percent": threads,
            "rss_mib": rss_mib(pid),
        }
    return out


def idle_launchers(workers: int, seconds: float, workdir: Path) -> dict[str, dict[str, Any]]:
    # Launchers stop first (last started), while the controller still hears their agents' last report.
    with Children() as children:
        controller, address = controller_bench.start_controller(workdir)
        children.own(controller)
        pids = {"controller": controller.pid}
        for name, cmd in _commands(address, workers).items():
            pids[name] = children.start(cmd, log=workdir / f"{name}.log").pid
        time.sleep(_SETTLE)
        return _sample(pids, seconds)


def client_child(mode: str, address: str, seconds: float) -> None:
    """One client in ``mode``: print its CPU % of one core over ``seconds`` as JSON (for ``client_costs``)."""
    interval = CLIENT_MODES[mode]
    client = DLRecoverManager(
        pb.ClientInfo(jobId=f"idle-client-{mode}", role="bench"),
        address,
        agent_id="a0",
        handler=lambda signal: None,
        health_interval=interval or 1.0,
    )
    try:
        client.init_clusterd()
        client.register()
        if interval is not None:
            threading.Thread(target=client.start_subscribe, name="subscriber", daemon=True).start()
        time.sleep(2.0)  # connected and subscribed
        cpu0, t0 = time.process_time(), time.monotonic()
        time.sleep(seconds)
        print(json.dumps({"cpu_percent": 100.0 * (time.process_time() - cpu0) / (time.monotonic() - t0)}))
    finally:
        client.close()


def call_cost_child(address: str, calls: int) -> None:
    """Wall time and calling-thread CPU of one HealthCheck, after 1 s idle and back to back; prints JSON."""
    with grpc.insecure_channel(address) as channel:
        stub = recover_pb2_grpc.RecoverStub(channel)
        info = pb.ClientInfo(jobId="idle-call-cost", role="bench")
        stub.HealthCheck(info, timeout=10.0)  # connected
        out = {}
        for label, gap in (("after_idle", 1.0), ("back_to_back", 0.0)):
            walls, cpus = [], []
            for _ in range(calls):
                time.sleep(gap)
                wall0, cpu0 = time.perf_counter(), time.thread_time()
                stub.HealthCheck(info, timeout=10.0)
                cpus.append(time.thread_time() - cpu0)
                walls.append(time.perf_counter() - wall0)
            out[label] = {"wall_ms": percentile(walls, 50) * 1e3, "cpu_ms": percentile(cpus, 50) * 1e3}
    print(json.dumps(out))


def _child(args: list[str], timeout: float) -> Any:
    """Run this script with hidden ``args``; the JSON of its last output line."""
    proc = subprocess.run(
        [PYTHON, __file__, *args], capture_output=True, text=True, check=True, timeout=timeout
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def client_costs(seconds: float, workdir: Path) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """CPU % of each client mode, and the cost of one HealthCheck call (see :func:`call_cost_child`)."""
    workdir.mkdir()  # a fresh directory: start_controller waits for its port file to appear
    with Children() as children:
        controller, address = controller_bench.start_controller(workdir)
        children.own(controller)
        modes = {
            mode: _child(["--client-child", mode, address, str(seconds)], seconds + 60.0)["cpu_percent"]
            for mode in CLIENT_MODES
        }
        call = _child(["--call-cost-child", address, str(_CALLS)], _CALLS * 1.2 + 60.0)
    return modes, call


async def _hold_jobs(address: str, pid: int, jobs: int, seconds: float) -> dict[str, float]:
    bench = controller_bench.Bench(address, timeout=300.0)
    try:
        rss_before = rss_mib(pid)
        t0 = time.monotonic()
        await bench.start_agents([(f"idle-job-{i}", "a0") for i in range(jobs)])
        joined = time.monotonic() - t0
        rss_after = rss_mib(pid)
        cpu0, t1 = cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(seconds)
        cpu_percent = 100.0 * (cpu_seconds(pid) - cpu0) / (time.monotonic() - t1)
    finally:
        await bench.close()
    return {
        "jobs": jobs,
        "join_seconds": joined,
        "rss_mib_before": rss_before,
        "rss_mib_after": rss_after,
        "rss_kib_per_job": (rss_after - rss_before) * 1024 / jobs,
        "cpu_percent": cpu_percent,
        "cpu_window_seconds": seconds,
    }


def many_jobs(jobs: int, seconds: float, workdir: Path) -> dict[str, float]:
    workdir.mkdir()  # a fresh directory: start_controller waits for its port file to appear
    with Children() as children:
        controller, address = controller_bench.start_controller(workdir)
        children.own(controller)
        return asyncio.run(_hold_jobs(address, controller.pid, jobs, seconds))


def client_share(clients: dict[str, float], mode: str) -> float:
    """CPU % that ``mode`` adds to the mode it builds on."""
    base = _MODE_BASE[mode]
    return clients[mode] - (clients[base] if base else 0.0)


def report(
    launchers: dict[str, dict[str, Any]],
    clients: dict[str, float],
    call: dict[str, dict[str, float]],
    jobs: dict[str, float] | None,
) -> str:
    rows = []
    for s in SUBJECTS:
        r = launchers[s.name]
        target = ("met" if r["cpu_percent"] < AGENT_TARGET else "MISSED") if s.agent else ""
        threads = sorted(r["threads_cpu_percent"].items(), key=lambda kv: -kv[1])
        by_thread = ", ".join(f"{kind} {pct:.2f}" for kind, pct in threads if pct > 0)
        rows.append([s.label, fmt(r["cpu_percent"], 2), by_thread, fmt(r["rss_mib"], 0), target])
    text = markdown_table(
        ["process", "CPU % of one core", "by thread (%)", "RSS MiB", f"target < {AGENT_TARGET:g} %"], rows
    )
    text += "\n\n" + markdown_table(
        ["client mode (one DLRecoverManager)", "CPU % of one core", "added by this part"],
        [
            [_MODE_LABEL[mode], fmt(clients[mode], 2), fmt(client_share(clients, mode), 2)]
            for mode in CLIENT_MODES
        ],
    )
    text += "\n\n" + markdown_table(
        ["one HealthCheck to the controller (median)", "wall ms", "calling thread CPU ms"],
        [
            [label, fmt(call[key]["wall_ms"], 1), fmt(call[key]["cpu_ms"], 1)]
            for key, label in (("after_idle", "after 1 s without calls"), ("back_to_back", "back to back"))
        ],
    )
    if jobs is not None:
        text += "\n\n" + markdown_table(
            ["controller with N subscribed jobs", "value"],
            [
                ["jobs", int(jobs["jobs"])],
                ["RSS before, MiB", fmt(jobs["rss_mib_before"], 1)],
                ["RSS after, MiB", fmt(jobs["rss_mib_after"], 1)],
                ["per job, KiB", fmt(jobs["rss_kib_per_job"], 1)],
                ["time to join all, s", fmt(jobs["join_seconds"], 1)],
                [f"idle CPU % over {jobs['cpu_window_seconds']:.0f} s", fmt(jobs["cpu_percent"], 2)],
            ],
        )
    return text


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="measurement window (default: %(default)s)")
    p.add_argument(
        "--workers", type=int, default=8, help="sleeping workers per launcher (default: %(default)s)"
    )
    p.add_argument("--jobs", type=int, default=1000, help="jobs registered for the memory part; 0 skips it")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--client-child", nargs=3, metavar=("MODE", "ADDRESS", "SECONDS"), help=argparse.SUPPRESS)
    p.add_argument("--call-cost-child", nargs=2, metavar=("ADDRESS", "CALLS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client_child:
        mode, address, seconds = args.client_child
        client_child(mode, address, float(seconds))
        return 0
    if args.call_cost_child:
        call_cost_child(args.call_cost_child[0], int(args.call_cost_child[1]))
        return 0
    setup_logging(args.log_level)
    exit_on_sigterm()
    if args.seconds <= 0 or args.workers < 1 or args.jobs < 0:
        p.error("--seconds must be > 0, --workers >= 1, --jobs >= 0")
    info = machine()
    with tempfile.TemporaryDirectory(prefix="idle-bench-") as tmp:
        launchers = idle_launchers(args.workers, args.seconds, Path(tmp))
        clients, call = client_costs(args.seconds / 4, Path(tmp) / "clients")
        jobs = many_jobs(args.jobs, args.seconds / 4, Path(tmp) / "jobs") if args.jobs else None
    print(report(launchers, clients, call, jobs))
    results: dict[str, Any] = {
        "launchers": launchers,
        "clients": clients,
        "health_call": call,
        "many_jobs": jobs,
    }
    write_json(
        args.json,
        {
            "bench": "idle",
            "machine": info,
            "loadavg_at_end": os.getloadavg(),
            "seconds": args.seconds,
            "workers": args.workers,
            "results": results,
            "target": {
                "what": f"idle agent under {AGENT_TARGET:g} % of one core",
                "met": all(launchers[s.name]["cpu_percent"] < AGENT_TARGET for s in SUBJECTS if s.agent),
            },
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
