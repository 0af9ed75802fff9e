"""The snapshot planner: one plan while the state keeps its structure, a new one when it changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from taskd_pytorch.snapshot import SnapshotPlanner


def _plan(planner: SnapshotPlanner, state: dict[str, Any]) -> tuple[object, object, object]:
    planner.set_up_planner(state, None, True)
    local = planner.create_local_plan()
    plans, metadata = planner.create_global_plan([local])
    return local, plans, metadata


def test_the_plan_is_reused_while_the_structure_holds_and_made_again_when_it_changes() -> None:
    planner = SnapshotPlanner()
    state: dict[str, Any] = {"model": {"w": torch.zeros(4, 3)}, "step": 1}
    first = _plan(planner, state)
    own = planner.own_metadata(planner.plan)
    # New values, same structure: every part of the plan is the one made before.
    again = _plan(planner, {"model": {"w": torch.ones(4, 3)}, "step": 2})
    assert all(a is b for a, b in zip(first, again, strict=True))
    assert planner.own_metadata(planner.plan) is own and planner.planned == 1

    changed: list[dict[str, Any]] = [
        {"model": {"w": torch.zeros(5, 3)}, "step": 3},  # shape
        {"model": {"w": torch.zeros(5, 3, dtype=torch.float64)}, "step": 3},  # dtype
        {"model": {"w": torch.zeros(5, 3, dtype=torch.float64), "b": torch.zeros(3)}, "step": 3},  # a key
        {
            "model": {"w": torch.zeros(5, 3, dtype=torch.float64), "b": torch.zeros(3)},
            "step": torch.tensor(3),
        },
    ]
    for n, new in enumerate(changed, start=2):
        local, _, metadata = _plan(planner, new)
        assert planner.planned == n and local is not first[0]
        md = metadata.state_dict_metadata  # type: ignore[attr-defined]
        assert md["model.w"].size == new["model"]["w"].shape
        assert md["model.w"].properties.dtype == new["model"]["w"].dtype
        assert ("model.b" in md) == ("b" in new["model"])
        assert planner.own_metadata(planner.plan) is not own


def test_saves_through_one_planner_write_each_save_s_own_values(tmp_path: Path) -> None:
    planner = SnapshotPlanner()
    for step in (1, 2):
        state = {"w": torch.full((3,), float(step)), "step": step}
        dcp.save(state, checkpoint_id=tmp_path / str(step), planner=planner, no_dist=True)
    for step in (1, 2):
        back: dict[str, Any] = {"w": torch.zeros(3), "step": 0}
        dcp.load(back, checkpoint_id=tmp_path / str(step), no_dist=True)
        assert back["w"].tolist() == [float(step)] * 3 and back["step"] == step
    assert planner.planned == 1
