"""A whole node lost during a live round's state hand-over, on 2 real ``taskdrun`` nodes x 2 workers.

Every rank carries 256 MiB of extra live state (``--ballast-mb``), so the
hand-over lasts long enough to lose the receiving node in the middle of it.
"""

from __future__ import annotations

import os
import re
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
from pt_support import Launcher, events, run_job
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from taskd_core.testing import descendants, process_running, wait_until

pytestmark = pytest.mark.slow

TOKEN = {"TASKD_JOB_TOKEN": "s3cret"}
#: The first live round's address key (restart 0, round 1; a PrefixStore joins with "/").
TRANSFER_KEY = "taskd/live/0/1//state-transfer"


@pytest.mark.parametrize("lost", ["receiver", "replica"])
def test_a_node_lost_during_the_hand_over_ends_the_job_on_the_other_node_with_a_clear_message(
    launch: Launcher, tmp_path: Path, lost: str
) -> None:
    """The node lost holds the replacement that receives the state, or the replica that sends it
    (both of the other node's ranks were lost, so only the lost node's ranks are replicas)."""
    nodes, progress, _ = run_job(
        launch,
        tmp_path / "loss",
        "--ballast-mb",
        "256",
        script="train_live.py",
        env=TOKEN,
        taskd=("--taskd-live-timeout", "10", "--taskd-dump-grace", "5", "--taskd-no-hang-detection"),
    )
    logs = [tmp_path / f"loss{n}.{n}.log" for n in (0, 1)]
    wait_until(
        lambda: len({e["rank"] for e in events(progress) if e["event"] == "step"}) == 4,
        "every rank to train",
        240,
    )
    # The node that hosts the controller (and the workers' store) survives; the other one is lost.
    survivor = next(n for n in (0, 1) if "embedded controller listening" in logs[n].read_text())
    victim = 1 - survivor
    found = re.search(r"restart round 0: workers meet at (\S+):(\d+)", logs[survivor].read_text())
    assert found is not None
    store = TCPStore(found.group(1), int(found.group(2)), is_master=False, timeout=timedelta(seconds=30))
    starts = {int(e["pid"]): int(e["rank"]) for e in events(progress) if e["event"] == "start"}
    victim_ranks = sorted(rank for pid, rank in starts.items() if pid in set(descendants(nodes[victim].pid)))
    assert len(victim_ranks) == 2
    if lost == "receiver":
        # One of the victim's ranks dies: its replacement, on the victim node, receives the state ...
        os.kill(next(pid for pid, rank in starts.items() if rank == victim_ranks[1]), signal.SIGKILL)
    else:
        # Both of the survivor's ranks die: their replacements take the state from a victim's rank ...
        for pid in [pid for pid, rank in starts.items() if rank not in victim_ranks]:
            os.kill(pid, signal.SIGKILL)
    wait_until(lambda: store.check([TRANSFER_KEY]), "the replica to publish where it serves the state", 120)
    # ... and the whole node goes while the state is on its way.
    tree = {nodes[victim].pid} | set(descendants(nodes[victim].pid))
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    lost_at = time.monotonic()

    # Within the stream grace (30 s), the dump grace and a stop: not the rendezvous' 600 s, nor for ever.
    assert nodes[survivor].wait(timeout=240) == 1
    took = time.monotonic() - lost_at
    text = logs[survivor].read_text()
    assert "left the job during recovery cycle 1" in text, text[-3000:]
    assert "every restart needs all of the job's nodes" in text
    print(f"the surviving node ended {took:.1f}s after the other node was lost")
    everyone = set(starts) | {int(e["pid"]) for e in events(progress)} | tree
    wait_until(
        lambda: not [pid for pid in everyone if process_running(pid)], "no process of the job to be left", 60
    )
