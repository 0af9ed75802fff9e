"""MindSpore recoveries under real msrun 2.10: cold start, kill → stepping again, and the fork server's cost.

The job is ``plugins/mindspore/examples/train.py`` under ``msrun
--worker_num=2 --local_worker_num=2`` with TaskD (``MS_ENABLE_TFT='{ARF:1}'``),
its embedded controller, and the step idling ``--step-sleep`` seconds (a
stand-in for compute). Two jobs (``--jobs``):

* ``collective``: an AllReduce of the gradients every step. Killing one rank
  makes the controller choose ``recover``: every worker of the node and the
  scheduler start again (on CPU MindSpore cannot rebuild a communication group
  around one replaced rank). Trials kill rank 1 (``kill1``), then both ranks
  at once (``kill-all``, a whole-node restart);
* ``in-place``: ``--no-collective`` with ``TASKD_RECOVER_IN_PLACE=1``: killing
  rank 1 restarts rank 1 alone (``recover-in-place``, ``START_WORKER_LIST``).

Each job runs in every ``--modes``:

* ``fork``: TaskD as shipped (workers and the scheduler forked from the
  MindSpore fork server, heartbeat interval 1 s, the start-up workarounds of
  :mod:`taskd_mindspore.forkhooks`);
* ``exec``: ``TASKD_FORK_SERVER=0``: msrun's own starts (heartbeat still 1 s);
* ``before``: ``TASKD_FORK_SERVER=0`` with MindSpore's own heartbeat bounds
  (``MS_RETRY_INTERVAL_LOWER=3``, ``UPPER=5``): TaskD before this work;
* ``fork-cache``: ``fork`` plus MindSpore's compile cache
  (``MS_COMPILER_CACHE_ENABLE=1``, a directory per job), which a script may
  turn on itself (it is not TaskD's to switch on: see docs/warm-restarts.md).

Per job: the cold start (``msrun`` launched → every rank completed its first
step), then ``--trials`` kills of each kind, each once the job has trained
``--settle`` seconds since its last start (past the agent's 10 s crash-loop
window). Per kill, from the timestamps the workers write
(``progress.jsonl``: ``start`` before ``import mindspore``, ``init`` after
``communication.init()``, each step) and ``time.time()`` right before
``os.kill``: kill → the victim's replacement started, → its ``init()``
returned, → it completed a step (the target), and → every rank of the job
completed a step in a new process. A kill counts as recovered when the victim
steps again within ``--recovery-deadline``. Ratios divide the medians by the
same job's cold start in the same mode.

``--server-window`` measures the fork server of the first ``fork`` job: its
CPU over that window once the workers' last module report is past (the
server is idle then), its RSS and PSS (pages shared with the workers counted
pro rata).

Run (the whole table; ``--trials 1 --modes fork`` is a smoke run)::

    .venv/bin/python bench/mindspore_bench.py --trials 5 --json /tmp/ms.json
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from _common import (
    PYTHON,
    REPO,
    Children,
    cpu_seconds,
    exit_on_sigterm,
    fmt,
    fmt_range,
    free_port,
    machine,
    markdown_table,
    ratio,
    setup_logging,
    summarize,
    write_json,
)
from recovery_bench import ProgressLog, _memory_kib

from taskd_core.forkserver._server import LEARN_AFTER

logger = logging.getLogger(__name__)

EXAMPLE = REPO / "plugins" / "mindspore" / "examples" / "train.py"
MSRUN = Path(PYTHON).with_name("msrun")
#: The target of issue 25: kill → stepping again as a share of the same job's cold start.
TARGET = 0.3
#: The fork server's idle CPU target, % of one core.
SERVER_CPU_TARGET = 0.1
_POLL = 0.01

MODES: dict[str, dict[str, str]] = {
    "fork": {},
    "exec": {"TASKD_FORK_SERVER": "0"},
    "before": {"TASKD_FORK_SERVER": "0", "MS_RETRY_INTERVAL_LOWER": "3", "MS_RETRY_INTERVAL_UPPER": "5"},
    "fork-cache": {"MS_COMPILER_CACHE_ENABLE": "1"},
}


@dataclass(frozen=True, slots=True)
class Job:
    name: str
    script_args: tuple[str, ...]
    env: dict[str, str]
    #: the kinds of kill and the ranks each kills.
    kills: dict[str, tuple[int, ...]]


JOBS = {
    "collective": Job("collective", (), {}, {"kill1": (1,), "kill-all": (0, 1)}),
    "in-place": Job(
        "in-place",
        ("--no-collective",),
        {"TASKD_RECOVER_IN_PLACE": "1", "TASKD_STRATEGIES": "recover-in-place,recover,exit"},
        {"kill1": (1,)},
    ),
}


class Progress(ProgressLog):
    """The job's progress log (read incrementally), with the look-ups a kill needs."""

    def first(self, event: str, rank: int, after: float, not_pids: set[int]) -> dict[str, Any] | None:
        return next(
            (
                e
                for e in self.events
                if e.get("event") == event
                and e["rank"] == rank
                and e["time"] > after
                and e["pid"] not in not_pids
            ),
            None,
        )

    def last_step(self, rank: int) -> dict[str, Any] | None:
        return next(
            (e for e in reversed(self.events) if e.get("event") == "step" and e["rank"] == rank), None
        )


@dataclass
class Settings:
    trials: int
    step_sleep: float
    settle: float
    startup_deadline: float
    recovery_deadline: float
    server_window: float


class Run:
    """One msrun job in one mode: started, its kills, its figures."""

    def __init__(self, job: Job, mode: str, settings: Settings, workdir: Path, children: Children) -> None:
        self.job, self.mode, self.settings = job, mode, settings
        self.dir = workdir / f"{job.name}-{mode}"
        self.dir.mkdir(parents=True)
        self.progress = Progress(self.dir / "out" / "progress.jsonl")
        self.children = children
        self.world = 2
        self.last_start = 0.0

    def start(self) -> float:
        env = {
            "PATH": f"{MSRUN.parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "MS_ENABLE_TFT": "{ARF:1}",
            "GLOG_v": "3",
            "TASKD_MAX_CYCLES": "1000",
            "TASKD_JOB_ID": f"msbench-{self.job.name}-{self.mode}",
            **self.job.env,
            **MODES[self.mode],
        }
        if env.get("MS_COMPILER_CACHE_ENABLE") == "1":
            env["MS_COMPILER_CACHE_PATH"] = str(self.dir / "compile-cache")
        command = [
            str(MSRUN),
            f"--worker_num={self.world}",
            f"--local_worker_num={self.world}",
            f"--master_port={free_port()}",
            f"--log_dir={self.dir / 'logs'}",
            "--join=False",
            str(EXAMPLE),
            "--out",
            str(self.dir / "out"),
            "--steps",
            "1000000",
            "--step-sleep",
            str(self.settings.step_sleep),
            *self.job.script_args,
        ]
        t0 = time.time()
        self.msrun = self.children.start(command, log=self.dir / "msrun.log", env=env, cwd=self.dir)
        stepped = self._wait(lambda: self._all_stepped(t0, set()), self.settings.startup_deadline)
        if stepped is None:
            raise RuntimeError(
                f"{self.job.name}/{self.mode}: no step within {self.settings.startup_deadline}s"
            )
        self.last_start = time.time()
        return stepped - t0

    def _wait(self, probe: Any, deadline: float) -> Any:
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            self.progress.poll()
            found = probe()
            if found is not None:
                return found
            if self.msrun.poll() is not None:
                return None
            time.sleep(_POLL)
        return None

    def _all_stepped(self, after: float, old: set[int]) -> float | None:
        firsts = [self.progress.first("step", r, after, old) for r in range(self.world)]
        return None if any(f is None for f in firsts) else max(f["time"] for f in firsts)  # type: ignore[index]

    def kill(self, ranks: Sequence[int]) -> dict[str, Any]:
        time.sleep(max(0.0, self.last_start + self.settings.settle - time.time()))
        self.progress.poll()
        old = {e["pid"] for e in self.progress.events}
        victims = {r: self.progress.last_step(r)["pid"] for r in ranks}  # type: ignore[index]
        t_kill = time.time()
        for pid in victims.values():
            os.kill(pid, signal.SIGKILL)
        watched = max(ranks)
        stepped = self._wait(
            lambda: self.progress.first("step", watched, t_kill, old), self.settings.recovery_deadline
        )
        result: dict[str, Any] = {"ranks": list(ranks), "recovered": stepped is not None}
        if stepped is None:
            return result
        every = self._wait(
            lambda: self._all_stepped(t_kill, old if self.job.name != "in-place" else set(victims.values())),
            self.settings.recovery_deadline,
        )
        self.last_start = time.time()
        replacement = stepped["pid"]
        for key, event in (("started", "start"), ("init_done", "init")):
            found = next(
                (e for e in self.progress.events if e.get("event") == event and e["pid"] == replacement), None
            )
            result[key] = None if found is None else found["time"] - t_kill
        result["stepped"] = stepped["time"] - t_kill
        result["every_rank_stepped"] = None if every is None else every - t_kill
        result["resumed_from"] = stepped["resumed_from"]
        return result

    def fork_server(self) -> dict[str, Any]:
        """The server's idle CPU and memory, once the workers' module reports are past."""
        server = _fork_server_of(self.msrun.pid)
        if server is None:
            return {"error": "no fork server found under msrun"}
        time.sleep(max(0.0, self.last_start + LEARN_AFTER[-1] + 2.0 - time.time()))
        cpu0, t0 = cpu_seconds(server), time.monotonic()
        time.sleep(self.settings.server_window)
        cpu1, t1 = cpu_seconds(server), time.monotonic()
        return {
            "pid": server,
            "window": t1 - t0,
            "cpu_percent": 100 * (cpu1 - cpu0) / (t1 - t0),
            **_memory_kib(server),
        }

    def stop(self) -> None:
        self.children.adopt(e["pid"] for e in self.progress.events)
        try:
            os.killpg(self.msrun.pid, signal.SIGTERM)
            self.msrun.wait(60)
        except (ProcessLookupError, OSError):
            pass
        except Exception:  # noqa: BLE001 - Children.close SIGKILLs what is left
            logger.warning("%s/%s: msrun did not stop within 60 s", self.job.name, self.mode)


def _fork_server_of(parent: int) -> int | None:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            comm = (proc / "comm").read_text().strip()
            ppid = int((proc / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError):
            continue
        if comm == "taskd-forksrv" and ppid == parent:
            return int(proc.name)
    return None


def run_job(job: Job, mode: str, settings: Settings, workdir: Path, server: bool) -> dict[str, Any]:
    with Children(grace=30.0) as children:
        run = Run(job, mode, settings, workdir, children)
        try:
            out: dict[str, Any] = {"cold_start": run.start(), "kills": {}}
            logger.info("%s/%s: cold start %.2f s", job.name, mode, out["cold_start"])
            if server:
                out["fork_server"] = run.fork_server()
            for kind, ranks in job.kills.items():
                trials = []
                for n in range(settings.trials):
                    trial = run.kill(ranks)
                    logger.info("%s/%s %s #%s: %s", job.name, mode, kind, n, trial)
                    trials.append(trial)
                    if not trial["recovered"]:
                        break
                out["kills"][kind] = trials
            return out
        finally:
            run.stop()


def table(results: dict[str, Any]) -> str:
    """Per job, mode and kind of kill: the cold start, the kills recovered and the medians (min–max) after the kill."""
    rows = []
    for key, res in results["runs"].items():
        if "error" in res:
            rows.append([key, "error: " + res["error"], "", "", "", "", "", ""])
            continue
        cold = res["cold_start"]
        for kind, trials in res["kills"].items():
            done = [t for t in trials if t["recovered"]]
            step = summarize(t["stepped"] for t in done).as_dict()
            rows.append(
                [
                    key,
                    fmt(cold),
                    kind,
                    f"{len(done)}/{len(trials)}",
                    fmt_range(summarize(t["started"] for t in done).as_dict()),
                    fmt_range(summarize(t["init_done"] for t in done).as_dict()),
                    fmt_range(step),
                    fmt(ratio(step["median"], cold)),
                ]
            )
    return markdown_table(
        [
            "job / mode",
            "cold start (s)",
            "kill",
            "recovered",
            "kill → replacement started",
            "→ its init() returned",
            "→ it stepped (median, min–max)",
            "stepped / cold start",
        ],
        rows,
    )


def report(results: dict[str, Any], settings: Settings) -> str:
    lines = [
        f"MindSpore {results['mindspore']}, msrun 2 workers, {settings.trials} trial(s) per kill,"
        f" step sleep {settings.step_sleep}s; load average at start {results['machine']['loadavg_at_start']},"
        f" at end {results['loadavg_at_end']}",
        "",
        table(results),
        "",
        f"Target: stepped / cold start ≤ {TARGET} (fork mode).",
    ]
    for key, res in results["runs"].items():
        server = res.get("fork_server")
        if server and "cpu_percent" in server:
            lines.append(
                f"Fork server of {key}: CPU {server['cpu_percent']:.3f} % of a core over {server['window']:.0f} s"
                f" (target < {SERVER_CPU_TARGET} %; one 10 ms tick is {100 * 0.01 / server['window']:.3f} %),"
                f" RSS {server['vmrss'] / 1024:.0f} MiB, PSS {server['pss'] / 1024:.0f} MiB."
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5, help="kills of each kind per job and mode")
    p.add_argument("--jobs", default="collective,in-place", help=f"comma list of {sorted(JOBS)}")
    p.add_argument("--modes", default="fork,exec,before", help=f"comma list of {sorted(MODES)}")
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument(
        "--settle", type=float, default=11.0, help="seconds of training after a start before a kill"
    )
    p.add_argument("--startup-deadline", type=float, default=180.0)
    p.add_argument("--recovery-deadline", type=float, default=90.0)
    p.add_argument("--server-window", type=float, default=20.0, help="0: do not measure the fork server")
    p.add_argument("--json", type=Path)
    p.add_argument("--workdir", type=Path, help="keep logs here (default: a temporary directory)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    setup_logging(args.log_level)
    exit_on_sigterm()
    unknown = [j for j in args.jobs.split(",") if j not in JOBS] + [
        m for m in args.modes.split(",") if m not in MODES
    ]
    if unknown:
        p.error(f"unknown job or mode: {', '.join(unknown)}")
    if not MSRUN.exists():
        p.error(f"{MSRUN} not found: run scripts/env.sh (MindSpore 2.10)")
    settings = Settings(
        args.trials,
        args.step_sleep,
        args.settle,
        args.startup_deadline,
        args.recovery_deadline,
        args.server_window,
    )
    results: dict[str, Any] = {
        "machine": machine(),
        "mindspore": metadata.version("mindspore"),
        "settings": dataclasses.asdict(settings),
        "command": sys.argv,
        "runs": {},
    }
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="msbench-"))
    server_done = False
    for job in args.jobs.split(","):
        for mode in args.modes.split(","):
            measure = args.server_window > 0 and mode == "fork" and not server_done
            try:
                results["runs"][f"{job} / {mode}"] = run_job(JOBS[job], mode, settings, workdir, measure)
                server_done = server_done or measure
            except RuntimeError as exc:
                logger.error("%s", exc)
                results["runs"][f"{job} / {mode}"] = {"error": str(exc)}
    results["loadavg_at_end"] = os.getloadavg()
    results["median_ratio_fork"] = statistics.median(
        [
            ratio(summarize(t["stepped"] for t in trials if t["recovered"]).median, res["cold_start"])
            for key, res in results["runs"].items()
            if key.endswith("/ fork") and "kills" in res
            for trials in res["kills"].values()
        ]
        or [float("nan")]
    )
    write_json(args.json, results)
    print(report(results, settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
