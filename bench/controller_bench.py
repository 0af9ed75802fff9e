"""Controller benchmark: signal latency and fan-out, many jobs, memory.

Runs ``taskd controller`` as a child process (state ``:memory:``, no flush
window) and drives it with grpc.aio agents in this process that answer every
signal at once:

* one agent: fault report -> changeStrategy received, over many cycles;
* one job with 10, 100, 1000 agents: fault report -> stopTrain received by each
  agent (and by the last one), over several cycles;
* 1000 jobs with one agent each, all faulting at once: fault -> changeStrategy;
* the controller's resident memory (VmRSS / peak VmHWM) after each part.

Usage: ``.venv/bin/python bench/controller_bench.py [--cycles 200] [--fanout 10,100,1000]
[--jobs 1000] [--json out.json]``. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from taskd_core.rpc import recover_pb2 as pb  # noqa: E402
from taskd_core.rpc import recover_pb2_grpc  # noqa: E402

#: Streams per client channel; each channel gets its own connection.
STREAMS_PER_CHANNEL = 50
FAULT = [pb.FaultRank(rankId="0", faultType="1")]


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summary_ms(values: Sequence[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": round(percentile(values, 50) * 1000, 2),
        "p99_ms": round(percentile(values, 99) * 1000, 2),
        "max_ms": round(max(values) * 1000, 2),
    }


def memory_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


@dataclass
class Agent:
    """One agent: records when each signal arrived and answers it at once."""

    stub: recover_pb2_grpc.RecoverStub
    job_id: str
    agent_id: str
    arrivals: dict[tuple[int, str], float] = field(default_factory=dict)
    cycle_done: dict[int, asyncio.Event] = field(default_factory=dict)

    @property
    def info(self) -> pb.ClientInfo:
        return pb.ClientInfo(jobId=self.job_id, role="bench", agentId=self.agent_id)

    def done(self, cycle: int) -> asyncio.Event:
        return self.cycle_done.setdefault(cycle, asyncio.Event())

    async def join(self) -> None:
        await self.stub.Init(self.info)
        await self.stub.Register(self.info)

    async def run(self) -> None:
        call = self.stub.SubscribeProcessManageSignal(self.info)
        try:
            async for sig in call:
                if sig.signalType == "keep-alive":
                    continue
                self.arrivals[(sig.cycle, sig.signalType)] = time.perf_counter()
                await self._answer(sig)
        except asyncio.CancelledError:
            call.cancel()
            raise

    async def _answer(self, sig: pb.ProcessManageSignal) -> None:
        who = {"jobId": self.job_id, "agentId": self.agent_id, "uuid": sig.uuid}
        if sig.signalType == "stopTrain":
            await self.stub.ReportStopComplete(pb.StopCompleteRequest(status=pb.Status(), **who))
        elif sig.signalType == "globalFault":
            await self.stub.ReportRecoverStrategy(
                pb.RecoverStrategyRequest(strategies=["recover", "exit"], **who)
            )
        elif sig.signalType == "changeStrategy":
            await self.stub.ReportRecoverStatus(
                pb.RecoverStatusRequest(status=pb.Status(), strategy=sig.changeStrategy, **who)
            )
            self.done(sig.cycle).set()


class Bench:
    def __init__(self, address: str, timeout: float) -> None:
        self.address = address
        self.timeout = timeout
        self.channels: list[grpc.aio.Channel] = []
        self.tasks: list[asyncio.Task[None]] = []

    def stub(self, index: int) -> recover_pb2_grpc.RecoverStub:
        while len(self.channels) <= index // STREAMS_PER_CHANNEL:
            # A local subchannel pool gives each channel its own TCP connection.
            self.channels.append(
                grpc.aio.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1)])
            )
        return recover_pb2_grpc.RecoverStub(self.channels[index // STREAMS_PER_CHANNEL])

    async def start_agents(self, specs: list[tuple[str, str]]) -> list[Agent]:
        """Join and subscribe agents ``(job, agent id)``; return once every stream is live."""
        agents = [Agent(self.stub(i), job, aid) for i, (job, aid) in enumerate(specs)]
        await asyncio.gather(*(a.join() for a in agents))
        self.tasks += [asyncio.create_task(a.run()) for a in agents]
        jobs = {a.job_id for a in agents}
        stub = self.stub(0)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            reply = await stub.QueryStatus(pb.StatusQuery())
            live = sum(ag.subscribed for j in reply.jobs if j.jobId in jobs for ag in j.agents)
            if live == len(agents):
                return agents
            await asyncio.sleep(0.05)
        raise TimeoutError(f"only some of {len(agents)} agents subscribed within {self.timeout}s")

    async def cycle(self, agents: list[Agent], cycle: int, stub: recover_pb2_grpc.RecoverStub) -> float:
        """Report a fault for the agents' job; wait for the cycle to end; return the start time."""
        t0 = time.perf_counter()
        reply = await stub.ReportProcessFault(
            pb.ProcessFaultRequest(jobId=agents[0].job_id, faultRanks=FAULT)
        )
        if reply.code != 0:
            raise RuntimeError(f"fault report refused: {reply.info}")
        await asyncio.wait_for(asyncio.gather(*(a.done(cycle).wait() for a in agents)), self.timeout)
        return t0

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for channel in self.channels:
            await channel.close()


async def single_agent(bench: Bench, cycles: int) -> dict[str, Any]:
    (agent,) = await bench.start_agents([("bench-single", "a0")])
    latencies = []
    for c in range(1, cycles + 1):
        t0 = await bench.cycle([agent], c, agent.stub)
        latencies.append(agent.arrivals[(c, "changeStrategy")] - t0)
    return summary_ms(latencies)


async def fan_out(bench: Bench, agents_n: int, cycles: int) -> dict[str, Any]:
    job = f"bench-fanout-{agents_n}"
    agents = await bench.start_agents([(job, f"a{i}") for i in range(agents_n)])
    each, last = [], []
    for c in range(1, cycles + 1):
        t0 = await bench.cycle(agents, c, agents[0].stub)
        arrivals = [a.arrivals[(c, "stopTrain")] - t0 for a in agents]
        each += arrivals
        last.append(max(arrivals))
    return {
        "agents": agents_n,
        "cycles": cycles,
        "per_agent": summary_ms(each),
        "all_agents": summary_ms(last),
    }


async def many_jobs(bench: Bench, jobs_n: int) -> dict[str, Any]:
    t_join = time.perf_counter()
    agents = await bench.start_agents([(f"bench-job-{i}", "a0") for i in range(jobs_n)])
    joined = time.perf_counter() - t_join
    starts = await asyncio.gather(*(bench.cycle([a], 1, a.stub) for a in agents))
    latencies = [a.arrivals[(1, "changeStrategy")] - t0 for a, t0 in zip(agents, starts, strict=True)]
    return {"jobs": jobs_n, "join_all_s": round(joined, 2), "fault_to_change_strategy": summary_ms(latencies)}


def start_controller(workdir: Path, extra: Sequence[str] = ()) -> tuple[subprocess.Popen[bytes], str]:
    """``taskd controller`` on a free loopback port (``extra``: more of its options); its process and address."""
    port_file = workdir / "port"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "taskd_core",
            "--log-level",
            "WARNING",
            "controller",
            "--listen",
            "127.0.0.1:0",
            "--state",
            ":memory:",
            "--port-file",
            str(port_file),
            "--flush-seconds",
            "0",
            "--report-timeout",
            "120",
            "--max-cycles",
            "1000000",
            # Every simulated agent is one tokenless host here (127.0.0.1): the bench measures the
            # controller, not the per-host quotas that would rightly stop this much from one host.
            "--max-requests-per-second",
            "1000000",
            "--max-jobs-per-peer",
            "1000000",
            "--max-journal-bytes-per-second",
            "1000000000",
            "--strategies",
            "recover,exit",
            *extra,
        ],
        cwd=ROOT,
    )
    deadline = time.monotonic() + 30
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("controller did not start")
        time.sleep(0.05)
    return proc, port_file.read_text().strip()


async def run(args: argparse.Namespace, pid: int, address: str) -> dict[str, Any]:
    report: dict[str, Any] = {"memory_kib": {}}
    bench = Bench(address, args.timeout)
    try:
        report["memory_kib"]["start"] = memory_kib(pid)
        report["single_agent_fault_to_change_strategy"] = await single_agent(bench, args.cycles)
        report["memory_kib"]["after_single"] = memory_kib(pid)
        report["fan_out_stop_train"] = []
        for n in args.fanout:
            cycles = max(5, min(args.cycles, 2000 // n))
            report["fan_out_stop_train"].append(await fan_out(bench, n, cycles))
            report["memory_kib"][f"after_fanout_{n}"] = memory_kib(pid)
        if args.jobs:
            report["many_jobs"] = await many_jobs(bench, args.jobs)
            report["memory_kib"]["after_many_jobs"] = memory_kib(pid)
    finally:
        await bench.close()
    return report


def render(report: dict[str, Any]) -> str:
    single = report["single_agent_fault_to_change_strategy"]
    lines = [
        f"1 agent, fault -> changeStrategy over {single['n']} cycles: "
        f"p50 {single['p50_ms']} ms, p99 {single['p99_ms']} ms"
    ]
    for row in report["fan_out_stop_train"]:
        each, last = row["per_agent"], row["all_agents"]
        lines.append(
            f"{row['agents']:>5} agents, fault -> stopTrain ({row['cycles']} cycles): per agent p50 "
            f"{each['p50_ms']} ms p99 {each['p99_ms']} ms; last agent p50 {last['p50_ms']} ms "
            f"p99 {last['p99_ms']} ms"
        )
    if "many_jobs" in report:
        mj = report["many_jobs"]
        lat = mj["fault_to_change_strategy"]
        lines.append(
            f"{mj['jobs']} jobs x 1 agent: joined in {mj['join_all_s']} s; all faulting at once, "
            f"fault -> changeStrategy p50 {lat['p50_ms']} ms p99 {lat['p99_ms']} ms"
        )
    mem = report["memory_kib"]
    lines.append(
        "controller RSS (MiB): "
        + ", ".join(f"{k} {v['VmRSS'] / 1024:.1f}" for k, v in mem.items())
        + f"; peak {max(v['VmHWM'] for v in mem.values()) / 1024:.1f}"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=200, help="cycles for the single-agent part")
    parser.add_argument("--fanout", default="10,100,1000", help="agent counts for the fan-out part")
    parser.add_argument("--jobs", type=int, default=1000, help="jobs for the many-jobs part (0 skips it)")
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline of any single wait, seconds")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    args = parser.parse_args(argv)
    args.fanout = [int(n) for n in args.fanout.split(",") if n]
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_controller(Path(tmp))
        try:
            report = asyncio.run(run(args, proc.pid, address))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    report["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
