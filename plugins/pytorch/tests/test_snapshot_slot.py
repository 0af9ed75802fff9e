"""Staging a state dict into its snapshot's file: one copy, in the file, safe from the training that goes on."""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from pathlib import Path

import torch

from taskd_core.snapshots.store import SnapshotStore
from taskd_pytorch.snapshot._slot import ALIGN, Slot, data_size, stage, tensors_of


def test_the_staged_tensors_are_copies_in_the_snapshot_file_and_the_rest_is_copied(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    weight = torch.arange(10, dtype=torch.float32)
    odd = torch.arange(6, dtype=torch.int64).reshape(2, 3).t()  # not contiguous
    groups = [{"lr": 0.1, "params": ["w"]}]
    state = {
        "model": OrderedDict(w=weight, empty=torch.empty(0)),
        "optim": defaultdict(dict, {"state": {"w": {"step": torch.tensor(3.0), "odd": odd}}, "groups": groups}),
        "extra": {"step": 7, "pair": (weight, "x")},
    }
    found = tensors_of(state)
    assert len(found) == 5
    slot = Slot(store, 0, 7, data_size(found))
    staged = stage(slot, state)

    weight += 100  # training goes on: the snapshot keeps what it saw
    odd.add_(100)
    groups[0]["lr"] = 0.5
    assert staged["model"]["w"].tolist() == list(range(10))
    assert staged["optim"]["state"]["w"]["odd"].tolist() == [[0, 3], [1, 4], [2, 5]]
    assert staged["optim"]["groups"][0]["lr"] == 0.1
    assert staged["extra"]["step"] == 7 and staged["extra"]["pair"][0].tolist() == list(range(10))
    assert isinstance(staged["model"], OrderedDict)

    # Each staged tensor is a run of the mapped file, at an aligned offset: the one copy there is.
    raw = (slot.target / "data").read_bytes()
    assert len(raw) == slot.size == data_size(found)
    for tensor in tensors_of(staged):
        at = slot.offset(tensor)
        assert at is not None and at % ALIGN == 0
        n = tensor.numel() * tensor.element_size()
        assert raw[at : at + n] == tensor.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    assert slot.offset(weight) is None  # the original is not in the file


def test_a_new_snapshot_reuses_the_data_file_of_one_no_longer_needed(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    data = [memoryview(b"a" * 8192)]
    for step in (1, 2):
        store.write(0, step, b"m", data)
    inode = (store.step_dir(0, 1) / "data").stat().st_ino
    store.write(0, 3, b"m", [memoryview(b"b" * 4096)])  # step 1 goes: its file (pages) is step 3's
    assert store.steps(0) == [2, 3]
    assert (store.step_dir(0, 3) / "data").stat().st_ino == inode
    assert bytes(store.read(0, 3).data) == b"b" * 4096
