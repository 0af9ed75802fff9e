"""The node's snapshot files: marker last, checksums refuse damage, two per rank at most, ring pairing."""

from __future__ import annotations

from pathlib import Path

import pytest

from taskd_core.errors import SnapshotError
from taskd_core.snapshots.pairing import holders
from taskd_core.snapshots.store import SnapshotStore


def write(store: SnapshotStore, rank: int, step: int, fill: int = 1) -> None:
    store.write(rank, step, b"index %d" % step, [memoryview(bytes([fill]) * 1000), memoryview(b"tail")])


def test_a_written_snapshot_reads_back_byte_for_byte(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    write(store, 3, 7, fill=9)
    snap = store.read(3, 7)
    assert snap.meta == b"index 7"
    assert bytes(snap.data) == bytes([9]) * 1000 + b"tail"
    assert store.inventory() == {3: [7]}


def test_a_snapshot_without_its_marker_is_never_listed(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    write(store, 0, 1)
    store.begin(0, 2)  # a writer killed during the copy of step 2 leaves this
    (store.step_dir(0, 2) / "data").write_bytes(b"half")
    assert store.steps(0) == [1]
    with pytest.raises(SnapshotError, match="not complete"):
        store.read(0, 2)


def test_a_changed_byte_is_refused_by_the_checksum(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    write(store, 1, 4)
    data = store.step_dir(1, 4) / "data"
    raw = bytearray(data.read_bytes())
    raw[500] ^= 0xFF
    data.write_bytes(raw)
    with pytest.raises(SnapshotError, match="damaged"):
        store.read(1, 4)


def test_a_truncated_copy_is_refused(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    write(store, 1, 4)
    data = store.step_dir(1, 4) / "data"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(SnapshotError, match="truncated"):
        store.read(1, 4)


def test_starting_a_step_keeps_only_the_newest_complete_one_before_it(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    for step in (1, 2, 3):
        write(store, 0, step)
    assert store.steps(0) == [2, 3]  # two at most
    # Training went back to step 2 (a restore): step 3 belongs to a life that is over.
    write(store, 0, 3, fill=5)
    assert store.steps(0) == [2, 3]
    assert store.read(0, 3).data[0] == 5
    store.begin(0, 2)
    assert store.steps(0, complete=False) == [2]


def test_drop_forgets_the_steps_after_a_restored_one(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    write(store, 2, 5)
    write(store, 2, 6)
    store.drop(2, 5)
    assert store.steps(2) == [5]


def test_the_ring_puts_each_copy_on_another_node_and_every_node_holds_some() -> None:
    # 3 nodes x 2 ranks, one copy: node n's ranks go to node n+1.
    assert [holders(r, 2, 6, 1) for r in range(6)] == [[2], [3], [4], [5], [0], [1]]
    assert holders(0, 2, 6, 2) == [2, 4]
    # Never more copies than other nodes, none on one node.
    assert holders(0, 2, 4, 5) == [2]
    assert holders(1, 4, 4, 1) == []
