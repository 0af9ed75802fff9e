"""A live session's memory snapshots of sharded state: one ``dcp.async_save`` per committed step, a restore.

Sharded state (FSDP2's ``fully_shard``, ``ZeroRedundancyOptimizer``) has no
replica that could hand a lost rank's shard over, so a
:class:`~taskd_pytorch.live.LiveSession` made with ``snapshot_every=K``
keeps it in TaskD's memory tier instead (:mod:`taskd_pytorch.snapshot`,
its public API only): after every K-th committed step it waits for the
previous snapshot, then starts ``dcp.async_save(state, SnapshotWriter(step))``
with ``no_dist=True`` (each rank's snapshot is complete on its own: no
collectives) and one :class:`~taskd_pytorch.snapshot.SnapshotPlanner` (the
plan is reused while the state keeps its structure), so the copy overlaps the
next step's compute and at most one snapshot is in flight. A restore is ``dcp.load`` through a
``SnapshotReader``: the newest step every rank can get (own node memory, a
peer's copy), else the script's disk checkpoint, else nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save
from torch.distributed.checkpoint.storage import StorageReader

from taskd_core.errors import SnapshotError
from taskd_pytorch.snapshot import SnapshotPlanner, SnapshotReader, SnapshotWriter, Source

logger = logging.getLogger(__name__)

#: What DCP saves and loads: the script's ``get_state_dict`` output plus whatever a restore needs.
State = dict[str, Any]


@dataclass(frozen=True)
class ShardedState:
    """How the script's sharded state is saved and put back (``LiveSession.restore``'s arguments)."""

    #: the state at a number of steps done, as DCP saves it (``get_state_dict``'s dictionaries, the step).
    state: Callable[[int], State]
    #: puts a loaded state in place (``set_state_dict``); returns the steps it had done.
    load: Callable[[State], int]
    #: the disk checkpoint's reader at restore time (None: nothing on disk).
    fallback: Callable[[], StorageReader | None] | None


class SnapshotLoop:
    """One rank's snapshots: the group they run on, the one in flight, and the restore."""

    def __init__(self, rank: int, every: int) -> None:
        self._rank = rank
        self._every = every
        self._sharded: ShardedState | None = None
        self._group: dist.ProcessGroup | None = None
        self._pending: Future[Any] | AsyncSaveResponse | None = None
        self._pending_step = 0
        self._planner = SnapshotPlanner()
        #: where the last restore took the state from.
        self.source = Source.NONE
        #: seconds the training loop waited for snapshots to complete.
        self.waited = 0.0

    @property
    def ready(self) -> bool:
        return self._sharded is not None

    def restore(
        self,
        state_of: Callable[[int], State],
        load: Callable[[State], int],
        fallback: Callable[[], StorageReader | None] | None,
        step: int,
    ) -> int:
        """Load the newest state every rank can get (collective); returns its step (``step``: none found)."""
        sharded = self._sharded = ShardedState(state_of, load, fallback)
        # The restore's collectives never meet training's: a group of their own.
        self._group = dist.new_group(backend="gloo")
        state = sharded.state(step)
        disk = sharded.fallback() if sharded.fallback is not None else None
        reader: StorageReader | None = disk
        try:
            memory = SnapshotReader(fallback=disk, process_group=self._group)
        except SnapshotError as exc:
            if self._every:
                logger.warning("rank %s: %s; no memory snapshots", self._rank, exc)
            self._every = 0
            self.source = Source.NONE if disk is None else Source.DISK
        else:
            reader, self.source = memory, memory.source
        if reader is None or self.source is Source.NONE:
            return step
        dcp_load(state, storage_reader=reader, process_group=self._group)
        return sharded.load(state)

    def committed(self, step: int) -> None:
        """``step`` steps are committed: the previous snapshot completes, this one begins if it is due.

        The previous one had this step's compute to finish in; waiting for it
        here, before the step is reported, means a step reported done is at
        most one step ahead of a restorable one.
        """
        self.settle()
        if self._sharded is None or not self._every or step % self._every:
            return
        # Each rank's snapshot is complete on its own: no DCP collectives (no_dist), and the
        # plan of the previous one is reused while the state keeps its structure.
        state, writer = self._sharded.state(step), SnapshotWriter(step)
        self._pending = async_save(state, storage_writer=writer, planner=self._planner, no_dist=True)
        self._pending_step = step

    def settle(self) -> None:
        """Wait for the snapshot in flight; one that failed is said and skipped (the older one stays)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        began = time.monotonic()
        try:
            (pending.upload_completion if isinstance(pending, AsyncSaveResponse) else pending).result()
        except Exception as exc:  # a peer lost during the save: the restore takes an older step
            logger.warning("rank %s: the snapshot of step %s failed: %s", self._rank, self._pending_step, exc)
        self.waited += time.monotonic() - began
