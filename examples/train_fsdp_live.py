"""``examples/train_fsdp.py`` under a ``LiveSession``: sharded state, snapshotted by the session.

Same job, same options, same progress events and ``--result`` file as
``train_fsdp.py`` (it reuses that script's model, sharding, state and disk
checkpoints); only ``main`` differs, by the lines that adopt
:class:`taskd_pytorch.live.LiveSession` for sharded state. Run it under ``taskdrun``::

    taskdrun --standalone --nproc-per-node=4 examples/train_fsdp_live.py --ckpt-dir /tmp/ckpt --steps 100

``LiveSession(sharded=True, snapshot_every=K)`` owns the process group and
the step loop; ``session.restore(state, load, fallback)`` loads the newest
step every rank can get (own node memory, a peer's copy, the disk
checkpoint) and, from then on, every K-th committed step is snapshotted to
the node keeper's memory while the next one computes. A lost rank restarts
every rank (FSDP2's modules are bound to their process group, and no
replica holds the lost shard), each restoring that step: at most one step
is lost. ``--snapshot-to disk`` (``train_fsdp.py``'s comparison) is not
offered here.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.storage import StorageReader
from train_ddp import Progress, stand_in_step
from train_fsdp import DiskCheckpoints, Sharded, parse_args

from taskd_pytorch.live import LiveSession
from taskd_pytorch.snapshot import disk_reader


def main() -> int:
    args = parse_args()
    if args.snapshot_to != "memory":
        print("train_fsdp_live.py: --snapshot-to disk is train_fsdp.py's comparison only", file=sys.stderr)
        return 2
    rank = int(os.environ["RANK"])
    restart = int(os.environ.get("TASKD_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    progress = Progress(args.progress, rank, restart)
    progress.log("start", 0)
    session = LiveSession(sharded=True, snapshot_every=args.snapshot_every, heartbeat=not args.no_heartbeat)
    session.start()  # joins the job's process group
    job = Sharded(args)  # fully_shard (or ZeRO) on the session's group
    job.prime()
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    disk = DiskCheckpoints(args.ckpt_dir, rank)

    def load(state: dict[str, Any]) -> int:
        job.load(state)
        return int(state["extra"]["step"])

    def on_disk() -> StorageReader | None:
        latest = disk.latest()
        return disk_reader(latest) if latest is not None else None

    # Every rank: the newest step all can get, from memory, a peer's copy or disk.
    done = session.restore(job.state, load, on_disk)
    if done:
        progress.log("resumed", done)
        progress.log(f"restored-from-{session.restored_from.value}", done)  # type: ignore[union-attr]
    loss_fn = nn.MSELoss()
    for live_step in session.steps(args.steps):
        with live_step:  # commits at its end: then the session snapshots the state
            step = live_step.number
            stand_in_step(args, step, rank, restart == 0)
            job.train_step(step, rank, args.width, loss_fn)
        done = session.step
        progress.log("step", done)
        if done % args.ckpt_every == 0 or done == args.steps:
            disk.save(job.state(done), done, dist.group.WORLD)
    digest = job.digest()  # collective under FSDP: every rank takes part, before the group is left
    if rank == 0 and args.result is not None:
        args.result.write_text(json.dumps({"steps": done, "snapshot_wait": session.snapshot_wait, **digest}))
    progress.log("done", done)
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
