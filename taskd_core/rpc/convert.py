"""Conversion between protobuf messages and :mod:`taskd_core.models` values.

Parsing is strict: rank ids must be non-negative decimal strings and fault
types one of :class:`~taskd_core.models.FaultType`'s values; anything else raises
:class:`~taskd_core.errors.ProtocolError` naming the field, which the service
answers with ``Code.INVALID_PARAM`` and the client logs and skips.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from taskd_core.errors import ProtocolError
from taskd_core.models import FaultRank, FaultType, Signal, WorkerEvent, WorkerEventKind
from taskd_core.rpc._gen import recover_pb2 as pb

#: Largest rank id accepted; keeps int() of a hostile string cheap and bounded.
MAX_RANK = 10_000_000


#: Longest agent id, role, cycle uuid or strategy name accepted in a request.
MAX_NAME = 128


def check_name(text: str, field: str, limit: int = MAX_NAME) -> str:
    """A request's name field: printable (no control or escape characters) and at most ``limit`` long."""
    if len(text) > limit or not text.isprintable():
        raise ProtocolError(
            f"{field} must be printable and at most {limit} characters, got {text[:32]!r}"
            f"{'...' if len(text) > 32 else ''}",
            field=field,
        )
    return text


def parse_rank(text: str, *, field: str = "rankId") -> int:
    if not text or len(text) > 8 or not text.isdigit() or not text.isascii():
        raise ProtocolError(f"{field} must be a non-negative decimal string, got {text[:32]!r}", field=field)
    rank = int(text)
    if rank > MAX_RANK:
        raise ProtocolError(f"{field} {rank} is larger than {MAX_RANK}", field=field)
    return rank


def parse_fault_type(text: str) -> FaultType:
    try:
        return FaultType(text)
    except ValueError:
        raise ProtocolError(
            f"faultType must be one of {', '.join(repr(t.value) for t in FaultType)}, got {text[:32]!r}",
            field="faultType",
        ) from None


def fault_ranks_from_pb(items: Iterable[pb.FaultRank]) -> tuple[FaultRank, ...]:
    return tuple(FaultRank(parse_rank(i.rankId), parse_fault_type(i.faultType)) for i in items)


def fault_ranks_to_pb(faults: Iterable[FaultRank]) -> list[pb.FaultRank]:
    return [pb.FaultRank(rankId=str(f.rank), faultType=f.fault_type.value) for f in faults]


def _whole(value: object, field: str) -> str:
    """An ``int`` (not a bool) or a decimal string, as the decimal string the wire carries."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and value.strip().isdigit():
        return value.strip()
    raise ProtocolError(f"{field} must be a whole number, got {value!r:.40}", field=field)


def fault_dict_to_pb(fault_ranks: Mapping[int, int] | None) -> list[pb.FaultRank]:
    """The seed API's ``{global_rank: fault_type}`` dict as wire messages.

    :raises ProtocolError: for anything but a mapping of whole-number ranks to fault types.
    """
    if fault_ranks is None:
        return []
    if not isinstance(fault_ranks, Mapping):
        raise ProtocolError(
            f"fault_ranks must be a dict {{rank: fault_type}}, got {type(fault_ranks).__name__}",
            field="faultRanks",
        )
    out = []
    for rank, kind in fault_ranks.items():
        rank_id = str(parse_rank(_whole(rank, "rank")))
        out.append(pb.FaultRank(rankId=rank_id, faultType=parse_fault_type(_whole(kind, "faultType")).value))
    return out


def fault_codes_to_pb(fault_codes: Mapping[int, object] | None) -> dict[str, str]:
    """The seed API's ``fault_codes`` (``{rank: code}``) as the wire's ``faultCodes`` map.

    :raises ProtocolError: for anything but a mapping of whole-number ranks to codes.
    """
    if fault_codes is None:
        return {}
    if not isinstance(fault_codes, Mapping):
        raise ProtocolError(
            f"fault_codes must be a dict {{rank: code}}, got {type(fault_codes).__name__}", field="faultCodes"
        )
    return {
        str(parse_rank(_whole(rank, "rank"))): check_name(str(code), "fault code")
        for rank, code in fault_codes.items()
    }


def fault_dict(faults: Iterable[FaultRank]) -> dict[int, int]:
    """Wire fault ranks as the seed API's dict."""
    return {f.rank: int(f.fault_type.value) for f in faults}


def signal_from_pb(msg: pb.ProcessManageSignal) -> Signal:
    # Fields 8/9 and the extensions read as defaults from an older controller.
    return Signal(
        signal_type=msg.signalType,
        job_id=msg.jobId,
        uuid=msg.uuid,
        actions=tuple(msg.actions),
        fault_ranks=fault_ranks_from_pb(msg.faultRanks),
        change_strategy=msg.changeStrategy,
        timeout=msg.timeout,
        node_rank_ids=tuple(msg.nodeRankIds),
        extra_params=msg.extraParams,
        seq=msg.signalSeq,
        cycle=msg.cycle,
    )


def signal_to_pb(signal: Signal) -> pb.ProcessManageSignal:
    return pb.ProcessManageSignal(
        uuid=signal.uuid,
        jobId=signal.job_id,
        signalType=signal.signal_type,
        actions=list(signal.actions),
        faultRanks=fault_ranks_to_pb(signal.fault_ranks),
        changeStrategy=signal.change_strategy,
        timeout=signal.timeout,
        nodeRankIds=list(signal.node_rank_ids),
        extraParams=signal.extra_params,
        signalSeq=signal.seq,
        cycle=signal.cycle,
    )


def worker_event_to_pb(event: WorkerEvent) -> pb.WorkerEvent:
    return pb.WorkerEvent(
        kind=event.kind.value,
        rank=event.rank,
        localRank=event.local_rank,
        pid=event.pid,
        time=event.time,
        exitCode=event.exit_code,
        step=event.step,
    )


#: Worker events that are about a step, and must say which.
_STEP_KINDS = frozenset({WorkerEventKind.RESUMED, WorkerEventKind.STEPPING})


def worker_event_from_pb(msg: pb.WorkerEvent) -> WorkerEvent:
    """A reported worker event, checked; :class:`ProtocolError` names the bad field."""
    try:
        kind = WorkerEventKind(msg.kind)
    except ValueError:
        known = ", ".join(repr(k.value) for k in WorkerEventKind)
        raise ProtocolError(f"kind must be one of {known}, got {msg.kind[:32]!r}", field="kind") from None
    if not 0 <= msg.rank <= MAX_RANK:
        raise ProtocolError(f"rank must be in 0..{MAX_RANK}, got {msg.rank}", field="rank")
    if msg.pid < 0 or msg.localRank < 0:
        raise ProtocolError(f"pid and localRank must not be negative (pid {msg.pid})", field="pid")
    if not math.isfinite(msg.time) or msg.time < 0:
        raise ProtocolError(f"time must be Unix seconds, got {msg.time}", field="time")
    if msg.HasField("step") and msg.step < 0:
        raise ProtocolError(f"step must not be negative, got {msg.step}", field="step")
    if kind in _STEP_KINDS and not msg.HasField("step"):
        raise ProtocolError(f"a {kind.value!r} event needs its step", field="step")
    return WorkerEvent(
        kind=kind,
        rank=msg.rank,
        local_rank=msg.localRank,
        pid=msg.pid,
        time=msg.time,
        exit_code=msg.exitCode if msg.HasField("exitCode") else None,
        step=msg.step if msg.HasField("step") else None,
    )
