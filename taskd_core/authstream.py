"""Authenticated, encrypted byte streams between two processes of one job, keyed by the job's token.

Processes of a job hand each other bulk data over plain TCP (a live replica
its state to a replacement; a node a memory snapshot to its peer). Whoever
else reaches the port (another user of the host, anyone on the network) must
not be able to read what is sent, change one byte of it, or stand in for
either side. So every byte after the handshake travels in AES-256-GCM frames
(``cryptography``, OpenSSL underneath: several GB/s per core, where an
HMAC-SHA256 of the stream measured about 1) under keys that only holders of
the job's token can derive::

    key = stream_key(token, purpose)                  # one key per use of the token
    with Listener(key, context, host="10.0.0.1") as listener:
        publish(sign(key, context, listener.address))   # where clients find it, signed
        with listener.accept(timeout=60) as stream:     # only a client that proved the key
            stream.send(header)
            stream.send_buffers(views)
    # the other process
    address = verify(key, context, published)          # None: not signed with this job's key
    with connect(address, key, context, hello=b"rank 3", timeout=60) as stream:
        header = stream.receive(limit=1 << 20)
        stream.receive_into(views)

``context`` names one use (a job and its recovery round, say): a proof, a
signed address or a frame of another use does not verify in this one.

The handshake, all integers big-endian, ``K`` the key and ``|`` concatenation:

1. client → server: ``TASKDAS1``, a fresh 32-byte nonce ``Nc``, the hello's
   length (``!H``) and the hello (what the client says it is);
2. server → client: a fresh nonce ``Ns`` and ``HMAC-SHA256(K, "server" | context | Nc | Ns | hello)``;
3. the client checks that proof, so it reads nothing from a server without the
   key, and answers ``HMAC-SHA256(K, "client" | context | Nc | Ns | hello)``;
4. the server checks it, so a client without the key learns nothing (it has
   had a nonce and a proof bound to its own nonce, nothing of the data).

Each direction then has its own AES-256-GCM key,
``HMAC-SHA256(K, "server->client" | context | Nc | Ns)`` and the same with
``client->server``. A frame is its plaintext's length (``!I``, also the
associated data), the ciphertext and a 16-byte tag; the nonce is the frame's
number in its direction, so a frame that is changed, dropped, replayed,
reordered or cut short fails the tag. Bulk data (:meth:`Stream.send_buffers`,
:meth:`Stream.receive_into`) goes through two 256 KiB buffers per side, a
thread of the stream moving one over the socket while the other is sealed or
opened (the cipher holds the GIL, the socket does not). A :class:`Listener` runs each
handshake in a thread of its own under a short deadline (at most
:data:`MAX_PENDING` at once), so a silent or hostile connection holds only
itself, never the clients that prove the key.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import queue
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from taskd_core.errors import ConfigError, StreamError

logger = logging.getLogger(__name__)

_MAGIC = b"TASKDAS1"
_NONCE = 32
_PROOF = hashlib.sha256().digest_size
_TAG = 16
_HELLO_HEAD = struct.Struct(f"!8s{_NONCE}sH")
_FRAME_HEAD = struct.Struct("!I")
#: Bulk data goes in frames of at most this many bytes (the scratch buffer each side keeps).
CHUNK = 1 << 18
#: Handshakes a listener runs at once; connections beyond are closed unanswered.
MAX_PENDING = 64
#: Seconds a client gets to complete its handshake with a listener.
HANDSHAKE_TIMEOUT = 10.0


def stream_key(token: str, purpose: str) -> bytes:
    """The 32-byte key of one use (``purpose``) of the job's token.

    :raises ConfigError: for an empty token: without a secret nothing can be proved.
    """
    if not token:
        raise ConfigError(
            f"{purpose}: no job token to key the stream with; set TASKD_JOB_TOKEN to the same secret on "
            "every node of the job (a one-node launch makes one itself)"
        )
    return hmac.new(token.encode(), b"taskd stream key\0" + purpose.encode(), hashlib.sha256).digest()


def _mac(key: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        # Length-prefixed: no two different lists of parts hash alike.
        mac.update(struct.pack("!I", len(part)))
        mac.update(part)
    return mac.digest()


def sign(key: bytes, context: bytes, value: str) -> str:
    """``value`` with a tag proving a holder of ``key`` published it for ``context`` (for a store, say)."""
    return f"{value} {_mac(key, b'value', context, value.encode()).hex()}"


def verify(key: bytes, context: bytes, signed: str) -> str | None:
    """The value :func:`sign` tagged, or None when ``signed`` was not signed with ``key`` for ``context``."""
    value, _, tag = signed.rpartition(" ")
    expected = _mac(key, b"value", context, value.encode()).hex()
    return value if value and hmac.compare_digest(tag, expected) else None


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as a host and a port."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise StreamError(f"{address!r} is not an address (HOST:PORT)")
    return host.strip("[]"), int(port)


class Stream:
    """One authenticated connection: frames in both directions, sealed with the session's keys.

    Built by :func:`connect` (the client) or :meth:`Listener.accept` (the
    server). ``hello`` is what the client said it is, proved with the key.
    Every method raises :class:`StreamError` when the peer goes away, times
    out or sends a frame that does not authenticate; the stream is then unusable.
    """

    def __init__(self, sock: socket.socket, send_key: bytes, receive_key: bytes, hello: bytes) -> None:
        self._sock = sock
        self._send = algorithms.AES(send_key)
        self._receive = algorithms.AES(receive_key)
        self._sent = 0
        self._received = 0
        self._scratch = bytearray()
        self.hello = hello
        try:
            self.peer = _name(sock.getpeername())
        except OSError:
            self.peer = "a peer that left"

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def settimeout(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)

    def send(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` as one frame (at most 4 GiB)."""
        self._frame(memoryview(data).cast("B"))

    def receive(self, limit: int) -> bytes:
        """The next frame; one announced as longer than ``limit`` bytes is refused before it is read."""
        size = self._head()
        if size > limit:
            raise StreamError(f"{self.peer} announced a {size}-byte frame, more than the {limit} expected")
        out = bytearray(size)
        self._open(size, memoryview(out))
        return bytes(out)

    def send_buffers(self, views: Iterable[memoryview]) -> None:
        """Send the bytes of ``views`` in frames of at most :data:`CHUNK` (none spans two views).

        The receiver passes views of the same lengths, in the same order, to
        :meth:`receive_into`. A thread of the stream's writes each frame while
        the next one is sealed (the cipher holds the GIL, a socket write does not).
        """
        with _Pipeline(self._sock.sendall, f"sending to {self.peer}") as pipe:
            for part in _frames(views):
                buf = pipe.free()
                pipe.put(buf, self._seal(part, buf))

    def receive_into(self, views: Iterable[memoryview]) -> None:
        """Fill ``views`` with what the peer sent through :meth:`send_buffers`, decrypting in place.

        A thread of the stream's reads each frame while the one before is opened.
        """
        parts = list(_frames(views))
        reader = _Reader(self, [len(p) for p in parts])
        try:
            for part in parts:
                buf, sealed = reader.take()
                self._unseal(sealed, part)
                reader.release(buf)
        except StreamError:
            # Unusable now: the shutdown also ends a read the thread may be blocked in.
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            raise
        finally:
            reader.close()

    # --- frames ----------------------------------------------------------------------

    def _frame(self, data: memoryview) -> None:
        if len(self._scratch) < _FRAME_HEAD.size + len(data) + _TAG:
            self._scratch = bytearray(_FRAME_HEAD.size + max(len(data), CHUNK) + _TAG)
        size = self._seal(data, memoryview(self._scratch))
        try:
            self._sock.sendall(memoryview(self._scratch)[:size])
        except OSError as exc:
            raise StreamError(f"sending to {self.peer} failed: {exc}") from exc

    def _seal(self, data: memoryview, out: memoryview) -> int:
        """Write ``data``'s frame (length, ciphertext, tag) into ``out``; returns its size.

        The frame leaves in one write: a separate small write of the length would
        wait for the receiver's delayed ACK (Nagle) before every frame.
        """
        head = _FRAME_HEAD.pack(len(data))
        end = _FRAME_HEAD.size + len(data) + _TAG
        out[: _FRAME_HEAD.size] = head
        sealer = Cipher(self._send, modes.GCM(_nonce(self._sent))).encryptor()
        self._sent += 1
        sealer.authenticate_additional_data(head)
        sealer.update_into(data, out[_FRAME_HEAD.size : end - _TAG])
        sealer.finalize()
        out[end - _TAG : end] = sealer.tag
        return end

    def _head(self) -> int:
        (size,) = _FRAME_HEAD.unpack(_recv_exact(self._sock, _FRAME_HEAD.size, self.peer))
        return int(size)

    def _open(self, size: int, into: memoryview) -> None:
        """Receive a frame's ciphertext and tag, decrypt them into ``into`` and check the tag."""
        if len(self._scratch) < size + _TAG:
            self._scratch = bytearray(max(size, CHUNK) + _TAG)
        sealed = memoryview(self._scratch)[: size + _TAG]
        _recv_into(self._sock, sealed, self.peer)
        self._unseal(sealed, into)

    def _unseal(self, sealed: memoryview, into: memoryview) -> None:
        """Decrypt one received frame (ciphertext and tag) into ``into`` and check its tag."""
        size = len(sealed) - _TAG
        opener = Cipher(self._receive, modes.GCM(_nonce(self._received))).decryptor()
        self._received += 1
        opener.authenticate_additional_data(_FRAME_HEAD.pack(size))
        opener.update_into(sealed[:size], into)
        try:
            opener.finalize_with_tag(bytes(sealed[size:]))
        except InvalidTag:
            raise StreamError(
                f"a frame from {self.peer} does not authenticate: it was changed on the way or "
                "does not come from a holder of the job's key"
            ) from None


def _frames(views: Iterable[memoryview]) -> Iterator[memoryview]:
    """The bulk frames' plaintexts: each view in pieces of at most :data:`CHUNK` bytes."""
    for view in views:
        flat = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        for at in range(0, len(flat), CHUNK):
            yield flat[at : at + CHUNK]


def _buffers() -> list[memoryview]:
    return [memoryview(bytearray(_FRAME_HEAD.size + CHUNK + _TAG)) for _ in range(2)]


class _Pipeline:
    """Two frame buffers and a thread that writes the sealed ones in order while the caller seals the next."""

    def __init__(self, write: Callable[[memoryview], object], what: str) -> None:
        self._write = write
        self._what = what
        self._free: queue.Queue[memoryview] = queue.Queue()
        for buf in _buffers():
            self._free.put(buf)
        self._full: queue.Queue[tuple[memoryview, int] | None] = queue.Queue()
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="taskd-authstream-send", daemon=True)
        self._thread.start()

    def __enter__(self) -> _Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self._full.put(None)
        self._thread.join()
        self._raise()

    def free(self) -> memoryview:
        buf = self._free.get()
        self._raise()
        return buf

    def put(self, buf: memoryview, size: int) -> None:
        self._full.put((buf, size))

    def _raise(self) -> None:
        if self._error is not None:
            raise StreamError(f"{self._what} failed: {self._error}") from self._error

    def _run(self) -> None:
        while (item := self._full.get()) is not None:
            buf, size = item
            if self._error is None:
                try:
                    self._write(buf[:size])
                except OSError as exc:
                    self._error = exc
            self._free.put(buf)


class _Reader:
    """A thread that reads the frames of the given plaintext sizes into two buffers, one ahead."""

    def __init__(self, stream: Stream, sizes: list[int]) -> None:
        self._stream = stream
        self._sizes = sizes
        self._free: queue.Queue[memoryview | None] = queue.Queue()
        for buf in _buffers():
            self._free.put(buf)
        self._full: queue.Queue[tuple[memoryview, memoryview] | StreamError] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="taskd-authstream-receive", daemon=True)
        self._thread.start()

    def take(self) -> tuple[memoryview, memoryview]:
        """The next frame: its buffer and the frame's ciphertext and tag in it."""
        item = self._full.get()
        if isinstance(item, StreamError):
            raise item
        return item

    def release(self, buf: memoryview) -> None:
        self._free.put(buf)

    def close(self) -> None:
        self._free.put(None)  # ends a read loop that waits for a buffer
        self._thread.join()

    def _run(self) -> None:
        stream = self._stream
        for expected in self._sizes:
            buf = self._free.get()
            if buf is None:
                return
            try:
                size = stream._head()
                if size != expected:
                    raise StreamError(
                        f"{stream.peer} sent a {size}-byte frame where {expected} bytes were expected"
                    )
                sealed = buf[: size + _TAG]
                _recv_into(stream._sock, sealed, stream.peer)
            except StreamError as exc:
                self._full.put(exc)
                return
            self._full.put((buf, sealed))


def _nonce(number: int) -> bytes:
    return number.to_bytes(12, "big")


def _name(sockaddr: object) -> str:
    if isinstance(sockaddr, tuple) and len(sockaddr) >= 2:
        host, port = sockaddr[0], sockaddr[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(sockaddr)


def _recv_exact(sock: socket.socket, size: int, peer: str) -> bytes:
    buf = bytearray(size)
    _recv_into(sock, memoryview(buf), peer)
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview, peer: str) -> None:
    got = 0
    try:
        while got < len(view):
            n = sock.recv_into(view[got:])
            if n == 0:
                raise StreamError(f"{peer} closed the connection after {got} of {len(view)} bytes")
            got += n
    except OSError as exc:
        raise StreamError(f"receiving from {peer} failed: {exc}") from exc


def _session_keys(key: bytes, context: bytes, nc: bytes, ns: bytes) -> tuple[bytes, bytes]:
    """(server → client, client → server) keys of one session."""
    return _mac(key, b"server->client", context, nc, ns), _mac(key, b"client->server", context, nc, ns)


def connect(address: str, key: bytes, context: bytes, hello: bytes, timeout: float) -> Stream:
    """An authenticated stream to the listener at ``address`` (``host:port``), which must prove ``key``.

    :raises StreamError: when the listener cannot be reached, or does not prove the key within ``timeout``.
    """
    host, port = split_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise StreamError(f"cannot reach {address}: {exc}") from exc
    try:
        nc = os.urandom(_NONCE)
        sock.sendall(_HELLO_HEAD.pack(_MAGIC, nc, len(hello)) + hello)
        answer = _recv_exact(sock, _NONCE + _PROOF, address)
        ns, proof = answer[:_NONCE], answer[_NONCE:]
        if not hmac.compare_digest(proof, _mac(key, b"server", context, nc, ns, hello)):
            raise StreamError(
                f"{address} did not prove this job's key: it is not the process this job published "
                "(every node of the job must run with the same TASKD_JOB_TOKEN)"
            )
        sock.sendall(_mac(key, b"client", context, nc, ns, hello))
    except (OSError, StreamError) as exc:
        sock.close()
        if isinstance(exc, StreamError):
            raise
        raise StreamError(f"the handshake with {address} failed: {exc}") from exc
    to_client, to_server = _session_keys(key, context, nc, ns)
    return Stream(sock, to_server, to_client, hello)


class Listener:
    """Listens on ``host`` (port 0: any free one) and hands out only the clients that prove ``key``.

    :param hello_limit: longest hello a client may send.
    :param handshake_timeout: seconds each client has to complete its handshake.
    """

    def __init__(
        self,
        key: bytes,
        context: bytes,
        *,
        host: str,
        port: int = 0,
        hello_limit: int = 256,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
    ) -> None:
        self._key = key
        self._context = context
        self._hello_limit = hello_limit
        self._handshake_timeout = handshake_timeout
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._server = socket.create_server((host, port), family=family, backlog=MAX_PENDING)
        except OSError as exc:
            raise StreamError(f"cannot listen on {host}:{port}: {exc}") from exc
        self.address = _name(self._server.getsockname())
        self._ready: queue.Queue[Stream] = queue.Queue()
        self._pending = threading.BoundedSemaphore(MAX_PENDING)
        self._closed = threading.Event()
        #: clients refused so far (no or a wrong proof, silence, garbage), for the caller's messages.
        self.refused = 0
        self._count = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="taskd-authstream-accept", daemon=True)
        self._thread.start()

    def __enter__(self) -> Listener:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def accept(self, timeout: float) -> Stream:
        """The next client that proved the key; :class:`StreamError` when none did within ``timeout``."""
        try:
            return self._ready.get(timeout=max(0.0, timeout))
        except queue.Empty:
            raise StreamError(
                f"no client proved this job's key on {self.address} within {timeout:g}s "
                f"({self.refused} connection(s) refused)"
            ) from None

    def close(self) -> None:
        """Stop listening; streams already handed out stay open, those not taken are closed."""
        self._closed.set()
        try:
            # Wakes the accept() of the loop's thread (closing alone does not).
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()
        self._thread.join(timeout=5.0)
        while not self._ready.empty():
            self._ready.get_nowait().close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            if not self._pending.acquire(blocking=False):
                self._refuse(conn, "too many handshakes at once")
                continue
            threading.Thread(
                target=self._handshake, args=(conn,), name="taskd-authstream-handshake", daemon=True
            ).start()

    def _handshake(self, conn: socket.socket) -> None:
        peer = "a client"
        try:
            peer = _name(conn.getpeername())
            conn.settimeout(self._handshake_timeout)
            magic, nc, length = _HELLO_HEAD.unpack(_recv_exact(conn, _HELLO_HEAD.size, peer))
            if magic != _MAGIC:
                raise StreamError(f"{peer} does not speak this protocol (sent {magic!r})")
            if length > self._hello_limit:
                raise StreamError(f"{peer} announced a {length}-byte hello")
            hello = _recv_exact(conn, length, peer)
            ns = os.urandom(_NONCE)
            conn.sendall(ns + _mac(self._key, b"server", self._context, nc, ns, hello))
            proof = _recv_exact(conn, _PROOF, peer)
            if not hmac.compare_digest(proof, _mac(self._key, b"client", self._context, nc, ns, hello)):
                raise StreamError(f"{peer} did not prove this job's key")
        except (OSError, StreamError) as exc:
            self._refuse(conn, str(exc))
            return
        finally:
            self._pending.release()
        conn.settimeout(None)
        to_client, to_server = _session_keys(self._key, self._context, nc, ns)
        stream = Stream(conn, to_client, to_server, hello)
        if self._closed.is_set():
            stream.close()
        else:
            self._ready.put(stream)

    def _refuse(self, conn: socket.socket, why: str) -> None:
        with self._count:
            self.refused += 1
        logger.warning("refused a connection on %s: %s", self.address, why)
        conn.close()
