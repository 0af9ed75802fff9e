"""One rank's snapshot data as it is written: its file in the node's shared memory, mapped, filled in place.

A save copies each tensor once, straight into the file (the copy that makes
the snapshot safe from the training that goes on): :func:`stage` does it on
the caller's thread (``dcp.async_save`` calls it before its background
thread starts) and hands DCP a state dict whose tensors are those copies, so
what the background thread does is cheap: the checksum (``zlib`` releases the
GIL) and the marker. Tensors sit at :data:`ALIGN`-byte offsets, so each one's
bytes can be viewed as its dtype again.
"""

from __future__ import annotations

import copy
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from taskd_core.snapshots.store import SnapshotStore

#: Offsets of tensors in the data are multiples of this (any dtype's alignment, a cache line).
ALIGN = 64
#: Leaves that need no copy: nothing can change them in place.
_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # The attribute, not to_local(): no autograd node per tensor and save.
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _walk(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` rebuilt with ``leaf`` applied to what is not a dict, list or tuple (faster than pytree)."""
    kind = type(value)
    if kind is dict or kind is OrderedDict:
        return kind((k, _walk(v, leaf)) for k, v in value.items())
    if kind is list or kind is tuple:
        return kind(_walk(v, leaf) for v in value)
    # DCP walks into every mapping and list (its tensors must be staged ones); a tuple it pickles whole.
    if isinstance(value, Mapping):
        return {k: _walk(v, leaf) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, leaf) for v in value]
    return leaf(value)


def data_size(tensors: list[torch.Tensor]) -> int:
    """The bytes a slot for ``tensors`` (their local shards) takes."""
    return sum(_aligned(_nbytes(_local(t))) for t in tensors)


class Slot:
    """The mapped data file of one snapshot being written (see the module docstring)."""

    def __init__(self, store: SnapshotStore, rank: int, step: int, size: int) -> None:
        """:raises SnapshotError: when the node has no room for ``size`` bytes."""
        self.target, self._mapped = store.allocate(rank, step, size)
        self.size = size
        self._bytes = (
            torch.frombuffer(self._mapped, dtype=torch.uint8)
            if self._mapped is not None
            else torch.empty(0, dtype=torch.uint8)
        )
        self._base = self._bytes.data_ptr()
        self._at = 0

    def put(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` (a DTensor's local shard) in the slot: contiguous, same dtype and shape."""
        source = tensor.detach()
        n = _nbytes(source)
        view = self._bytes[self._at : self._at + n].view(source.dtype).view(source.shape)
        view.copy_(source)
        self._at += _aligned(n)
        return view

    def stage(self, value: Any) -> Any:
        """``value``, its tensors copied into the slot (DTensors keep their sharding), the rest copied."""
        if isinstance(value, DTensor):
            # The constructor, not from_local: no autograd node, and the copy stays on the CPU.
            local = self.put(value._local_tensor)
            return DTensor(local, value._spec, requires_grad=False)  # type: ignore[no-untyped-call]
        if isinstance(value, torch.Tensor):
            return self.put(value)
        return value if isinstance(value, _IMMUTABLE) else copy.deepcopy(value)

    def offset(self, tensor: torch.Tensor) -> int | None:
        """Where ``tensor``'s bytes start in the slot; None when they are not a contiguous run of it."""
        if not tensor.numel():
            return 0  # no bytes: any offset does, and an empty tensor's pointer is anything
        start = tensor.data_ptr() - self._base
        if (
            tensor.is_contiguous()
            and tensor.device.type == "cpu"
            and 0 <= start <= self.size - _nbytes(tensor)
        ):
            return start
        return None

    def view(self) -> memoryview:
        """The data as it stands (empty when there is none)."""
        return memoryview(self._mapped) if self._mapped is not None else memoryview(b"")

    def crc(self) -> int:
        return zlib.crc32(self.view())


def tensors_of(state_dict: Any) -> list[torch.Tensor]:
    """Every tensor of a (nested) state dict."""
    found: list[torch.Tensor] = []

    def note(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)

    _walk(state_dict, note)
    return found


def stage(slot: Slot, state_dict: Any) -> Any:
    """``state_dict`` with its tensors copied into ``slot`` (which :func:`data_size` of them sized)."""
    return _walk(state_dict, slot.stage)
