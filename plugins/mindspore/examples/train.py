"""A tiny MindSpore data-parallel training job for msrun, with checkpoint save and resume.

Run under ``msrun`` (graph mode on CPU)::

    msrun --worker_num=4 --local_worker_num=2 --node_rank=0 --master_port=8118 \
        --log_dir=logs --join=False examples/train.py --out /tmp/run --steps 30

Each worker builds a one-layer network, trains it for ``--steps`` steps on
fixed synthetic data, and after every step

* saves a MindSpore checkpoint (``save_checkpoint``) holding the weights and
  the step counter, and
* appends one JSON line ``{"event": "step", "rank", "pid", "step",
  "resumed_from", "restart", "time", ...}`` to ``<out>/progress.jsonl``, so a
  test can see which process reached which step, when, and from where a
  restarted process resumed (also ``start``, before ``import mindspore``, and
  ``init``, after ``communication.init()``, for the phases of a start).

On start a worker loads its checkpoint if there is one (``load_checkpoint``)
and continues after the saved step. It tells the node agent where it resumed
and how far it got (``taskd_core.worker.resumed`` / ``step``: the steps a
fault cost reach the controller's journal and ``/metrics``).

``--collective`` (default) all-reduces the gradients every step, so every rank
depends on every other one: losing one worker stalls the others, which is the
situation a full ``recover`` handles. ``--no-collective`` keeps the ranks
independent after ``init()``: a restarted rank does not need its peers, which
is the only honest way to show ``recover-in-place`` on CPU, where MindSpore has
no way to rebuild a communication group around a replaced peer.

TaskD's ``dump`` strategy (:mod:`taskd_mindspore.dump`): on the dump signal
the loop stops at the next step boundary, saves the checkpoint of the last
completed step, records ``{"event": "dump"}`` and exits 0. ``--ckpt-every N``
saves only every N steps otherwise, so that the dump's checkpoint is the one
that keeps the most recent step.

``--stop-file PATH``: once the file exists and names a step, training ends
there as at ``--steps`` (every rank reads it at each step: write a step
still a few steps ahead, so that all ranks end at the same one).

``--fork-child`` starts a child with ``mindspore.multiprocessing`` (a fork
after ``import mindspore``, with MindSpore's own fork hooks) once training
began; the child runs a MindSpore op and sends the result back, recorded as
``{"event": "child", "value"}``: a script that forks by itself.

The scheduler process msrun starts runs this same script; for it
``mindspore.communication.init()`` is the whole job (it serves the cluster
and returns when the workers are done), so the script stops right after it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for checkpoints and progress.jsonl")
    parser.add_argument("--steps", type=int, default=20, help="step the job finishes at")
    parser.add_argument("--step-sleep", type=float, default=0.2, help="seconds each step idles, to stretch the job")
    parser.add_argument("--collective", action=argparse.BooleanOptionalAction, default=True,
                        help="all-reduce gradients every step (default) or train each rank on its own")
    parser.add_argument("--ckpt-every", type=int, default=1, help="save a checkpoint every N steps")
    parser.add_argument("--fork-child", action="store_true",
                        help="fork a MindSpore child process (mindspore.multiprocessing) after the first step")
    parser.add_argument("--stop-file", type=Path,
                        help="a file naming a step: training finishes there (as at --steps) once it exists")
    return parser.parse_args(argv)


def _record(out: Path, **fields: object) -> None:
    # One short O_APPEND write per line keeps concurrent ranks' lines whole.
    line = (json.dumps({"time": time.time(), **fields}, sort_keys=True) + "\n").encode()
    fd = os.open(out / "progress.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    sched = os.environ.get("MS_ROLE") == "MS_SCHED"
    if not sched:
        # msrun exports RANK_ID when it knows the ranks (--node_rank given, or one node).
        args.out.mkdir(parents=True, exist_ok=True)
        _record(args.out, rank=int(os.environ.get("RANK_ID", "-1")), pid=os.getpid(), ppid=os.getppid(),
                event="start")
    import mindspore as ms  # imported late: --help and argument errors need no framework
    import numpy as np
    from mindspore import nn, ops
    from mindspore.communication import get_group_size, get_rank, init

    from taskd_core import worker
    from taskd_mindspore.dump import DumpRequest

    dump = DumpRequest()

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    init()
    if sched:
        return 0
    rank, size = get_rank(), get_group_size()
    _record(args.out, rank=rank, pid=os.getpid(), event="init")
    ckpt = args.out / f"rank{rank}.ckpt"

    net = nn.Dense(4, 1)
    step_param = ms.Parameter(ms.Tensor(0, ms.int32), name="global_step", requires_grad=False)
    resumed_from = 0
    if ckpt.exists():
        saved = ms.load_checkpoint(str(ckpt))
        resumed_from = int(saved.pop("global_step").asnumpy())
        ms.load_param_into_net(net, saved)
    worker.resumed(resumed_from)
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.01)
    loss_fn = nn.MSELoss()
    all_reduce = ops.AllReduce() if args.collective else None

    def forward(x: ms.Tensor, y: ms.Tensor) -> ms.Tensor:
        return loss_fn(net(x), y)

    grad_fn = ms.value_and_grad(forward, None, optimizer.parameters)

    @ms.jit
    def train_step(x: ms.Tensor, y: ms.Tensor) -> ms.Tensor:
        loss, grads = grad_fn(x, y)
        if all_reduce is not None:
            grads = tuple(all_reduce(g) / size for g in grads)
        optimizer(grads)
        return loss

    rng = np.random.default_rng(rank)
    x = ms.Tensor(rng.standard_normal((8, 4)).astype(np.float32))
    y = ms.Tensor(rng.standard_normal((8, 1)).astype(np.float32))
    restart = int(os.environ.get("TASKD_RESTART_COUNT", "0"))
    heartbeat = {k: os.environ.get(k) for k in ("MS_RETRY_INTERVAL_LOWER", "MS_RETRY_INTERVAL_UPPER")}

    def save(step: int) -> None:
        step_param.set_data(ms.Tensor(step, ms.int32))
        ms.save_checkpoint(net, str(ckpt), append_dict={"global_step": step_param})

    done = resumed_from
    for step in range(resumed_from + 1, args.steps + 1):
        loss = train_step(x, y)
        done = step
        last = step == args.steps or step == _stop_step(args.stop_file)
        if step % args.ckpt_every == 0 or last:
            save(step)
        worker.step(step)  # also a heartbeat for the agent's hang detection
        _record(args.out, rank=rank, pid=os.getpid(), event="step", step=step, resumed_from=resumed_from,
                restart=restart, loss=float(loss.asnumpy()), heartbeat=heartbeat)
        if args.fork_child and step == resumed_from + 1:
            _record(args.out, rank=rank, pid=os.getpid(), step=step, event="child", value=_child_sum())
        time.sleep(args.step_sleep)
        if dump.requested:  # the step boundary: the parameters are those of `done` on every rank
            save(done)
            _record(args.out, rank=rank, pid=os.getpid(), step=done, event="dump", restart=restart)
            worker.done()
            return 0
        if last:
            break
    _record(args.out, rank=rank, pid=os.getpid(), step=done, event="done", restart=restart)
    logger.info("rank %s finished at step %s", rank, done)
    return 0


def _stop_step(path: Path | None) -> int | None:
    # Read at every step: a rank must see it before reaching that step, so write it well ahead.
    try:
        return int(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None


def _add_in_child(queue: object) -> None:
    import mindspore as ms

    queue.put(float((ms.Tensor([1.0, 2.0]) + ms.Tensor([3.0, 4.0])).sum().asnumpy()))  # type: ignore[attr-defined]


def _child_sum() -> float:
    """Fork a child with MindSpore's multiprocessing, have it run an op, and return its result."""
    import mindspore.multiprocessing as msmp

    queue = msmp.Queue()  # msmp.Process forks (Linux's default start method) between MindSpore's hooks
    child = msmp.Process(target=_add_in_child, args=(queue,))
    child.start()
    value = float(queue.get(timeout=60))
    child.join(60)
    return value


if __name__ == "__main__":
    raise SystemExit(main())
