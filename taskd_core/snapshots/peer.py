"""The keepers' wire: a rank's snapshot sent to, listed at and fetched from another node's keeper.

Every request is one connection over :mod:`taskd_core.authstream` keyed by
the job's token (purpose ``memory snapshots``, context the job id), so only
processes of the job can store, read or drop copies. The hello names the
request; a JSON header follows each way, then the bulk bytes:

* ``put``: header ``{"seal": …, "sizes": […]}`` and the meta blob →
  ``{"ready": true}`` once the keeper reserved the room (or ``{"error"}``: over
  its budget, say), then the data (in buffers of ``sizes``) → ``{"ok": true}``
  once the keeper verified the checksum and wrote the marker (a sender killed
  midway leaves no listed copy);
* ``get``: ``{"rank", "step"}`` → ``{"seal", "sizes"}``, meta, data (the
  fetcher verifies the checksum itself), or ``{"error"}``;
* ``list``: ``{}`` → ``{"inventory": {rank: [steps]}}``;
* ``drop``: ``{"rank", "above"}`` → ``{"ok": true}``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from taskd_core.authstream import Stream, connect, stream_key
from taskd_core.errors import SnapshotError, StreamError
from taskd_core.snapshots.store import Seal, Snapshot, flat, verify

#: The authstream purpose of the keepers' wire.
PURPOSE = "memory snapshots"
#: Longest JSON header either side accepts.
HEADER_LIMIT = 1 << 20
#: Longest meta blob a keeper accepts.
META_LIMIT = 256 << 20


def key_of(token: str) -> bytes:
    return stream_key(token, PURPOSE)


def context_of(job_id: str) -> bytes:
    return b"taskd snapshots\0" + job_id.encode()


def send_header(stream: Stream, header: dict[str, Any]) -> None:
    stream.send(json.dumps(header).encode())


def receive_header(stream: Stream) -> dict[str, Any]:
    raw = stream.receive(HEADER_LIMIT)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise StreamError(f"{stream.peer} sent a header that is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise StreamError(f"{stream.peer} sent a header that is not an object")
    return header


def seal_of(header: dict[str, Any], what: str) -> Seal:
    return Seal.from_json(json.dumps(header.get("seal")).encode(), what)


def _answer(stream: Stream, what: str) -> dict[str, Any]:
    header = receive_header(stream)
    if "error" in header:
        raise SnapshotError(f"{what}: {header['error']}")
    return header


class PeerClient:
    """Requests to keepers at any address, with the job's key."""

    def __init__(self, token: str, job_id: str, timeout: float = 60.0) -> None:
        self._key = key_of(token)
        self._context = context_of(job_id)
        self._timeout = timeout

    def _connect(self, address: str, op: str) -> Stream:
        return connect(address, self._key, self._context, hello=op.encode(), timeout=self._timeout)

    def put(self, address: str, seal: Seal, meta: bytes, buffers: Sequence[memoryview]) -> None:
        """Store a copy at the keeper at ``address``; returns once it is complete there.

        :raises StreamError: when the keeper is gone or the copy does not arrive whole.
        :raises SnapshotError: when the keeper refuses it (no room, say).
        """
        views = [flat(b) for b in buffers]
        with self._connect(address, "put") as stream:
            # No step in the words: a refusal repeated every step reads the same (and is said once).
            what = f"the keeper at {address} refused a copy of rank {seal.rank}"
            send_header(stream, {"seal": asdict(seal), "sizes": [len(v) for v in views]})
            stream.send(meta)
            _answer(stream, what)  # room reserved: only now the bulk (none for a copy refused)
            stream.send_buffers(views)
            _answer(stream, what)

    def get(self, address: str, rank: int, step: int) -> Snapshot:
        """``rank``'s snapshot of ``step`` from the keeper at ``address``, verified.

        :raises SnapshotError: when the keeper has none, or the copy is damaged.
        :raises StreamError: when the keeper cannot be reached or the transfer breaks.
        """
        what = f"the copy of rank {rank} step {step} at {address}"
        with self._connect(address, "get") as stream:
            send_header(stream, {"rank": rank, "step": step})
            header = _answer(stream, what)
            seal = seal_of(header, what)
            meta = stream.receive(META_LIMIT)
            data = bytearray(seal.data_size)
            view = memoryview(data)
            parts, at = [], 0
            for size in header.get("sizes", []):
                parts.append(view[at : at + int(size)])
                at += int(size)
            if at != seal.data_size:
                raise SnapshotError(f"{what}: its keeper announced {at} of {seal.data_size} bytes")
            stream.receive_into(parts)
        snapshot = Snapshot(seal, meta, data)
        verify(snapshot, what)
        return snapshot

    def inventory(self, address: str) -> dict[int, list[int]]:
        """Every rank's complete steps at the keeper at ``address``."""
        with self._connect(address, "list") as stream:
            send_header(stream, {})
            header = _answer(stream, f"the keeper at {address}")
        raw = header.get("inventory", {})
        return {int(rank): [int(s) for s in steps] for rank, steps in raw.items()}

    def drop(self, address: str, rank: int, above: int) -> None:
        """Make the keeper at ``address`` forget ``rank``'s copies after step ``above``."""
        with self._connect(address, "drop") as stream:
            send_header(stream, {"rank": rank, "above": above})
            _answer(stream, f"the keeper at {address}")
