"""The job's named state: registration, and its hand-over from a replica over an authenticated stream.

A live replica hands its state to a replacement over a TCP connection of
their own, not through the process group, and every byte of it is
authenticated and encrypted (:mod:`taskd_core.authstream`, keyed by the
job's token, :func:`state_key`): the bytes go from the replica's tensors
through one 256 KiB scratch buffer on each side (AES-GCM) into the
receiver's tensors, with no packing copy. The hand-over:

1. the replica listens on the address by which its host reaches the job's
   store host and publishes it in the round's store, signed with the key
   for this round (:func:`taskd_core.authstream.sign`); the receiver uses
   only an address that verifies, so a value another process put there
   first is skipped;
2. the receiver connects; both sides prove the key to each other before
   anything else (the receiver's hello is its global rank, ``!I``); a
   connection that does not prove it within a few seconds is closed, and
   the replica meanwhile serves the ones that do;
3. the replica sends one frame: a header ``!8sQQ`` (the magic ``TASKDST2``,
   the skeleton's length and the payload's length) and the *skeleton*: the
   pickled state with every tensor replaced by a reference (its size, dtype
   and shape). The receiver unpickles plain values, dtypes and tensor
   references only (:class:`_SkeletonUnpickler`), so that no skeleton runs
   code in it, even one from a holder of the key;
4. the replica sends the *payload*: every tensor's bytes, in the skeleton's
   order, in frames of at most 256 KiB (none spans two tensors);
5. the receiver answers one frame, ``0x01``, once every frame authenticated.

The receiver decrypts each tensor into its own tensor at the same place of
its own state when dtype and shape match (a replacement's fresh model), so
loading it afterwards copies nothing; other tensors (an optimizer without
momentum buffers yet) arrive in new ones. A broken or forged transfer fails
the recovery; the controller then restarts the job from its checkpoint,
which also replaces whatever the receiver had half-read.
"""

from __future__ import annotations

import io
import logging
import pickle
import struct
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from taskd_core.authstream import HANDSHAKE_TIMEOUT, Listener, Stream, connect, sign, stream_key
from taskd_core.errors import StreamError, TaskdError
from taskd_pytorch.listen import job_interface

logger = logging.getLogger(__name__)


class StateTransferError(TaskdError):
    """The state from a replica did not arrive, or arrived damaged."""


@runtime_checkable
class Stateful(Protocol):
    """What modules, optimizers and LR schedulers have in common."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


@dataclass(frozen=True, slots=True)
class _Ref:
    """One tensor of the payload, in skeleton order."""

    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A state ready to send: its skeleton and its tensors' bytes (views, not copies)."""

    skeleton: bytes
    chunks: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.numel() for c in self.chunks)


_MAGIC = b"TASKDST2"
_HEADER = struct.Struct("!8sQQ")
_HELLO = struct.Struct("!I")
#: A skeleton describes the state, it does not hold it: a larger one is not read (nor allocated).
_MAX_SKELETON = 64 * 2**20
_ACK = b"\x01"
#: Seconds between two publications of the replica's address while it waits for receivers.
_REPUBLISH = 0.2


def check_registrable(name: str, obj: object) -> None:
    """Raise ``TypeError`` naming ``name`` unless ``obj`` can be saved and loaded in place."""
    if isinstance(obj, torch.Tensor | Stateful):
        return
    if isinstance(obj, list | tuple) and all(isinstance(t, torch.Tensor) for t in obj):
        return
    raise TypeError(
        f"live state {name!r} is a {type(obj).__name__}: register modules, optimizers, schedulers "
        "(anything with state_dict/load_state_dict), tensors or lists of tensors"
    )


def capture(state: Mapping[str, object]) -> dict[str, Any]:
    """The current value of every registered object, as a tree of plain containers and tensors."""
    out: dict[str, Any] = {}
    for name, obj in state.items():
        if isinstance(obj, torch.Tensor):
            out[name] = obj.detach()
        elif isinstance(obj, Stateful):
            out[name] = obj.state_dict()
        else:
            out[name] = [t.detach() for t in obj]  # type: ignore[attr-defined]
    return out


def restore(state: Mapping[str, object], values: Mapping[str, Any]) -> None:
    """Load ``values`` (received from a replica) into the registered objects, in place.

    Tensors that were received straight into their registered tensor are not copied again.
    """
    with torch.no_grad():
        for name, obj in state.items():
            value = values[name]
            if isinstance(obj, torch.Tensor):
                _copy(obj, value)
            elif isinstance(obj, nn.Module) and _all_alias(value, obj.state_dict()):
                continue
            elif isinstance(obj, Stateful):
                obj.load_state_dict(value)
            else:
                for target, source in zip(obj, value, strict=True):  # type: ignore[call-overload]
                    _copy(target, source)


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    if not _alias(target, source):
        target.copy_(source)


def _alias(a: torch.Tensor, b: torch.Tensor) -> bool:
    same_place = a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
    return same_place and a.dtype == b.dtype and a.shape == b.shape


def _all_alias(value: Any, current: Any) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(current, dict)
        and value.keys() == current.keys()
        and all(
            isinstance(v, torch.Tensor) and isinstance(current[k], torch.Tensor) and _alias(v, current[k])
            for k, v in value.items()
        )
    )


def prepare(tree: Any) -> Outgoing:
    """The skeleton of ``tree`` and its tensors as byte views (no tensor is copied)."""
    chunks: list[torch.Tensor] = []

    def strip(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            flat = _bytes_of(node.detach().contiguous())
            chunks.append(flat)
            return _Ref(flat.numel(), node.dtype, tuple(node.shape))
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items()}
        if isinstance(node, list | tuple):
            return type(node)(strip(v) for v in node)
        return node

    skeleton = strip(tree)
    buf = io.BytesIO()
    pickle.dump(skeleton, buf)
    return Outgoing(buf.getvalue(), tuple(chunks))


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    return tensor.reshape(-1).view(torch.uint8)


def _memory(chunk: torch.Tensor) -> memoryview:
    array: Any = chunk.numpy()  # numpy arrays are buffers; torch's stubs do not say so
    return memoryview(array).cast("B")


def state_key(token: str) -> bytes:
    """The key of the state hand-over, from the job's token (``TASKD_JOB_TOKEN``).

    :raises ConfigError: without a token: a hand-over nobody can authenticate is never made.
    """
    return stream_key(token, "live state")


def send_state(outgoing: Outgoing, stream: Stream) -> None:
    """Hand ``outgoing`` to the receiver on ``stream`` (which proved the key).

    Raises ``StateTransferError`` when the receiver goes away or does not acknowledge.
    """
    try:
        header = _HEADER.pack(_MAGIC, len(outgoing.skeleton), outgoing.nbytes)
        stream.send(header + outgoing.skeleton)
        stream.send_buffers(_memory(c) for c in outgoing.chunks if c.numel())
        if stream.receive(len(_ACK)) != _ACK:
            raise StateTransferError(f"the receiver on {stream.peer} rejected the state")
    except StreamError as exc:
        raise StateTransferError(f"sending the state to {stream.peer} failed: {exc}") from exc


def recv_state(stream: Stream, local: Any) -> Any:
    """Receive the state a replica sends on ``stream``, reading tensors into ``local``'s where they fit.

    ``local`` is this rank's own :func:`capture`. Raises ``StateTransferError``
    when the stream breaks or a frame does not authenticate, or when the
    skeleton names anything but plain values.
    """
    try:
        data = stream.receive(_HEADER.size + _MAX_SKELETON)
        if len(data) < _HEADER.size:
            raise StateTransferError(f"the replica sent {len(data)} bytes, not a TaskD state header")
        magic, skeleton_len, payload_len = _HEADER.unpack_from(data)
        if magic != _MAGIC or skeleton_len != len(data) - _HEADER.size:
            raise StateTransferError(f"the replica sent {magic!r}, not a TaskD state header of this version")
        skeleton = _load_skeleton(data[_HEADER.size :])
        tree = _targets(skeleton, local)
        chunks = [_bytes_of(t) for t in _tensors(tree)]
        if sum(c.numel() for c in chunks) != payload_len:
            raise StateTransferError(f"the replica's skeleton does not match its {payload_len} payload bytes")
        stream.receive_into(_memory(c) for c in chunks if c.numel())
        stream.send(_ACK)
    except StreamError as exc:
        raise StateTransferError(
            f"receiving the state failed: {exc}; the recovery fails and the controller falls back to a "
            "full restart"
        ) from exc
    return tree


class _SkeletonUnpickler(pickle.Unpickler):
    """Unpickles what :func:`prepare` makes of a registered state, and refuses anything that could run code.

    State dicts hold plain values (numbers, strings, containers), dtypes and,
    once stripped, tensor references; any other global a skeleton names
    would be called by ``pickle`` with arguments of the sender's choosing.
    """

    _ALLOWED = frozenset(
        {
            (_Ref.__module__, _Ref.__qualname__),
            ("collections", "OrderedDict"),
            ("builtins", "complex"),
            ("builtins", "set"),
            ("builtins", "frozenset"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise StateTransferError(
            f"the replica's state names {module}.{name}, which a replacement does not load: "
            "register modules, optimizers, schedulers and tensors, whose state dicts hold plain values"
        )


def _load_skeleton(data: bytes) -> Any:
    try:
        return _SkeletonUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError) as exc:
        raise StateTransferError(f"the replica's skeleton is not a TaskD state: {exc}") from exc


def _targets(skeleton: Any, local: Any) -> Any:
    """The skeleton with every reference replaced by the tensor its bytes go into."""
    if isinstance(skeleton, _Ref):
        if (
            isinstance(local, torch.Tensor)
            and local.dtype == skeleton.dtype
            and tuple(local.shape) == skeleton.shape
            and local.is_contiguous()
        ):
            return local.detach()
        return torch.empty(skeleton.shape, dtype=skeleton.dtype)
    if isinstance(skeleton, dict):
        mine = local if isinstance(local, dict) else {}
        return {k: _targets(v, mine.get(k)) for k, v in skeleton.items()}
    if isinstance(skeleton, list | tuple):
        same = isinstance(local, list | tuple) and len(local) == len(skeleton)
        return type(skeleton)(_targets(v, local[i] if same else None) for i, v in enumerate(skeleton))
    return skeleton


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Every tensor of ``tree`` in the order :func:`prepare` meets them."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from _tensors(v)


def serve(
    outgoing: Outgoing,
    receivers: Collection[int],
    near: str,
    publish: Callable[[str], None],
    timeout: float,
    key: bytes,
    context: bytes,
) -> None:
    """Send ``outgoing`` to each of the ranks ``receivers`` once, within ``timeout`` seconds.

    Listens on the address by which this host reaches ``near`` (the job's
    store host, so that the receivers on other hosts reach it too) and
    ``publish``es it, signed with ``key`` for ``context``, before it accepts.
    Connections that do not prove the key, or come from a rank that is not
    expected, are dropped without holding the others.
    """
    deadline = time.monotonic() + timeout
    pending = set(receivers)
    try:
        listener = Listener(
            key,
            context,
            host=job_interface(near),
            hello_limit=_HELLO.size,
            handshake_timeout=min(timeout, HANDSHAKE_TIMEOUT),
        )
    except (OSError, StreamError) as exc:
        raise StateTransferError(
            f"cannot listen for the state's receivers on the way to {near}: {exc}"
        ) from exc
    with listener:
        signed = sign(key, context, listener.address)
        while pending:
            # Published again every slice: a value another process wrote over it does not last.
            publish(signed)
            try:
                stream = listener.accept(min(_REPUBLISH, deadline - time.monotonic()))
            except StreamError as exc:
                if time.monotonic() < deadline:
                    continue
                raise StateTransferError(f"ranks {sorted(pending)} did not fetch the state: {exc}") from exc
            with stream:
                (rank,) = _HELLO.unpack(stream.hello) if len(stream.hello) == _HELLO.size else (-1,)
                if rank not in pending:
                    logger.warning("%s asked for the state as rank %s, which needs none", stream.peer, rank)
                    continue
                stream.settimeout(max(deadline - time.monotonic(), 1.0))
                send_state(outgoing, stream)
                pending.discard(rank)


def fetch(address: str, rank: int, local: Any, timeout: float, key: bytes, context: bytes) -> Any:
    """Receive the state from the replica serving at ``address`` (``host:port``); see :func:`recv_state`."""
    try:
        stream = connect(address, key, context, _HELLO.pack(rank), timeout)
    except StreamError as exc:
        raise StateTransferError(f"cannot reach the replica serving the state at {address}: {exc}") from exc
    with stream:
        stream.settimeout(timeout)
        return recv_state(stream, local)
