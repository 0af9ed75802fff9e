"""Sharded training (FSDP2 ``fully_shard`` + AdamW, or ZeRO) that loses at most one step to a killed rank.

Run it under ``taskdrun`` (gloo on CPU works)::

    taskdrun --standalone --nproc-per-node=4 examples/train_fsdp.py --ckpt-dir /tmp/ckpt --steps 100

Each rank holds only its shard of the parameters and of AdamW's moments, so
a lost rank's shard exists nowhere else: ``examples/train_ddp.py``'s
checkpoint of rank 0 would not do. Instead:

* **every step** (``--snapshot-every K``, default 1; 0: off) the state goes
  to TaskD's memory tier with ``torch.distributed.checkpoint``'s own
  ``async_save``, one argument changed (``storage_writer=SnapshotWriter(step)``):
  the copy runs in the background while the next step computes, into memory
  its worker does not own (the node's keeper) and to a paired rank's keeper
  on another node;
* **every ``--ckpt-every`` steps** ``dcp.save`` writes a disk checkpoint as
  usual (``<ckpt-dir>/step-N``, then the ``latest`` file names it), the last rung;
* **every start restores** with ``dcp.load(storage_reader=SnapshotReader(fallback=...))``:
  the newest step whose snapshot every rank can get (own memory, then a
  peer's), else the disk checkpoint, else nothing.

Training is deterministic (fixed seeds, data from the step and the rank), so
a run with faults ends with the parameters of a run without. ``--zero``
trains the same model replicated (data parallel, gradients averaged in one
all_reduce) with ``ZeroRedundancyOptimizer``: the optimizer's state is
sharded, each rank snapshots its own shard.
``--snapshot-to disk`` sends the every-step ``async_save`` to local disk
instead (``<ckpt-dir>/async``), the alternative the benchmark compares. The
options and progress events are ``examples/train_ddp.py``'s (``--steps``,
``--progress``, ``--result``, ``--step-time``, the fault options), plus
``--width``/``--layers`` (the model's size) and ``snapshot`` events (a
snapshot complete, with ``seconds`` the main loop waited for the previous one).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from train_ddp import Progress, build_parser, stand_in_step

from taskd_core import worker
from taskd_pytorch.snapshot import SnapshotPlanner, SnapshotReader, SnapshotWriter, Source, disk_reader

BATCH = 8
LEARNING_RATE = 1e-3


def parse_args() -> Any:
    p = build_parser(__doc__)
    p.add_argument("--snapshot-every", type=int, default=1, help="memory snapshot every K steps (0: none)")
    p.add_argument(
        "--snapshot-to",
        choices=("memory", "disk"),
        default="memory",
        help="where the every-step async_save goes: TaskD's memory tier, or local disk",
    )
    p.add_argument("--width", type=int, default=64, help="features of every layer")
    p.add_argument("--layers", type=int, default=4, help="linear layers")
    p.add_argument("--zero", action="store_true", help="DDP + ZeroRedundancyOptimizer instead of FSDP2")
    return p.parse_args()


def make_model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)  # every rank starts from the same parameters
    parts: list[nn.Module] = []
    for _ in range(layers):
        parts += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*parts, nn.Linear(width, 1))


def batch(step: int, rank: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of ``rank`` at ``step``: depends on nothing else, so a replayed step is identical."""
    g = torch.Generator().manual_seed(step * 100_003 + rank)
    x = torch.randn(BATCH, width, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


class Sharded:
    """The model and optimizer of either variant, and their state as DCP saves and loads it."""

    def __init__(self, args: Any) -> None:
        self.zero = args.zero
        self.shard = f"rank{dist.get_rank()}"
        model = make_model(args.width, args.layers)
        if self.zero:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            # Gradients averaged in one all_reduce (see train_step), not by DDP: DDP regroups its
            # buckets after its first step, which would make a restarted run round differently.
            self.module: nn.Module = model
            self.model = model
            self.optimizer: Any = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.AdamW, lr=LEARNING_RATE
            )
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
            self.module = self.model = model
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)

    def state(self, done: int) -> dict[str, Any]:
        if self.zero:
            # Each rank's own shard of the optimizer (the inner AdamW over the parameters it owns),
            # under a key of its own: DCP would take same-named entries of all ranks for copies.
            optim = self.optimizer.optim.state_dict()
            optim_state = {str(k): v for k, v in optim["state"].items()}  # DCP's keys are strings
            return {
                "model": self.model.state_dict(),
                "optim": {self.shard: optim_state},
                "extra": {"step": done},
            }
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "extra": {"step": done}}

    def prime(self) -> None:
        """Create the optimizer's state as AdamW's first step would (zeros, step 0).

        A load then has tensors to fill in place, and ``get_state_dict`` finds the state made: on an
        optimizer without state it makes it by an optimizer step with zero gradients, the largest
        part of a restarted worker's restore (a DTensor op per parameter and moment).
        """
        inner = self.optimizer.optim if self.zero else self.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }

    def load(self, state: dict[str, Any]) -> None:
        if self.zero:
            self.model.load_state_dict(state["model"])
            inner = self.optimizer.optim
            params = [p for g in inner.param_groups for p in g["params"]]
            for i, p in enumerate(params):
                inner.state[p] = state["optim"][self.shard][str(i)]
            return
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )

    def train_step(self, step: int, rank: int, width: int, loss_fn: nn.Module) -> None:
        x, y = batch(step, rank, width)
        loss_fn(self.module(x), y).backward()
        if self.zero:
            params = [p for p in self.model.parameters() if p.grad is not None]
            grads = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
            dist.all_reduce(grads)
            grads /= dist.get_world_size()
            offset = 0
            for p in params:
                assert p.grad is not None
                p.grad.copy_(grads[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def digest(self) -> dict[str, object]:
        """The full parameters (gathered from the shards), and their SHA-256."""
        if self.zero:
            flat = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        else:
            flat = torch.cat([p.full_tensor().detach().reshape(-1) for p in self.model.parameters()])
        return {"sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest(), "params": flat.numel()}


class DiskCheckpoints:
    """``<dir>/step-N`` written by ``dcp.save``, then named by ``<dir>/latest`` (rank 0, atomically)."""

    def __init__(self, root: Path, rank: int) -> None:
        self.root, self.rank = root, rank

    def latest(self) -> Path | None:
        try:
            return self.root / (self.root / "latest").read_text().strip()
        except OSError:
            return None

    def save(self, state: dict[str, Any], done: int, group: dist.ProcessGroup) -> None:
        previous = self.latest()
        target = self.root / f"step-{done}"
        dcp.save(state, checkpoint_id=target, process_group=group)  # returns once every rank wrote
        if self.rank == 0:
            tmp = self.root / f"latest.tmp{os.getpid()}"
            tmp.write_text(target.name)
            os.replace(tmp, self.root / "latest")
            for old in self.root.glob("step-*"):
                if old not in (target, previous):
                    shutil.rmtree(old, ignore_errors=True)


def restore(
    job: Sharded, disk: DiskCheckpoints, async_disk: DiskCheckpoints, args: Any, rank: int
) -> tuple[int, str]:
    """Load the newest state there is; returns the steps it had done and where it came from."""
    job.prime()
    state = job.state(0)
    if args.snapshot_to == "disk":
        # The alternative: the every-step async_save to disk, else the regular checkpoint.
        newest = max(
            (d for d in (async_disk.latest(), disk.latest()) if d is not None),
            key=lambda d: int(d.name.split("-")[1]),
            default=None,
        )
        if newest is None:
            return 0, "none"
        dcp.load(state, checkpoint_id=newest)
        job.load(state)
        return int(state["extra"]["step"]), "disk"
    latest = disk.latest()
    reader = SnapshotReader(fallback=disk_reader(latest) if latest is not None else None)
    if reader.source is Source.NONE:
        return 0, "none"
    dcp.load(state, storage_reader=reader)
    job.load(state)
    return int(state["extra"]["step"]), reader.source.value


def main() -> int:
    args = parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TASKD_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    progress = Progress(args.progress, rank, restart)
    progress.log("start", 0)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    # Checkpoints have a group of their own: async_save's collectives run in a thread beside training's.
    ckpt_group = dist.new_group(backend="gloo")
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    disk = DiskCheckpoints(args.ckpt_dir, rank)
    async_disk = DiskCheckpoints(args.ckpt_dir / "async", rank)
    async_disk.root.mkdir(exist_ok=True)
    job = Sharded(args)
    done, source = restore(job, disk, async_disk, args, rank)
    worker.resumed(done)
    if done:
        progress.log("resumed", done)
        progress.log(f"restored-from-{source}", done)
    loss_fn = nn.MSELoss()
    pending: Future[Any] | None = None
    pending_step = 0
    planner = SnapshotPlanner()
    waited = [0.0]  # seconds the loop waited for snapshots

    def settle() -> None:
        """Wait for the snapshot in flight: one at a time, and a complete one before the next begins."""
        nonlocal pending
        if pending is None:
            return
        began = time.monotonic()
        pending.result()
        if args.snapshot_to == "disk" and rank == 0:
            previous = async_disk.latest()
            tmp = async_disk.root / f"latest.tmp{os.getpid()}"
            tmp.write_text(f"step-{pending_step}")
            os.replace(tmp, async_disk.root / "latest")
            for old in async_disk.root.glob("step-*"):
                if old.name != f"step-{pending_step}" and old != previous:
                    shutil.rmtree(old, ignore_errors=True)
        progress.log("snapshot", pending_step)
        pending = None
        waited[0] += time.monotonic() - began

    try:
        for step in range(done, args.steps):
            stand_in_step(args, step, rank, restart == 0)
            job.train_step(step, rank, args.width, loss_fn)
            # The previous snapshot had this step's compute to finish in: once it is complete
            # everywhere, a step reported done is at most one step ahead of a restorable one.
            settle()
            done = step + 1
            if not args.no_heartbeat:
                worker.step(done)
            progress.log("step", done)
            if args.snapshot_every and done % args.snapshot_every == 0:
                if args.snapshot_to == "memory":
                    # Each rank's snapshot is complete on its own: no DCP collectives (no_dist);
                    # one planner for the loop: the plan is reused while the state keeps its structure.
                    pending = dcp.async_save(
                        job.state(done), storage_writer=SnapshotWriter(done), planner=planner, no_dist=True
                    )
                else:
                    writer = dcp.FileSystemWriter(async_disk.root / f"step-{done}")
                    pending = dcp.async_save(job.state(done), storage_writer=writer, process_group=ckpt_group)
                pending_step = done
            if done % args.ckpt_every == 0 or done == args.steps:
                settle()
                disk.save(job.state(done), done, ckpt_group)
        settle()
    finally:
        worker.done()
    digest = job.digest()  # collective under FSDP: every rank takes part
    if rank == 0 and args.result is not None:
        args.result.write_text(json.dumps({"steps": done, "snapshot_wait": waited[0], **digest}))
    progress.log("done", done)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
