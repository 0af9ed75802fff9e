"""Strict parsing of wire values into TaskD's models."""

from __future__ import annotations

import pytest

from taskd_core.errors import ProtocolError
from taskd_core.models import EXTRA_RECOVER_IN_PLACE, FaultRank, FaultType, Signal, Strategy
from taskd_core.rpc import recover_pb2 as pb
from taskd_core.rpc.convert import fault_dict, fault_dict_to_pb, parse_rank, signal_from_pb, signal_to_pb


@pytest.mark.parametrize("text", ["", "abc", "-1", "1.5", " 1", "１", "123456789"])
def test_bad_rank_ids_are_rejected(text: str) -> None:
    with pytest.raises(ProtocolError, match="rankId"):
        parse_rank(text)


def test_bad_fault_type_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="faultType"):
        signal_from_pb(pb.ProcessManageSignal(faultRanks=[pb.FaultRank(rankId="1", faultType="7")]))


def test_signal_round_trip() -> None:
    signal = Signal(
        "changeStrategy", "job", "u", ("change_strategy", "fault_nodes_restart"),
        (FaultRank(3, FaultType.NORMAL),), "recover", 0, ("1",), EXTRA_RECOVER_IN_PLACE, 7, 2,
    )
    back = signal_from_pb(signal_to_pb(signal))
    assert back == signal
    assert back.strategy is Strategy.RECOVER_IN_PLACE


def test_fault_dict_round_trip() -> None:
    assert fault_dict([FaultRank(3, FaultType.NORMAL), FaultRank(1, FaultType.NETWORK)]) == {3: 1, 1: 2}
    wire = fault_dict_to_pb({5: 1, 2: 0})
    assert [(f.rankId, f.faultType) for f in wire] == [("5", "1"), ("2", "0")]
    with pytest.raises(ProtocolError):
        fault_dict_to_pb({1: 9})
