"""Chaos: one long job under many random faults of its workers and of TaskD itself.

One ``taskd controller`` (state file on disk) and one ``taskd run --nproc 2``
node agent train a deterministic job: each rank hashes its parameters once
per step and checkpoints after every step (atomic rename), so a restarted
rank resumes exactly where it stood. Faults are drawn at random, one at a
time, and each must be recovered before the next is injected:

============================  =====================================================
``worker-kill``               SIGKILL a running worker
``worker-stop``               SIGSTOP a worker and leave it frozen: the agent's hang
                              detection (state ``T`` past 0.5 s) must find it, take
                              its stack, kill it and report a hang
``controller-kill``           SIGKILL the controller, start it again 0.5-3 s later
``controller-restart``        SIGTERM the controller, start it again at once
``agent-restart``             SIGKILL ``taskd run`` (its lifeline takes the workers
                              down), start a new one for the same node: a new
                              launch of the job, which the controller accepts once
                              the old launch has been silent for 30 s (its
                              ``LIVE_GRACE``; until then the new one is refused and
                              started again every 2 s)
``outage``                    SIGSTOP the controller for 1-5 s: connections stay
                              open and nothing answers, as in a network partition
============================  =====================================================

A fault counts as recovered when, within ``--deadline`` seconds, the node's
agent holds a signal stream again and every rank runs in a process that was
not hit (a killed rank: a new pid); its recovery time counts from the end of
its cause (the kill, the new controller or agent process, the SIGCONT), as
seen by polling every 50 ms. The last ``--quiet-share`` of the faults
are worker faults only: the controller and agent then live through all of
them, and their open descriptors and memory are read before and after that
stretch. At the end the job is let finish; its final parameters are compared
with a fault-free run of the same worker, and every process of the job, its
lifeline guard and TaskD's own processes must be gone.

Run::

    .venv/bin/python bench/chaos_bench.py --faults 120 --json /tmp/chaos.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    PYTHON,
    REPO,
    Children,
    exit_on_sigterm,
    fmt,
    free_port,
    markdown_table,
    pid_alive,
    poll_until,
    processes_with_env,
    rss_mib,
    setup_logging,
    summarize,
    write_json,
)

from taskd_core.client.query import QueryClient
from taskd_core.errors import ControllerUnavailableError, TaskdError
from taskd_core.models import Credentials, JobState, JobStatus

logger = logging.getLogger(__name__)

#: argv: OUT STEPS HOLD_AT STEP_TIME. Resumes from OUT/ckpt-<rank>.json; holds before step
#: HOLD_AT while OUT/hold exists; writes OUT/final-<rank>.json at STEPS.
WORKER = """
import hashlib, json, os, pathlib, sys, time
out, steps, hold_at = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
step_time = float(sys.argv[4])
rank = int(os.environ["RANK"])
ckpt = out / f"ckpt-{rank}.json"
state = json.loads(ckpt.read_text()) if ckpt.exists() else {"step": 0, "params": "seed"}
(out / f"start-{rank}-{os.getpid()}").touch()
while state["step"] < steps:
    if state["step"] >= hold_at and (out / "hold").exists():
        time.sleep(0.05)
        continue
    time.sleep(step_time)
    params = hashlib.sha256(f"{state['params']}:{rank}:{state['step']}".encode()).hexdigest()
    state = {"step": state["step"] + 1, "params": params}
    tmp = out / f".ckpt-{rank}.{os.getpid()}"
    tmp.write_text(json.dumps(state))
    os.replace(tmp, ckpt)
(out / f"final-{rank}.json").write_text(json.dumps(state))
"""

KINDS = {
    "worker-kill": 40,
    "worker-stop": 15,
    "controller-kill": 15,
    "controller-restart": 10,
    "agent-restart": 4,
    "outage": 10,
}
WORKER_KINDS = ("worker-kill", "worker-stop")
NPROC = 2
JOB = "chaos"


@dataclass
class Fault:
    kind: str
    recovered: bool = False
    seconds: float = float("nan")


@dataclass
class Chaos:
    """The job and the TaskD processes serving it; the fault injectors."""

    root: Path
    children: Children
    steps: int
    step_time: float
    port: int = field(default_factory=free_port)
    controller: subprocess.Popen[bytes] | None = None
    agent: subprocess.Popen[bytes] | None = None
    incarnations: int = 0
    #: lifeline guard of every agent incarnation: all must be gone at the end.
    guards: list[int] = field(default_factory=list)
    #: when the last fault's cause ended (kill sent, process started again, SIGCONT):
    #: recovery counts from here.
    back_at: float = 0.0

    @property
    def out(self) -> Path:
        return self.root / "out"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def admin(self) -> Credentials:
        """The bench reads the job's state with the controller's admin token (the job has its own)."""
        return Credentials(token=(self.root / "admin.token").read_text().strip())

    def start_controller(self) -> None:
        self.incarnations += 1
        self.back_at = time.monotonic()
        self.controller = self.children.start(
            [
                PYTHON,
                "-m",
                "taskd_core",
                "controller",
                "--listen",
                self.address,
                "--state",
                str(self.root / "state.db"),
                "--max-cycles",
                "100000",
                "--flush-seconds",
                "0.1",
                "--report-timeout",
                "30",
                "--admin-token-file",
                str(self.root / "admin.token"),
            ],
            log=self.root / "controller.log",
            cwd=REPO,
        )
        poll_until(lambda: self._view() is not False, 60, "controller to serve", interval=0.05)

    def _view(self) -> JobStatus | None | bool:
        """The job as the controller sees it (None: unknown yet); False: the controller does not answer."""
        try:
            with QueryClient(self.address, self.admin, timeout=2.0) as controller:
                return controller.job(JOB)
        except ControllerUnavailableError:
            return False
        except TaskdError:  # answered: it does not know the job (yet)
            return None

    def start_agent(self) -> None:
        script = self.root / "worker.py"
        self.agent = self.children.start(
            [
                PYTHON,
                "-m",
                "taskd_core",
                "run",
                "--controller",
                self.address,
                "--job-id",
                JOB,
                "--nproc",
                str(NPROC),
                "--connect-timeout",
                "120",
                "--restart-backoff",
                "0",
                "--stop-timeout",
                "5",
                "--",
                PYTHON,
                str(script),
                str(self.out),
                str(self.steps),
                str(self.steps - 1),
                str(self.step_time),
            ],
            log=self.root / "agent.log",
            cwd=REPO,
        )
        agent = self.agent
        guard = poll_until(
            lambda: _child_guard(agent.pid) or (agent.poll() is not None and -1), 60, "a guard"
        )
        if guard > 0:
            self.guards.append(guard)

    def start_agent_until_accepted(self, deadline: float) -> None:
        """Start agents until one is not refused at once (a new launch waits out the old one's grace)."""
        end = time.monotonic() + deadline
        while True:
            self.start_agent()
            assert self.agent is not None
            accepted = poll_until(
                lambda: self.subscribed() or self.agent.poll() is not None,
                deadline,  # type: ignore[union-attr]
                "the agent to subscribe or end",
            )
            if self.agent.poll() is None and accepted:
                return
            if time.monotonic() > end:
                raise TimeoutError(f"no agent was accepted within {deadline:.0f}s")
            time.sleep(2.0)

    # --- what the job looks like -------------------------------------------------------------

    def rank_pids(self) -> dict[int, int]:
        """Each rank's newest started pid that is still alive (absent: the rank is not running)."""
        newest: dict[int, tuple[float, int]] = {}
        for path in self.out.glob("start-*"):
            _, rank, pid = path.name.split("-")
            stamp = path.stat().st_mtime
            if int(rank) not in newest or stamp >= newest[int(rank)][0]:
                newest[int(rank)] = (stamp, int(pid))
        return {r: pid for r, (_, pid) in newest.items() if pid_alive(pid)}

    def subscribed(self) -> bool:
        view = self._view()
        return isinstance(view, JobStatus) and any(a.subscribed for a in view.agents)

    def healthy(self, hit: set[int]) -> bool:
        """The agent holds its stream and every rank runs in a pid the fault did not hit."""
        pids = self.rank_pids()
        return len(pids) == NPROC and not (set(pids.values()) & hit) and self.subscribed()

    # --- injectors: each returns the pids it hit ------------------------------------------------

    def inject(self, kind: str, rng: random.Random) -> set[int]:
        injectors: dict[str, Callable[[random.Random], set[int]]] = {
            "worker-kill": self._worker_kill,
            "worker-stop": self._worker_stop,
            "controller-kill": self._controller_kill,
            "controller-restart": self._controller_restart,
            "agent-restart": self._agent_restart,
            "outage": self._outage,
        }
        return injectors[kind](rng)

    def _victim(self, rng: random.Random) -> int:
        pids = poll_until(lambda: self.rank_pids() if len(self.rank_pids()) == NPROC else None, 60, "ranks")
        return pids[rng.choice(sorted(pids))]

    def _worker_kill(self, rng: random.Random) -> set[int]:
        pid = self._victim(rng)
        os.kill(pid, signal.SIGKILL)
        self.back_at = time.monotonic()
        return {pid}

    def _worker_stop(self, rng: random.Random) -> set[int]:
        pid = self._victim(rng)
        os.kill(pid, signal.SIGSTOP)
        self.back_at = time.monotonic()
        return {pid}

    def _controller_kill(self, rng: random.Random) -> set[int]:
        assert self.controller is not None
        self.controller.kill()
        self.controller.wait(30)
        time.sleep(rng.uniform(0.5, 3.0))
        self.start_controller()
        return set()

    def _controller_restart(self, rng: random.Random) -> set[int]:
        assert self.controller is not None
        self.controller.terminate()
        self.controller.wait(30)
        self.start_controller()
        return set()

    def _agent_restart(self, rng: random.Random) -> set[int]:
        assert self.agent is not None
        hit = set(self.rank_pids().values())
        self.agent.kill()
        self.agent.wait(30)
        self.back_at = time.monotonic()
        self.start_agent_until_accepted(120.0)
        return hit

    def _outage(self, rng: random.Random) -> set[int]:
        assert self.controller is not None
        self.controller.send_signal(signal.SIGSTOP)
        time.sleep(rng.uniform(1.0, 5.0))
        self.controller.send_signal(signal.SIGCONT)
        self.back_at = time.monotonic()
        return set()


def resources(pid: int) -> dict[str, float]:
    return {"fds": float(len(os.listdir(f"/proc/{pid}/fd"))), "rss_mib": rss_mib(pid)}


def _child_guard(parent: int) -> int | None:
    """The lifeline guard process ``parent`` started, if it runs yet."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"_lifeline_guard.py" in cmdline and int(stat[stat.rfind(")") + 2 :].split()[1]) == parent:
            return int(entry)
    return None


def job_processes() -> list[int]:
    """Live processes that carry the job's TASKD_JOB_ID: its workers and anything they started."""
    return processes_with_env(f"TASKD_JOB_ID={JOB}")


def fault_free(root: Path, steps: int) -> dict[int, str]:
    """Final parameters of each rank run straight through without TaskD or faults."""
    out = root / "reference"
    out.mkdir()
    params = {}
    for rank in range(NPROC):
        subprocess.run(
            [PYTHON, str(root / "worker.py"), str(out), str(steps), str(steps), "0"],
            env={**os.environ, "RANK": str(rank)},
            check=True,
            timeout=300,
        )
        params[rank] = json.loads((out / f"final-{rank}.json").read_text())["params"]
    return params


def run(
    faults: int, quiet_share: float, deadline: float, steps: int, step_time: float, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    quiet_from = int(faults * (1 - quiet_share))
    plan = [
        rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        if i < quiet_from
        else rng.choice(WORKER_KINDS)
        for i in range(faults)
    ]
    with tempfile.TemporaryDirectory(prefix="taskd-chaos-") as tmp, Children(grace=30.0) as children:
        root = Path(tmp)
        (root / "worker.py").write_text(WORKER)
        (root / "admin.token").write_text(secrets.token_urlsafe(32))
        (root / "admin.token").chmod(0o600)  # the controller refuses a token file others may read
        chaos = Chaos(root, children, steps, step_time)
        chaos.out.mkdir()
        (chaos.out / "hold").touch()
        chaos.start_controller()
        chaos.start_agent()
        poll_until(lambda: chaos.healthy(set()), deadline, "the job to start")
        done: list[Fault] = []
        before: dict[str, dict[str, float]] = {}
        t0 = time.monotonic()
        for i, kind in enumerate(plan):
            if i == quiet_from:
                assert chaos.controller is not None and chaos.agent is not None
                before = {"controller": resources(chaos.controller.pid), "agent": resources(chaos.agent.pid)}
            hit = chaos.inject(kind, rng)
            fault = Fault(kind)
            try:
                poll_until(
                    lambda hit=hit: chaos.healthy(hit), deadline, f"recovery from {kind}", interval=0.05
                )
                fault.recovered, fault.seconds = True, time.monotonic() - chaos.back_at
            except TimeoutError:
                logger.error("fault %d (%s) not recovered within %.0fs", i, kind, deadline)
            done.append(fault)
            logger.info(
                "fault %d/%d %s: %s",
                i + 1,
                faults,
                kind,
                f"recovered in {fault.seconds:.2f}s" if fault.recovered else "NOT recovered",
            )
            time.sleep(rng.uniform(0.2, 1.0))
        chaos_seconds = time.monotonic() - t0
        assert chaos.controller is not None and chaos.agent is not None
        after = {"controller": resources(chaos.controller.pid), "agent": resources(chaos.agent.pid)}
        (chaos.out / "hold").unlink()
        code = chaos.agent.wait(300)
        finals = {
            r: json.loads((chaos.out / f"final-{r}.json").read_text())["params"]
            for r in range(NPROC)
            if (chaos.out / f"final-{r}.json").exists()
        }
        view = chaos._view()
        finished = isinstance(view, JobStatus) and view.state is JobState.FINISHED
        chaos.controller.terminate()
        chaos.controller.wait(30)
        time.sleep(1.0)
        leftovers = job_processes() + [g for g in chaos.guards if pid_alive(g)]
        taskd_left = [p.pid for p in (chaos.controller, chaos.agent) if p.poll() is None]
        reference = fault_free(root, steps)
    by_kind = {
        kind: {
            "injected": sum(1 for f in done if f.kind == kind),
            "recovered": sum(1 for f in done if f.kind == kind and f.recovered),
            "seconds": summarize(f.seconds for f in done if f.kind == kind and f.recovered).as_dict(),
        }
        for kind in KINDS
    }
    return {
        "faults": faults,
        "seed": seed,
        "chaos_seconds": chaos_seconds,
        "quiet_faults": faults - quiet_from,
        "controller_incarnations": chaos.incarnations,
        "by_kind": by_kind,
        "injected": len(done),
        "recovered": sum(f.recovered for f in done),
        "agent_exit": code,
        "jobs_finished": int(finished and code == 0),
        "params_equal": finals == reference,
        "leftover_processes": len(leftovers) + len(taskd_left),
        "resources": {"before": before, "after": after},
    }


def report(r: dict[str, Any]) -> str:
    rows = [
        [kind, k["injected"], k["recovered"], fmt(k["seconds"]["median"]), fmt(k["seconds"]["max"])]
        for kind, k in r["by_kind"].items()
        if k["injected"]
    ]
    rows.append(["all", r["injected"], r["recovered"], "", ""])
    faults = markdown_table(["fault", "injected", "recovered", "recovery p50 (s)", "max (s)"], rows)
    res = r["resources"]
    usage = markdown_table(
        ["process", f"fds before → after {r['quiet_faults']} faults", "RSS MiB before → after"],
        [
            [
                name,
                f"{res['before'][name]['fds']:.0f} → {res['after'][name]['fds']:.0f}",
                f"{fmt(res['before'][name]['rss_mib'], 1)} → {fmt(res['after'][name]['rss_mib'], 1)}",
            ]
            for name in ("controller", "agent")
            if name in res["before"]
        ],
    )
    outcome = markdown_table(
        ["jobs finished", "final parameters = fault-free", "leftover processes"],
        [[f"{r['jobs_finished']}/1", "yes" if r["params_equal"] else "NO", r["leftover_processes"]]],
    )
    return f"{faults}\n\n{outcome}\n\n{usage}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=120)
    p.add_argument("--quiet-share", type=float, default=0.3, help="last share of faults: worker faults only")
    p.add_argument("--deadline", type=float, default=90.0, help="seconds one recovery may take")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=15)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args()
    setup_logging(args.log_level)
    exit_on_sigterm()
    r = run(args.faults, args.quiet_share, args.deadline, args.steps, args.step_time, args.seed)
    print(report(r))
    write_json(args.json, r)
    ok = r["recovered"] == r["injected"] and r["params_equal"] and r["leftover_processes"] == 0
    return 0 if ok and r["jobs_finished"] == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
