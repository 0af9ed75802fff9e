"""Packing, checking and loading the state a live replica hands to a replacement."""

from __future__ import annotations

import pytest
import torch
from taskd_pytorch.live._state import capture, check_registrable, checksum, pack, restore, unpack
from torch import nn


def trained() -> tuple[nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
    return model, optimizer, [torch.arange(6, dtype=torch.int32).reshape(2, 3), torch.ones(2, dtype=torch.float64)]


def test_a_fresh_replica_loads_exactly_what_a_trained_one_packed() -> None:
    model, optimizer, extra = trained()
    packed = pack(capture({"model": model, "optimizer": optimizer, "extra": extra}))

    torch.manual_seed(2)
    fresh_model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    fresh_optimizer = torch.optim.SGD(fresh_model.parameters(), lr=0.5, momentum=0.9)  # no momentum buffers yet
    fresh_extra = [torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.float64)]
    state = {"model": fresh_model, "optimizer": fresh_optimizer, "extra": fresh_extra}
    restore(state, unpack(packed.skeleton, packed.payload))

    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert fresh_optimizer.state_dict()["param_groups"][0]["lr"] == 0.1
    for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(optimizer.state[p]["momentum_buffer"], fresh_optimizer.state[q]["momentum_buffer"])
    assert all(torch.equal(a, b) for a, b in zip(extra, fresh_extra, strict=True))
    assert packed.checksum == checksum(packed.payload)


def test_the_checksum_sees_a_flipped_byte_and_a_shift() -> None:
    payload = pack([torch.arange(10_000, dtype=torch.float32)]).payload
    flipped, shifted = payload.clone(), torch.roll(payload, 8)
    flipped[1234] ^= 1
    assert checksum(flipped) != checksum(payload)
    assert checksum(shifted) != checksum(payload)


@pytest.mark.parametrize("value", [3, "text", [torch.ones(1), 2], {"a": torch.ones(1)}])
def test_only_state_that_loads_in_place_can_be_registered(value: object) -> None:
    with pytest.raises(TypeError, match="live state 'x'.*state_dict"):
        check_registrable("x", value)
