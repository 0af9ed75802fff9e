"""The ``StorageReader`` restoring the newest step complete for every rank: memory, peer memory, disk."""

from __future__ import annotations

import io
import logging
import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from taskd_core.errors import SnapshotError, StreamError
from taskd_core.snapshots.store import Snapshot
from taskd_pytorch.snapshot._layout import Layout, parse, tensor_of
from taskd_pytorch.snapshot._place import Place

logger = logging.getLogger(__name__)


class Source(str, Enum):
    """Where a restore took the state from."""

    MEMORY = "memory"
    PEER = "peer"
    DISK = "disk"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class _Node:
    """What one node's keeper holds, as one of its ranks saw it."""

    root: str
    keeper: str
    inventory: dict[int, list[int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Choice:
    """The restore every rank agreed on: its source for this rank, and the step (None: the fallback's)."""

    source: Source
    step: int | None


class SnapshotReader(StorageReader):
    """Restores each rank from the newest step whose snapshot every rank can get, else from ``fallback``.

    The first call (:meth:`choose`, or ``dcp.load``'s first) is collective over
    ``process_group`` (default: the default group): the ranks pool what every
    node's keeper holds, take the newest step found for every rank, and each
    reads its own, from its node's memory, else from a peer's keeper; a copy
    whose checksum fails is refused with one line and the next source is
    tried, and if some rank has none left the ranks go on to the next older
    step, then to ``fallback`` (the user's disk checkpoint reader).

    :param fallback: the last rung, e.g. ``dcp.FileSystemReader(path)``; None: nothing on disk.
    """

    def __init__(
        self, fallback: StorageReader | None = None, *, process_group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        self._fallback = fallback
        self._group = process_group
        self._place = Place.from_env()
        self._choice: Choice | None = None
        self._snapshot: Snapshot | None = None
        self._layout: Layout | None = None

    # --- the choice ------------------------------------------------------------------

    @property
    def step(self) -> int | None:
        """The snapshot step restored (None: from the fallback, or nothing); call after :meth:`choose`."""
        return self.choose().step

    @property
    def source(self) -> Source:
        return self.choose().source

    def choose(self) -> Choice:
        """Agree with every rank on what to restore (collective; once)."""
        if self._choice is None:
            self._choice = self._agree()
        return self._choice

    def _agree(self) -> Choice:
        place = self._place
        world = dist.get_world_size(self._group)
        own = _Node(str(place.store.root), place.keeper, place.store.inventory())
        nodes_seen: list[Any] = [None] * world
        dist.all_gather_object(nodes_seen, own, group=self._group)
        nodes = {(n.root, n.keeper): n for n in nodes_seen}.values()
        steps: set[int] | None = None
        for rank in range(world):
            found = {s for n in nodes for s in n.inventory.get(rank, [])}
            steps = found if steps is None else steps & found
        for step in sorted(steps or (), reverse=True):
            got = self._fetch(step, nodes)
            flags: list[Any] = [None] * world
            dist.all_gather_object(flags, got is not None, group=self._group)
            if all(flags):
                assert got is not None
                self._snapshot, self._layout, source = got
                self._forget_after(step, nodes)
                logger.info("rank %s: restoring step %s from %s", place.rank, step, source.value)
                return Choice(source, step)
            self._snapshot = None
            logger.warning("step %s is not restorable on every rank: trying an older one", step)
        if self._fallback is None:
            return Choice(Source.NONE, None)
        logger.info("rank %s: no memory snapshot complete for every rank: restoring from disk", place.rank)
        return Choice(Source.DISK, None)

    def _fetch(self, step: int, nodes: Any) -> tuple[Snapshot, Layout, Source] | None:
        """This rank's snapshot of ``step``: its node's copy, else a peer keeper's; None if none is sound.

        Sound: its checksums match and its index is of this code's layout version.
        """
        place = self._place
        root = str(place.store.root)
        ordered = sorted(nodes, key=lambda n: n.root != root)
        for node in ordered:
            if step not in node.inventory.get(place.rank, []):
                continue
            try:
                if node.root == root:
                    snapshot, source = place.store.read(place.rank, step), Source.MEMORY
                elif node.keeper and place.token:
                    snapshot, source = place.client().get(node.keeper, place.rank, step), Source.PEER
                else:
                    continue
                what = f"rank {place.rank}'s snapshot of step {step} ({source.value} copy)"
                return snapshot, parse(snapshot.meta, what), source
            except (SnapshotError, StreamError) as exc:
                logger.warning("rank %s: %s; trying the next copy", place.rank, exc)
        return None

    def _forget_after(self, step: int, nodes: Any) -> None:
        """Copies of this rank newer than the restored step belong to a life that is over: drop them."""
        place = self._place
        root = str(place.store.root)
        for node in nodes:
            if not any(s > step for s in node.inventory.get(place.rank, [])):
                continue
            try:
                if node.root == root:
                    place.store.drop(place.rank, step)
                elif node.keeper and place.token:
                    place.client().drop(node.keeper, place.rank, step)
            except (OSError, SnapshotError, StreamError) as exc:
                logger.warning("rank %s: could not drop its copies after step %s: %s", place.rank, step, exc)

    def _memory(self) -> bool:
        return self.choose().step is not None

    def _disk(self) -> StorageReader:
        if self._fallback is None:
            raise SnapshotError(
                "no memory snapshot is complete for every rank and no fallback reader was given: "
                "check SnapshotReader.source before dcp.load, or pass fallback=dcp.FileSystemReader(path)"
            )
        return self._fallback

    # --- StorageReader ---------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if self._fallback is not None:
            self._fallback.reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if not self._memory():
            return self._disk().read_metadata(*args, **kwargs)
        assert self._layout is not None
        if "rank" not in kwargs:
            # No global metadata: dcp.load asks again for this rank's own and loads without collectives.
            return None  # type: ignore[return-value]
        return self._layout.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if not self._memory():
            self._disk().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan if self._memory() else self._disk().prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans if self._memory() else self._disk().prepare_global_plan(plans)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not self._memory():
            return self._disk().read_data(plan, planner)
        assert self._snapshot is not None and self._layout is not None
        data = self._snapshot.data
        spans = self._layout.spans
        for item in plan.items:
            span = spans.get(item.storage_index)
            if span is None:
                raise SnapshotError(
                    f"rank {self._place.rank}'s snapshot holds no {item.storage_index.fqn!r} at "
                    f"{tuple(item.storage_index.offset or ())}: it was saved with another sharding"
                )
            if item.type is LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(span.inline))
                continue
            tensor = narrow_tensor_by_index(tensor_of(data, span), item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != tensor.size():
                raise SnapshotError(
                    f"{item.storage_index.fqn}: the snapshot holds {tuple(tensor.size())}, the model "
                    f"wants {tuple(target.size())}"
                )
            target.copy_(tensor)
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


def disk_reader(path: Path) -> StorageReader | None:
    """``dcp.FileSystemReader(path)`` when a DCP checkpoint is there (its ``.metadata``), else None."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return FileSystemReader(path) if (path / ".metadata").exists() else None
