"""How fast a launcher ends after SIGTERM, taskdrun against torchrun, in two phases of a job.

* ``rendezvous``: one node of a two-node c10d job (torchrun's elastic form, no
  node rank) whose second node never comes; the launcher waits in torch's
  rendezvous join (600 s by default). The bench waits until the node serves
  the rendezvous store (the port accepts a connection), then 1 s more, then
  sends SIGTERM.
* ``workers``: one node (``--standalone``) with two workers that sleep; the
  bench waits until both have started, then sends SIGTERM. The launcher must
  stop its workers first (they end at once on SIGTERM).

One sample is the time from ``os.kill`` to the launcher's exit as seen by
``wait()``; the bench also records the exit code and counts workers still
alive after the launcher ended.

Run::

    .venv/bin/python bench/signal_bench.py --repeats 5 --json /tmp/signals.json
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    PYTHON,
    Children,
    fmt,
    free_port,
    markdown_table,
    pid_alive,
    poll_until,
    setup_logging,
    write_json,
)

LAUNCHERS = ("taskdrun", "torchrun")
PHASES = ("rendezvous", "workers")
#: issue 17: SIGTERM while no worker runs ends taskdrun within this many seconds.
IDLE_TARGET = 2.0
#: Longest the bench waits for a launcher to end after SIGTERM before it kills it (and records no sample).
EXIT_DEADLINE = 60.0
#: The venv's scripts (taskdrun, torchrun) sit beside its python.
BIN = Path(PYTHON).parent
SLEEPER = "import os, sys, time\nopen(os.path.join(sys.argv[1], str(os.getpid())), 'w').close()\ntime.sleep(600)\n"


def _serves(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def one_trial(launcher: str, phase: str, root: Path) -> dict[str, Any]:
    """Start ``launcher`` in ``phase``, SIGTERM it; seconds to its exit, exit code, workers left alive."""
    pids_dir = Path(tempfile.mkdtemp(dir=root))
    script = root / "sleeper.py"
    script.write_text(SLEEPER)
    port = free_port()
    if phase == "rendezvous":
        argv = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id=signal-{port}"]
    else:
        argv = ["--standalone", "--nproc-per-node=2"]
    with Children(grace=5.0) as children:
        proc = children.start([str(BIN / launcher), *argv, str(script), str(pids_dir)], log=root / f"{launcher}.log")
        if phase == "rendezvous":
            poll_until(lambda: _serves(port), 120, f"{launcher} to serve the rendezvous store")
            time.sleep(1.0)  # inside the join loop by now
        else:
            poll_until(lambda: len(list(pids_dir.iterdir())) == 2, 120, f"{launcher}'s two workers to start")
        workers = [int(p.name) for p in pids_dir.iterdir()]
        children.adopt(workers)
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        try:
            code: int | None = proc.wait(EXIT_DEADLINE)
            seconds: float | None = time.monotonic() - t0
        except subprocess.TimeoutExpired:
            code = seconds = None
        left = sum(pid_alive(pid) for pid in workers)
    return {"seconds": seconds, "code": code, "left": left}


def measure(repeats: int, root: Path) -> dict[str, Any]:
    """Every launcher and phase ``repeats`` times, taking turns so that load changes fall on all alike."""
    results: dict[str, Any] = {launcher: {phase: [] for phase in PHASES} for launcher in LAUNCHERS}
    for _ in range(repeats):
        for phase in PHASES:
            for launcher in LAUNCHERS:
                results[launcher][phase].append(one_trial(launcher, phase, root))
    return results


def _worst(trials: list[dict[str, Any]]) -> float | None:
    times = [t["seconds"] for t in trials]
    return None if None in times else max(times)


def report(results: dict[str, Any]) -> str:
    rows = []
    for phase in PHASES:
        for launcher in LAUNCHERS:
            trials = results[launcher][phase]
            times = sorted(t["seconds"] for t in trials if t["seconds"] is not None)
            median = times[len(times) // 2] if times else None
            worst = _worst(trials)
            rows.append([
                phase, launcher, f"{len(times)}/{len(trials)}", fmt(median), fmt(worst) if worst is not None else
                f"> {EXIT_DEADLINE:g}", ", ".join(sorted({str(t["code"]) for t in trials})),
                sum(t["left"] for t in trials),
            ])
    return markdown_table(
        ["phase", "launcher", "ended", "SIGTERM → exit p50 (s)", "worst (s)", "exit codes", "workers left"], rows
    )


def verdicts(results: dict[str, Any]) -> list[list[str]]:
    worst = _worst(results["taskdrun"]["rendezvous"])
    codes = {t["code"] for t in results["taskdrun"]["rendezvous"]}
    measured = f"{fmt(worst)} s at worst, exit codes {sorted(codes, key=str)}" if worst is not None else "did not end"
    ok = worst is not None and worst <= IDLE_TARGET and codes == {128 + signal.SIGTERM}
    return [[f"SIGTERM in the rendezvous ends taskdrun (exit 143) ≤ {IDLE_TARGET:g} s", measured,
             "met" if ok else "missed"]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="trials per launcher and phase (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args()
    setup_logging(args.log_level)
    with tempfile.TemporaryDirectory(prefix="taskd-signal-bench-") as tmp:
        results = measure(args.repeats, Path(tmp))
    print(report(results))
    print(markdown_table(["target", "measured", "verdict"], verdicts(results)))
    write_json(args.json, {"repeats": args.repeats, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
