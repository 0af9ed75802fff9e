"""The ``StorageWriter`` that puts a ``torch.distributed.checkpoint`` save into node and peer memory."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from taskd_core.errors import SnapshotError, StreamError
from taskd_pytorch.snapshot._layout import gather
from taskd_pytorch.snapshot._place import Place

logger = logging.getLogger(__name__)


class SnapshotTooLarge(UserWarning):
    """A snapshot does not fit its memory budget: it is not kept, the disk checkpoint is the only one."""


class SnapshotWriter(StorageWriter):
    """Saves each rank's own state for ``step`` into its node's keeper and to its paired ranks' keepers.

    Use it where a ``FileSystemWriter`` would go; every rank writes its own
    items only (no other rank's snapshot is needed to restore it), marker last.
    A snapshot over the rank's memory budget, or that finds no room, is skipped
    with one warning: training goes on, the disk checkpoint stays the fallback.

    :param step: the training step the state is at (what a restore resumes from).
    :raises SnapshotError: outside ``taskdrun`` (no node keeper).
    """

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step
        self._place = Place.from_env()
        self._plan: SavePlan | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._plan = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # Before the coordinator removes items other ranks also hold: this rank keeps all of its own.
        self._plan = plan
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        own = self._plan if self._plan is not None else plan
        meta, buffers, size = gather(own, planner, self.step)
        self.keep(meta, buffers, size)
        future: Future[list[WriteResult]] = Future()
        future.set_result(
            [WriteResult(index=item.index, size_in_bytes=0, storage_data=None) for item in plan.items]
        )
        return future

    def keep(self, meta: bytes, buffers: list[memoryview], size: int) -> None:
        """Write the snapshot locally, then to each holder's keeper; what fails is said and skipped."""
        place = self._place
        holders = place.holders()
        need = 2 * (size + len(meta)) * (1 + len(holders))
        if need > place.budget:
            warnings.warn(
                SnapshotTooLarge(
                    f"rank {place.rank}: a memory snapshot of {size >> 20} MiB needs {need >> 20} MiB "
                    f"(two of them, own and {len(holders)} peer copies), over this rank's budget of "
                    f"{place.budget >> 20} MiB (--taskd-snapshot-memory): not kept, disk checkpoints only"
                ),
                stacklevel=2,
            )
            return
        try:
            seal = place.store.write(place.rank, self.step, meta, buffers)
        except SnapshotError as exc:
            warnings.warn(SnapshotTooLarge(f"rank {place.rank}: {exc}; disk checkpoints only"), stacklevel=2)
            return
        if not holders:
            return
        keepers = place.peer_keepers(holders)
        client = place.client()
        for holder in holders:
            address = keepers.get(holder)
            if address is None:
                logger.warning(
                    "rank %s: no keeper of rank %s's node is known: no peer copy there", place.rank, holder
                )
                continue
            try:
                client.put(address, seal, meta, buffers)
            except (SnapshotError, StreamError) as exc:
                logger.warning("rank %s: the peer copy of step %s failed: %s", place.rank, self.step, exc)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # Each rank's snapshot is complete on its own (its marker); the coordinator has nothing to add.
        pass

    def storage_meta(self) -> StorageMeta | None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False
