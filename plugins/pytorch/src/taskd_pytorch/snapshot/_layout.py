"""How one rank's ``torch.distributed.checkpoint`` items are laid out in a snapshot: meta blob, data.

The data is every item of the rank's own save plan, one after the other:
a tensor's bytes (its local shard, contiguous, on CPU) or a pickled object's
bytes. The meta blob (pickled: it only ever comes from this job's own
processes, through files only they can write or an authenticated stream)
holds the rank's own DCP ``Metadata`` (only its items: the rank restores
without reading any other rank's snapshot) and where each item sits.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType


@dataclass(frozen=True, slots=True)
class Span:
    """Where one item's bytes sit in the data, and what they are."""

    start: int
    length: int
    #: None for a pickled object; else the tensor's dtype and local shape.
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Layout:
    """A snapshot's meta blob, unpickled."""

    step: int
    metadata: Metadata
    spans: dict[MetadataIndex, Span]


def gather(plan: SavePlan, planner: SavePlanner, step: int) -> tuple[bytes, list[memoryview], int]:
    """The meta blob, the data buffers and their total size of ``plan``'s items, resolved by ``planner``."""
    spans: dict[MetadataIndex, Span] = {}
    buffers: list[memoryview] = []
    at = 0
    for item in plan.items:
        data: Any = planner.resolve_data(item)
        if item.type is WriteItemType.BYTE_IO:
            view = memoryview(data.getbuffer() if isinstance(data, io.BytesIO) else bytes(data))
            span = Span(at, len(view))
        else:
            tensor = data.detach()
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            tensor = tensor.contiguous()
            view = (
                memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
                if tensor.numel()
                else memoryview(b"")
            )
            span = Span(at, len(view), tensor.dtype, tuple(tensor.shape))
        spans[item.index] = span
        buffers.append(view)
        at += len(view)
    _, metadata = create_default_global_save_plan([plan], rewrite_index_hints=False)
    mappings = getattr(planner, "mappings", None)
    if mappings is not None:
        metadata = dataclasses.replace(metadata, planner_data=mappings)
    meta = pickle.dumps(Layout(step, metadata, spans), protocol=pickle.HIGHEST_PROTOCOL)
    return meta, buffers, at


def parse(meta: bytes) -> Layout:
    layout = pickle.loads(meta)  # noqa: S301  # written by this job's own processes only (module docstring)
    if not isinstance(layout, Layout):
        raise TypeError("not a snapshot layout")
    return layout


def tensor_of(data: bytearray, span: Span) -> torch.Tensor:
    """The tensor ``span`` names in ``data`` (a view of it, no copy)."""
    dtype = span.dtype if span.dtype is not None else torch.uint8
    if span.length == 0:
        return torch.empty(span.shape, dtype=dtype)
    flat = torch.frombuffer(data, dtype=torch.uint8, count=span.length, offset=span.start)
    return flat.view(dtype).reshape(span.shape)
