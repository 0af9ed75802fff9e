"""``LiveSession(sharded=True)`` in one real process (gloo, one rank): what it snapshots and restores.

The snapshot directory is a plain directory standing in for the node
keeper's (the worker side needs only its path and budget); no launcher runs,
so a lost peer is not in play here (``test_live_snapshots.py`` kills one
under ``taskdrun``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
from pt_support import WORKERS

from taskd_core.snapshots.keeper import BUDGET_ENV, COPIES_ENV, DIR_ENV
from taskd_core.snapshots.store import SnapshotStore
from taskd_core.testing import free_port

pytestmark = pytest.mark.slow


def run(tmp_path: Path, name: str, steps: int, every: int, snapshots: Path | None) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TASKD_", "TORCHELASTIC_"))}
    env.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    if snapshots is not None:
        env.update({DIR_ENV: str(snapshots), BUDGET_ENV: str(2**30), COPIES_ENV: "0"})
    proc = subprocess.run(
        [sys.executable, str(WORKERS / "sharded_session.py"), str(out), str(steps), str(every)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**json.loads(out.read_text()), "stderr": proc.stderr}


def test_every_kth_committed_step_is_snapshotted_and_the_next_life_resumes_from_the_newest(
    tmp_path: Path,
) -> None:
    snapshots = tmp_path / "shm"
    snapshots.mkdir()
    first = run(tmp_path, "first", 5, 2, snapshots)
    assert (first["source"], first["resumed"], first["done"]) == ("none", 0, 5)
    assert max(first["kept"]) == 4 and set(first["kept"]) <= {2, 4}  # steps 2 and 4; 5 is not a multiple

    again = run(tmp_path, "again", 8, 2, snapshots)
    assert (again["source"], again["resumed"], again["done"]) == ("memory", 4, 8)

    # The newest copy, as code of another layout version would have kept it (sealed, checksums
    # right): refused with one warning naming it, the older step restored instead.
    store = SnapshotStore(snapshots)
    assert store.steps(0) == [6, 8]
    seal = store.seal(0, 8)
    foreign = pickle.dumps({"step": 8, "spans": {}})
    store.commit(dataclasses.replace(seal, meta_size=len(foreign), meta_crc=zlib.crc32(foreign)), foreign)
    upgraded = run(tmp_path, "upgraded", 8, 2, snapshots)
    assert (upgraded["source"], upgraded["resumed"], upgraded["done"]) == ("memory", 6, 8)
    refusals = [line for line in upgraded["stderr"].splitlines() if "another snapshot layout" in line]
    assert len(refusals) == 1 and "snapshot of step 8" in refusals[0], upgraded["stderr"][-3000:]
    assert upgraded["weight"] == again["weight"]

    # The same 8 steps in one life end with the same parameters.
    whole = run(tmp_path, "whole", 8, 2, None)
    assert whole["weight"] == again["weight"]
    # Without a node keeper the session says so once and trains on (disk checkpoints only).
    assert (whole["source"], whole["done"]) == ("none", 8)
    assert whole["stderr"].count("no memory snapshots") == 1
