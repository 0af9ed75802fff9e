"""How a node keeps memory snapshots: on or off, where, how much memory, how many peer copies."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from taskd_core.values import MAX_INT32, check_count

#: The tmpfs of Linux hosts: files there are memory.
SHARED_MEMORY = Path("/dev/shm")


@dataclass(frozen=True, slots=True)
class SnapshotSettings:
    """The node keeper's settings (``--snapshot-*`` flags, ``TASKD_SNAPSHOT_*`` variables)."""

    #: keep a snapshot directory and a keeper for the workers (``taskd_pytorch.snapshot``).
    enabled: bool = True
    #: where the node's snapshot directory is made: a tmpfs, so that the files are memory.
    directory: Path = SHARED_MEMORY
    #: MiB the node's snapshots (own and peer copies) may take; None: half of the tmpfs' free space.
    memory_mib: int | None = None
    #: copies of each rank's snapshot sent to ranks on other nodes.
    copies: int = 1

    def __post_init__(self) -> None:
        check_count(self.copies, "snapshot copies", high=16)
        if self.memory_mib is not None:
            check_count(self.memory_mib, "snapshot memory (MiB)", high=MAX_INT32)
