"""What memory snapshots cost a sharded job, and what they save: ``examples/train_fsdp.py`` under real ``taskdrun``.

Three parts, each run side by side in one invocation:

1. **Step time, fault-free.** The same FSDP2 job three ways: no every-step
   snapshot (``--snapshot-every 0``), a memory snapshot every step
   (``dcp.async_save(storage_writer=SnapshotWriter(step), no_dist=True)``) and
   ``dcp.async_save`` to local disk every step (``--snapshot-to disk``, the
   user's alternative), on two sizes: the example (4 ranks, a small model) and
   a model whose state (parameter shard and AdamW's two moments) is about
   ``--mib`` MiB per rank (2 ranks). The step time is the median interval
   between rank 0's ``step`` events after the first ``--warmup`` steps; the
   memory cost is the largest size of the nodes' snapshot directories
   (``/dev/shm``) seen while the job ran, and the workers' largest summed RSS.
2. **Steps lost, recovery time.** The example again, a rank SIGKILLed as step
   ``--kill-at`` begins, each way under taskdrun, and under torchrun (one
   restart: a cold restart of every worker;
   ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, without which its restarted
   workers often hang on a stale store) with ``dcp.async_save`` to disk
   every step: the steps done before the kill minus the step training resumed
   from (disk checkpoints every ``--ckpt-every`` steps in all), and the seconds
   from the killed rank's last step to every rank's first step after it.
3. **Copy bandwidth.** In this process, ``--mib`` MiB: a plain ``memcpy``
   (``Tensor.copy_`` into a buffer already allocated), the worker's snapshot
   write (one copy into its reused data file on ``/dev/shm``, mapped), its
   CRC-32, and a peer copy through a keeper over loopback (encrypted and
   authenticated), in GB/s.

    python bench/snapshot_bench.py --repeats 3 --mib 256 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import PYTHON, REPO, Children, fmt, machine, markdown_table, setup_logging, write_json

from taskd_core.testing import descendants

logger = logging.getLogger(__name__)

TASKDRUN = str(Path(PYTHON).with_name("taskdrun"))
#: torchrun, one restart: its cold restart of the same job is what recovery is compared with.
TORCHRUN = (PYTHON, "-m", "torch.distributed.run", "--max-restarts=1")
#: As shipped, torchrun's restarted workers often meet a stale rendezvous store and hang (SPEC §9,
#: bench/recovery_bench.py's torchrun-noshare): the comparison is with the variant that restarts.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
SCRIPT = REPO / "examples" / "train_fsdp.py"
#: The ways a job snapshots every step, and their train_fsdp.py options.
MODES = {
    "none": ("--snapshot-every", "0"),
    "memory": ("--snapshot-every", "1"),
    "disk": ("--snapshot-every", "1", "--snapshot-to", "disk"),
}
LABELS = {
    "none": "no every-step snapshot",
    "memory": "memory snapshot (TaskD)",
    "disk": "dcp.async_save to disk",
}
#: Issue 24: a snapshot every step costs at most this share of the fault-free step time.
STEP_TARGET = 0.05


def width_for(mib: float, ranks: int, layers: int = 2) -> int:
    """The layer width whose state (parameters + 2 AdamW moments, float32) is ``mib`` MiB per rank."""
    params = mib * 2**20 * ranks / 12
    return int((params / layers) ** 0.5)


def _keeper_roots(pid: int) -> list[Path]:
    """The snapshot directories of the keepers among ``pid``'s descendants (their first argument)."""
    roots = []
    for each in descendants(pid):
        try:
            argv = Path(f"/proc/{each}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 3 and argv[2] == b"taskd_core.snapshots._serve":
            roots.append(Path(argv[3].decode()))
    return roots


def _shm_bytes(launcher: int) -> int:
    """The bytes of this job's snapshots (only its own keepers': other jobs may share the machine)."""
    total = 0
    for root in _keeper_roots(launcher):
        # Snapshots come and go while this walks: what vanished meanwhile counts for nothing.
        for folder, _, files in os.walk(root):
            if "data" in files:
                try:
                    total += os.stat(os.path.join(folder, "data")).st_size
                except OSError:
                    pass
    return total


def _rss(pids: set[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _events(progress: Path) -> list[dict[str, Any]]:
    if not progress.exists():
        return []
    return [json.loads(line) for line in progress.read_text().splitlines() if line.endswith("}")]


def run_job(
    work: Path, ranks: int, extra: tuple[str, ...], timeout: float, launcher: tuple[str, ...] = (TASKDRUN,)
) -> dict[str, Any]:
    """One job of train_fsdp.py (taskdrun, or ``launcher``); its events, largest snapshot bytes and worker RSS."""
    work.mkdir(parents=True)
    progress = work / "progress.jsonl"
    cmd = [
        *launcher,
        "--standalone",
        f"--nproc-per-node={ranks}",
        str(SCRIPT),
        "--ckpt-dir",
        str(work / "ckpt"),
        "--progress",
        str(progress),
        "--result",
        str(work / "result.json"),
        *extra,
    ]
    shm = rss = 0
    with Children(grace=30.0) as children:
        env = TORCHRUN_ENV if launcher == TORCHRUN else None
        proc = children.start(cmd, log=work / "launcher.log", cwd=REPO, env=env)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            events = _events(progress)
            pids = {e["pid"] for e in events if e["event"] == "start"}
            children.adopt(pids)
            shm, rss = max(shm, _shm_bytes(proc.pid)), max(rss, _rss(pids))
            time.sleep(0.2)
        code = proc.wait(max(1.0, deadline - time.monotonic()))
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}; see {work / 'launcher.log'}")
    return {
        "events": _events(progress),
        "shm_bytes": shm,
        "rss_bytes": rss,
        "result": json.loads((work / "result.json").read_text()),
    }


def step_time(events: list[dict[str, Any]], warmup: int) -> float:
    """The median interval between rank 0's steps after ``warmup`` (the last one, with a disk save, left out)."""
    times = [e["time"] for e in events if e["event"] == "step" and e["rank"] == 0 and e["restart"] == 0]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)][warmup:-1]
    return statistics.median(gaps)


def steps_part(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    sizes = {
        "example": (4, ("--steps", str(args.steps), "--ckpt-every", str(args.steps))),
        f"{args.mib:g} MiB per rank": (
            2,
            (
                "--steps",
                str(args.big_steps),
                "--ckpt-every",
                str(args.big_steps),
                "--layers",
                "2",
                "--width",
                str(width_for(args.mib, 2)),
            ),
        ),
    }
    out: dict[str, Any] = {}
    for size, (ranks, base) in sizes.items():
        per: dict[str, dict[str, Any]] = {m: {"step_s": [], "shm_bytes": 0, "rss_bytes": 0} for m in MODES}
        for repeat in range(args.repeats):
            for mode, flags in MODES.items():  # interleaved: the machine's load hits every mode alike
                name = f"{size.split()[0]}-{mode}-{repeat}"
                logger.info("step time: %s, %s, repeat %s", size, mode, repeat)
                job = run_job(root / name, ranks, (*base, *flags), args.timeout)
                per[mode]["step_s"].append(step_time(job["events"], args.warmup))
                per[mode]["shm_bytes"] = max(per[mode]["shm_bytes"], job["shm_bytes"])
                per[mode]["rss_bytes"] = max(per[mode]["rss_bytes"], job["rss_bytes"])
                per[mode]["params"] = job["result"]["params"]
        for mode in MODES:
            per[mode]["median_s"] = statistics.median(per[mode]["step_s"])
        out[size] = {"ranks": ranks, "modes": per}
    return out


def recovery_s(events: list[dict[str, Any]], rank: int) -> float | None:
    """Killed rank's last step of its first life → every rank's first step after it, seconds.

    The rank kills itself as the step after its last ``step`` event begins, so this
    is the recovery from the kill, give or take the start of that step.
    """
    last = [e["time"] for e in events if e["event"] == "step" and e["rank"] == rank and e["restart"] == 0]
    ranks = {e["rank"] for e in events}
    firsts = []
    for each in ranks:
        after = [e["time"] for e in events if e["event"] == "step" and e["rank"] == each and e["restart"] > 0]
        if not after:
            return None
        firsts.append(min(after))
    return max(firsts) - max(last) if last and firsts else None


#: The steps-lost runs: (label, launcher, train_fsdp.py flags).
LOST_WAYS = {
    "none": (TASKDRUN,),
    "memory": (TASKDRUN,),
    "disk": (TASKDRUN,),
    "torchrun-disk": TORCHRUN,
}


def lost_part(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for way, launcher in LOST_WAYS.items():
        flags = MODES[way.removeprefix("torchrun-")]
        logger.info("steps lost: %s", way)
        extra = (
            "--steps",
            str(args.steps),
            "--ckpt-every",
            str(args.ckpt_every),
            "--fail-at-step",
            str(args.kill_at),
            "--fail-rank",
            "1",
            "--fail-mode",
            "kill",
            *flags,
        )
        job = run_job(root / f"lost-{way}", 4, extra, args.timeout, launcher)
        resumed = [e for e in job["events"] if e["event"] == "resumed" and e["restart"] > 0]
        source = {
            e["event"].removeprefix("restored-from-")
            for e in job["events"]
            if e["event"].startswith("restored-from-") and e["restart"] > 0
        }
        step = min(e["step"] for e in resumed)
        out[way] = {
            "killed_after": args.kill_at,
            "resumed": step,
            "lost": args.kill_at - step,
            "source": ",".join(sorted(source)),
            "recovery_s": recovery_s(job["events"], 1),
            "sha256": job["result"]["sha256"],
        }
    return out


def bandwidth_part(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from taskd_core.snapshots.keeper import Keeper
    from taskd_core.snapshots.peer import PeerClient
    from taskd_core.snapshots.settings import SnapshotSettings
    from taskd_core.snapshots.store import Seal, SnapshotStore, crc32
    from taskd_pytorch.snapshot._slot import Slot

    size = int(args.mib * 2**20)
    src = torch.randn(size // 4)
    dst = torch.empty_like(src)
    rates: dict[str, list[float]] = {"memcpy": [], "slot": [], "crc32": [], "peer": []}
    with (
        tempfile.TemporaryDirectory(dir="/dev/shm", prefix="taskd-bench-") as tmp,
        Keeper(
            SnapshotSettings(directory=Path(tmp)),
            job_id="bench",
            host="127.0.0.1",
            token="bench",
            local_world_size=1,
        ) as keeper,
    ):
        store = SnapshotStore(Path(tmp) / "own")
        client = PeerClient("bench", "bench")
        address = keeper.address()
        # The first two trials make the files the later ones reuse (the newest complete one is kept).
        for trial in range(args.repeats + 2):
            t0 = time.perf_counter()
            dst.copy_(src)
            t1 = time.perf_counter()
            slot = Slot(store, 0, trial, size)  # the worker's path: its reused data file, mapped
            slot.put(src)
            t2 = time.perf_counter()
            crc = crc32([slot.view()])
            t3 = time.perf_counter()
            seal = Seal(0, trial, 4, size, crc32([b"meta"]), crc)
            store.commit(seal, b"meta")
            client.put(address, seal, b"meta", [slot.view()])
            t4 = time.perf_counter()
            del slot
            if trial < 2:
                continue
            for key, seconds in (
                ("memcpy", t1 - t0),
                ("slot", t2 - t1),
                ("crc32", t3 - t2),
                ("peer", t4 - t3),
            ):
                rates[key].append(size / seconds / 1e9)
    return {"bytes": size, "gb_s": rates, "median_gb_s": {k: statistics.median(v) for k, v in rates.items()}}


def report(data: dict[str, Any]) -> str:
    """The three parts as Markdown tables."""
    rows = []
    for size, part in data["steps"].items():
        base = part["modes"]["none"]["median_s"]
        for mode, m in part["modes"].items():
            rows.append(
                [
                    size,
                    LABELS[mode],
                    fmt(m["median_s"] * 1e3, 1),
                    fmt(100 * (m["median_s"] / base - 1), 1),
                    fmt(m["shm_bytes"] / 2**20, 0),
                    fmt(m["rss_bytes"] / 2**20, 0),
                ]
            )
    steps = markdown_table(
        [
            "state",
            "every step",
            "step (ms)",
            "vs none (%)",
            "snapshots in /dev/shm (MiB)",
            "workers' RSS (MiB)",
        ],
        rows,
    )
    lost_rows = []
    torchrun = data["lost"].get("torchrun-disk", {}).get("recovery_s")
    for way, r in data["lost"].items():
        label = f"torchrun, {LABELS['disk']}" if way == "torchrun-disk" else f"taskdrun, {LABELS[way]}"
        seconds = r.get("recovery_s")
        ratio = fmt(seconds / torchrun, 2) if seconds is not None and torchrun else "n/a"
        lost_rows.append(
            [
                label,
                str(r["killed_after"]),
                str(r["resumed"]),
                str(r["lost"]),
                r["source"],
                fmt(seconds, 2) if seconds is not None else "n/a",
                ratio,
            ]
        )
    lost = markdown_table(
        [
            "launcher, every step",
            "steps done at the kill",
            "resumed from",
            "steps lost",
            "restored from",
            "kill → every rank stepping (s)",
            "vs torchrun",
        ],
        lost_rows,
    )
    bw = data["bandwidth"]["median_gb_s"]
    copy = markdown_table(
        ["copy", "GB/s"],
        [
            ["plain memcpy (Tensor.copy_)", fmt(bw["memcpy"])],
            ["snapshot write: one copy into its mapped /dev/shm file (the training thread)", fmt(bw["slot"])],
            ["CRC-32 of it (the background thread)", fmt(bw["crc32"])],
            ["peer copy to a keeper over loopback (AES-GCM)", fmt(bw["peer"])],
        ],
    )
    return f"{steps}\n\n{lost}\n\n{copy}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="runs of each job (default: %(default)s)")
    p.add_argument("--mib", type=float, default=256.0, help="state per rank of the large job, MiB")
    p.add_argument("--steps", type=int, default=40, help="steps of the example job")
    p.add_argument("--big-steps", type=int, default=12, help="steps of the large job")
    p.add_argument("--warmup", type=int, default=3, help="first step intervals left out")
    p.add_argument("--kill-at", type=int, default=25, help="the killed rank dies as this step begins")
    p.add_argument("--ckpt-every", type=int, default=10, help="disk checkpoints of the steps-lost jobs")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of each job, seconds")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args()
    setup_logging(args.log_level)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="taskd-snapshot-bench-") as tmp:
        root = Path(tmp)
        data = {
            "steps": steps_part(root, args),
            "lost": lost_part(root, args),
            "bandwidth": bandwidth_part(args),
        }
    data.update(
        config={k: v for k, v in vars(args).items() if k != "json"} | {"json": None},
        machine=machine(),
        loads=[load_before, os.getloadavg()],
        target=STEP_TARGET,
    )
    data["config"].pop("json")
    print(report(data))
    write_json(args.json, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
