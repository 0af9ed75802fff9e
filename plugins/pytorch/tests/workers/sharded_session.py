"""A one-rank ``LiveSession(sharded=True)`` that trains a few steps and says what it restored and kept.

Usage: ``sharded_session.py OUT STEPS EVERY``; the snapshot directory and
rendezvous come from the environment the test sets (as ``taskdrun`` would).
Writes ``OUT`` (JSON): where the restore came from, its step, the steps
committed, the snapshot steps the node's store holds for rank 0 at the end,
and the parameters.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from taskd_core.snapshots.keeper import DIR_ENV
from taskd_core.snapshots.store import SnapshotStore
from taskd_pytorch.live import LiveSession


def main() -> int:
    out, steps, every = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    session = LiveSession(sharded=True, snapshot_every=every)
    session.start()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)  # no momentum: the model is the whole state

    def state(step: int) -> dict[str, Any]:
        return {"model": model.state_dict(), "extra": {"step": step}}

    def load(loaded: dict[str, Any]) -> int:
        model.load_state_dict(loaded["model"])
        return int(loaded["extra"]["step"])

    resumed = session.restore(state, load)
    for step in session.steps(steps):
        with step:
            x = torch.full((2, 4), 0.1 * step.number)
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    done = session.step
    session.close()
    root = os.environ.get(DIR_ENV)
    kept = SnapshotStore(Path(root)).steps(0) if root else []
    out.write_text(
        json.dumps(
            {
                "source": session.restored_from.value if session.restored_from else None,
                "resumed": resumed,
                "done": done,
                "kept": kept,
                "weight": model.weight.detach().tolist(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
