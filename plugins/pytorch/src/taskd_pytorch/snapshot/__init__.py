"""Memory snapshots for sharded PyTorch training, through ``torch.distributed.checkpoint``.

A script that saves with DCP changes one argument to keep a snapshot in
memory that outlives its worker (its node's keeper, ``taskd_core.snapshots``)
and its node (a copy at a paired rank's keeper on another node)::

    from taskd_pytorch.snapshot import SnapshotReader, SnapshotWriter

    # every step (async: the copy overlaps the next steps); one planner for the loop (the plan is reused)
    planner = SnapshotPlanner()
    future = dcp.async_save(state, storage_writer=SnapshotWriter(step), planner=planner, no_dist=True)
    # every K steps, as before
    dcp.save(state, checkpoint_id=ckpt_dir)
    # at start: memory, else a peer's memory, else disk
    reader = SnapshotReader(fallback=disk_reader(ckpt_dir))
    if reader.source is not Source.NONE:
        dcp.load(state, storage_reader=reader)

``state`` is what ``get_state_dict(model, optimizer)`` gives (FSDP2's
``fully_shard``, ``ZeroRedundancyOptimizer`` …) plus whatever else a restore
needs (the step, the data position, RNG states). Each rank keeps its own items
only; a restore needs the same world size and sharding. A snapshot's
``async_save`` with ``no_dist=True`` runs no collectives; give a disk
``async_save`` a process group of its own (``dist.new_group(backend="gloo")``),
whose collectives then never meet training's. What is copied where and what it
costs: ``docs/snapshots.md``.
"""

from taskd_pytorch.snapshot._plan import SnapshotPlanner
from taskd_pytorch.snapshot._reader import Choice, SnapshotReader, Source, disk_reader
from taskd_pytorch.snapshot._writer import SnapshotTooLarge, SnapshotWriter

__all__ = [
    "Choice",
    "SnapshotPlanner",
    "SnapshotReader",
    "SnapshotTooLarge",
    "SnapshotWriter",
    "Source",
    "disk_reader",
]
