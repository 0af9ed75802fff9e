"""``examples/train_ddp.py`` adapted to live recovery: a lost rank costs no committed step.

Same job, same options, same progress events and ``--result`` file as
``train_ddp.py`` (it reuses that script's model, data, checkpoints and
update); only ``main`` differs, by the lines that adopt
:mod:`taskd_pytorch.live`. Run it under ``taskdrun``::

    taskdrun --nproc-per-node=2 examples/train_live.py --ckpt-dir /tmp/ckpt --steps 200

When a rank is lost, the others keep running; the replacement receives the
parameters and momentum of the most advanced live rank and the interrupted
step runs again. Checkpoints are still written: they are what a full restart
falls back to when live recovery cannot be done.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from types import FrameType

import torch
from torch import nn
from train_ddp import (
    LEARNING_RATE,
    MOMENTUM,
    Progress,
    batch,
    hold,
    inject_fault,
    load_checkpoint,
    make_model,
    params_digest,
    parse_args,
    save_checkpoint,
    sgd_step,
    spin_forever,
    step_pause,
    step_timer,
)

from taskd_pytorch.live import LiveSession


def main() -> int:
    args = parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TASKD_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    progress = Progress(args.progress, rank, restart)
    progress.log("start", 0)

    # The dump signal only sets a flag: the loop saves at the next step boundary,
    # where the parameters are consistent on every rank.
    dump_requested = False

    def on_dump(signum: int, frame: FrameType | None) -> None:
        nonlocal dump_requested
        dump_requested = True
        session.request_stop()  # also ends a wait for the next live round

    model = make_model()
    velocity = [torch.zeros_like(p) for p in model.parameters()]
    # The state a replacement receives; every committed step is a heartbeat unless told otherwise.
    ballast = {"ballast": torch.zeros(args.ballast_mb * 2**18)} if args.ballast_mb else {}
    session = LiveSession(model=model, velocity=velocity, heartbeat=not args.no_heartbeat, **ballast)
    signal.signal(signal.SIGUSR1, on_dump)
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt = args.ckpt_dir / "ckpt.pt"
    # Joins the job; a rank that replaces a lost one receives the live state here.
    done = session.start(load_checkpoint(ckpt, model, velocity))
    if done:
        progress.log("resumed", done)
    loss_fn = nn.MSELoss()
    watchdog = step_timer(args.timer)
    optimizer = None
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
        for p, v in zip(model.parameters(), velocity, strict=True):
            optimizer.state[p]["momentum_buffer"] = v  # the very tensors the session hands on
    ddp, ddp_round = None, -1
    first_life = restart == 0 and session.round == 0
    for live_step in session.steps(args.steps):
        if live_step.number == args.hold_at_step and args.hold_file is not None and first_life:
            hold(args.hold_file)  # outside the step: a lost peer fails the step's collectives, not this wait
        with live_step:
            step = live_step.number
            if step == args.fail_at_step and rank == args.fail_rank and first_life:
                inject_fault(args.fail_mode, step)
            with watchdog():
                if step == args.hang_at_step and rank == args.hang_rank and first_life:
                    spin_forever()
                pause = step_pause(args, step, rank, first_life)
                if pause:
                    # Stands for compute: the window in which a peer's fault is handled.
                    time.sleep(pause)
                model.zero_grad()
                x, y = batch(step, rank)
                if optimizer is None:
                    loss_fn(model(x), y).backward()
                    sgd_step(model, velocity, world_size, session.all_reduce)
                else:
                    if ddp_round != session.round:  # a DDP wrapper belongs to one process group
                        ddp, ddp_round = nn.parallel.DistributedDataParallel(model), session.round
                        ddp.register_comm_hook(None, session.ddp_comm_hook)  # leaves a broken round
                    loss_fn(ddp(x), y).backward()  # DDP averages the gradients over the ranks
                    optimizer.step()
            done = step + 1
            progress.log("step", done)
            if rank == 0 and (done % args.ckpt_every == 0 or done == args.steps):
                save_checkpoint(ckpt, done, model, velocity)
    done = session.step  # a step that failed here may have been completed by a replica
    if dump_requested:
        if rank == 0:
            save_checkpoint(ckpt, done, model, velocity)
        progress.log("dump", done)
        return 0
    if rank == 0 and args.result is not None:
        args.result.write_text(json.dumps({"steps": done, **params_digest(model)}))
    progress.log("done", done)
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
