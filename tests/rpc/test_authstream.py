"""The authenticated stream between a job's processes, over real loopback sockets."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from taskd_core.authstream import CHUNK, Listener, Stream, connect, sign, split_address, stream_key, verify
from taskd_core.errors import ConfigError, StreamError

KEY = stream_key("the job's token", "test")
CONTEXT = b"job/round 1"


@pytest.fixture
def listener() -> Iterator[Listener]:
    with Listener(KEY, CONTEXT, host="127.0.0.1", handshake_timeout=5.0) as it:
        yield it


def served(listener: Listener, work: Callable[[Stream], object]) -> tuple[threading.Thread, list[object]]:
    """Runs ``work`` on the listener's next authenticated stream in a thread; its result or error lands in the list."""
    out: list[object] = []

    def run() -> None:
        try:
            with listener.accept(30) as stream:
                out.append(work(stream))
        except StreamError as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_frames_and_buffers_arrive_whole_and_in_order(listener: Listener) -> None:
    payload = [memoryview(os.urandom(n)) for n in (0, 1, CHUNK - 1, CHUNK, 3 * CHUNK + 7)]

    def send(stream: Stream) -> bytes:
        stream.send(b"header")
        stream.send_buffers(payload)
        return stream.receive(16)

    thread, out = served(listener, send)
    with connect(listener.address, KEY, CONTEXT, b"rank 3", 30) as stream:
        assert stream.receive(16) == b"header"
        got = [bytearray(len(v)) for v in payload]
        stream.receive_into(memoryview(g) for g in got)
        stream.send(b"ok")
    thread.join(30)
    assert out == [b"ok"]
    assert [bytes(g) for g in got] == [bytes(v) for v in payload]


def test_the_server_sees_what_the_client_said_it_is(listener: Listener) -> None:
    thread, out = served(listener, lambda stream: stream.hello)
    connect(listener.address, KEY, CONTEXT, b"rank 3", 30).close()
    thread.join(30)
    assert out == [b"rank 3"]


def raw_client(address: str) -> socket.socket:
    return socket.create_connection(split_address(address), timeout=30)


def test_a_client_without_the_key_learns_nothing_and_is_refused(listener: Listener) -> None:
    secret = os.urandom(4096)
    thread, out = served(listener, lambda stream: stream.send(secret))
    with raw_client(listener.address) as sock:
        sock.sendall(b"TASKDAS1" + os.urandom(32) + b"\x00\x00")
        sock.sendall(os.urandom(32))  # a guessed proof
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert len(received) == 64  # the server's nonce and proof, nothing of the data
    with connect(listener.address, KEY, CONTEXT, b"", 30) as stream:  # one that proves the key is served
        assert stream.receive(4096) == secret
    thread.join(30)
    assert out == [None] and listener.refused == 1


def test_a_server_without_the_key_is_refused_before_anything_is_read() -> None:
    with Listener(stream_key("another token", "test"), CONTEXT, host="127.0.0.1") as impostor:
        with pytest.raises(StreamError, match="did not prove this job's key"):
            connect(impostor.address, KEY, CONTEXT, b"", 30)


def test_a_proof_of_another_context_does_not_verify() -> None:
    with Listener(KEY, b"job/round 2", host="127.0.0.1") as other_round:
        with pytest.raises(StreamError, match="did not prove"):
            connect(other_round.address, KEY, CONTEXT, b"", 30)


def test_silent_and_garbage_connections_hold_nobody(listener: Listener) -> None:
    thread, out = served(listener, lambda stream: stream.send(b"state"))
    silent = [raw_client(listener.address) for _ in range(3)]
    with raw_client(listener.address) as garbage:
        garbage.sendall(b"GET / HTTP/1.0\r\n\r\n")
        with connect(listener.address, KEY, CONTEXT, b"", 30) as stream:
            assert stream.receive(16) == b"state"
    thread.join(30)
    for sock in silent:
        sock.close()
    assert out == [None]


class Relay:
    """A man in the middle: passes bytes both ways, flipping one bit of the server's byte ``flip_at``."""

    def __init__(self, upstream: str, flip_at: int) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self._upstream = upstream
        self._flip_at = flip_at
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        client, _ = self.server.accept()
        with client, socket.create_connection(split_address(self._upstream)) as upstream:
            up = threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True)
            up.start()
            self._pipe(upstream, client, self._flip_at)
            up.join(30)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, flip_at: int | None) -> None:
        seen = 0
        try:
            while data := src.recv(65536):
                if flip_at is not None and seen <= flip_at < seen + len(data):
                    data = bytearray(data)
                    data[flip_at - seen] ^= 1
                seen += len(data)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self.server.close()
        self._thread.join(30)


@pytest.mark.parametrize("flip_at", [64 + 2, 64 + 4 + 100, 64 + 4 + 1000 + 16 + 4 + 5])
def test_a_byte_changed_on_the_way_fails_the_frame(listener: Listener, flip_at: int) -> None:
    """A relay that passes the handshake through (so both sides prove the key to each other) and
    changes one bit after it: in a frame's length, its first frame, its second frame."""
    thread, out = served(listener, lambda stream: (stream.send(b"a" * 1000), stream.send(b"b" * 10)))
    relay = Relay(listener.address, flip_at)
    try:
        with connect(relay.address, KEY, CONTEXT, b"", 30) as stream:
            with pytest.raises(StreamError, match="does not authenticate|frame|closed"):
                stream.receive(2000)
                stream.receive(2000)
    finally:
        thread.join(30)
        relay.close()


def test_signed_values_verify_only_with_the_key_and_the_context() -> None:
    signed = sign(KEY, CONTEXT, "10.0.0.1:4242")
    assert verify(KEY, CONTEXT, signed) == "10.0.0.1:4242"
    assert verify(KEY, b"job/round 2", signed) is None
    assert verify(stream_key("another token", "test"), CONTEXT, signed) is None
    assert verify(KEY, CONTEXT, "10.0.0.66:4242" + signed[len("10.0.0.1:4242") :]) is None
    assert verify(KEY, CONTEXT, "10.0.0.1:4242") is None


def test_no_token_no_key() -> None:
    with pytest.raises(ConfigError, match="TASKD_JOB_TOKEN"):
        stream_key("", "test")
    assert stream_key("a", "x") != stream_key("a", "y") != stream_key("b", "x")


def test_an_unreachable_listener_is_a_clear_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    with pytest.raises(StreamError, match="cannot reach"):
        connect(f"127.0.0.1:{port}", KEY, CONTEXT, b"", 5)
    with pytest.raises(StreamError, match="not an address"):
        connect("nowhere", KEY, CONTEXT, b"", 5)


def test_nobody_proving_the_key_in_time_is_a_clear_error(listener: Listener) -> None:
    with pytest.raises(StreamError, match=r"no client proved this job's key .* within 0.1s"):
        listener.accept(0.1)
