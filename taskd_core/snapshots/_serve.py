"""The keeper process of :mod:`taskd_core.snapshots.keeper` (``python -m taskd_core.snapshots._serve``).

Arguments: the node's snapshot directory, the host to listen on (``-``: no
listener, so no peer copies), the job id and the bytes the other nodes' copies
may take here (:class:`PeerBudget`); the job's token comes in
``TASKD_JOB_TOKEN``. It writes where it listens into the directory's
``address`` file, then serves the requests of :mod:`taskd_core.snapshots.peer`,
each in a thread, until its stdin (a pipe from the launcher) ends, whether
the launcher closed it or died: then it removes the directory and exits.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from dataclasses import asdict
from pathlib import Path

from taskd_core.authstream import Listener, Stream
from taskd_core.errors import SnapshotError, StreamError, TaskdError
from taskd_core.snapshots.peer import META_LIMIT, context_of, key_of, receive_header, seal_of, send_header
from taskd_core.snapshots.store import Seal, SnapshotStore, crc32

logger = logging.getLogger(__name__)

#: Environment variable holding the job's token.
TOKEN_ENV = "TASKD_JOB_TOKEN"


class PeerBudget:
    """The bytes of other nodes' copies this keeper holds at most; one over it is refused, said once per rank.

    What counts is what the files take once the copy is in: every peer rank's
    snapshots here, with the sender's older ones that the copy replaces left out.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        #: held while a copy is admitted and its room reserved: two senders cannot both take the last room.
        self.lock = threading.Lock()
        self._ranks: set[int] = set()
        self._warned: set[int] = set()

    def admit(self, store: SnapshotStore, seal: Seal) -> None:
        """:raises SnapshotError: when ``seal``'s copy would take this keeper over its limit."""
        held = sum(store.held(rank) for rank in self._ranks - {seal.rank}) + store.held(seal.rank, seal.step)
        if held + seal.data_size > self.limit:
            if seal.rank not in self._warned:
                self._warned.add(seal.rank)
                logger.warning(
                    "snapshot keeper: a copy of rank %s (%s MiB) does not fit beside the %s MiB of copies "
                    "held here, over the node's budget of %s MiB for peer copies (--taskd-snapshot-memory): "
                    "refused, the rank's copies stay on its own node",
                    seal.rank,
                    seal.data_size >> 20,
                    held >> 20,
                    self.limit >> 20,
                )
            raise SnapshotError(
                f"no room for a copy of rank {seal.rank}: this node holds peer copies of "
                f"{self.limit >> 20} MiB at most (--taskd-snapshot-memory)"
            )
        self._ranks.add(seal.rank)


def _put(store: SnapshotStore, budget: PeerBudget, stream: Stream) -> None:
    header = receive_header(stream)
    seal = seal_of(header, f"a copy from {stream.peer}")
    sizes = [int(s) for s in header.get("sizes", [])]
    if sum(sizes) != seal.data_size:
        raise SnapshotError(f"{stream.peer} announced {sum(sizes)} of {seal.data_size} bytes")
    meta = stream.receive(META_LIMIT)
    with budget.lock:
        budget.admit(store, seal)
        target, mapped = store.allocate(seal.rank, seal.step, seal.data_size)
    try:
        send_header(stream, {"ready": True})
        if mapped is not None:
            view = memoryview(mapped)
            parts, at = [], 0
            for size in sizes:
                parts.append(view[at : at + size])
                at += size
            stream.receive_into(parts)
            ok = crc32([view]) == seal.data_crc
            del parts, view
        else:
            ok = seal.data_crc == 0
        if not ok or crc32([meta]) != seal.meta_crc:
            raise SnapshotError(
                f"the copy of rank {seal.rank} step {seal.step} from {stream.peer} is damaged"
            )
    except TaskdError:
        shutil.rmtree(target, ignore_errors=True)
        raise
    finally:
        if mapped is not None:
            mapped.close()
    store.commit(seal, meta)
    send_header(stream, {"ok": True})


def _get(store: SnapshotStore, stream: Stream) -> None:
    header = receive_header(stream)
    # The fetcher verifies: a damaged copy reaches it as one, and it says so.
    rank, step = int(header["rank"]), int(header["step"])
    seal = store.seal(rank, step)
    data = (store.step_dir(rank, step) / "data").read_bytes()
    send_header(stream, {"seal": asdict(seal), "sizes": [len(data)]})
    stream.send((store.step_dir(rank, step) / "meta").read_bytes())
    stream.send_buffers([memoryview(data)])


def _handle(store: SnapshotStore, budget: PeerBudget, stream: Stream) -> None:
    op = stream.hello.decode(errors="replace")
    with stream:
        try:
            if op == "put":
                _put(store, budget, stream)
            elif op == "get":
                _get(store, stream)
            elif op == "list":
                receive_header(stream)
                send_header(stream, {"inventory": {str(r): s for r, s in store.inventory().items()}})
            elif op == "drop":
                header = receive_header(stream)
                store.drop(int(header["rank"]), int(header["above"]))
                send_header(stream, {"ok": True})
            else:
                send_header(stream, {"error": f"unknown request {op!r}"})
        except (SnapshotError, OSError, KeyError, ValueError) as exc:
            logger.warning("snapshot keeper: %s request from %s failed: %s", op, stream.peer, exc)
            try:
                send_header(stream, {"error": str(exc)})
            except StreamError:
                pass
        except StreamError as exc:
            logger.warning("snapshot keeper: %s request from %s broke off: %s", op, stream.peer, exc)


def _serve(listener: Listener, store: SnapshotStore, budget: PeerBudget) -> None:
    while True:
        try:
            stream = listener.accept(timeout=3600.0)
        except StreamError:
            continue
        threading.Thread(
            target=_handle, args=(store, budget, stream), name="taskd-keeper-request", daemon=True
        ).start()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="[taskd snapshot keeper] %(message)s")
    root, host, job_id, budget = Path(argv[0]), argv[1], argv[2], PeerBudget(int(argv[3]))
    store = SnapshotStore(root)
    listener = None
    token = os.environ.pop(TOKEN_ENV, "")
    if host != "-" and token:
        listener = Listener(key_of(token), context_of(job_id), host=host)
        threading.Thread(
            target=_serve, args=(listener, store, budget), name="taskd-keeper", daemon=True
        ).start()
        store.publish(listener.address)
    try:
        while sys.stdin.buffer.read(4096):
            pass
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # Daemon threads may be inside a transfer: no orderly interpreter shutdown to wait for.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
