"""Controller replicas on etcd: fail-over, latency against SQLite, scale, chaos.

A real etcd (``/usr/bin/etcd``, free loopback ports, a temporary data dir) and
``taskd controller`` processes on one prefix (``--lease-ttl``, default 2 s):

* **failover**: SIGKILL the leader ``--failovers`` times (20): seconds until
  the standby answers SERVING, and until a fault report that a real client
  (``DLRecoverManager`` given both replicas) sent right after the kill is
  taken, counted from SERVING. The killed replica comes back as the standby.
* **latency**: one agent, fault -> changeStrategy over ``--cycles`` cycles on
  a SQLite state file and on etcd, same run, both on the same disk (median
  ratio etcd / SQLite).
* **scale**: ``--agents`` (2048) simulated nodes of one job in ``--procs``
  processes (grpc.aio, real streams, each following the leader as TaskD's
  client does): one node's fault -> stopTrain at every agent (p50/p99);
  the leader's RSS and etcd's database size; then the leader is SIGKILLed and
  every agent's time until it holds a stream on the new leader.
* **chaos**: a ``taskd run`` job given three replicas (``--controller A,B,C``)
  trains a deterministic job (bench/chaos_bench.py's worker) while workers
  are killed one at a time; during each recovery the leader is SIGKILLed
  (``--kills``) or SIGSTOPped past its lease (``--freezes``). Counts jobs
  lost, cycles started twice, ranks restarted more than once per kill, and
  compares the final parameters with a fault-free run.

Usage: ``.venv/bin/python bench/failover_bench.py [--parts failover,latency,scale,chaos]
[--failovers 20] [--cycles 200] [--agents 2048] [--procs 4] [--kills 50] [--freezes 20]
[--json out.json]``. Prints one table with medians and the targets' ratios. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import (  # noqa: E402
    PYTHON,
    REPO,
    Children,
    exit_on_sigterm,
    free_port,
    job_events,
    job_status,
    machine,
    markdown_table,
    pid_alive,
    poll_until,
    rss_mib,
    setup_logging,
    summarize,
    write_json,
)
from _nodes import start_etcd  # noqa: E402
from chaos_bench import JOB as CHAOS_JOB  # noqa: E402
from chaos_bench import NPROC, WORKER, fault_free, job_processes  # noqa: E402
from controller_bench import Bench, single_agent  # noqa: E402

from taskd_core.client.manager import DLRecoverManager  # noqa: E402
from taskd_core.controller.etcd_client import EtcdClient, parse_etcd_url  # noqa: E402
from taskd_core.errors import TaskdError  # noqa: E402
from taskd_core.models import Credentials, JobStatus, Signal, SignalType  # noqa: E402
from taskd_core.rpc import (
    LEADER_METADATA,  # noqa: E402
    recover_pb2_grpc,  # noqa: E402
)
from taskd_core.rpc import recover_pb2 as pb  # noqa: E402

logger = logging.getLogger("failover_bench")

ADMIN = "bench-admin-token"
#: Issue 23's targets: leader SIGKILLed → a standby SERVING (p50), seconds; → the agent's report taken, seconds.
SERVE_TARGET = 3.0
REPORT_TARGET = 1.0
#: fault → changeStrategy on etcd, at most this many times the SQLite figure (p50, same run).
LATENCY_RATIO_TARGET = 2.0
#: One node's fault → stopTrain at every agent (p99), and every agent following a new leader, seconds.
FANOUT_P99_TARGET = 1.0
FOLLOW_TARGET = 10.0


# --- etcd and replicas ---------------------------------------------------------------------------


def etcd_db_size(endpoint: str) -> int:
    """Bytes of etcd's database file (0 when it does not answer)."""

    async def ask() -> int:
        client = EtcdClient(parse_etcd_url(f"etcd://{endpoint}/x"))
        try:
            return int((await client.status(timeout=1.0)).dbSize)
        except TaskdError:
            return 0
        finally:
            await client.close()

    return asyncio.run(ask())


@dataclass
class Replica:
    """One ``taskd controller`` on a fixed port (a restarted one keeps its address)."""

    children: Children
    root: Path
    state: str
    name: str
    extra: Sequence[str] = ()
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Replica:
        (self.root / "admin").write_text(ADMIN)
        (self.root / "admin").chmod(0o600)  # the controller refuses a token file others may read
        self.proc = self.children.start(
            [
                PYTHON,
                "-m",
                "taskd_core",
                "--log-level",
                "INFO",
                "controller",
                "--listen",
                self.address,
                "--state",
                self.state,
                "--admin-token-file",
                str(self.root / "admin"),
                "--flush-seconds",
                "0",
                "--report-timeout",
                "120",
                "--max-cycles",
                "1000000",
                "--keepalive-interval",
                "2",
                "--strategies",
                "recover-in-place,recover,exit",
                *self.extra,
            ],
            log=self.root / f"{self.name}.log",
            cwd=REPO,
        )
        poll_until(lambda: health(self.address) >= 0 or None, 60, f"{self.name} to answer", interval=0.05)
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


def health(address: str, timeout: float = 2.0) -> int:
    """1 SERVING, 2 NOT_SERVING, -1 no answer (the gRPC health service)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            return int(
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(), timeout=timeout)
                .status
            )
        except grpc.RpcError:
            return -1


def leader(replicas: Sequence[Replica], timeout: float = 60.0) -> Replica:
    return poll_until(
        lambda: next((r for r in replicas if health(r.address) == 1), None), timeout, "a leader"
    )


def job_view(addresses: str, job: str) -> JobStatus | None:
    try:
        return job_status(addresses, job, events=0, token=ADMIN)
    except TaskdError:
        return None


# --- failover --------------------------------------------------------------------------------------


class Answering:
    """A signal handler that answers as an agent whose actions all succeed."""

    def __init__(self) -> None:
        self.manager: DLRecoverManager | None = None
        self.changes = 0

    def __call__(self, signal_: Signal) -> None:
        manager = self.manager
        assert manager is not None
        faults = {f.rank: int(f.fault_type.value) for f in signal_.fault_ranks}
        if signal_.signal_type == SignalType.STOP_TRAIN:
            manager.report_stop_complete(0, "stopped", faults)
        elif signal_.signal_type == SignalType.GLOBAL_FAULT:
            manager.report_recover_strategy(faults, ["recover", "exit"])
        elif signal_.signal_type == SignalType.CHANGE_STRATEGY:
            manager.report_recover_status(0, "done", faults, signal_.change_strategy)
            self.changes += 1


def failover(root: Path, children: Children, etcd: str, trials: int, ttl: int) -> dict[str, Any]:
    state = f"etcd://{etcd}/failover-{uuid.uuid4().hex[:8]}"
    extra = ("--lease-ttl", str(ttl))
    replicas = [Replica(children, root, state, f"failover-{n}", extra).start() for n in range(2)]
    handler = Answering()
    manager = DLRecoverManager.for_job(
        "bench-failover",
        ",".join(r.address for r in replicas),
        agent_id="a0",
        handler=handler,
        credentials=Credentials(token="job-token"),
        connect_deadline=120,
        report_deadline=120,
    )
    handler.manager = manager
    thread = threading.Thread(target=manager.start_subscribe, kwargs={"frame": "bench"}, daemon=True)
    thread.start()
    serve_s: list[float] = []
    report_s: list[float] = []
    try:
        for trial in range(trials):
            current = leader(replicas)
            poll_until(
                lambda c=current: (
                    (v := job_view(c.address, "bench-failover"))
                    and v.state.value == "idle"
                    and v.agents
                    and all(a.subscribed for a in v.agents)
                    or None
                ),
                60,
                "the job idle and followed",
            )
            standby = next(r for r in replicas if r is not current)
            done = threading.Event()
            taken: list[float] = []

            def report(taken: list[float] = taken, done: threading.Event = done) -> None:
                if manager.report_process_fault({0: 1}) == 0:
                    taken.append(time.monotonic())
                done.set()

            t_kill = time.monotonic()
            current.kill()
            threading.Thread(target=report, daemon=True).start()
            poll_until(
                lambda s=standby: health(s.address, 1.0) == 1 or None,
                60,
                "the standby to serve",
                interval=0.005,
            )
            t_serving = time.monotonic()
            done.wait(120)
            serve_s.append(t_serving - t_kill)
            if taken:
                report_s.append(max(0.0, taken[0] - t_serving))
            logger.info(
                "fail-over %d: serving after %.2f s, report taken %.2f s later",
                trial + 1,
                serve_s[-1],
                report_s[-1] if taken else float("nan"),
            )
            poll_until(lambda t=trial: handler.changes > t or None, 120, "the cycle to end")
            current.start()  # back as the standby
    finally:
        manager.close()
        thread.join(30)
    return {
        "lease_ttl_s": ttl,
        "trials": trials,
        "kill_to_serving_s": summarize(serve_s).as_dict(),
        "serving_to_report_taken_s": summarize(report_s).as_dict(),
    }


# --- latency: SQLite against etcd ---------------------------------------------------------------------


def latency(root: Path, children: Children, etcd: str, cycles: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, state in (
        ("sqlite", str(root / "latency.db")),
        ("etcd", f"etcd://{etcd}/latency-{uuid.uuid4().hex[:8]}"),
    ):
        replica = Replica(children, root, state, f"latency-{name}").start()
        leader([replica])

        async def measure(address: str = replica.address) -> dict[str, Any]:
            bench = Bench(address, 120.0)
            try:
                return await single_agent(bench, cycles)
            finally:
                await bench.close()

        out[name] = asyncio.run(measure())
        assert replica.proc is not None
        replica.proc.terminate()
        replica.proc.wait(30)
    out["ratio_p50"] = round(out["etcd"]["p50_ms"] / out["sqlite"]["p50_ms"], 2)
    return out


# --- scale: thousands of agents in a few processes --------------------------------------------------


async def _agents_main(addresses: list[str], job: str, first: int, count: int) -> None:
    """Worker mode: ``count`` agents that follow the leader; prints ``ready``, then a JSON dump on ``dump``."""
    # A connection per 50 agents and address, as controller_bench does (one per node in real life).
    channels = {
        (a, group): grpc.aio.insecure_channel(a, options=[("grpc.use_local_subchannel_pool", 1)])
        for a in addresses
        for group in range(count // 50 + 1)
    }
    errors: dict[str, int] = {}
    arrivals: dict[str, dict[str, float]] = {}
    subscribed: dict[str, list[float]] = {}
    ready = asyncio.Event()
    joined = 0

    async def agent(index: int) -> None:
        nonlocal joined
        name = f"n{index}"
        info = pb.ClientInfo(jobId=job, role="bench", agentId=name, nodeRank=index, rankIds=[str(index)])
        current = addresses[index % len(addresses)]
        marked = False
        while True:
            stub = recover_pb2_grpc.RecoverStub(channels[current, (index - first) // 50])
            call = None
            try:
                await stub.Init(info)
                await stub.Register(info)
                call = stub.SubscribeProcessManageSignal(info)
                await call.initial_metadata()
                subscribed.setdefault(name, []).append(time.time())
                if not marked:
                    marked = True
                    joined += 1
                    if joined == count:
                        ready.set()
                async for sig in call:
                    if sig.signalType == "keep-alive":
                        continue
                    arrivals.setdefault(name, {}).setdefault(f"{sig.signalType}-{sig.cycle}", time.time())
                    who = {"jobId": job, "agentId": name, "uuid": sig.uuid}
                    if sig.signalType == "stopTrain":
                        await stub.ReportStopComplete(pb.StopCompleteRequest(status=pb.Status(), **who))
                    elif sig.signalType == "globalFault":
                        await stub.ReportRecoverStrategy(
                            pb.RecoverStrategyRequest(strategies=["recover", "exit"], **who)
                        )
                    elif sig.signalType == "changeStrategy":
                        await stub.ReportRecoverStatus(
                            pb.RecoverStatusRequest(status=pb.Status(), strategy=sig.changeStrategy, **who)
                        )
            except grpc.aio.AioRpcError as exc:
                if call is not None:
                    call.cancel()  # a failed report must not leave the stream open behind the next one
                errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
                errors[f"{exc.code().name}: {(exc.details() or '')[:60]}"] = 1
                trailing = dict(exc.trailing_metadata() or ())
                named = str(trailing.get(LEADER_METADATA, ""))
                if exc.code() is grpc.StatusCode.ALREADY_EXISTS:
                    # The controller has not yet seen the old stream go: as TaskD's client, wait.
                    await asyncio.sleep(random.uniform(0.5, 1.0))
                    continue
                current = (
                    named
                    if named in addresses
                    else addresses[(addresses.index(current) + 1) % len(addresses)]
                )
                await asyncio.sleep(
                    random.uniform(0.1, 0.2) if LEADER_METADATA in trailing else random.uniform(0.05, 0.3)
                )

    tasks = [asyncio.create_task(agent(i)) for i in range(first, first + count)]
    await ready.wait()
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    while (line := await loop.run_in_executor(None, sys.stdin.readline)).strip() != "quit":
        if line.strip() == "dump":
            print(json.dumps({"arrivals": arrivals, "subscribed": subscribed, "errors": errors}), flush=True)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def scale(root: Path, children: Children, etcd: str, agents: int, procs: int, ttl: int) -> dict[str, Any]:
    state = f"etcd://{etcd}/scale-{uuid.uuid4().hex[:8]}"
    replicas = [
        Replica(children, root, state, f"scale-{n}", ("--lease-ttl", str(ttl))).start() for n in range(2)
    ]
    first_leader = leader(replicas)
    addresses = ",".join(r.address for r in replicas)
    job = "bench-scale"
    workers = []
    per = -(-agents // procs)
    t_join = time.monotonic()
    for p in range(procs):
        count = min(per, agents - p * per)
        workers.append(
            subprocess.Popen(
                [PYTHON, __file__, "--agents-worker", addresses, job, str(p * per), str(count)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=REPO,
            )
        )
    for w in workers:
        assert w.stdout is not None
        if w.stdout.readline().strip() != "ready":
            raise RuntimeError("an agents process did not start")
    joined_s = time.monotonic() - t_join

    def dump() -> dict[str, Any]:
        merged: dict[str, Any] = {"arrivals": {}, "subscribed": {}, "errors": {}}
        for w in workers:
            assert w.stdin is not None and w.stdout is not None
            w.stdin.write("dump\n")
            w.stdin.flush()
            data = json.loads(w.stdout.readline())
            merged["arrivals"].update(data["arrivals"])
            merged["subscribed"].update(data["subscribed"])
            for code, n in data["errors"].items():
                merged["errors"][code] = merged["errors"].get(code, 0) + n
        return merged

    try:
        t0 = time.time()
        with grpc.insecure_channel(first_leader.address) as channel:
            stub = recover_pb2_grpc.RecoverStub(channel)
            reply = stub.ReportProcessFault(
                pb.ProcessFaultRequest(
                    jobId=job, agentId="n0", faultRanks=[pb.FaultRank(rankId="0", faultType="1")]
                ),
                timeout=60,
            )
            assert reply.code == 0, reply
        poll_until(
            lambda: (
                (v := job_view(first_leader.address, job))
                and v.state.value == "idle"
                and v.cycle == 1
                or None
            ),
            300,
            "the cycle over all agents",
            interval=0.2,
        )
        got = dump()
        stop = [
            got["arrivals"][a]["stopTrain-1"] - t0
            for a in got["arrivals"]
            if "stopTrain-1" in got["arrivals"][a]
        ]
        # The replica leading now: on a loaded machine the lease may have moved during the cycle.
        current = leader(replicas, 120)
        assert current.proc is not None
        rss = rss_mib(current.proc.pid)
        db = etcd_db_size(etcd)
        t_kill = time.time()
        current.kill()
        second = leader([r for r in replicas if r is not current], 120)
        poll_until(
            lambda: (
                (v := job_view(second.address, job)) and sum(a.subscribed for a in v.agents) == agents or None
            ),
            300,
            "every agent on the new leader",
            interval=0.2,
        )
        got = dump()
        follow = [
            max(t for t in times if t > t_kill) - t_kill
            for times in got["subscribed"].values()
            if any(t > t_kill for t in times)
        ]
    finally:
        for w in workers:
            if w.poll() is None and w.stdin is not None:
                w.stdin.write("quit\n")
                w.stdin.flush()
        for w in workers:
            try:
                w.wait(30)
            except subprocess.TimeoutExpired:
                w.kill()
    return {
        "agents": agents,
        "procs": procs,
        "join_all_s": round(joined_s, 2),
        "fault_to_stop_train_s": summarize(stop).as_dict(),
        "stop_train_received": len(stop),
        "leader_rss_mib": round(rss, 1),
        "etcd_db_mib": round(db / 2**20, 2),
        "leader_moved_during_cycle": current is not first_leader,
        "kill_to_every_agent_following_s": round(max(follow), 2) if follow else None,
        "followed": len(follow),
        "follow_s": summarize(follow).as_dict(),
        "agent_errors": got["errors"],
    }


# --- chaos ---------------------------------------------------------------------------------------------


def chaos(
    root: Path, children: Children, etcd: str, kills: int, freezes: int, ttl: int, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    state = f"etcd://{etcd}/chaos-{uuid.uuid4().hex[:8]}"
    replicas = [
        Replica(children, root, state, f"chaos-{n}", ("--lease-ttl", str(ttl))).start() for n in range(3)
    ]
    addresses = ",".join(r.address for r in replicas)
    out = root / "out"
    out.mkdir()
    (out / "hold").touch()
    (root / "worker.py").write_text(WORKER)
    steps = 400 + 10 * (kills + freezes)
    run = children.start(
        [
            PYTHON,
            "-m",
            "taskd_core",
            "run",
            "--nproc",
            str(NPROC),
            "--job-id",
            CHAOS_JOB,
            "--controller",
            addresses,
            "--in-place",
            "--connect-timeout",
            "300",
            "--",
            PYTHON,
            str(root / "worker.py"),
            str(out),
            str(steps),
            str(steps - 1),
            "0.01",
        ],
        log=root / "chaos-run.log",
        cwd=REPO,
        env={"TASKD_JOB_TOKEN": "chaos-token"},
    )

    def pids() -> dict[int, int]:
        """Each rank's newest worker, when it runs."""
        found: dict[int, tuple[float, int]] = {}
        for path in out.glob("start-*"):
            _, rank, pid = path.name.split("-")
            started = path.stat().st_mtime
            if pid_alive(int(pid)) and started >= found.get(int(rank), (0.0, 0))[0]:
                found[int(rank)] = (started, int(pid))
        return {rank: pid for rank, (_, pid) in found.items()}

    poll_until(lambda: len(pids()) == NPROC or None, 120, "the job to start")
    plan = ["kill"] * kills + ["freeze"] * freezes
    rng.shuffle(plan)
    recovered = 0
    restarts_expected: dict[int, int] = dict.fromkeys(range(NPROC), 1)
    for i, kind in enumerate(plan):
        current = leader(replicas, 120)
        before = poll_until(lambda: p if len(p := pids()) == NPROC else None, 120, "every rank running")
        rank = rng.randrange(NPROC)
        os.kill(before[rank], signal.SIGKILL)
        restarts_expected[rank] += 1
        time.sleep(rng.uniform(0.0, 0.3))  # the leader goes while the cycle runs
        if kind == "kill":
            current.kill()
            current.start()
        else:
            assert current.proc is not None
            current.proc.send_signal(signal.SIGSTOP)
            time.sleep(ttl + 1.0)
            current.proc.send_signal(signal.SIGCONT)
        try:
            poll_until(
                lambda r=rank, b=before[rank]: (
                    (p := pids()).get(r, b) != b
                    and len(p) == NPROC
                    and (v := job_view(addresses, CHAOS_JOB)) is not None
                    and v.state.value == "idle"
                    or None
                ),
                120,
                f"recovery {i + 1}",
                interval=0.05,
            )
            recovered += 1
        except TimeoutError:
            logger.error("recovery %d (%s) not done", i + 1, kind)
        logger.info("chaos %d/%d (%s): %d recovered", i + 1, len(plan), kind, recovered)
    (out / "hold").unlink()
    code = run.wait(600)
    view = job_view(addresses, CHAOS_JOB)
    events = job_events(addresses, CHAOS_JOB, events=1000, token=ADMIN)
    started = [e.detail.get("uuid") for e in events if e.kind == "cycle started"]
    finals = {
        r: json.loads((out / f"final-{r}.json").read_text())["params"]
        for r in range(NPROC)
        if (out / f"final-{r}.json").exists()
    }
    starts_per_rank = {r: sum(1 for p in out.glob(f"start-{r}-*")) for r in range(NPROC)}
    reference = fault_free(root, steps)
    return {
        "kills": kills,
        "freezes": freezes,
        "recovered": recovered,
        "agent_exit": code,
        "jobs_lost": int(view is None or view.state.value != "finished"),
        "cycles": view.cycle if view else None,
        "cycles_started_twice": len(started) - len(set(started)),
        "extra_restarts": sum(max(0, starts_per_rank[r] - restarts_expected[r]) for r in range(NPROC)),
        "params_equal": finals == reference,
        "leftover_processes": len(job_processes()),
    }


# --- the report -------------------------------------------------------------------------------------------


def table(report: dict[str, Any]) -> str:
    """One row per figure of the parts that ran: what, measured, the issue's target."""
    rows = []
    for part in ("failover", "latency", "scale", "chaos"):
        if "error" in report.get(part, {}):
            rows.append([f"{part}: did not finish", report[part]["error"], ""])
    report = {k: v for k, v in report.items() if not (isinstance(v, dict) and "error" in v)}
    if "failover" in report:
        f = report["failover"]
        rows.append(
            [
                "leader SIGKILLed -> standby SERVING",
                f"p50 {f['kill_to_serving_s']['median']:.2f} s "
                f"(max {f['kill_to_serving_s']['max']:.2f}, {f['trials']} trials, lease {f['lease_ttl_s']} s)",
                f"<= {SERVE_TARGET:g} s",
            ]
        )
        rows.append(
            [
                "SERVING -> the agent's report taken",
                f"p50 {f['serving_to_report_taken_s']['median']:.2f} s "
                f"(max {f['serving_to_report_taken_s']['max']:.2f})",
                f"<= {REPORT_TARGET:g} s",
            ]
        )
    if "latency" in report:
        lat = report["latency"]
        rows.append(
            [
                "fault -> changeStrategy, SQLite",
                f"p50 {lat['sqlite']['p50_ms']} ms, p99 {lat['sqlite']['p99_ms']} ms",
                "",
            ]
        )
        rows.append(
            [
                "fault -> changeStrategy, etcd",
                f"p50 {lat['etcd']['p50_ms']} ms, p99 {lat['etcd']['p99_ms']} ms "
                f"({lat['ratio_p50']} x SQLite)",
                f"<= {LATENCY_RATIO_TARGET:g} x SQLite",
            ]
        )
    if "scale" in report:
        s = report["scale"]
        rows.append(
            [
                f"{s['agents']} agents: fault -> stopTrain at each",
                f"p50 {s['fault_to_stop_train_s']['median']:.3f} s, "
                f"p99 {s['fault_to_stop_train_s']['p99']:.3f} s ({s['stop_train_received']} received)",
                f"p99 <= {FANOUT_P99_TARGET:g} s",
            ]
        )
        rows.append(
            ["leader RSS / etcd database", f"{s['leader_rss_mib']} MiB / {s['etcd_db_mib']} MiB", "reported"]
        )
        rows.append(
            [
                f"leader SIGKILLed, {s['agents']} attached: all following",
                f"{s['kill_to_every_agent_following_s']} s ({s['followed']} agents)",
                f"<= {FOLLOW_TARGET:g} s",
            ]
        )
    if "chaos" in report:
        c = report["chaos"]
        rows.append(
            [
                f"chaos: {c['kills']} leader kills + {c['freezes']} freezes",
                f"{c['recovered']} recovered, jobs lost {c['jobs_lost']}, cycles twice {c['cycles_started_twice']}, "
                f"extra restarts {c['extra_restarts']}, params equal {c['params_equal']}",
                "0 lost, 0 twice, equal",
            ]
        )
    return markdown_table(["what", "measured", "target"], rows)


def render(report: dict[str, Any]) -> str:
    return table(report) + f"\n\nload average at the start: {report['machine']['loadavg_at_start']}"


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--agents-worker":
        addresses, job, first, count = sys.argv[2:6]
        asyncio.run(_agents_main(addresses.split(","), job, int(first), int(count)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="failover,latency,scale,chaos")
    parser.add_argument("--failovers", type=int, default=20)
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--agents", type=int, default=2048)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--freezes", type=int, default=20)
    parser.add_argument("--lease-ttl", type=int, default=2)
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--workdir", type=Path, help="keep the logs and data here (default: a temporary dir)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    exit_on_sigterm()  # a SIGTERMed bench still stops everything it started
    # The bench's own status reads go to whichever replica leads: their hops are no news.
    logging.getLogger("taskd_core.client.endpoints").setLevel(logging.WARNING)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    version = subprocess.run(
        ["/usr/bin/etcd", "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    report: dict[str, Any] = {
        "machine": machine(),
        "command": sys.argv,
        "etcd": version.stdout.split("\n")[0],
    }
    with contextlib.ExitStack() as stack:
        root = args.workdir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="taskd-failover-"))
        )
        root.mkdir(parents=True, exist_ok=True)
        children = stack.enter_context(Children(grace=15.0))
        etcd = start_etcd(
            children, root, "--auto-compaction-mode", "revision", "--auto-compaction-retention", "1000"
        )
        runs: dict[str, Callable[[], dict[str, Any]]] = {
            "failover": lambda: failover(root, children, etcd, args.failovers, args.lease_ttl),
            "latency": lambda: latency(root, children, etcd, args.cycles),
            "scale": lambda: scale(root, children, etcd, args.agents, args.procs, args.lease_ttl),
            "chaos": lambda: chaos(root, children, etcd, args.kills, args.freezes, args.lease_ttl, args.seed),
        }
        for part in (p for p in runs if p in parts):
            try:
                report[part] = runs[part]()
            except (TimeoutError, RuntimeError, TaskdError, grpc.RpcError, OSError) as exc:
                # One part that does not finish is its own result; the others still run and are kept.
                logger.error("%s failed: %s", part, exc)
                report[part] = {"error": f"{type(exc).__name__}: {exc}"}
            write_json(args.json, {**report, "loadavg_at_end": os.getloadavg()})
    report["loadavg_at_end"] = os.getloadavg()
    print(render(report))
    write_json(args.json, report)
    return 0 if not any("error" in report[p] for p in runs if p in report) else 1


if __name__ == "__main__":
    raise SystemExit(main())
