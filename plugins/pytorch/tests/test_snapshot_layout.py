"""A snapshot's meta blob: what this code wrote reads back; another layout version's is refused, never used."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from taskd_core.errors import SnapshotError
from taskd_pytorch.snapshot._layout import HEADER, VERSION, Layout, Span, dump, parse

WHAT = "rank 2's snapshot of step 7 (memory copy)"


def layout() -> Layout:
    weight = MetadataIndex("model.weight", (0, 0))
    step = MetadataIndex("step")
    return Layout(
        7,
        Metadata(state_dict_metadata={}),
        {weight: Span(0, 32, torch.float32, (2, 4)), step: Span(0, 3, inline=b"abc")},
    )


def test_a_blob_this_code_wrote_reads_back() -> None:
    blob = dump(layout())
    assert blob.startswith(HEADER)
    back = parse(blob, WHAT)
    assert back.step == 7 and back.spans == layout().spans


@pytest.mark.parametrize(
    ("blob", "says"),
    [
        # Kept by the code before versioned blobs (main's layout changed under a running job).
        (pickle.dumps(layout()), r"another snapshot layout \(an unversioned one; this code reads"),
        (b"taskd-snapshot-layout 1\n" + pickle.dumps(layout()), r"another snapshot layout \(1; this code reads"),
        (b"taskd-snapshot-layout 99\n", r"\(99; this code reads"),
    ],
)
def test_a_blob_of_another_layout_version_is_refused_naming_the_snapshot(blob: bytes, says: str) -> None:
    with pytest.raises(SnapshotError, match=says) as caught:
        parse(blob, WHAT)
    assert str(caught.value).startswith(WHAT) and str(VERSION) in str(caught.value)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"\x80\x05garbage", "unreadable index: UnpicklingError"),
        (pickle.dumps({"step": 7}), "not a snapshot layout"),
        # A class that no longer exists where the blob says it is.
        (b"ctaskd_pytorch.snapshot.gone\nLayout\n.", "unreadable index: ModuleNotFoundError"),
    ],
)
def test_a_blob_of_this_version_that_does_not_unpickle_to_a_layout_is_refused(body: bytes, says: str) -> None:
    with pytest.raises(SnapshotError, match=says):
        parse(HEADER + body, WHAT)
