"""A small but real data-parallel training job that survives being killed: TaskD's main example.

Run it under ``taskd run`` (or ``torchrun``)::

    taskd run --nproc 2 -- python examples/train_ddp.py --ckpt-dir /tmp/ckpt --steps 200

What makes it recoverable:

* **Checkpoints are atomic**: rank 0 writes ``<ckpt-dir>/ckpt.pt`` through a
  temporary file and ``os.replace``, so a kill at any moment leaves either the
  old or the new checkpoint, never half of one.
* **Every start resumes**: all ranks load the latest checkpoint, if any, and
  continue from the step after it.
* **Training is deterministic**: fixed seeds, and the data of each step is
  derived from the step number and the rank alone. A run with faults therefore
  ends with exactly the parameters of a run without.
* **The dump signal (SIGUSR1) saves and exits 0**, which is what TaskD's
  ``dump`` strategy asks of a worker.
* **It tells the node agent it makes progress**: where it resumed and one
  heartbeat with the step count per step (:mod:`taskd_core.worker`), from
  which the agent learns the job's hang timeout and the controller counts the
  steps a fault cost; ``--timer S`` also arms torch elastic's file timer
  around every step, as a torchrun script would.

The update is written out by default (``--optimizer manual``): one
all_reduce, then SGD with momentum. ``--optimizer sgd`` runs the same math the
canonical way, ``DistributedDataParallel`` + ``torch.optim.SGD``, whose first
step imports ``torch._dynamo`` (seconds, on every cold restart).

It logs one JSON line per event (``start``, ``resumed``, ``step``, ``dump``,
``done``) to ``--progress`` so tests and benchmarks can see where training
resumed and when every rank stepped. Fault injection for tests:
``--fail-at-step S --fail-rank R --fail-mode {raise,exit,kill}`` fails once,
on the first start only (``TASKD_RESTART_COUNT == 0``); ``--hang-at-step S
--hang-rank R`` makes rank R spin in ``spin_forever`` there without a heartbeat;
``--hold-at-step S --hold-file F`` makes every rank wait before step S (with
heartbeats) until F exists, so that a test can line a fault up with the job's
other launchers however loaded the machine is; ``--rush-file F`` drops the
``--step-time`` pause once F exists (a bench ends a long job sooner, with the same math).
``--step-jitter J`` varies step times by up to J times ``--step-time`` (the
same on every rank; ``--jitter-per-rank``: each rank's on its own);
``--slow-from S --slow-step-time T`` changes the step time from step S on
(with ``--slow-rank R`` on rank R alone, on its first life only: a straggler;
``--slow-rank 2,3``: those ranks, a slow node); ``--job-slow-from S
--job-slow-factor F`` makes every rank's steps F times longer from step S on,
on every life (a job-wide slowdown, no straggler).
Each step tells the agent how long it worked (``worker.step(n, busy=...)``: its
time less its wait in the all_reduce), from which the controller finds a rank
slower than its peers.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist
from torch import nn

from taskd_core import worker

IN_FEATURES = 16
HIDDEN = 32
BATCH = 8
LEARNING_RATE = 0.05
MOMENTUM = 0.9


def parse_args() -> argparse.Namespace:
    return build_parser(__doc__).parse_args()


def build_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options every example training job shares (``doc``: the script's docstring, for ``--help``)."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="training steps in total")
    p.add_argument("--ckpt-dir", type=Path, required=True, help="directory of the checkpoint")
    p.add_argument("--ckpt-every", type=int, default=10, help="checkpoint every K steps")
    p.add_argument(
        "--step-time", type=float, default=0.0, help="extra seconds per step (makes kill timing easy)"
    )
    p.add_argument(
        "--progress", type=Path, default=os.environ.get("TRAIN_PROGRESS"), help="JSON-lines event log"
    )
    p.add_argument("--result", type=Path, default=None, help="rank 0 writes the final parameters here (JSON)")
    p.add_argument("--fail-at-step", type=int, default=None, help="fail once when this step begins")
    p.add_argument("--fail-rank", type=int, default=0, help="global rank that fails")
    p.add_argument("--fail-mode", choices=("raise", "exit", "kill"), default="raise")
    p.add_argument(
        "--hang-at-step", type=int, default=None, help="hang once (spin, silent) when this step begins"
    )
    p.add_argument("--hang-rank", type=int, default=0, help="global rank that hangs")
    p.add_argument("--hold-at-step", type=int, default=None, help="every rank waits before this step ...")
    p.add_argument("--hold-file", type=Path, default=None, help="... until this file exists")
    p.add_argument(
        "--rush-file", type=Path, default=None, help="once this file exists, steps take no --step-time pause"
    )
    p.add_argument("--no-heartbeat", action="store_true", help="do not report progress to the agent")
    p.add_argument(
        "--timer", type=float, default=None, help="arm torch's file timer for S seconds around each step"
    )
    p.add_argument(
        "--step-jitter", type=float, default=1.0, help="step time varies between 1x and Jx --step-time"
    )
    p.add_argument(
        "--jitter-per-rank", action="store_true", help="each rank's steps vary on their own (default: alike)"
    )
    p.add_argument(
        "--slow-from", type=int, default=None, help="from this step on, steps take --slow-step-time"
    )
    p.add_argument("--slow-step-time", type=float, default=0.0)
    p.add_argument(
        "--slow-rank",
        type=rank_list,
        default=None,
        help="only these global ranks (R or R,R...) take --slow-step-time, on their first life only "
        "(default: every rank)",
    )
    p.add_argument(
        "--job-slow-from", type=int, default=None, help="from this step on, every rank's steps take ..."
    )
    p.add_argument("--job-slow-factor", type=float, default=1.0, help="... this many times longer")
    p.add_argument(
        "--optimizer",
        choices=("manual", "sgd"),
        default="manual",
        help="the update: written out (manual) or DistributedDataParallel + torch.optim.SGD (sgd)",
    )
    p.add_argument(
        "--ballast-mb",
        type=int,
        default=0,
        help="train_live.py: MiB of extra live state per rank (a slow state hand-over, for tests)",
    )
    return p


def rank_list(text: str) -> frozenset[int]:
    """``--slow-rank``'s ranks: ``R`` or ``R,R...``."""
    try:
        ranks = frozenset(int(r) for r in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ranks like 3 or 2,3, got {text!r}") from None
    if min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"ranks are 0 or more, got {text!r}")
    return ranks


class Progress:
    """Append-only JSON-lines log shared by every rank (a short O_APPEND write stays whole)."""

    def __init__(self, path: Path | None, rank: int, restart: int) -> None:
        self.path, self.rank, self.restart = path, rank, restart

    def log(self, event: str, step: int) -> None:
        if self.path is None:
            return
        line = json.dumps(
            {
                "event": event,
                "rank": self.rank,
                "step": step,
                "pid": os.getpid(),
                "restart": self.restart,
                # A job of --nnodes=MIN:MAX restarts with another world size when it shrinks.
                "world": int(os.environ.get("WORLD_SIZE", "1")),
                "time": time.time(),
            }
        )
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def make_model() -> nn.Module:
    torch.manual_seed(0)  # every rank starts from the same parameters
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of ``rank`` at ``step``: depends on nothing else, so a replayed step is identical."""
    g = torch.Generator().manual_seed(step * 100_003 + rank)
    x = torch.randn(BATCH, IN_FEATURES, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return x, y


def save_checkpoint(path: Path, step: int, model: nn.Module, velocity: list[torch.Tensor]) -> None:
    """Write atomically: a reader (or a resume after a kill) sees the old file or the new one, never half."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save({"step": step, "model": model.state_dict(), "velocity": velocity}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model: nn.Module, velocity: list[torch.Tensor]) -> int:
    """Steps already done according to the checkpoint (0 without one); loads the state in place."""
    if not path.exists():
        return 0
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    for v, saved in zip(velocity, state["velocity"], strict=True):
        v.copy_(saved)
    return int(state["step"])


def sgd_step(
    model: nn.Module,
    velocity: list[torch.Tensor],
    world_size: int,
    all_reduce: Callable[[torch.Tensor], object] = dist.all_reduce,
) -> None:
    """Average gradients over all ranks, then SGD with momentum.

    One all_reduce of all gradients before any update: if a peer dies during
    it, no parameter has changed yet. Written out instead of DDP + torch.optim
    because the first optimizer step imports torch._dynamo, seconds on every restart.
    """
    params = list(model.parameters())
    grads = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
    all_reduce(grads)
    grads /= world_size
    with torch.no_grad():
        offset = 0
        for p, v in zip(params, velocity, strict=True):
            g = grads[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            v.mul_(MOMENTUM).add_(g)
            p.sub_(LEARNING_RATE * v)


def params_digest(model: nn.Module) -> dict[str, object]:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest(), "params": flat.tolist()}


def spin_forever() -> None:
    """A hang that burns CPU and reports nothing: what a livelocked rank looks like."""
    end = time.monotonic() + 600
    while time.monotonic() < end:
        pass


def step_timer(seconds: float | None) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """torch elastic's watchdog around each step, when asked for and served (``TORCHELASTIC_TIMER_FILE``)."""
    path = os.environ.get("TORCHELASTIC_TIMER_FILE")
    if seconds is None or not path:
        return contextlib.nullcontext
    from torch.distributed.elastic import timer

    timer.configure(timer.FileTimerClient(path))
    return lambda: timer.expires(after=seconds, scope="step")


def hold(path: Path, timeout: float = 600.0) -> None:
    """Wait until ``path`` exists, alive (heartbeats) but not stepping; a test that died never makes it."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"--hold-file {path} did not appear within {timeout:.0f} s")
        worker.heartbeat()
        time.sleep(0.05)


def step_pause(args: argparse.Namespace, step: int, rank: int, first_life: bool) -> float:
    """Seconds this step sleeps: a stand-in for compute, the same in every run.

    With ``--slow-rank`` only those ranks' first lives slow down; the jitter is the step's, job-wide,
    or with ``--jitter-per-rank`` the step's on each rank. No pause once ``--rush-file`` exists.
    """
    if args.rush_file is not None and args.rush_file.exists():
        return 0.0
    slowed = args.slow_rank is None or (rank in args.slow_rank and first_life)
    late = args.slow_from is not None and step >= args.slow_from and slowed
    pause = args.slow_step_time if late else args.step_time
    if args.job_slow_from is not None and step >= args.job_slow_from:
        pause *= args.job_slow_factor
    seed = f"{step}:{rank}" if args.jitter_per_rank else step
    return pause * random.Random(seed).uniform(1.0, args.step_jitter)


class WaitClock:
    """The seconds a rank waits in its collectives, so that a step can report the rest as its work."""

    def __init__(self, collective: Callable[[torch.Tensor], object]) -> None:
        self._collective = collective
        self.waited = 0.0

    def __call__(self, tensor: torch.Tensor) -> None:
        began = time.monotonic()
        self._collective(tensor)
        self.waited += time.monotonic() - began


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

    signal.signal(signal.SIGUSR1, on_dump)

    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # MASTER_ADDR/MASTER_PORT from env
    model = make_model()
    velocity = [torch.zeros_like(p) for p in model.parameters()]
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt = args.ckpt_dir / "ckpt.pt"
    done = load_checkpoint(ckpt, model, velocity)
    # Nobody may overwrite the checkpoint until every rank has read it.
    dist.barrier()
    worker.resumed(done)  # where training resumes: the steps a fault cost are counted from it
    if done:
        progress.log("resumed", done)
    loss_fn = nn.MSELoss()
    watchdog = step_timer(args.timer)
    optimizer = None
    if args.optimizer == "sgd":
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
        if done:  # a zero buffer would equal SGD's first step, which takes the gradient as its buffer
            for p, v in zip(model.parameters(), velocity, strict=True):
                optimizer.state[p]["momentum_buffer"] = v
    reduce = WaitClock(dist.all_reduce)
    try:
        for step in range(done, args.steps):
            if step == args.hold_at_step and args.hold_file is not None:
                hold(args.hold_file)
            began, reduce.waited = time.monotonic(), 0.0
            if step == args.fail_at_step and rank == args.fail_rank and restart == 0:
                inject_fault(args.fail_mode, step)
            with watchdog():
                if step == args.hang_at_step and rank == args.hang_rank and restart == 0:
                    spin_forever()
                pause = step_pause(args, step, rank, restart == 0)
                if pause:
                    # Stands for compute: the window in which a peer's fault is handled.
                    time.sleep(pause)
                if dump_requested:
                    break
                model.zero_grad()
                x, y = batch(step, rank)
                if optimizer is None:
                    loss_fn(model(x), y).backward()
                    sgd_step(model, velocity, world_size, reduce)
                else:
                    loss_fn(ddp(x), y).backward()  # DDP averages the gradients over the ranks
                    optimizer.step()
                    velocity = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
            done = step + 1
            if not args.no_heartbeat:
                # A heartbeat that also says how far training got, and how long this rank worked
                # (DDP waits inside backward(), out of sight: its step reports no work).
                busy = time.monotonic() - began - reduce.waited if optimizer is None else None
                worker.step(done, busy=busy)
            progress.log("step", done)
            if rank == 0 and (done % args.ckpt_every == 0 or done == args.steps):
                save_checkpoint(ckpt, done, model, velocity)
    except RuntimeError:
        # A dead peer breaks the collective; with a dump pending, the parameters
        # (updated only after a successful all_reduce) are still those of `done`.
        if not dump_requested:
            raise
    finally:
        # Saving and tearing down take a while without steps: that silence is no hang.
        worker.done()
        # torch 2.13: gloo's threads release the last collectives DDP launched (taking the GIL) while
        # freeing the wrapper joins them holding it; a pause lets them finish (docs/warm-restarts.md).
        time.sleep(0.05)
    if dump_requested:
        if rank == 0:
            save_checkpoint(ckpt, done, model, velocity)
        progress.log("dump", done)
        return 0
    if rank == 0 and args.result is not None:
        args.result.write_text(json.dumps({"steps": done, **params_digest(model)}))
    progress.log("done", done)
    dist.destroy_process_group()
    return 0


def stand_in_step(args: argparse.Namespace, step: int, rank: int, first_life: bool) -> None:
    """The step's injected fault or hang when they are this rank's (first life only), then its pause."""
    if step == args.fail_at_step and rank == args.fail_rank and first_life:
        inject_fault(args.fail_mode, step)
    if step == args.hang_at_step and rank == args.hang_rank and first_life:
        spin_forever()
    pause = step_pause(args, step, rank, first_life)
    if pause:
        time.sleep(pause)  # stands for compute


def inject_fault(mode: str, step: int) -> None:
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "exit":
        os._exit(3)  # no cleanup, like a crash in native code
    raise RuntimeError(f"injected fault at step {step}")


if __name__ == "__main__":
    sys.exit(main())
