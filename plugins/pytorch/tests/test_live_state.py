"""Sending, checking and loading the state a live replica hands to a replacement (over real sockets)."""

from __future__ import annotations

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

from taskd_core.authstream import Listener, verify
from taskd_core.errors import ConfigError, StreamError
from taskd_pytorch.live._state import (
    StateTransferError,
    capture,
    check_registrable,
    fetch,
    prepare,
    restore,
    serve,
    state_key,
)

KEY = state_key("the job's token")
CONTEXT = b"run\0taskd/live/0/1/"


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
    tree: Any,
    local: Any,
    sender_key: bytes = KEY,
    receiver_key: bytes = KEY,
    sender_errors: list[Exception] | None = None,
    receivers: tuple[int, ...] = (1,),
    timeout: float = 30.0,
) -> Any:
    """``tree`` served by one thread over a real TCP connection, fetched by this one into ``local`` as rank 1.

    What the serving side raised goes to ``sender_errors`` (when given, else it fails the test).
    """
    published: list[str] = []
    ready = threading.Event()
    errors: list[Exception] = [] if sender_errors is None else sender_errors

    def publish(at: str) -> None:
        published.append(at)
        ready.set()

    def send() -> None:
        try:
            serve(prepare(tree), receivers, "127.0.0.1", publish, timeout, sender_key, CONTEXT)
        except StateTransferError as exc:
            errors.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert ready.wait(30)
        address = verify(sender_key, CONTEXT, published[0])
        assert address is not None
        return fetch(address, 1, local, 30.0, receiver_key, CONTEXT)
    finally:
        sender.join(60)
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


def test_an_unreachable_replica_is_a_clear_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    with pytest.raises(StateTransferError, match="cannot reach the replica"):
        fetch(f"127.0.0.1:{port}", 1, None, 5.0, KEY, CONTEXT)


def test_a_replica_that_cannot_find_its_address_is_a_clear_error() -> None:
    with pytest.raises(StateTransferError, match="cannot listen for the state's receivers"):
        serve(prepare([torch.ones(1)]), [1], "no-such-host.invalid", lambda at: None, 5.0, KEY, CONTEXT)


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


def pose_as_replica(first_frame: bytes, key: bytes = KEY) -> Any:
    """What ``fetch`` makes of a holder of ``key`` that serves ``first_frame`` in place of a state's header."""
    with Listener(key, CONTEXT, host="127.0.0.1") as listener:

        def answer() -> None:
            try:
                with listener.accept(30 if key == KEY else 2) as stream:
                    stream.send(first_frame)
            except StreamError:
                pass  # the receiver hung up: what the test is about

        thread = threading.Thread(target=answer)
        thread.start()
        try:
            return fetch(listener.address, 1, None, 30.0, KEY, CONTEXT)
        finally:
            thread.join(30)


def state_frame(body: bytes, payload: int = 0) -> bytes:
    return struct.pack("!8sQQ", b"TASKDST2", len(body), payload) + body


@pytest.mark.parametrize("skeleton", ["code", "garbage"])
def test_a_skeleton_that_is_not_a_state_is_refused_and_runs_nothing(skeleton: str, tmp_path: Path) -> None:
    """Even a holder of the token cannot run code in a replacement."""
    marker = tmp_path / "ran"
    body = pickle.dumps([_RunsCode(marker)]) if skeleton == "code" else b"\x80\x05not a pickle"

    with pytest.raises(StateTransferError, match="does not load|not a TaskD state"):
        pose_as_replica(state_frame(body))

    assert not marker.exists()


def test_a_skeleton_too_large_to_be_a_description_is_refused_before_it_is_read() -> None:
    with pytest.raises(StateTransferError, match=r"announced a \d+-byte frame, more than"):
        pose_as_replica(state_frame(b"x" * (64 * 2**20 + 1)))


def test_a_replica_without_the_jobs_token_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    with pytest.raises(StateTransferError, match="did not prove this job's key"):
        pose_as_replica(state_frame(pickle.dumps([_RunsCode(tmp_path / "ran")])), state_key("another token"))
    assert not (tmp_path / "ran").exists()


def test_a_receiver_without_the_jobs_token_gets_nothing_and_the_replica_hears_of_it() -> None:
    sender_errors: list[Exception] = []
    with pytest.raises(StateTransferError, match="did not prove this job's key"):
        hand_over([torch.arange(4)], None, state_key("other"), KEY, sender_errors, timeout=2.0)
    assert "did not fetch the state" in str(sender_errors[0])  # its wait ran out: nobody proved the key


def test_a_job_without_a_token_has_no_key() -> None:
    with pytest.raises(ConfigError, match="TASKD_JOB_TOKEN"):
        state_key("")


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


def test_a_silent_first_connection_does_not_hold_the_replica() -> None:
    """Whoever connects first and says nothing (or anything) holds only itself: the replacement that proves
    the key is served at once, long before the silent one's handshake deadline or the replica's timeout."""
    published: list[str] = []
    ready = threading.Event()
    errors: list[Exception] = []
    tree = [torch.arange(1000)]

    def publish(at: str) -> None:
        published.append(at)
        ready.set()

    def send() -> None:
        try:
            serve(prepare(tree), [1], "127.0.0.1", publish, 600.0, KEY, CONTEXT)
        except StateTransferError as exc:
            errors.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    assert ready.wait(30)
    address = verify(KEY, CONTEXT, published[0])
    assert address is not None
    host, _, port = address.rpartition(":")
    silent = [socket.create_connection((host, int(port)), timeout=30) for _ in range(3)]
    try:
        got = fetch(address, 1, None, 30.0, KEY, CONTEXT)
        sender.join(30)  # served its one receiver: done, whatever the silent ones do
        assert not sender.is_alive() and not errors
        assert torch.equal(got[0], tree[0])
    finally:
        for sock in silent:
            sock.close()
        sender.join(30)
