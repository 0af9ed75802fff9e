"""The save planner that plans a memory snapshot once and reuses the plan while the state keeps its structure.

Every snapshot of a training loop saves the same items (the same keys,
shapes, dtypes, shardings); only the values change. DCP's default planner
still builds each save's write items (a DTensor's chunk offsets), the global
plan and its metadata again, and the snapshot's index another metadata, all
in Python on ``async_save``'s background thread. A :class:`SnapshotPlanner`
that the caller makes once and passes to every ``async_save`` keeps those
and reuses them when the state's structure is the one planned for; any
change (a key, a shape, a dtype, a placement) plans afresh. DCP's own
``enable_plan_caching`` keeps its cache on the ``SavePlanner`` class (one per
process, shared by every planner); this one is the caller's object.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_global_save_plan
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.tensor import DTensor


def structure(state_dict: dict[str, Any], mappings: Any, is_coordinator: bool) -> tuple[Hashable, ...]:
    """What a save plan of the flattened ``state_dict`` depends on: each item's key, kind, shape, sharding."""
    key: list[Hashable] = [is_coordinator, tuple(mappings.items()) if isinstance(mappings, dict) else None]
    for fqn, value in state_dict.items():
        if isinstance(value, DTensor):
            local = value._local_tensor
            key.append(
                (
                    fqn,
                    "d",
                    value.shape,
                    value.dtype,
                    value.requires_grad,
                    value.placements,
                    value.device_mesh,
                    local.shape,
                    local.stride(),
                )
            )
        elif isinstance(value, torch.Tensor):
            key.append((fqn, "t", type(value), value.shape, value.dtype, value.requires_grad, value.stride()))
        else:
            key.append((fqn, "o"))  # pickled at write time: its value is not part of the plan
    return tuple(key)


class SnapshotPlanner(DefaultSavePlanner):
    """DCP's default save planner that reuses its last plan while the state's structure stays the same.

    Make one per training loop and pass it to each ``async_save`` (or
    ``save``) of memory snapshots, with ``no_dist=True``::

        planner = SnapshotPlanner()
        ...
        dcp.async_save(state, storage_writer=SnapshotWriter(step), planner=planner, no_dist=True)

    One save at a time: wait for a save before the next starts (the planner
    holds the state of the save in flight, as DCP's own does).
    """

    def __init__(self) -> None:
        super().__init__()
        self._key: tuple[Hashable, ...] | None = None
        self._local: SavePlan | None = None
        self._global: tuple[list[SavePlan], Metadata] | None = None
        self._own: Metadata | None = None
        #: saves planned afresh (the first, and each whose structure changed).
        self.planned = 0

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        key = structure(self.state_dict, getattr(self, "mappings", None), is_coordinator)
        if key != self._key:
            self._key, self._local, self._global, self._own = key, None, None, None

    def create_local_plan(self) -> SavePlan:
        if self._local is None:
            self._local = super().create_local_plan()
            self.planned += 1
        self.plan = self._local
        return self._local

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # Only this rank's own plan is reusable as is (no_dist); other ranks' plans came over the wire.
        if not (len(all_plans) == 1 and all_plans[0] is self._local):
            return super().create_global_plan(all_plans)
        if self._global is None:
            self._global = super().create_global_plan(all_plans)
        self.global_plan, self.metadata = self._global
        return self._global

    def own_metadata(self, plan: SavePlan) -> Metadata | None:
        """The DCP metadata of this rank's own items of ``plan``, kept while it is reused (None: not ours)."""
        if plan is not self._local:
            return None
        if self._own is None:
            _, self._own = create_default_global_save_plan([plan], rewrite_index_hints=False)
        return self._own
