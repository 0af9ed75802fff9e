"""The ``StorageWriter`` that puts a ``torch.distributed.checkpoint`` save into node and peer memory."""

from __future__ import annotations

import logging
import os
import warnings
import zlib
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from taskd_core.errors import SnapshotError, StreamError
from taskd_core.snapshots.store import Seal
from taskd_pytorch.snapshot._layout import index, tensors
from taskd_pytorch.snapshot._place import Place
from taskd_pytorch.snapshot._slot import Slot, data_size, stage, tensors_of

logger = logging.getLogger(__name__)


class SnapshotTooLarge(UserWarning):
    """A snapshot does not fit its memory budget: it is not kept, the disk checkpoint is the only one."""


class SnapshotWriter(StorageWriter, AsyncStager):
    """Saves each rank's own state for ``step`` into its node's keeper and to its paired ranks' keepers.

    Use it where a ``FileSystemWriter`` would go; every rank writes its own
    items only (no other rank's snapshot is needed to restore it), marker last.
    Under ``dcp.async_save`` it is also the stager: the state is copied once,
    on the caller's thread, straight into the snapshot's file in shared memory
    (no staging copy of DCP's, no second copy into the file); the background
    thread checksums it, writes the marker and sends the peer copies. A
    snapshot over the rank's memory budget, or that finds no room, is skipped
    with one warning: training goes on, the disk checkpoint stays the fallback.

    The ranks' snapshots need no coordination (each is complete on its own and a
    restore agrees on the step): pass ``no_dist=True`` to ``async_save`` to skip
    DCP's two collectives per save.

    :param step: the training step the state is at (what a restore resumes from).
    :raises SnapshotError: outside ``taskdrun`` (no node keeper).
    """

    # Staging is done when stage() returns: nothing for async_save to wait for.
    _synchronize_after_execute = False

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step
        self._place = Place.from_env()
        self._plan: SavePlan | None = None
        self._slot: Slot | None = None
        #: set once the snapshot was found not to fit: it is not kept.
        self._skipped = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The state dict with its tensors copied into this snapshot's file (``async_save``'s staging)."""
        self._slot = self._reserve(data_size(tensors_of(state_dict)))
        # Not kept: nothing will read the tensors, DCP's planning only looks at their shapes.
        return state_dict if self._slot is None else stage(self._slot, state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the copy is complete."""
        return None  # a body: AsyncStager's empty ones count as abstract

    def close(self) -> None:
        """Nothing to release: the snapshot's mapping goes with the last of its tensors."""
        return None

    def _reserve(self, size: int) -> Slot | None:
        """This snapshot's slot, or None (and one warning) when it does not fit."""
        place = self._place
        copies = len(place.holders())
        need = 2 * size * (1 + copies)
        self._skipped = True
        if need > place.budget:
            warnings.warn(
                SnapshotTooLarge(
                    f"rank {place.rank}: a memory snapshot of {size >> 20} MiB needs {need >> 20} MiB "
                    f"(two of them, own and {copies} peer copies), over this rank's budget of "
                    f"{place.budget >> 20} MiB (--taskd-snapshot-memory): not kept, disk checkpoints only"
                ),
                stacklevel=3,
            )
            return None
        try:
            slot = Slot(place.store, place.rank, self.step, size)
        except SnapshotError as exc:
            warnings.warn(SnapshotTooLarge(f"rank {place.rank}: {exc}; disk checkpoints only"), stacklevel=3)
            return None
        self._skipped = False
        return slot

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
        if not self._skipped:
            self.keep(own, planner)
        future: Future[list[WriteResult]] = Future()
        future.set_result(
            [WriteResult(index=item.index, size_in_bytes=0, storage_data=None) for item in plan.items]
        )
        return future

    def keep(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Complete the snapshot locally (checksum, marker), then send it to each holder's keeper.

        What fails is said and skipped: training goes on.
        """
        place = self._place
        slot = self._slot
        placed: dict[MetadataIndex, int] = {}
        if slot is None:
            # dcp.save (no staging): the tensors are copied now.
            items = [i for i in plan.items if i.type is not WriteItemType.BYTE_IO]
            found = tensors(plan, planner)
            slot = self._reserve(data_size(found))
            if slot is None:
                return
            for item, tensor in zip(items, found, strict=True):
                placed[item.index] = slot.offset(slot.put(tensor)) or 0
        try:
            meta = index(
                plan, planner, self.step, lambda item, tensor: placed.get(item.index, slot.offset(tensor))
            )
        except SnapshotError as exc:
            warnings.warn(SnapshotTooLarge(f"rank {place.rank}: {exc}: not kept"), stacklevel=1)
            return
        seal = Seal(place.rank, self.step, len(meta), slot.size, zlib.crc32(meta), slot.crc())
        try:
            place.store.commit(seal, meta)
        except SnapshotError as exc:
            logger.warning("rank %s: %s", place.rank, exc)
            return
        holders = place.holders()
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
                client.put(address, seal, meta, [slot.view()])
            except SnapshotError as exc:
                # Refused (no room there): the same words every step, so said once (warnings' registry).
                warnings.warn(SnapshotTooLarge(f"rank {place.rank}: no peer copy: {exc}"), stacklevel=1)
            except StreamError as exc:
                logger.warning("rank %s: the peer copy of step %s failed: %s", place.rank, self.step, exc)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # Each rank's snapshot is complete on its own (its marker); the coordinator has nothing to add.
        pass

    def storage_meta(self) -> StorageMeta | None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False
