"""A ``LiveSession`` of sharded state (FSDP2, 4 ranks, gloo) under ``taskdrun``: a SIGKILLed rank costs ≤ 1 step.

The job is ``examples/train_fsdp_live.py``: ``LiveSession(sharded=True)``
snapshots every committed step to the node keeper's memory and restores
every rank of the next life from the newest step all of them have. Its final
parameters are compared with a fault-free run's.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from pt_support import Launcher, finish_one, last_step, one_node_job, restores, workers

from taskd_core.testing import wait_until

pytestmark = pytest.mark.slow

STEPS = 16
ARGS = ("--steps", str(STEPS), "--ckpt-every", "4", "--width", "256", "--layers", "2", "--step-time", "0.1")
#: The rank the test kills.
VICTIM = 2


def run(launch: Launcher, work: Path) -> tuple[subprocess.Popen[bytes], Path, Path]:
    return one_node_job(launch, work, "train_fsdp_live.py", *ARGS)


def test_a_sigkilled_rank_of_a_sharded_live_session_restores_from_memory_losing_at_most_one_step(
    launch: Launcher, tmp_path: Path
) -> None:
    node, _, result = run(launch, tmp_path / "reference")
    reference = finish_one(node, result)["sha256"]

    node, progress, result = run(launch, tmp_path / "killed")
    wait_until(
        lambda: last_step(progress) >= 6 and len(workers(node, progress)) == 4,
        "every rank to train 6 steps",
        120,
    )
    # Somewhere in a step: the previous step's snapshot is being copied, or is complete.
    pause = random.Random().uniform(0.0, 0.2)
    print(f"killing rank {VICTIM} {pause:.3f}s later")
    time.sleep(pause)
    os.kill(workers(node, progress)[VICTIM], signal.SIGKILL)
    seen = last_step(progress)
    done = finish_one(node, result)

    back = restores(progress)
    print(f"steps reported before the kill: {seen}, after it: {last_step(progress)}; restored: {back}")
    assert sorted(back) == [0, 1, 2, 3] and {source for source, _ in back.values()} == {"memory"}, back
    (step,) = {step for _, step in back.values()}  # every rank resumed the same step
    assert last_step(progress) - step <= 1  # the newest step any rank committed in the first life
    assert done["steps"] == STEPS and done["sha256"] == reference
