"""One node's memory snapshots as files in shared memory: written marker-last, read only when verified.

A snapshot is what one rank saved at one step: an opaque ``meta`` blob (the
framework's index of what is where) and ``data`` (the bytes of its state, one
buffer after the other). The node's keeper directory holds them as::

    ROOT/rank<R>/<step, 12 digits>/meta
    ROOT/rank<R>/<step, 12 digits>/data
    ROOT/rank<R>/<step, 12 digits>/done     # written last, by rename
    ROOT/address                            # where the node's keeper listens (none: no peer copies)

``done`` names the sizes and CRC-32s of ``meta`` and ``data``: a snapshot
without it is half-written (its writer died during the copy) and is never
listed; one whose files do not match it (truncated, changed) is refused by
:meth:`SnapshotStore.read`. ``ROOT`` is on a tmpfs (``/dev/shm``), so the files
are memory that outlives the worker that wrote them; the node's keeper
(:mod:`taskd_core.snapshots.keeper`) owns the directory and removes it with the job.

Per rank at most two snapshots exist: starting step ``S`` removes every
snapshot at or after ``S`` (a previous life's, since training resumed before
it) and every one but the newest before it, so a kill during the copy of ``S``
leaves the newest complete one. The writers of one rank are one at a time
(a worker's saves are serial; a peer copy of rank ``R`` comes from ``R`` alone).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from taskd_core.errors import SnapshotError

logger = logging.getLogger(__name__)

_META = "meta"
_DATA = "data"
_DONE = "done"
_RANK = "rank"
#: The file naming where the node's keeper listens.
ADDRESS = "address"


@dataclass(frozen=True, slots=True)
class Seal:
    """What a complete snapshot's marker says: its identity, sizes and checksums."""

    rank: int
    step: int
    meta_size: int
    data_size: int
    meta_crc: int
    data_crc: int

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "rank": self.rank,
                "step": self.step,
                "meta_size": self.meta_size,
                "data_size": self.data_size,
                "meta_crc": self.meta_crc,
                "data_crc": self.data_crc,
            }
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes, what: str) -> Seal:
        try:
            fields = json.loads(raw)
            return cls(**{name: int(fields[name]) for name in cls.__slots__})
        except (ValueError, KeyError, TypeError) as exc:
            raise SnapshotError(f"{what}: unreadable marker ({exc})") from exc


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A verified snapshot, read into memory."""

    seal: Seal
    meta: bytes
    data: bytearray


def crc32(buffers: Iterable[memoryview | bytes | bytearray]) -> int:
    """CRC-32 of the buffers one after the other (zlib releases the GIL on large buffers)."""
    value = 0
    for buf in buffers:
        value = zlib.crc32(buf, value)
    return value


def flat(view: memoryview) -> memoryview:
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class SnapshotStore:
    """The snapshots under ``root`` (see the module docstring); safe for one writer per rank."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def rank_dir(self, rank: int) -> Path:
        return self.root / f"{_RANK}{rank}"

    def step_dir(self, rank: int, step: int) -> Path:
        return self.rank_dir(rank) / f"{step:012d}"

    def publish(self, address: str) -> None:
        """Say where the node's keeper listens (the keeper's side)."""
        tmp = self.root / (ADDRESS + ".tmp")
        tmp.write_text(address)
        os.replace(tmp, self.root / ADDRESS)

    def keeper(self) -> str:
        """Where the node's keeper listens; empty when it does not (yet)."""
        try:
            return (self.root / ADDRESS).read_text().strip()
        except OSError:
            return ""

    # --- writing ---------------------------------------------------------------------

    def write(self, rank: int, step: int, meta: bytes, buffers: Sequence[memoryview]) -> Seal:
        """Copy one snapshot in, marker last; returns its seal.

        :raises SnapshotError: when the files cannot be written (the tmpfs is full, say).
        """
        views = [flat(b) for b in buffers]
        target, mapped = self.allocate(rank, step, sum(len(v) for v in views))
        data_crc = 0
        if mapped is not None:
            at = 0
            for view in views:
                mapped[at : at + len(view)] = view
                at += len(view)
            data_crc = zlib.crc32(mapped)
            mapped.close()
        seal = Seal(rank, step, len(meta), sum(len(v) for v in views), zlib.crc32(meta), data_crc)
        self.commit(seal, meta)
        return seal

    def begin(self, rank: int, step: int) -> Path:
        """Make room for ``step`` of ``rank`` (see the module docstring) and return its directory.

        The data file of a complete snapshot that goes is moved in (its tmpfs pages are
        reused: no new memory to fault in and zero); an incomplete one's writer may still
        have it mapped, so it is only unlinked.
        """
        base = self.rank_dir(rank)
        base.mkdir(parents=True, exist_ok=True)
        kept = [s for s in self.steps(rank) if s < step][-1:]
        target = self.step_dir(rank, step)
        gone = [e for e in base.iterdir() if not (e.name.isdigit() and int(e.name) in kept)]
        if target in gone:  # a previous life's step: moved aside, so that the name is free
            aside = base / f"old-{target.name}"
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(target, aside)
            gone[gone.index(target)] = aside
        target.mkdir()
        for entry in gone:
            if (entry / _DONE).exists() and not (target / _DATA).exists():
                try:
                    os.rename(entry / _DATA, target / _DATA)
                except OSError:
                    pass
            shutil.rmtree(entry, ignore_errors=True)
        return target

    def allocate(self, rank: int, step: int, data_size: int) -> tuple[Path, mmap.mmap | None]:
        """Room for ``step`` of ``rank`` whose ``data_size`` bytes are filled in place: its data file, mapped.

        The caller fills the map and then calls :meth:`commit`; the map is None for an
        empty ``data``.

        :raises SnapshotError: when there is no room (the tmpfs is full, say).
        """
        target = self.begin(rank, step)
        try:
            with open(target / _DATA, "r+b" if (target / _DATA).exists() else "w+b") as f:
                os.ftruncate(f.fileno(), data_size)
                if not data_size:
                    return target, None
                # Reserved now: a tmpfs that fills up under a mapping kills with SIGBUS, not ENOSPC.
                os.posix_fallocate(f.fileno(), 0, data_size)
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                return target, mmap.mmap(f.fileno(), data_size, flags=flags)
        except OSError as exc:
            shutil.rmtree(target, ignore_errors=True)
            raise SnapshotError(
                f"no room for rank {rank}'s step {step} ({data_size} bytes) in {self.root}: {exc}"
            ) from exc

    def commit(self, seal: Seal, meta: bytes) -> None:
        """Write ``meta``, then ``seal``'s marker: from now on the snapshot is listed.

        :raises SnapshotError: when the snapshot's directory is gone (a newer start removed it).
        """
        target = self.step_dir(seal.rank, seal.step)
        try:
            (target / _META).write_bytes(meta)
            tmp = target / (_DONE + ".tmp")
            tmp.write_bytes(seal.to_json())
            os.replace(tmp, target / _DONE)
        except OSError as exc:
            raise SnapshotError(
                f"cannot complete the snapshot of rank {seal.rank} step {seal.step}: {exc}"
            ) from exc

    def drop(self, rank: int, above: int) -> None:
        """Forget ``rank``'s snapshots after step ``above`` (a restore went back to ``above``)."""
        for step in self.steps(rank, complete=False):
            if step > above:
                shutil.rmtree(self.step_dir(rank, step), ignore_errors=True)

    # --- reading ---------------------------------------------------------------------

    def ranks(self) -> list[int]:
        """The ranks with a directory here."""
        if not self.root.is_dir():
            return []
        out = []
        for entry in self.root.iterdir():
            tail = entry.name[len(_RANK) :]
            if entry.name.startswith(_RANK) and tail.isdigit():
                out.append(int(tail))
        return sorted(out)

    def steps(self, rank: int, *, complete: bool = True) -> list[int]:
        """``rank``'s steps with a marker (all of them when not ``complete``), oldest first."""
        base = self.rank_dir(rank)
        if not base.is_dir():
            return []
        out = []
        for entry in base.iterdir():
            if entry.name.isdigit() and (not complete or (entry / _DONE).exists()):
                out.append(int(entry.name))
        return sorted(out)

    def inventory(self) -> dict[int, list[int]]:
        """Every rank's complete steps here."""
        return {rank: steps for rank in self.ranks() if (steps := self.steps(rank))}

    def held(self, rank: int, before: int | None = None) -> int:
        """Bytes of ``rank``'s data here; with ``before``: of what starting that step keeps."""
        if before is None:
            steps = self.steps(rank, complete=False)
        else:
            steps = [s for s in self.steps(rank) if s < before][-1:]
        total = 0
        for step in steps:
            try:
                total += (self.step_dir(rank, step) / _DATA).stat().st_size
            except OSError:
                pass  # removed meanwhile, or not begun yet
        return total

    def seal(self, rank: int, step: int) -> Seal:
        what = f"the snapshot of rank {rank} step {step} in {self.root}"
        try:
            raw = (self.step_dir(rank, step) / _DONE).read_bytes()
        except OSError as exc:
            raise SnapshotError(f"{what} is not complete: {exc}") from exc
        return Seal.from_json(raw, what)

    def read(self, rank: int, step: int) -> Snapshot:
        """The snapshot, checked against its marker.

        :raises SnapshotError: when it is missing, incomplete, truncated or changed.
        """
        seal = self.seal(rank, step)
        target = self.step_dir(rank, step)
        what = f"the snapshot of rank {rank} step {step} in {self.root}"
        try:
            meta = (target / _META).read_bytes()
            with open(target / _DATA, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != seal.data_size:
                    raise SnapshotError(f"{what} is truncated: {size} of {seal.data_size} bytes")
                data = bytearray(size)
                f.readinto(data)
        except OSError as exc:
            raise SnapshotError(f"{what} cannot be read: {exc}") from exc
        snapshot = Snapshot(seal, meta, data)
        verify(snapshot, what)
        return snapshot


def verify(snapshot: Snapshot, what: str) -> None:
    """:class:`SnapshotError` unless ``snapshot``'s bytes are those its seal names."""
    seal = snapshot.seal
    if len(snapshot.meta) != seal.meta_size or zlib.crc32(snapshot.meta) != seal.meta_crc:
        raise SnapshotError(f"{what} is damaged: its index does not match its checksum")
    if len(snapshot.data) != seal.data_size:
        raise SnapshotError(f"{what} is truncated: {len(snapshot.data)} of {seal.data_size} bytes")
    if zlib.crc32(snapshot.data) != seal.data_crc:
        raise SnapshotError(f"{what} is damaged: its data does not match its checksum")
