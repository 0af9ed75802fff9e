"""The ``Recover`` gRPC servicer: protobuf in, :mod:`taskd_core.models` values out.

This is the one place where refusals become wire answers: a
:class:`~taskd_core.errors.RequestRejected` becomes ``Status(code, info)`` for
unary RPCs and a gRPC status for the signal stream (see :func:`stream_status`);
a :class:`~taskd_core.errors.ProtocolError` or
:class:`~taskd_core.errors.ConfigError` from parsing becomes 409. A used-up
quota (:class:`~taskd_core.errors.QuotaExceededError`) ends any call with gRPC
``RESOURCE_EXHAUSTED``, its message naming the limit and its flag.

A replica that does not lead (:class:`~taskd_core.errors.NotLeaderError`)
answers every RPC with gRPC ``UNAVAILABLE``, the status every client already
retries, and names the leader in the trailing metadata
(:data:`~taskd_core.rpc.LEADER_METADATA`: ``HOST:PORT``, empty while no leader
is known): TaskD's client follows it, a reference client retries as for an outage.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import NoReturn, Protocol

import grpc

from taskd_core.controller.machine import Reply, StatusReported, StopReported, StrategiesReported
from taskd_core.controller.runtime import AgentIdentity, Controller, policy_changes
from taskd_core.errors import (
    ConfigError,
    DuplicateSubscriberError,
    NotLeaderError,
    ProtocolError,
    QuotaExceededError,
    RequestRejected,
    TaskdError,
)
from taskd_core.models import Code, FaultRank, Strategy
from taskd_core.rpc import LEADER_METADATA, recover_pb2_grpc
from taskd_core.rpc import recover_pb2 as pb
from taskd_core.rpc.convert import (
    check_name,
    fault_ranks_from_pb,
    job_status_to_pb,
    journal_page_to_pb,
    parse_rank,
    rank_work_from_pb,
    signal_to_pb,
    worker_event_from_pb,
)
from taskd_core.rpc.security import caller_of

logger = logging.getLogger(__name__)

#: Largest number of ranks (fault ranks, an agent's ranks) in one request.
MAX_RANKS = 65_536
#: Largest number of strategy names in one ReportRecoverStrategy or SetJobPolicy.
MAX_STRATEGIES = 64
#: Most journal entries one QueryStatus returns per job.
MAX_QUERY_EVENTS = 1000
#: Strategy names agents may report: TaskD's and the reference's (stored, never chosen).
KNOWN_STRATEGIES = frozenset(s.value for s in Strategy) | {
    "elastic-training",
    "downgrade",
    "upgrade",
    "migration",
    "continue",
}
#: Longest evidence kept with a fault (a hung rank's reason and stacks).
MAX_FAULT_DETAIL = 65_536
#: Longest progress line an agent's HealthCheck may carry.
MAX_PROGRESS = 1_000

_STREAM_STATUS = {
    Code.FORBIDDEN: grpc.StatusCode.PERMISSION_DENIED,
    # A fenced node may not act for the job any more: a client stops retrying on it.
    Code.NODE_REPLACED: grpc.StatusCode.PERMISSION_DENIED,
    Code.UNREGISTERED: grpc.StatusCode.NOT_FOUND,
    Code.UNINIT: grpc.StatusCode.FAILED_PRECONDITION,
    Code.INVALID_PARAM: grpc.StatusCode.INVALID_ARGUMENT,
}


def rejection(exc: TaskdError) -> Reply:
    """The ``Status`` for a refused request."""
    code = Code(exc.code) if isinstance(exc, RequestRejected) else Code.INVALID_PARAM
    return Reply(code, str(exc))


def stream_status(exc: TaskdError) -> grpc.StatusCode:
    """The gRPC status ending a refused ``SubscribeProcessManageSignal``.

    The reference answers an unregistered job with UNKNOWN; we use NOT_FOUND,
    which its clients treat the same way (log, wait, Init/Register again).
    """
    if isinstance(exc, DuplicateSubscriberError):
        return grpc.StatusCode.ALREADY_EXISTS
    return _STREAM_STATUS.get(rejection(exc).code, grpc.StatusCode.UNKNOWN)


class Leadership(Protocol):
    """Where requests go: the leading replica's controller, or a refusal naming the leader."""

    def controller(self) -> Controller:
        """:raises NotLeaderError: this replica does not lead now."""
        ...

    @property
    def leader(self) -> str: ...

    @property
    def generation(self) -> int: ...


async def not_leader(context: grpc.aio.ServicerContext, exc: NotLeaderError) -> NoReturn:
    """End the call with UNAVAILABLE, naming the leader where known (the client may follow it)."""
    # Always there, empty when no leader is known yet: it tells a client a replica answered.
    metadata = ((LEADER_METADATA, exc.leader),)
    await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc), trailing_metadata=metadata)
    raise AssertionError("abort() returned")  # it raises; this line keeps the type checker honest


async def exhausted(context: grpc.aio.ServicerContext, exc: QuotaExceededError) -> NoReturn:
    """End the call with RESOURCE_EXHAUSTED: the caller's tenant used up a quota."""
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    raise AssertionError("abort() returned")  # it raises; this line keeps the type checker honest


async def _answer(context: grpc.aio.ServicerContext, call: Callable[[], Awaitable[Reply]]) -> pb.Status:
    try:
        reply = await call()
    except NotLeaderError as exc:
        await not_leader(context, exc)
    except QuotaExceededError as exc:
        await exhausted(context, exc)
    except (RequestRejected, ProtocolError, ConfigError) as exc:
        reply = rejection(exc)
    except Exception:  # one bad request must not take the controller down
        logger.exception("request failed")
        reply = Reply(Code.SERVER_INNER_ERROR, "internal controller error; see the controller's log")
    return pb.Status(code=int(reply.code), info=reply.info)


def _ranks(items: Sequence[object], field: str) -> None:
    if len(items) > MAX_RANKS:
        raise ProtocolError(f"{field} has {len(items)} entries; at most {MAX_RANKS} per request", field=field)


def _faults(items: Sequence[pb.FaultRank]) -> tuple[FaultRank, ...]:
    _ranks(items, "faultRanks")
    return fault_ranks_from_pb(items)


def identity(info: pb.ClientInfo) -> AgentIdentity:
    _ranks(info.rankIds, "rankIds")
    ranks = tuple(parse_rank(r, field="rankIds") for r in info.rankIds)
    if info.nodeRank < 0:
        raise ProtocolError(f"nodeRank must be >= 0, got {info.nodeRank}", field="nodeRank")
    known = bool(ranks) or info.nodeRank != 0
    return AgentIdentity(
        info.jobId,
        check_name(info.role, "role"),
        check_name(info.agentId, "agentId"),
        info.nodeRank if known else None,
        ranks,
    )


def _strategies(names: Sequence[str]) -> tuple[str, ...]:
    if len(names) > MAX_STRATEGIES:
        raise ProtocolError(
            f"strategies has {len(names)} entries; at most {MAX_STRATEGIES}", field="strategies"
        )
    return tuple(_strategy(name, "strategies") for name in names)


def _strategy(name: str, field: str) -> str:
    if name not in KNOWN_STRATEGIES:
        raise ProtocolError(
            f"{field}: unknown strategy {name[:32]!r}; known: {', '.join(sorted(KNOWN_STRATEGIES))}",
            field=field,
        )
    return name


def _uuid(text: str) -> str:
    return check_name(text, "uuid")


def _agent(agent_id: str) -> str:
    return check_name(agent_id, "agentId")


# protoc generates the servicer base without annotations, so the checker sees Any.
class RecoverService(recover_pb2_grpc.RecoverServicer):  # type: ignore[misc]
    """Thin adapter from the generated servicer to the leading replica's :class:`Controller`."""

    def __init__(self, leadership: Leadership) -> None:
        self._lead = leadership

    async def Init(self, request: pb.ClientInfo, context: grpc.aio.ServicerContext) -> pb.Status:
        caller = caller_of(context)
        return await _answer(context, lambda: self._lead.controller().init(identity(request), caller))

    async def Register(self, request: pb.ClientInfo, context: grpc.aio.ServicerContext) -> pb.Status:
        caller = caller_of(context)
        return await _answer(context, lambda: self._lead.controller().register(identity(request), caller))

    async def SubscribeProcessManageSignal(
        self, request: pb.ClientInfo, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessManageSignal]:
        try:
            ctl = self._lead.controller()
            sub = ctl.subscribe(identity(request), caller_of(context))
        except NotLeaderError as exc:
            await not_leader(context, exc)
        except QuotaExceededError as exc:
            await exhausted(context, exc)
        except (RequestRejected, ProtocolError) as exc:
            logger.warning("subscription refused: %s", exc)
            await context.abort(stream_status(exc), str(exc))
            return
        try:
            # Headers now: the client knows its stream was taken before the first signal.
            await context.send_initial_metadata(())
            async for signal in sub.signals():
                yield signal_to_pb(signal)
        finally:
            # Runs on normal end, on the client's cancel and on a dropped connection alike.
            ctl.unsubscribe(sub)

    async def ReportStopComplete(
        self, request: pb.StopCompleteRequest, context: grpc.aio.ServicerContext
    ) -> pb.Status:
        caller = caller_of(context)

        async def call() -> Reply:
            _faults(request.faultRanks)
            uuid = _uuid(request.uuid)
            return await self._lead.controller().report(
                request.jobId,
                _agent(request.agentId),
                lambda a: StopReported(a, request.status.code, uuid),
                caller,
            )

        return await _answer(context, call)

    async def ReportRecoverStrategy(
        self, request: pb.RecoverStrategyRequest, context: grpc.aio.ServicerContext
    ) -> pb.Status:
        caller = caller_of(context)

        async def call() -> Reply:
            _faults(request.faultRanks)
            names = _strategies(request.strategies)
            uuid = _uuid(request.uuid)
            return await self._lead.controller().report(
                request.jobId, _agent(request.agentId), lambda a: StrategiesReported(a, names, uuid), caller
            )

        return await _answer(context, call)

    async def ReportRecoverStatus(
        self, request: pb.RecoverStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.Status:
        caller = caller_of(context)

        async def call() -> Reply:
            _ranks(request.isolateRankIds, "isolateRankIds")
            strategy = _strategy(request.strategy, "strategy") if request.strategy else ""
            uuid = _uuid(request.uuid)
            return await self._lead.controller().report(
                request.jobId,
                _agent(request.agentId),
                lambda a: StatusReported(a, request.status.code, strategy, uuid),
                caller,
            )

        return await _answer(context, call)

    async def ReportProcessFault(
        self, request: pb.ProcessFaultRequest, context: grpc.aio.ServicerContext
    ) -> pb.Status:
        caller = caller_of(context)

        async def call() -> Reply:
            faults = _faults(request.faultRanks)
            if not faults:
                raise ProtocolError(
                    "faultRanks is empty; report at least one faulty rank", field="faultRanks"
                )
            if len(request.detail) > MAX_FAULT_DETAIL:
                raise ProtocolError(
                    f"detail has {len(request.detail)} characters; at most {MAX_FAULT_DETAIL}", field="detail"
                )
            codes = tuple(
                (parse_rank(rank, field="faultCodes"), check_name(code, "faultCodes"))
                for rank, code in sorted(request.faultCodes.items())
            )
            if len(codes) > len(faults):
                raise ProtocolError(
                    f"faultCodes has {len(codes)} entries for {len(faults)} faulty ranks", field="faultCodes"
                )
            started = request.startedCycle if request.HasField("startedCycle") else None
            if started is not None and started < 0:
                raise ProtocolError(
                    f"startedCycle is {started}; a cycle number is 0 or more", field="startedCycle"
                )
            return await self._lead.controller().process_fault(
                request.jobId, _agent(request.agentId), faults, caller, request.detail, codes, started
            )

        return await _answer(context, call)

    async def HealthCheck(self, request: pb.ClientInfo, context: grpc.aio.ServicerContext) -> pb.Status:
        try:
            ctl = self._lead.controller()
        except NotLeaderError as exc:
            await not_leader(context, exc)
        caller = caller_of(context)
        try:
            if request.agentId or request.progress:
                agent = request.agentId or request.role
                ctl.health(request.jobId, agent, request.progress[:MAX_PROGRESS], caller)
            else:
                ctl.admit(caller)
        except QuotaExceededError as exc:
            await exhausted(context, exc)
        # The reference's text, typo included: clients may match on it.
        return pb.Status(code=Code.OK, info=f"jobId={request.jobId[:256]}, receive HeathCheck")

    async def ReportAgentExit(
        self, request: pb.AgentExitRequest, context: grpc.aio.ServicerContext
    ) -> pb.Status:
        caller = caller_of(context)

        async def call() -> Reply:
            who = AgentIdentity(request.jobId, check_name(request.role, "role"), _agent(request.agentId))
            return await self._lead.controller().agent_exit(who, request.status.code, caller)

        return await _answer(context, call)

    async def SetJobPolicy(
        self, request: pb.JobPolicyRequest, context: grpc.aio.ServicerContext
    ) -> pb.Status:
        caller = caller_of(context)

        async def call() -> Reply:
            has = request.HasField
            # A field left out keeps the job's value (proto3 optional).
            changes = policy_changes(
                _strategies(request.strategies),
                request.recoveryEnabled if has("recoveryEnabled") else None,
                request.reportTimeoutSeconds if has("reportTimeoutSeconds") else None,
                request.flushSeconds if has("flushSeconds") else None,
                request.maxCycles if has("maxCycles") else None,
                request.expectedAgents if has("expectedAgents") else None,
            )
            return await self._lead.controller().set_policy(request.jobId, changes, caller)

        return await _answer(context, call)

    async def QueryStatus(
        self, request: pb.StatusQuery, context: grpc.aio.ServicerContext
    ) -> pb.ControllerStatus:
        views: list[pb.JobView] = []
        caller = caller_of(context)

        async def call() -> Reply:
            if not 0 <= request.events <= MAX_QUERY_EVENTS:
                raise ProtocolError(
                    f"events must be 0..{MAX_QUERY_EVENTS}, got {request.events}", field="events"
                )
            jobs = await self._lead.controller().status(request.jobId, request.events, caller)
            views.extend(job_status_to_pb(j) for j in jobs)
            return Reply(Code.OK, f"{len(views)} job(s)")

        status = await _answer(context, call)
        return pb.ControllerStatus(
            status=status, jobs=views, leader=self._lead.leader, leaderGeneration=self._lead.generation
        )

    async def ReportWorkerEvents(
        self, request: pb.WorkerEventsRequest, context: grpc.aio.ServicerContext
    ) -> pb.Status:
        caller = caller_of(context)

        async def call() -> Reply:
            _ranks(request.events, "events")
            _ranks(request.work, "work")
            events = tuple(worker_event_from_pb(e) for e in request.events)
            work = tuple(rank_work_from_pb(w) for w in request.work)
            return await self._lead.controller().worker_events(
                request.jobId, _agent(request.agentId), events, caller, work
            )

        return await _answer(context, call)

    async def QueryEvents(self, request: pb.EventQuery, context: grpc.aio.ServicerContext) -> pb.EventPage:
        caller = caller_of(context)
        page = pb.EventPage()

        async def call() -> Reply:
            found = await self._lead.controller().events_after(
                request.jobId, request.afterSeq, request.limit, caller
            )
            page.MergeFrom(journal_page_to_pb(found))
            return Reply(Code.OK, f"{len(found.events)} event(s)")

        page.status.CopyFrom(await _answer(context, call))
        return page
