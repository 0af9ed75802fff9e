"""The job's named state: registration, checksums, and its hand-over from a replica over a TCP socket.

A live replica hands its state to a replacement over a plain TCP connection
of their own, not through the process group: the bytes go straight from the
replica's tensors into the receiver's (``sendall`` and ``recv_into`` on the
tensors' memory), with no packing copy on either side. The wire, all
integers big-endian:

1. the receiver connects to the address the replica published in the
   round's store and sends its global rank and a fresh 16-byte nonce
   (``!I16s``);
2. the replica sends a header ``!8sQQ``: the magic ``TASKDST1``, the
   skeleton's length and the payload's length;
3. the replica sends the *skeleton*: the pickled state with every tensor
   replaced by a reference (its size, dtype and shape), then a 32-byte
   HMAC-SHA256 of nonce, header and skeleton keyed by the job's token
   (:func:`state_key`). The receiver checks the tag, so that only a
   holder of ``TASKD_JOB_TOKEN`` can serve it a state, and unpickles plain
   values, dtypes and tensor references only (:class:`_SkeletonUnpickler`),
   so that no skeleton runs code in it, token or not;
4. the replica sends the *payload*: every tensor's bytes, in the skeleton's
   order, unpadded;
5. the replica sends the payload's checksum ``!qq`` (two signed 64-bit
   sums, see :func:`checksum`), computed while the payload was on its way;
6. the receiver, which summed each tensor while receiving the next,
   compares and answers one byte, ``0x01``.

The receiver reads each tensor into its own tensor at the same place of
its own state when dtype and shape match (a replacement's fresh model), so
loading it afterwards copies nothing; other tensors (an optimizer without
momentum buffers yet) arrive in new ones. A broken or damaged transfer
fails the recovery; the controller then restarts the job from its
checkpoint, which also replaces whatever the receiver had half-read.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import pickle
import socket
import struct
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from taskd_core.errors import TaskdError


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


_MAGIC = b"TASKDST1"
_HEADER = struct.Struct("!8sQQ")
_TRAILER = struct.Struct("!qq")
_HELLO = struct.Struct("!I16s")
_TAG_SIZE = hashlib.sha256().digest_size
#: A skeleton describes the state, it does not hold it: a larger one is not read (nor allocated).
_MAX_SKELETON = 64 * 2**20
_ACK = b"\x01"
#: Checksum rows are this many 64-bit words.
_ROW = 1024
#: From this many payload bytes on, the checksum is summed beside the transfer.
_OVERLAP_FROM = 16 * 2**20
_T = TypeVar("_T")


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


def checksum(chunks: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> tuple[int, int]:
    """Two wrapping 64-bit sums over the chunks' bytes read as words: plain, and weighted by row.

    One vectorised pass over the bytes (sums of rows of ``_ROW`` words; a
    chunk's last, partial row is padded with zeros), several times faster
    than CRC-32 in Python's zlib. It catches lost and flipped bytes and bytes
    moved across rows; it is a transfer check, not a cryptographic one.
    """
    return _combine([_row_sums(c) for c in chunks])


def _combine(sums: list[torch.Tensor]) -> tuple[int, int]:
    rows = torch.cat(sums) if sums else torch.zeros(0, dtype=torch.int64)
    weights = torch.arange(1, rows.numel() + 1, dtype=torch.int64)
    return int(rows.sum()), int((rows * weights).sum())


def _row_sums(chunk: torch.Tensor) -> torch.Tensor:
    if chunk.storage_offset() % 8:
        chunk = chunk.clone()  # a word view needs 8-byte alignment
    whole = chunk.numel() // (8 * _ROW) * 8 * _ROW
    sums = chunk[:whole].view(torch.int64).view(-1, _ROW).sum(dim=1)
    if whole == chunk.numel():
        return sums
    tail = torch.zeros(8 * _ROW, dtype=torch.uint8)
    tail[: chunk.numel() - whole] = chunk[whole:]
    return torch.cat([sums, tail.view(torch.int64).sum().reshape(1)])


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    return tensor.reshape(-1).view(torch.uint8)


def _memory(chunk: torch.Tensor) -> memoryview:
    array: Any = chunk.numpy()  # numpy arrays are buffers; torch's stubs do not say so
    return memoryview(array).cast("B")


def state_key(token: str) -> bytes:
    """The key proving that a replica belongs to the job, from its token (empty: no token, no proof)."""
    return hashlib.sha256(b"taskd live state\0" + token.encode()).digest() if token else b""


def _tag(key: bytes, nonce: bytes, header: bytes, skeleton: bytes) -> bytes:
    return hmac.new(key, nonce + header + skeleton, hashlib.sha256).digest()


def send_state(outgoing: Outgoing, conn: socket.socket, key: bytes = b"") -> int:
    """Hand ``outgoing`` to the receiver connected on ``conn``; returns the receiver's rank.

    ``key`` (:func:`state_key`) signs the skeleton. Raises ``StateTransferError``
    when the receiver goes away or does not acknowledge.
    """
    try:
        rank, nonce = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
        header = _HEADER.pack(_MAGIC, len(outgoing.skeleton), outgoing.nbytes)
        conn.sendall(header)
        conn.sendall(outgoing.skeleton)
        conn.sendall(_tag(key, nonce, header, outgoing.skeleton))
        with _Overlap(outgoing.nbytes) as overlap:
            summed = overlap.run(checksum, outgoing.chunks)
            for chunk in outgoing.chunks:
                if chunk.numel():
                    conn.sendall(_memory(chunk))
            conn.sendall(_TRAILER.pack(*summed.result()))
        if _recv_exact(conn, 1) != _ACK:
            raise StateTransferError(f"the receiver on {conn.getpeername()} rejected the state")
    except OSError as exc:
        raise StateTransferError(f"sending the state failed: {exc}; the receiver is gone") from exc
    return int(rank)


def recv_state(conn: socket.socket, rank: int, local: Any, key: bytes = b"") -> Any:
    """Receive the state a replica sends on ``conn``, reading tensors into ``local``'s where they fit.

    ``local`` is this rank's own :func:`capture`; ``key`` (:func:`state_key`)
    checks the replica's signature. Raises ``StateTransferError`` when the
    connection breaks, the signature or the checksum does not match, or the
    skeleton names anything but plain values.
    """
    nonce = os.urandom(16)
    try:
        conn.sendall(_HELLO.pack(rank, nonce))
        header = _recv_exact(conn, _HEADER.size)
        magic, skeleton_len, payload_len = _HEADER.unpack(header)
        if magic != _MAGIC:
            raise StateTransferError(f"the replica sent {magic!r}, not a TaskD state header")
        if skeleton_len > _MAX_SKELETON:
            raise StateTransferError(
                f"the replica announced a {skeleton_len}-byte skeleton (at most {_MAX_SKELETON}); "
                "it is not a TaskD replica of this version"
            )
        data = _recv_exact(conn, skeleton_len)
        if not hmac.compare_digest(_recv_exact(conn, _TAG_SIZE), _tag(key, nonce, header, data)):
            raise StateTransferError(
                "the replica serving the state did not sign it with this job's key; "
                "every node of the job must run with the same TASKD_JOB_TOKEN"
            )
        skeleton = _load_skeleton(data)
        tree = _targets(skeleton, local)
        chunks = [_bytes_of(t) for t in _tensors(tree)]
        if sum(c.numel() for c in chunks) != payload_len:
            raise StateTransferError(f"the replica's skeleton does not match its {payload_len} payload bytes")
        with _Overlap(payload_len) as overlap:
            sums = []
            for chunk in chunks:
                _recv_into(conn, _memory(chunk))
                sums.append(overlap.run(_row_sums, chunk))
            mine = _combine([s.result() for s in sums])
        if _TRAILER.unpack(_recv_exact(conn, _TRAILER.size)) != mine:
            raise StateTransferError(
                f"the state arrived damaged (checksum mismatch over {payload_len} bytes); "
                "the recovery fails and the controller falls back to a full restart"
            )
        conn.sendall(_ACK)
    except OSError as exc:
        raise StateTransferError(f"receiving the state failed: {exc}; the replica is gone") from exc
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


class _Overlap:
    """Runs the checksum's sums beside the socket for a large payload; inline for a small one.

    Summing releases the GIL, so for a large state the checksum costs no time
    of its own; for a small one, starting a thread would cost more than the sums.
    """

    def __init__(self, nbytes: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1) if nbytes >= _OVERLAP_FROM else None

    def __enter__(self) -> _Overlap:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    def run(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        done: Future[_T] = Future()
        done.set_result(fn(*args))
        return done


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


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    _recv_into(conn, memoryview(buf))
    return bytes(buf)


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise StateTransferError(f"the connection closed after {got} of {len(view)} bytes")
        got += n


def serve(
    outgoing: Outgoing,
    receivers: int,
    near: str,
    publish: Callable[[str], None],
    timeout: float,
    key: bytes = b"",
) -> None:
    """Send ``outgoing`` to ``receivers`` receivers, one after the other.

    Listens on the address by which this host reaches ``near`` (the job's
    store host, so that the receivers on other hosts reach it too) and
    ``publish``es it as ``host:port`` before it accepts.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(near, 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)  # no packet is sent: this only picks the route's local address
            host = probe.getsockname()[0]
        server = socket.create_server((host, 0), family=family)
    except OSError as exc:
        raise StateTransferError(
            f"cannot listen for the state's receivers on the way to {near}: {exc}"
        ) from exc
    with server:
        server.settimeout(timeout)
        port = server.getsockname()[1]
        publish(f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}")
        for _ in range(receivers):
            try:
                conn, _ = server.accept()
            except OSError as exc:
                raise StateTransferError(
                    f"a receiver of the state did not connect within {timeout}s: {exc}"
                ) from exc
            with conn:
                conn.settimeout(timeout)
                send_state(outgoing, conn, key)


def fetch(address: str, rank: int, local: Any, timeout: float, key: bytes = b"") -> Any:
    """Receive the state from the replica serving at ``address`` (``host:port``); see :func:`recv_state`."""
    host, _, port = address.rpartition(":")
    try:
        conn = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except OSError as exc:
        raise StateTransferError(f"cannot reach the replica serving the state at {address}: {exc}") from exc
    with conn:
        return recv_state(conn, rank, local, key)
