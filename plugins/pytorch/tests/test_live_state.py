"""Sending, checking and loading the state a live replica hands to a replacement (over real sockets)."""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import socket
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from taskd_pytorch.live._state import (
    StateTransferError,
    capture,
    check_registrable,
    checksum,
    fetch,
    prepare,
    recv_state,
    restore,
    send_state,
    serve,
    state_key,
)


def trained() -> tuple[nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
    return model, optimizer, [torch.arange(6, dtype=torch.int32).reshape(2, 3), torch.ones(2, dtype=torch.float64)]


def hand_over(
    tree: Any, local: Any, sender_key: bytes = b"", receiver_key: bytes = b"", sender_errors: list[Exception] | None = None
) -> Any:
    """``tree`` sent by one thread over a real TCP connection, received by this one into ``local``.

    What the sending side raised goes to ``sender_errors`` (when given, else it fails the test).
    """
    published: list[str] = []
    ready = threading.Event()
    errors: list[Exception] = [] if sender_errors is None else sender_errors

    def publish(at: str) -> None:
        published.append(at)
        ready.set()

    def send() -> None:
        try:
            serve(prepare(tree), 1, "127.0.0.1", publish, 30.0, sender_key)
        except StateTransferError as exc:
            errors.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert ready.wait(30)
        return fetch(published[0], 1, local, 30.0, receiver_key)
    finally:
        sender.join(30)
        assert sender_errors is not None or not errors


def test_a_fresh_replica_loads_exactly_what_a_trained_one_sent() -> None:
    model, optimizer, extra = trained()

    torch.manual_seed(2)
    fresh_model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    fresh_optimizer = torch.optim.SGD(fresh_model.parameters(), lr=0.5, momentum=0.9)  # no momentum buffers yet
    fresh_extra = [torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.float64)]
    state = {"model": fresh_model, "optimizer": fresh_optimizer, "extra": fresh_extra}
    weight = fresh_model[0].weight
    restore(state, hand_over(capture({"model": model, "optimizer": optimizer, "extra": extra}), capture(state)))

    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert fresh_model[0].weight is weight  # received into the module's own parameters
    assert fresh_optimizer.state_dict()["param_groups"][0]["lr"] == 0.1
    for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(optimizer.state[p]["momentum_buffer"], fresh_optimizer.state[q]["momentum_buffer"])
    assert all(torch.equal(a, b) for a, b in zip(extra, fresh_extra, strict=True))


def test_odd_sizes_and_dtypes_arrive_whole() -> None:
    tree = {"a": torch.arange(8193, dtype=torch.uint8), "b": torch.randn(3, 5).bfloat16(), "c": torch.tensor(True)}
    tree["d"] = torch.arange(100, dtype=torch.float32)[1::3]  # not contiguous, odd offset
    got = hand_over(tree, {"a": torch.zeros(8193, dtype=torch.uint8)})
    assert all(torch.equal(tree[k], got[k]) for k in tree)


def test_a_large_state_arrives_whole_into_the_receivers_own_tensors() -> None:
    """Large enough (24 MiB) that both sides sum the checksum beside the socket."""
    tree = [torch.randn(3 * 2**20), torch.arange(3 * 2**20, dtype=torch.float64)]
    mine = [torch.zeros(3 * 2**20), torch.zeros(3 * 2**20, dtype=torch.float64)]
    got = hand_over(tree, mine)
    assert all(g is not m and g.data_ptr() == m.data_ptr() for g, m in zip(got, mine, strict=True))
    assert all(torch.equal(t, m) for t, m in zip(tree, mine, strict=True))


def test_a_payload_damaged_on_the_wire_is_refused_and_the_sender_hears_of_it() -> None:
    tensor = torch.arange(10_000, dtype=torch.float32)
    sender_side, relay_in = socket.socketpair()
    relay_out, receiver_side = socket.socketpair()
    errors: list[BaseException] = []

    def send() -> None:
        try:
            send_state(prepare([tensor]), sender_side)
        except StateTransferError as exc:
            errors.append(exc)

    def relay() -> None:
        """Passes the rank up and everything down, with one bit of the payload's last byte flipped."""
        relay_out.settimeout(30)
        relay_in.settimeout(30)
        relay_in.sendall(relay_out.recv(20))  # rank and nonce
        data = bytearray()
        while len(data) < 24 or len(data) < 24 + sum(struct.unpack("!QQ", data[8:24])) + 32 + 16:
            data += relay_in.recv(65536)
        data[-17] ^= 1  # the payload's last byte, before the 16-byte checksum
        relay_out.sendall(data)
        relay_in.sendall(relay_out.recv(1) or b"\x00")  # the receiver's verdict, or nothing

    threads = [threading.Thread(target=send), threading.Thread(target=relay)]
    for t in threads:
        t.start()
    try:
        receiver_side.settimeout(30)
        with pytest.raises(StateTransferError, match="arrived damaged"):
            recv_state(receiver_side, 1, None)
        receiver_side.close()
    finally:
        for t in threads:
            t.join(30)
        for sock in (sender_side, relay_in, relay_out, receiver_side):
            sock.close()
    assert len(errors) == 1 and "rejected" in str(errors[0])


def test_an_unreachable_replica_is_a_clear_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    with pytest.raises(StateTransferError, match="cannot reach the replica"):
        fetch(f"127.0.0.1:{port}", 1, None, 5.0)


def test_a_replica_that_cannot_find_its_address_is_a_clear_error() -> None:
    with pytest.raises(StateTransferError, match="cannot listen for the state's receivers"):
        serve(prepare([torch.ones(1)]), 1, "no-such-host.invalid", lambda at: None, 5.0)


def test_the_checksum_sees_a_flipped_byte_and_a_shift() -> None:
    payload = torch.arange(10_000, dtype=torch.float32).view(torch.uint8)
    flipped, shifted = payload.clone(), torch.roll(payload, 8)
    flipped[1234] ^= 1
    assert checksum([flipped]) != checksum([payload])
    assert checksum([shifted]) != checksum([payload])


@pytest.mark.parametrize("value", [3, "text", [torch.ones(1), 2], {"a": torch.ones(1)}])
def test_only_state_that_loads_in_place_can_be_registered(value: object) -> None:
    with pytest.raises(TypeError, match="live state 'x'.*state_dict"):
        check_registrable("x", value)


class _RunsCode:
    """What a hostile skeleton would carry: unpickling it calls ``os.system``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def pose_as_replica(body: bytes, key: bytes) -> Any:
    """What ``recv_state`` makes of a process answering on the published address with ``body`` as skeleton."""
    server, client = socket.socketpair()

    def answer() -> None:
        server.settimeout(30)
        _, nonce = struct.unpack("!I16s", server.recv(20))
        header = struct.pack("!8sQQ", b"TASKDST1", len(body), 0)
        server.sendall(header + body + hmac.new(key, nonce + header + body, hashlib.sha256).digest())

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        client.settimeout(30)
        return recv_state(client, 1, None, state_key("the job's token"))
    finally:
        thread.join(30)
        server.close()
        client.close()


@pytest.mark.parametrize("skeleton", ["code", "garbage"])
def test_a_signed_skeleton_that_is_not_a_state_is_refused_and_runs_nothing(skeleton: str, tmp_path: Path) -> None:
    """Even a holder of the token (or anyone, in a job without one) cannot run code in a replacement."""
    marker = tmp_path / "ran"
    body = pickle.dumps([_RunsCode(marker)]) if skeleton == "code" else b"\x80\x05not a pickle"

    with pytest.raises(StateTransferError, match="does not load|not a TaskD state"):
        pose_as_replica(body, state_key("the job's token"))

    assert not marker.exists()


def test_a_skeleton_too_large_to_be_a_description_is_refused_before_it_is_read() -> None:
    server, client = socket.socketpair()
    try:
        server.sendall(struct.pack("!8sQQ", b"TASKDST1", 2**62, 0))
        client.settimeout(30)
        with pytest.raises(StateTransferError, match="announced a 4611686018427387904-byte skeleton"):
            recv_state(client, 1, None)
    finally:
        server.close()
        client.close()


def test_a_replica_without_the_jobs_token_is_refused_before_its_skeleton_is_read(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    with pytest.raises(StateTransferError, match="did not sign it with this job's key"):
        pose_as_replica(pickle.dumps([_RunsCode(marker)]), state_key("another token"))

    assert not marker.exists()


def test_replicas_of_one_job_sign_and_check_with_its_token() -> None:
    key = state_key("s3cret")
    assert torch.equal(hand_over([torch.arange(4)], None, key, key)[0], torch.arange(4))
    sender_errors: list[Exception] = []
    with pytest.raises(StateTransferError, match="did not sign"):
        hand_over([torch.arange(4)], None, state_key("other"), key, sender_errors)
    assert "the receiver is gone" in str(sender_errors[0])  # the replica hears of it at once
    assert state_key("") == b""  # a job without a token: the skeleton check still holds


def test_every_optimizer_and_scheduler_state_passes_the_skeleton_check() -> None:
    model, optimizer, _ = trained()
    adam = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    adam.step()
    schedulers = {
        "step": torch.optim.lr_scheduler.StepLR(optimizer, 3),
        "onecycle": torch.optim.lr_scheduler.OneCycleLR(adam, 1.0, total_steps=10),
        "plateau": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer),
    }
    state = {"model": model, "sgd": optimizer, "adam": adam, **schedulers}
    got = hand_over(capture(state), None)
    assert got["adam"]["param_groups"] == adam.state_dict()["param_groups"]
    assert got["onecycle"] == schedulers["onecycle"].state_dict()
