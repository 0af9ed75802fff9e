"""A rank of a sharded (FSDP2) job SIGKILLed: kill → every rank stepping, steps lost, against torchrun.

One invocation, side by side, trials interleaved, on one node of ``--ranks``
ranks (gloo, CPU), each job ``--steps`` steps of ``examples/train_fsdp.py``'s
model with a disk checkpoint every ``--ckpt-every`` steps:

* ``torchrun``: ``examples/train_fsdp.py --snapshot-every 0 --snapshot-to disk``
  (disk checkpoints only: what a sharded job has without TaskD), ``--max-restarts 3``,
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``;
* ``taskdrun``: ``examples/train_fsdp.py``, a memory snapshot every step
  (``dcp.async_save(storage_writer=SnapshotWriter(step))`` in the script);
* ``taskdrun-live``: ``examples/train_fsdp_live.py``, the same job under
  ``LiveSession(sharded=True)``, which snapshots after each committed step.

The bench SIGKILLs rank 1 ``--kill-delay`` seconds after it logged step
``--kill-at`` (each delay in the list is one trial of each launcher per
repeat: 0 lands while the previous step's snapshot is being copied, a delay
near the step time after it completed). Figures: kill → every rank completed a
step in a process started after the kill (median, range, over the trials); the
steps lost (steps done by any rank before the kill minus the step training
resumed from); where the state came from; and whether the final parameters
equal a fault-free ``taskdrun-live`` run's.

    python bench/live_snapshot_bench.py --repeats 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    PYTHON,
    REPO,
    Children,
    fmt,
    machine,
    markdown_table,
    poll_until,
    setup_logging,
    write_json,
)

logger = logging.getLogger(__name__)

EXAMPLES = REPO / "examples"
#: launcher → (its executable, the script, the script's snapshot options, extra environment).
LAUNCHERS: dict[str, tuple[str, str, tuple[str, ...], dict[str, str]]] = {
    "torchrun": (
        str(Path(PYTHON).with_name("torchrun")),
        "train_fsdp.py",
        ("--snapshot-every", "0", "--snapshot-to", "disk"),
        {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    ),
    "taskdrun": (str(Path(PYTHON).with_name("taskdrun")), "train_fsdp.py", (), {}),
    "taskdrun-live": (str(Path(PYTHON).with_name("taskdrun")), "train_fsdp_live.py", (), {}),
}
VICTIM = 1


def _events(progress: Path) -> list[dict[str, Any]]:
    if not progress.exists():
        return []
    return [json.loads(line) for line in progress.read_text().splitlines() if line.endswith("}")]


def trial(work: Path, launcher: str, args: argparse.Namespace, delay: float | None) -> dict[str, Any]:
    """One job; with ``delay``, rank 1 is SIGKILLed that long after it logged step ``--kill-at``."""
    exe, script, flags, env = LAUNCHERS[launcher]
    work.mkdir(parents=True)
    progress, result = work / "progress.jsonl", work / "result.json"
    restarts = ("--max-restarts", "3") if launcher == "torchrun" else ()
    cmd = [
        exe,
        "--standalone",
        f"--nproc-per-node={args.ranks}",
        *restarts,
        str(EXAMPLES / script),
        "--ckpt-dir",
        str(work / "ckpt"),
        "--progress",
        str(progress),
        "--result",
        str(result),
        "--steps",
        str(args.steps),
        "--ckpt-every",
        str(args.ckpt_every),
        "--step-time",
        str(args.step_time),
        "--width",
        str(args.width),
        *flags,
    ]
    out: dict[str, Any] = {"launcher": launcher, "delay": delay}
    with Children(grace=30.0) as children:
        proc = children.start(cmd, log=work / "launcher.log", env=env, cwd=REPO)
        if delay is not None:

            def victim() -> int | None:
                events = _events(progress)
                children.adopt(e["pid"] for e in events if e["event"] == "start")
                stepped = any(
                    e["event"] == "step" and e["rank"] == VICTIM and e["step"] >= args.kill_at for e in events
                )
                starts = [e["pid"] for e in events if e["event"] == "start" and e["rank"] == VICTIM]
                return starts[0] if stepped and starts else None

            pid = poll_until(victim, args.timeout, f"rank {VICTIM} to log step {args.kill_at}", 0.005)
            time.sleep(delay)
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            out["killed_at"] = killed
        code = proc.wait(args.timeout)
        children.adopt(e["pid"] for e in _events(progress) if e["event"] == "start")
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}; see {work / 'launcher.log'}")
    events = _events(progress)
    out["sha256"] = json.loads(result.read_text())["sha256"]
    if delay is None:
        return out
    before = [e for e in events if e["event"] == "step" and e["time"] <= out["killed_at"]]
    later = [e for e in events if e["restart"] > 0]
    resumed = {e["step"] for e in later if e["event"] == "resumed"}
    firsts = {}
    for e in later:
        if e["event"] == "step":
            firsts.setdefault(e["rank"], e["time"])
    out["done_at_kill"] = max(e["step"] for e in before)
    out["resumed"] = min(resumed) if resumed else 0
    out["lost"] = out["done_at_kill"] - out["resumed"]
    out["source"] = ",".join(
        sorted(
            {
                e["event"].removeprefix("restored-from-")
                for e in later
                if e["event"].startswith("restored-from-")
            }
        )
    ) or ("disk" if resumed else "none")
    out["recovery_s"] = max(firsts.values()) - out["killed_at"] if len(firsts) == args.ranks else None
    return out


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    data: dict[str, Any] = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    data["reference"] = trial(root / "reference", "taskdrun-live", args, None)["sha256"]
    trials = []
    for repeat in range(args.repeats):
        for delay in args.kill_delays:
            for launcher in LAUNCHERS:  # interleaved: the machine's load hits every launcher alike
                logger.info("repeat %s, kill delay %ss: %s", repeat, delay, launcher)
                got = trial(root / f"{launcher}-{delay}-{repeat}", launcher, args, delay)
                got["identical"] = got["sha256"] == data["reference"]
                trials.append(got)
    data["trials"] = trials
    data["loadavg_at_end"] = os.getloadavg()
    return data


def report(data: dict[str, Any]) -> str:
    rows = []
    trials = data["trials"]
    medians = {}
    for launcher in LAUNCHERS:
        for delay in sorted({t["delay"] for t in trials}):
            mine = [t for t in trials if t["launcher"] == launcher and t["delay"] == delay]
            times = [t["recovery_s"] for t in mine if t["recovery_s"] is not None]
            median = statistics.median(times) if times else None
            medians[launcher, delay] = median
            rows.append(
                [
                    launcher,
                    f"{delay:g}",
                    f"{len(times)}/{len(mine)}",
                    fmt(median),
                    f"{fmt(min(times))}–{fmt(max(times))}" if times else "N/A",
                    ",".join(str(t["lost"]) for t in mine),
                    ",".join(sorted({t["source"] for t in mine})),
                    "yes" if all(t["identical"] for t in mine) else "no",
                ]
            )
    table = markdown_table(
        [
            "launcher",
            "kill delay (s)",
            "recovered",
            "kill → every rank stepped (median s)",
            "range",
            "steps lost",
            "restored from",
            "parameters = fault-free",
        ],
        rows,
    )
    ratios = []
    for delay in sorted({t["delay"] for t in trials}):
        cold = medians.get(("torchrun", delay))
        for launcher in ("taskdrun", "taskdrun-live"):
            warm = medians.get((launcher, delay))
            if cold and warm is not None:
                ratios.append(f"delay {delay:g} s: {launcher} / torchrun {warm / cold:.3f}")
    return table + "\n\n" + "; ".join(ratios) + " (target ≤ 0.1)."


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument(
        "--kill-at",
        type=int,
        default=45,
        help="rank 1 is killed after it logged this step (late enough that the fork server learned the workers' imports)",
    )
    p.add_argument(
        "--kill-delays",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.0, 0.15],
        help="seconds after that step, comma separated (one trial of each launcher per delay and repeat)",
    )
    p.add_argument("--step-time", type=float, default=0.2, help="the script's extra seconds per step")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep", type=Path, default=None, help="keep the jobs' files here")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args()
    setup_logging(args.log_level)
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        data = run(args, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="live-snapshot-bench-") as tmp:
            data = run(args, Path(tmp))
    write_json(args.json, data)
    print(report(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
