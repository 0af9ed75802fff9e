"""Conversion between protobuf messages and :mod:`taskd_core.models` values.

The status and journal answers (``QueryStatus``, ``QueryEvents``) convert
both ways here too: the controller builds :class:`~taskd_core.models.JobStatus`
values and sends them, the query client reads them back.

Parsing is strict: rank ids must be non-negative decimal strings and fault
types one of :class:`~taskd_core.models.FaultType`'s values; anything else raises
:class:`~taskd_core.errors.ProtocolError` naming the field, which the service
answers with ``Code.INVALID_PARAM`` and the client logs and skips.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

from taskd_core.errors import ProtocolError
from taskd_core.models import (
    AgentStatus,
    ControllerStatus,
    FaultRank,
    FaultType,
    JobState,
    JobStatus,
    JournalEvent,
    JournalPage,
    RankWork,
    Signal,
    SlowRankStatus,
    Strategy,
    WorkerEvent,
    WorkerEventKind,
)
from taskd_core.rpc._gen import recover_pb2 as pb

E = TypeVar("E", bound=enum.Enum)

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


def _enum(kind: type[E], text: str, field: str) -> E:
    """``text`` as a member of the enum ``kind``; :class:`ProtocolError` naming ``field`` otherwise."""
    try:
        return kind(text)
    except ValueError:
        known = ", ".join(repr(v.value) for v in kind)
        raise ProtocolError(f"{field} must be one of {known}, got {text[:32]!r}", field=field) from None


def parse_fault_type(text: str) -> FaultType:
    return _enum(FaultType, text, "faultType")


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
    kind = _enum(WorkerEventKind, msg.kind, "kind")
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


def rank_work_to_pb(work: RankWork) -> pb.RankWork:
    return pb.RankWork(rank=work.rank, pid=work.pid, step=work.step, steps=work.steps, busySeconds=work.busy)


def rank_work_from_pb(msg: pb.RankWork) -> RankWork:
    """A reported work sample, checked; :class:`ProtocolError` names the bad field."""
    if not 0 <= msg.rank <= MAX_RANK:
        raise ProtocolError(f"work: rank must be in 0..{MAX_RANK}, got {msg.rank}", field="rank")
    if msg.pid < 0 or msg.step < 0:
        raise ProtocolError(f"work: pid and step must not be negative (pid {msg.pid})", field="step")
    if msg.steps <= 0 or msg.steps > msg.step:
        raise ProtocolError(f"work: steps must be in 1..step ({msg.step}), got {msg.steps}", field="steps")
    if not math.isfinite(msg.busySeconds) or msg.busySeconds < 0:
        raise ProtocolError(
            f"work: busySeconds must be finite seconds >= 0, got {msg.busySeconds}", field="busySeconds"
        )
    return RankWork(msg.rank, msg.pid, msg.step, msg.steps, msg.busySeconds)


# --- status and journal answers ---------------------------------------------------------------


class JsonDetail(Mapping[str, Any]):
    """A journal entry's detail, kept as the JSON text it is stored and sent as and parsed on first use.

    The controller answers pages of up to 1000 entries on its event loop; passing
    their text through costs a fraction of parsing and writing it again. Text
    that is not a JSON object reads as ``{"text": <the text>}``.
    """

    __slots__ = ("_value", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self._value: dict[str, Any] | None = None

    def _parsed(self) -> dict[str, Any]:
        if self._value is None:
            try:
                value = json.loads(self.text) if self.text else {}
            except json.JSONDecodeError:
                value = None
            self._value = value if isinstance(value, dict) else {"text": self.text}
        return self._value

    def __getitem__(self, key: str) -> Any:
        return self._parsed()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._parsed())

    def __len__(self) -> int:
        return len(self._parsed())

    def __repr__(self) -> str:
        return repr(self._parsed())


def detail_of(text: str) -> Mapping[str, Any]:
    """A journal entry's detail (JSON text) as a mapping, parsed when first read."""
    return JsonDetail(text)


def journal_event_to_pb(event: JournalEvent) -> pb.EventView:
    detail = event.detail
    # sort_keys: the same text the controller's store keeps.
    text = detail.text if isinstance(detail, JsonDetail) else json.dumps(dict(detail), sort_keys=True)
    return pb.EventView(seq=event.seq, time=event.time, cycle=event.cycle, kind=event.kind, detail=text)


def journal_event_from_pb(job_id: str, view: pb.EventView) -> JournalEvent:
    return JournalEvent(view.seq, view.time, job_id, view.cycle, view.kind, detail_of(view.detail))


def journal_page_to_pb(page: JournalPage) -> pb.EventPage:
    return pb.EventPage(events=[journal_event_to_pb(e) for e in page.events], state=page.state.value)


def journal_page_from_pb(job_id: str, reply: pb.EventPage) -> JournalPage:
    """:class:`ProtocolError` for a state no TaskD controller sends."""
    events = tuple(journal_event_from_pb(job_id, v) for v in reply.events)
    return JournalPage(events, _enum(JobState, reply.state, "state"))


#: ``AgentView.exitState`` is ``"exited <code>"`` once the agent reported its end.
_EXITED = "exited "


def agent_status_to_pb(agent: AgentStatus) -> pb.AgentView:
    return pb.AgentView(
        agentId=agent.agent_id,
        role=agent.role,
        subscribed=agent.subscribed,
        nodeRank=-1 if agent.node_rank is None else agent.node_rank,
        exitState="" if agent.exit_code is None else f"{_EXITED}{agent.exit_code}",
        lastSeen=agent.last_seen,
        progress=agent.hang_timeouts,
    )


def agent_status_from_pb(view: pb.AgentView) -> AgentStatus:
    exit_code: int | None = None
    if view.exitState:
        code = view.exitState.removeprefix(_EXITED)
        if code == view.exitState or not code.lstrip("-").isdigit():
            raise ProtocolError(
                f"exitState must be empty or 'exited <code>', got {view.exitState[:32]!r}", field="exitState"
            )
        exit_code = int(code)
    return AgentStatus(
        agent_id=view.agentId,
        role=view.role,
        subscribed=view.subscribed,
        node_rank=None if view.nodeRank < 0 else view.nodeRank,
        exit_code=exit_code,
        last_seen=view.lastSeen,
        hang_timeouts=view.progress,
    )


def slow_rank_to_pb(slow: SlowRankStatus) -> pb.SlowRankView:
    return pb.SlowRankView(
        rank=slow.rank,
        pid=slow.pid,
        ratio=slow.ratio,
        workSeconds=slow.work,
        peerWorkSeconds=slow.peer_work,
        sinceStep=slow.since_step,
        since=slow.since,
    )


def slow_rank_from_pb(view: pb.SlowRankView) -> SlowRankStatus:
    return SlowRankStatus(
        rank=view.rank,
        pid=view.pid,
        ratio=view.ratio,
        work=view.workSeconds,
        peer_work=view.peerWorkSeconds,
        since_step=view.sinceStep,
        since=view.since,
    )


def job_status_to_pb(job: JobStatus) -> pb.JobView:
    return pb.JobView(
        jobId=job.job_id,
        state=job.state.value,
        cycle=job.cycle,
        strategy="" if job.strategy is None else job.strategy.value,
        faultRanks=fault_ranks_to_pb(job.faults),
        cyclesUsed=job.cycles_used,
        maxCycles=job.max_cycles,
        strategies=[s.value for s in job.strategies],
        agents=[agent_status_to_pb(a) for a in job.agents],
        events=[journal_event_to_pb(e) for e in job.events],
        outcome=job.outcome,
        legacy=job.legacy,
        slowRanks=[slow_rank_to_pb(r) for r in job.slow_ranks],
        slowRankBound=job.slow_rank_bound,
        slowRankBoundLearned=job.slow_rank_bound_learned,
    )


def job_status_from_pb(view: pb.JobView) -> JobStatus:
    """:class:`ProtocolError` names a field no TaskD controller would send so."""
    return JobStatus(
        job_id=view.jobId,
        state=_enum(JobState, view.state, "state"),
        cycle=view.cycle,
        strategy=_enum(Strategy, view.strategy, "strategy") if view.strategy else None,
        faults=fault_ranks_from_pb(view.faultRanks),
        strategies=tuple(_enum(Strategy, s, "strategies") for s in view.strategies),
        cycles_used=view.cyclesUsed,
        max_cycles=view.maxCycles,
        agents=tuple(agent_status_from_pb(a) for a in view.agents),
        events=tuple(journal_event_from_pb(view.jobId, e) for e in view.events),
        outcome=view.outcome,
        legacy=view.legacy,
        slow_ranks=tuple(slow_rank_from_pb(r) for r in view.slowRanks),
        slow_rank_bound=view.slowRankBound,
        slow_rank_bound_learned=view.slowRankBoundLearned,
    )


def controller_status_from_pb(reply: pb.ControllerStatus) -> ControllerStatus:
    return ControllerStatus(
        tuple(job_status_from_pb(j) for j in reply.jobs),
        leader=reply.leader,
        leader_generation=reply.leaderGeneration,
    )
