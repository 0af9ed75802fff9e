"""How one rank's ``torch.distributed.checkpoint`` items are laid out in a snapshot: meta blob, data.

The data is every tensor of the rank's own save plan (its local shard,
contiguous, on CPU), at the offsets :mod:`~taskd_pytorch.snapshot._slot`
gave them; pickled objects' bytes (small: the step, param groups) sit in the
meta blob. The meta blob (pickled: it only ever comes from this job's own
processes, through files only they can write or an authenticated stream)
holds the rank's own DCP ``Metadata`` (only its items: the rank restores
without reading any other rank's snapshot) and where each item sits. It
starts with a line naming the layout's version (:data:`HEADER`), checked
before anything is unpickled: a snapshot kept by other code (the job's code
changed under a running job, or another TaskD) is refused like a damaged one.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_global_save_plan
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from taskd_core.errors import SnapshotError
from taskd_pytorch.snapshot._plan import SnapshotPlanner

#: The meta blob's first line: change the number whenever :class:`Layout` or :class:`Span` changes.
VERSION = 2
HEADER = b"taskd-snapshot-layout %d\n" % VERSION
_PREFIX = b"taskd-snapshot-layout "


@dataclass(frozen=True, slots=True)
class Span:
    """Where one item's bytes sit in the data, and what they are."""

    start: int
    length: int
    #: None for a pickled object (its bytes are ``inline``); else the tensor's dtype and local shape.
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    inline: bytes = b""


@dataclass(frozen=True, slots=True)
class Layout:
    """A snapshot's meta blob, unpickled."""

    step: int
    metadata: Metadata
    spans: dict[MetadataIndex, Span]


def resolve(planner: SavePlanner, item: WriteItem) -> Any:
    """``planner.resolve_data(item)``; for DCP's default planner a tensor's local shard is looked up directly.

    (What ``resolve_data`` would give, without its ``to_local()``'s autograd node per tensor and save.)
    """
    # Only where resolve_data is DCP's default one (another subclass may transform the data).
    default = type(planner) in (DefaultSavePlanner, SnapshotPlanner)
    if isinstance(planner, DefaultSavePlanner) and default and item.type is not WriteItemType.BYTE_IO:
        found = planner.state_dict.get(item.index.fqn)
        if isinstance(found, DTensor):
            return found._local_tensor
        if type(found) is torch.Tensor:
            return found
    return planner.resolve_data(item)


def tensors(plan: SavePlan, planner: SavePlanner) -> list[torch.Tensor]:
    """The tensors of ``plan``'s items, resolved by ``planner``, in plan order."""
    return [resolve(planner, i) for i in plan.items if i.type is not WriteItemType.BYTE_IO]


def index(
    plan: SavePlan, planner: SavePlanner, step: int, offset: Callable[[WriteItem, torch.Tensor], int | None]
) -> bytes:
    """The meta blob of ``plan``'s items, whose tensors are in the data (at ``offset``); objects go inline.

    :raises SnapshotError: when a tensor is not in the slot (a planner that makes new tensors).
    """
    spans: dict[MetadataIndex, Span] = {}
    for item in plan.items:
        data = resolve(planner, item)
        if item.type is WriteItemType.BYTE_IO:
            raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
            spans[item.index] = Span(0, len(raw), inline=raw)
            continue
        tensor = data.detach()
        at = offset(item, tensor)
        if at is None:
            raise SnapshotError(
                f"{item.index.fqn}: the planner gave a tensor that is not the staged copy; "
                "memory snapshots take DCP's default planner"
            )
        spans[item.index] = Span(
            at, tensor.numel() * tensor.element_size(), tensor.dtype, tuple(tensor.shape)
        )
    own = planner.own_metadata(plan) if isinstance(planner, SnapshotPlanner) else None
    if own is None:
        _, own = create_default_global_save_plan([plan], rewrite_index_hints=False)
    metadata = own
    mappings = getattr(planner, "mappings", None)
    if mappings is not None:
        metadata = dataclasses.replace(metadata, planner_data=mappings)
    return dump(Layout(step, metadata, spans))


def dump(layout: Layout) -> bytes:
    """The meta blob of ``layout``: :data:`HEADER`, then the pickle."""
    return HEADER + pickle.dumps(layout, protocol=pickle.HIGHEST_PROTOCOL)


def parse(meta: bytes, what: str) -> Layout:
    """The layout in the meta blob ``meta`` of the snapshot ``what``.

    :raises SnapshotError: when another layout version wrote it, or it does not unpickle to one.
    """
    if not meta.startswith(HEADER):
        first = meta[: meta.find(b"\n")] if meta.startswith(_PREFIX) else b""
        written = first[len(_PREFIX) :].decode(errors="replace") or "an unversioned one"
        raise SnapshotError(
            f"{what} was written by another snapshot layout ({written}; this code reads {VERSION})"
        )
    try:
        layout = pickle.loads(meta[len(HEADER) :])  # noqa: S301  # this job's own processes only (docstring)
    except Exception as exc:  # any unpickling failure (a class that moved, bad bytes) means unusable
        raise SnapshotError(f"{what} has an unreadable index: {type(exc).__name__}: {exc}") from exc
    if not isinstance(layout, Layout) or not all(isinstance(s, Span) for s in layout.spans.values()):
        raise SnapshotError(f"{what} has an index that is not a snapshot layout")
    return layout


def tensor_of(data: bytearray, span: Span) -> torch.Tensor:
    """The tensor ``span`` names in ``data`` (a view of it, no copy)."""
    dtype = span.dtype if span.dtype is not None else torch.uint8
    if span.length == 0:
        return torch.empty(span.shape, dtype=dtype)
    flat = torch.frombuffer(data, dtype=torch.uint8, count=span.length, offset=span.start)
    return flat.view(dtype).reshape(span.shape)
