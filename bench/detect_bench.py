"""Detection latency: SIGKILL of a worker → ``ReportProcessFault`` handled by the controller.

Three agents, each measured on the same set-up (real :class:`EmbeddedController`,
real :class:`ProcessAdapter` with ``--workers`` ``sleep`` workers, the real
client, dispatcher and recovery cycle; everything runs in this process):

* ``taskd``: the real :class:`NodeAgent`, which waits on pidfds;
* ``poll-0.1s`` / ``poll-1s``: the same NodeAgent whose pidfd wait is
  replaced by a plain sleep of 0.1 s (torchrun's monitor interval) or 1 s (the
  reference agent's): every interval it calls MONITOR (``Popen.poll``) and
  reports what failed through the same client. Nothing else differs.

For each kill the bench waits until the job is idle and every worker runs,
sleeps a random 0–``--jitter`` s (so kills land at random phases of a polling
loop), takes ``time.time()`` and SIGKILLs a random worker. The arrival time is
the wall-clock time of the controller's ``fault`` journal event for that kill
(read through ``QueryStatus``; the controller stamps it when it handles the
RPC), so no library code is modified or wrapped.

Run::

    .venv/bin/python bench/detect_bench.py --kills 50 --json /tmp/detect.json
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import random
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    exit_on_sigterm,
    fmt,
    job_events,
    job_status,
    machine,
    markdown_table,
    poll_until,
    setup_logging,
    summarize,
    write_json,
)

from taskd_core.agent.config import AgentConfig, DispatchConfig, RestartBackoff
from taskd_core.agent.node_agent import AgentOutcome, NodeAgent
from taskd_core.agent.pidwatch import PidWatch
from taskd_core.controller.server import EmbeddedController
from taskd_core.launcher import LaunchSpec, ProcessAdapter
from taskd_core.models import JobPolicy, JournalEvent, WorkerState
from taskd_core.plugins import load_adapter

logger = logging.getLogger(__name__)

#: Flush window of the bench's controller: it only delays the recovery cycle
#: that follows each detection, never the detection itself, so keep it short.
_FLUSH = 0.05
#: Deadline for one kill to be detected, recovered and settled again.
_KILL_DEADLINE = 30.0
#: The target: median kill → arrival at the controller, seconds.
TARGET_P50 = 0.020


class PollingWatch(PidWatch):
    """A :class:`PidWatch` that ignores pidfds: :meth:`wait` sleeps ``interval`` (or until :meth:`wake`)."""

    def __init__(self, interval: float) -> None:
        super().__init__()
        self.interval = interval

    def watch(self, pids: object) -> set[int]:
        return set()

    def wait(self, timeout: float) -> set[int]:
        return super().wait(self.interval)


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    #: None: the real pidfd wait; otherwise the polling interval in seconds.
    interval: float | None


VARIANTS = (Variant("taskd", None), Variant("poll-0.1s", 0.1), Variant("poll-1s", 1.0))


def _make_agent(variant: Variant, address: str, workers: int, log_dir: Path) -> NodeAgent:
    job_id = f"detect-{variant.name}"
    spec = LaunchSpec(
        ("sleep", "3600"),
        nproc=workers,
        job_id=job_id,
        log_dir=log_dir,
        independent_workers=True,
        stop_timeout=5.0,
    )
    agent = NodeAgent(
        AgentConfig(
            job_id=job_id,
            controller=address,
            connect_timeout=10.0,
            dispatch=DispatchConfig(stop_timeout=5.0),
            # Each kill lands within seconds of the last restart: without this, the bench would time
            # the restart backoff of a crash loop, not the detection.
            restart_backoff=RestartBackoff(initial=0.0),
        ),
        load_adapter("process", instance=ProcessAdapter(spec)),
    )
    if variant.interval is not None:
        agent._watch.close()
        agent._watch = PollingWatch(variant.interval)
    return agent


def _settled(agent: NodeAgent, address: str, gone: frozenset[int]) -> dict[int, int] | None:
    """``{local rank: pid}`` when the job is idle and every worker runs a pid not in ``gone``; else None."""
    view = job_status(address, agent.config.job_id, events=0)
    if view is None or view.state != "idle":
        return None
    statuses = agent.adapter.monitor()
    if not all(s.state is WorkerState.RUNNING and s.pid and s.pid not in gone for s in statuses.values()):
        return None
    return {rank: s.pid for rank, s in statuses.items() if s.pid}


def _wait_settled(agent: NodeAgent, address: str, killed: set[int], what: str) -> dict[int, int]:
    probe = functools.partial(_settled, agent, address, frozenset(killed))
    return poll_until(probe, _KILL_DEADLINE, what, interval=0.05)


def _faults_after(address: str, job_id: str, seq: int) -> list[JournalEvent]:
    """The job's ``fault`` journal events after sequence number ``seq``, oldest first."""
    return [e for e in job_events(address, job_id, events=50) if e.seq > seq and e.kind == "fault"]


def measure(variant: Variant, kills: int, workers: int, jitter: float, rng: random.Random) -> list[float]:
    """Kill → arrival latencies in seconds, one per kill."""
    policy = JobPolicy(flush_seconds=_FLUSH, max_cycles=kills + 1, report_timeout=_KILL_DEADLINE)
    latencies: list[float] = []
    killed: set[int] = set()
    with EmbeddedController(defaults=policy) as ctl, tempfile.TemporaryDirectory(prefix="detect-") as logs:
        agent = _make_agent(variant, ctl.address, workers, Path(logs))
        outcome: list[AgentOutcome] = []
        runner = threading.Thread(target=lambda: outcome.append(agent.run()), name="bench-agent", daemon=True)
        runner.start()
        last_seq = 0
        try:
            for i in range(kills):
                pids = _wait_settled(
                    agent, ctl.address, killed, f"{variant.name}: recovery before kill {i + 1}"
                )
                time.sleep(rng.uniform(0.0, jitter))
                victim = pids[rng.randrange(workers)]
                killed.add(victim)
                t_kill = time.time()
                os.kill(victim, signal.SIGKILL)
                faults = poll_until(
                    functools.partial(_faults_after, ctl.address, agent.config.job_id, last_seq),
                    _KILL_DEADLINE,
                    f"{variant.name}: fault event of kill {i + 1}",
                    interval=0.05,
                )
                last_seq = max(e.seq for e in faults)
                latencies.append(faults[0].time - t_kill)
                logger.debug("%s kill %d: pid %s, %.1f ms", variant.name, i + 1, victim, latencies[-1] * 1e3)
            # Nothing may be in flight when the agent stops: a restart after its final stop would outlive it.
            _wait_settled(agent, ctl.address, killed, f"{variant.name}: recovery after the last kill")
        finally:
            agent.shutdown()
            runner.join(agent.config.dispatch.stop_timeout + 10.0)
            if runner.is_alive():
                logger.error("%s agent did not stop", variant.name)
            stray = [
                s.pid for s in agent.adapter.monitor().values() if s.state is WorkerState.RUNNING and s.pid
            ]
            if stray:
                logger.error("%s: workers %s outlived their agent; SIGKILL", variant.name, stray)
                for pid in stray:
                    os.kill(pid, signal.SIGKILL)
    logger.info(
        "%s: %d kills, outcome %s", variant.name, len(latencies), outcome[0].kind.value if outcome else "?"
    )
    return latencies


def report(results: dict[str, dict[str, Any]]) -> str:
    """Markdown table of the variants' latencies in milliseconds."""
    rows = []
    for name in (v.name for v in VARIANTS):
        r = results[name]
        rows.append(
            [
                name,
                "pidfd" if r["interval"] is None else f"poll every {r['interval']:g} s",
                r["n"],
                *(fmt(r[key] * 1e3, 1) for key in ("median", "p99", "min", "max")),
            ]
        )
    return markdown_table(["agent", "detection", "kills", "p50 ms", "p99 ms", "min ms", "max ms"], rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=50, help="kills per agent variant (default: %(default)s)")
    p.add_argument("--workers", type=int, default=4, help="workers under the agent (default: %(default)s)")
    p.add_argument(
        "--jitter",
        type=float,
        default=1.0,
        help="random extra wait before each kill, 0..S seconds (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed of victims and kill phases")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args()
    setup_logging(args.log_level)
    exit_on_sigterm()
    if args.kills < 1 or args.workers < 1 or args.jitter < 0:
        p.error("--kills and --workers must be at least 1, --jitter not negative")
    info = machine()
    results: dict[str, dict[str, Any]] = {}
    for variant in VARIANTS:
        latencies = measure(variant, args.kills, args.workers, args.jitter, random.Random(args.seed))
        results[variant.name] = {
            "interval": variant.interval,
            "latencies_s": latencies,
            **summarize(latencies).as_dict(),
        }
    print(report(results))
    write_json(
        args.json,
        {
            "bench": "detect",
            "machine": info,
            "loadavg_at_end": os.getloadavg(),
            "kills": args.kills,
            "workers": args.workers,
            "jitter": args.jitter,
            "results": results,
            "target": {
                "what": f"taskd p50 under {TARGET_P50 * 1e3:g} ms",
                "met": results["taskd"]["median"] < TARGET_P50,
            },
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
