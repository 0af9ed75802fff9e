"""The main job: train under ``taskd run`` on the embedded controller, kill a rank, watch it recover.

Run with ``bash scripts/demo.sh`` (which installs everything first), or
``.venv/bin/python examples/demo.py [--nproc 2] [--steps 60] [--kill-at 25]``.

It starts ``taskd run --nproc N -- python examples/train_ddp.py ...``, waits
until training passes step ``--kill-at``, SIGKILLs one worker, and prints what
happened: the fault the agent saw, the strategy the controller chose, the
restarted workers, the step training resumed from, and how the job ended,
then draws the recovery (``taskd timeline``) and prints the picture's path.
Everything it prints comes from the job itself (the launcher's log and the
workers' progress log); its files stay in ``runs/demo-<time>/``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def events(progress: Path) -> list[dict[str, object]]:
    if not progress.exists():
        return []
    return [json.loads(line) for line in progress.read_text().splitlines() if line.strip()]


def wait_for(what: str, predicate: object, launcher: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if launcher.poll() is not None:
            raise SystemExit(f"taskd run ended (exit {launcher.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting {timeout:.0f}s for {what}")
        time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=25, help="SIGKILL a worker once training passes this step")
    parser.add_argument("--kill-rank", type=int, default=1)
    args = parser.parse_args()

    run = ROOT / "runs" / time.strftime("demo-%Y%m%d-%H%M%S")
    run.mkdir(parents=True)
    progress, launcher_log = run / "progress.jsonl", run / "taskd-run.log"
    command = [
        sys.executable, "-m", "taskd_core", "run", "--nproc", str(args.nproc), "--job-id", "demo",
        "--log-dir", str(run / "logs"), "--flush-seconds", "0.2", "--controller-state", str(run / "state.db"), "--",
        sys.executable, str(ROOT / "examples" / "train_ddp.py"), "--steps", str(args.steps),
        "--ckpt-every", str(args.ckpt_every), "--ckpt-dir", str(run / "ckpt"), "--progress", str(progress),
        "--result", str(run / "result.json"), "--step-time", "0.05",
    ]
    print(f"$ {' '.join(command)}\n  (files in {run})")
    with open(launcher_log, "wb") as log:
        launcher = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_for(
            f"step {args.kill_at}",
            lambda: any(e["event"] == "step" and int(e["step"]) >= args.kill_at for e in events(progress)),  # type: ignore[call-overload]
            launcher, 300,
        )
        victim = next(e for e in events(progress) if e["event"] == "start" and e["rank"] == args.kill_rank)
        print(f"\n[kill]     SIGKILL rank {args.kill_rank} (pid {victim['pid']}) after step {args.kill_at}")
        os.kill(int(victim["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
        code = launcher.wait(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=60)

    for line in launcher_log.read_text().splitlines():
        if "failed with exit code" in line:
            print("[fault]   ", line.split(": ", 1)[-1])
        elif " signal " in line and "actions=" in line:
            print("[signal]  ", line.split(": ", 1)[-1])
    seen = events(progress)
    for e in seen:
        if e["event"] == "start" and int(e["restart"]) > 0:  # type: ignore[call-overload]
            print(f"[restart]  rank {e['rank']} started again as pid {e['pid']} (restart {e['restart']})")
    for e in seen:
        if e["event"] == "resumed" and int(e["restart"]) > 0:  # type: ignore[call-overload]
            print(f"[resumed]  rank {e['rank']} resumed from the checkpoint of step {e['step']}")
    done = [e for e in seen if e["event"] == "done"]
    print(f"[finished] {len(done)} of {args.nproc} ranks finished step {args.steps}; taskd run exited {code}")
    if (run / "result.json").exists():
        print(f"[result]   final parameters: {(run / 'result.json').read_text().strip()[:120]}")
    timeline = run / "timeline.png"
    drawn = subprocess.run(
        [sys.executable, "-m", "taskd_core", "timeline", "demo", "--state", str(run / "state.db"), "--out", str(timeline)],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )
    if drawn.returncode == 0:
        print(f"[timeline] {timeline}")
    else:
        print(f"[timeline] not drawn: {drawn.stderr.strip().splitlines()[-1:]}")
    print(f"[journal]  taskd events demo --state {run / 'state.db'} --json")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
