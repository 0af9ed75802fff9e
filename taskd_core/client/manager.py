"""``DLRecoverManager``: the client of the recovery controller (seed API).

It speaks the ClusterD ``Recover`` protocol, so it works against TaskD's
controller and a real ClusterD alike; TaskD's extension fields (agent id,
node rank, signal sequence numbers) are simply ignored by the latter.

Several controller replicas (``server_addr="A,B,C"`` or a list): the client
talks to one at a time and follows the leader (:mod:`taskd_core.client.endpoints`);
a fail-over looks like a controller outage: the stream comes back from the
new leader, reports wait and are sent again.

Threads: :meth:`start_subscribe` blocks the calling thread, reading the
signal stream and handing each signal, one at a time, to a handler: the one
given, or the one ``handler_factory`` builds for ``frame`` (the seed path
:mod:`taskd.python.toolkit.recover_module.recover_manager` builds the core's
action dispatcher over the adapter named ``frame``; this module does not know
the agent). A health-check thread runs beside it while subscribed. Reports may
be sent from any thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc

from taskd_core.client.backoff import Backoff
from taskd_core.client.endpoints import Endpoints, controller_addresses, from_standby
from taskd_core.errors import (
    AccessDeniedError,
    ConfigError,
    ControllerUnavailableError,
    ProtocolError,
    RecoveryDisabledError,
    RegistrationRefusedError,
    TaskdError,
)
from taskd_core.models import (
    PERMISSION_DENIED_INFO,
    Code,
    Credentials,
    RankWork,
    Signal,
    SignalType,
    WorkerEvent,
)
from taskd_core.rpc import recover_pb2 as pb
from taskd_core.rpc.convert import (
    fault_codes_to_pb,
    fault_dict_to_pb,
    rank_work_to_pb,
    signal_from_pb,
    worker_event_to_pb,
)

logger = logging.getLogger(__name__)

SignalHandler = Callable[[Signal], None]
#: Builds the signal handler for a ``frame`` (an adapter name), given the manager its actions report to.
HandlerFactory = Callable[[str, "DLRecoverManager"], SignalHandler]

#: The real clients ping every 3 s; the controller is configured to allow it.
#: gRPC's own reconnect backoff grows to 120 s by default, so after a long
#: outage the channel would not even try again before the connect deadline;
#: capping it at 1 s keeps every attempt of ours a real one.
_CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 3000),
    ("grpc.keepalive_timeout_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

#: Least seconds a HealthCheck may take before the client tries another replica.
HEALTH_DEADLINE = 2.0
#: How often the client asks the replica beside it (``leader_hint``) which replica leads.
HINT_POLL = 0.1

#: Least seconds between two tries of one controller replica (several given).
FOLLOW_INTERVAL = 0.2
#: Most seconds between tries while standby replicas answer (an election is under way): short,
#: because a new leader that loaded a job with a spare ready gives its nodes only
#: ``runtime.TAKEOVER_GRACE`` to subscribe again; a refusal costs a standby next to nothing.
FOLLOW_CAP = 0.25

#: Answers meaning "this controller does not know the job or agent" (it lost
#: its state, or restarted without any): joining again fixes them.
_REJOIN_CODES = frozenset({Code.UNREGISTERED, Code.JOB_NOT_EXIST, Code.UNINIT})
#: gRPC statuses no retry can fix: the controller refuses this client.
_REFUSING_STATUSES = frozenset(
    {
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)

# The seed's module-level report functions have no manager argument, so the
# open managers are tracked here; close() removes a manager again.
_active_lock = threading.Lock()
_active: list[DLRecoverManager] = []


def _brief(exc: BaseException | None) -> ConnectionError | None:
    """A gRPC error as one short line (its details run over several lines)."""
    if exc is None:
        return None
    details = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
    return ConnectionError((details or str(exc)).splitlines()[0][:200])


def active_manager() -> DLRecoverManager:
    """The most recently created, not yet closed manager (what the seed's module functions use)."""
    with _active_lock:
        if not _active:
            raise TaskdError("no DLRecoverManager is open; create one before calling the report_* functions")
        return _active[-1]


class DLRecoverManager:
    """Client of one job's recovery controller.

    :param info: ``info.jobId`` is the job, ``info.role`` this client's role.
    :param server_addr: ``HOST:PORT`` of the controller; several replicas as
        ``"A,B,C"`` or a sequence (TaskD extension): the client follows the leader.
    :param agent_id: TaskD extension: distinguishes the agents of a job with
        several nodes; empty for a single legacy-style client.
    :param handler: what to do with each signal.
    :param handler_factory: without ``handler``, builds it for the ``frame``
        given to :meth:`start_subscribe`.
    :param connect_deadline: seconds :meth:`init_clusterd` keeps retrying.
    :param report_deadline: seconds a report keeps retrying while the
        controller is unreachable (for example while it restarts).
    :param credentials: TLS files and the job token; by default from
        ``TASKD_TLS_CA``/``TASKD_TLS_CERT``/``TASKD_TLS_KEY``/``TASKD_JOB_TOKEN``.
    :param health_note: TaskD extension: a line every HealthCheck carries
        (the agent's hang timeouts, which ``taskd status`` shows).
    :param leader_hint: TaskD extension: the leading replica's address as a
        controller replica in this process knows it ("" unknown); the client
        follows it within :data:`HINT_POLL` seconds, its signal stream too.
    """

    def __init__(
        self,
        info: pb.ClientInfo,
        server_addr: str | Sequence[str],
        *,
        agent_id: str = "",
        node_rank: int = 0,
        rank_ids: Sequence[int] = (),
        handler: SignalHandler | None = None,
        handler_factory: HandlerFactory | None = None,
        connect_deadline: float = 300.0,
        report_deadline: float = 60.0,
        rpc_timeout: float = 10.0,
        health_interval: float = 1.0,
        backoff: Backoff | None = None,
        credentials: Credentials | None = None,
        health_note: Callable[[], str] | None = None,
        leader_hint: Callable[[], str] | None = None,
    ) -> None:
        if not info.jobId:
            raise TaskdError("DLRecoverManager needs info.jobId: the job to recover")
        self.job_id = info.jobId
        self.role = info.role or "taskd agent"
        self._endpoints = Endpoints(
            controller_addresses(server_addr),
            credentials or Credentials.from_env(os.environ),
            _CHANNEL_OPTIONS,
        )
        #: every address given, comma-separated (the seed's attribute; messages name it).
        self.server_addr = str(self._endpoints)
        self.agent_id = agent_id
        self.node_rank = node_rank
        self.rank_ids = tuple(rank_ids)
        self._handler = handler
        self._handler_factory = handler_factory
        self._connect_deadline = connect_deadline
        self._report_deadline = report_deadline
        #: False once the controller turned out not to have ReportWorkerEvents.
        self._worker_events = True
        self._rpc_timeout = rpc_timeout
        self._health_interval = health_interval
        self._health_note = health_note
        self._leader_hint = leader_hint
        self._backoff = backoff or Backoff()
        self._closed = threading.Event()
        self._killed = threading.Event()
        self._health_stop = threading.Event()
        self._stream: Any = None
        #: the replica the signal stream is with (while there is one).
        self._stream_address = ""
        self._stream_lock = threading.Lock()
        self._last_seq = 0
        self._last_uuid = ""
        #: uuid of the cycle whose signal is being handled; reports carry it.
        self.cycle_uuid = ""
        with _active_lock:
            _active.append(self)

    @classmethod
    def for_job(
        cls, job_id: str, server_addr: str | Sequence[str], *, role: str = "taskd agent", **kwargs: Any
    ) -> DLRecoverManager:
        """A manager for ``job_id`` without building a ``pb.ClientInfo`` (what the node agent uses)."""
        return cls(pb.ClientInfo(jobId=job_id, role=role), server_addr, **kwargs)

    # --- identity -----------------------------------------------------------

    def client_info(self) -> pb.ClientInfo:
        return pb.ClientInfo(
            jobId=self.job_id,
            role=self.role,
            agentId=self.agent_id,
            nodeRank=self.node_rank,
            rankIds=[str(r) for r in self.rank_ids],
        )

    @property
    def controller(self) -> str:
        """The controller replica this client talks to now."""
        return self._endpoints.current

    @property
    def killed(self) -> bool:
        """The controller sent ``killMaster``: the job was given up."""
        return self._killed.is_set()

    # --- set-up ---------------------------------------------------------------

    def init_clusterd(self, deadline: float | None = None) -> bool:
        """Initialise the job on the controller; False when it answers 403 (recovery off).

        Retries connection errors and transient answers with capped
        exponential backoff until ``deadline`` (a ``time.monotonic()`` value;
        default: the connect deadline from now), the last attempt landing on
        it. A refusal no retry can fix raises at once.

        :raises ControllerUnavailableError: nothing answered before the deadline.
        :raises RegistrationRefusedError: 409 (bad job id), 500 (controller
            full) or a permission error.
        """
        started = time.monotonic()
        until = started + self._connect_deadline if deadline is None else deadline
        attempt = 0
        last: BaseException | None = None
        while True:
            address, stub = self._endpoints.pick()
            try:
                # wait_for_ready: an attempt waits for the channel to connect instead of failing
                # at once between reconnects; with several replicas, failing at once moves on.
                status = stub.Init(
                    self.client_info(),
                    timeout=self._attempt_timeout(until),
                    wait_for_ready=not self._endpoints.several,
                )
                if status.code == Code.OK:
                    return True
                if status.code == Code.FORBIDDEN and PERMISSION_DENIED_INFO in status.info:
                    raise AccessDeniedError(address, status.info)
                if status.code == Code.RECOVERY_OFF:
                    logger.warning(
                        "controller %s: recovery is off for job %s: %s",
                        address,
                        self.job_id,
                        status.info,
                    )
                    return False
                if status.code in (Code.INVALID_PARAM, Code.OUT_OF_MAX_JOBS):
                    raise RegistrationRefusedError(address, "Init", int(status.code), status.info)
                logger.warning(
                    "Init of job %s answered %s (%s); retrying", self.job_id, status.code, status.info
                )
            except grpc.RpcError as exc:
                self._raise_if_refused(exc, "Init", address)
                last = exc
                logger.debug("Init of job %s failed: %s", self.job_id, exc)
                self._endpoints.failed(exc, address)
            if not self._pause(attempt, until, last, address):
                raise ControllerUnavailableError(self.server_addr, until - started, _brief(last))
            attempt += 1

    def _attempt_timeout(self, until: float) -> float:
        # At least a short try even at the deadline, so the last attempt is a real one.
        return max(0.5, min(self._rpc_timeout, until - time.monotonic()))

    def _raise_if_refused(self, exc: grpc.RpcError, rpc: str, address: str) -> None:
        if exc.code() in _REFUSING_STATUSES:
            raise RegistrationRefusedError(address, rpc, exc.code().name, exc.details() or "") from None

    def _pause(self, attempt: int, until: float, last: BaseException | None, address: str) -> bool:
        """Wait before try ``attempt`` (``last`` failed at ``address``); False once ``until`` passed."""
        remaining = until - time.monotonic()
        return remaining > 0 and not self._closed.wait(min(self._delay(attempt, last, address), remaining))

    def _delay(self, attempt: int, last: BaseException | None, address: str) -> float:
        """Seconds before the next try.

        One controller: capped exponential backoff. Several replicas: a move to
        another one (or to the leader a standby named) is tried at once, no
        replica more often than every :data:`FOLLOW_INTERVAL`, backing off only
        after whole rounds failed; while standbys answer (an election is under
        way, a new leader serves within its lease) at most :data:`FOLLOW_CAP` apart.
        """
        endpoints = self._endpoints
        if not endpoints.several:
            return self._backoff.delay(attempt)
        pace = endpoints.pace(FOLLOW_INTERVAL)
        if isinstance(last, grpc.RpcError) and from_standby(last):
            return max(pace, min(self._backoff.delay(attempt), FOLLOW_CAP))
        if endpoints.current != address:
            rounds = attempt // len(endpoints.addresses)
            return max(pace, self._backoff.delay(rounds - 1) if rounds else 0.0)
        return self._backoff.delay(attempt)

    def rejoin(self, deadline: float | None = None) -> None:
        """Init and Register again: what a controller that lost (or never had) the job needs.

        :raises RecoveryDisabledError: the controller now answers 403.
        :raises RegistrationRefusedError: it refuses this client.
        :raises ControllerUnavailableError: it did not answer before ``deadline``.
        """
        started = time.monotonic()
        until = started + self._connect_deadline if deadline is None else deadline
        attempt = 0
        while True:
            if not self.init_clusterd(until):
                raise RecoveryDisabledError(self.job_id)
            address = self._endpoints.current
            try:
                status = self.register()
                break
            except grpc.RpcError as exc:
                # The controller went between the two calls (a fail-over, a restart): join again.
                self._raise_if_refused(exc, "Register", address)
                self._endpoints.failed(exc, address)
                if not self._pause(attempt, until, exc, address):
                    raise ControllerUnavailableError(address, until - started, _brief(exc)) from None
                attempt += 1
        if status.code == Code.FORBIDDEN and PERMISSION_DENIED_INFO in status.info:
            raise AccessDeniedError(address, status.info)
        if status.code != Code.OK:
            raise RegistrationRefusedError(address, "Register", int(status.code), status.info)

    def register(self, request: pb.ClientInfo | None = None) -> pb.Status:
        """Register this client for its job; ``Status.code`` 0 is success.

        A ``request`` may change the role, never the job: a different
        ``jobId`` is answered with :attr:`Code.INVALID_PARAM` and nothing is sent.
        """
        info = self.client_info()
        if request is not None:
            if request.jobId and request.jobId != self.job_id:
                refusal = (
                    f"register: this manager serves job {self.job_id!r}, not {request.jobId!r}; "
                    "create a DLRecoverManager for that job instead"
                )
                logger.error("%s", refusal)
                return pb.Status(code=Code.INVALID_PARAM, info=refusal)
            info.role = request.role or info.role
        status: pb.Status = self._endpoints.pick()[1].Register(info, timeout=self._rpc_timeout)
        return status

    # --- the signal stream ------------------------------------------------------

    def start_subscribe(self, frame: str = "pytorch") -> None:
        """Follow the controller's signals and act on them until ``killMaster`` or :meth:`close`.

        A lost stream is re-established (Init, Register, Subscribe again);
        a signal already executed (same sequence number) is not executed twice.
        """
        handler = self._handler_for(frame)
        logger.info("job %s follows the controller's signals for frame %s", self.job_id, frame)
        self._health_stop.clear()
        loops = [threading.Thread(target=self._health_loop, name=f"taskd-health-{self.job_id}", daemon=True)]
        if self._leader_hint is not None:
            name = f"taskd-follow-{self.job_id}"
            loops.append(threading.Thread(target=self._follow_loop, name=name, daemon=True))
        for loop in loops:
            loop.start()
        try:
            self._subscribe_loop(handler)
        finally:
            self._health_stop.set()
            for loop in loops:
                loop.join(timeout=self._rpc_timeout + self._health_interval)

    def _handler_for(self, frame: str) -> SignalHandler:
        if self._handler is not None:
            return self._handler
        if self._handler_factory is None:
            raise ConfigError(
                f"DLRecoverManager of job {self.job_id!r} has no signal handler for frame {frame!r}: pass "
                "handler= or handler_factory=, or use taskd.python.toolkit.recover_module.recover_manager"
            )
        return self._handler_factory(frame, self)

    def _subscribe_loop(self, handler: SignalHandler) -> None:
        attempt = 0
        # The outage clock starts when the stream is lost, so the job rides out
        # exactly the connect deadline, however the time splits into attempts.
        lost_since = time.monotonic()
        while not self._closed.is_set():
            failure: BaseException | None = None
            address = self._endpoints.current
            try:
                self.rejoin(lost_since + self._connect_deadline)
                address, stub = self._endpoints.pick()
                stream = stub.SubscribeProcessManageSignal(self.client_info())
                with self._stream_lock:
                    self._stream, self._stream_address = stream, address
                if self._closed.is_set():
                    stream.cancel()
                # TaskD's controller answers with its headers once it took the stream; others at
                # their first signal. Until then a refusal may still come (raised below).
                stream.initial_metadata()
                if attempt:
                    logger.info("job %s follows the signals of controller %s again", self.job_id, address)
                    attempt = 0
                for message in stream:
                    attempt = 0
                    if self._on_message(message, handler):
                        return
                logger.info("controller ended the signal stream of job %s; subscribing again", self.job_id)
            except grpc.RpcError as exc:
                if self._closed.is_set():
                    return
                self._raise_if_refused(exc, "SubscribeProcessManageSignal", address)
                logger.warning("signal stream of job %s lost: %s %s", self.job_id, exc.code(), exc.details())
                self._endpoints.failed(exc, address)
                failure = exc
            except ControllerUnavailableError as exc:
                if self._closed.is_set():
                    return
                # The figure the user configured, which is how long the outage was ridden out.
                raise ControllerUnavailableError(
                    self.server_addr, self._connect_deadline, exc.cause
                ) from None
            finally:
                with self._stream_lock:
                    self._stream, self._stream_address = None, ""
            if attempt == 0:
                lost_since = time.monotonic()
            # Not bounded by the deadline: rejoin() enforces it, and a controller
            # that answers but refuses the stream (ALREADY_EXISTS) must not be hammered.
            self._closed.wait(self._delay(attempt, failure, address))
            attempt += 1

    def _on_message(self, message: pb.ProcessManageSignal, handler: SignalHandler) -> bool:
        """Handle one streamed signal; True when the subscription should end."""
        try:
            signal = signal_from_pb(message)
        except ProtocolError as exc:
            logger.error("ignoring malformed signal from the controller: %s", exc)
            return False
        if signal.job_id and signal.job_id != self.job_id:
            logger.warning("ignoring signal for job %s on the stream of job %s", signal.job_id, self.job_id)
            return False
        if signal.signal_type == SignalType.KEEP_ALIVE:
            return False
        # A controller that restarted without its state numbers from 1 again,
        # but always in a new cycle (uuid): only the same cycle's numbers repeat.
        if signal.seq and signal.uuid == self._last_uuid and signal.seq <= self._last_seq:
            logger.info("signal %s #%s already executed; skipped", signal.signal_type, signal.seq)
            return False
        kill = signal.signal_type == SignalType.KILL_MASTER
        if not kill and not signal.actions:
            return False
        self._last_seq, self._last_uuid = signal.seq, signal.uuid
        self.cycle_uuid = signal.uuid
        logger.info(
            "job %s signal %s actions=%s strategy=%s faults=%s",
            self.job_id,
            signal.signal_type,
            list(signal.actions),
            signal.change_strategy,
            [f.rank for f in signal.fault_ranks],
        )
        try:
            handler(signal)
        except Exception:  # a failed action is reported by the handler; the stream must go on
            logger.exception("handling signal %s of job %s failed", signal.signal_type, self.job_id)
        if kill:
            self._killed.set()
        return kill

    def health_check(self) -> None:
        """One HealthCheck: the controller hears from this client (raises ``grpc.RpcError``).

        A failed one moves the client on to another replica (or the leader a standby named), so
        that the next one, and every other call, goes there.
        """
        info = self.client_info()
        if self._health_note is not None:
            info.progress = self._health_note()
        address, stub = self._endpoints.pick()
        try:
            # Bounded by the beat: a replica that cannot answer within it is as good as gone for this
            # client, which then tries another (a hung leader would otherwise hold it for rpc_timeout).
            deadline = min(self._rpc_timeout, max(HEALTH_DEADLINE, 2 * self._health_interval))
            stub.HealthCheck(info, timeout=deadline)
        except grpc.RpcError as exc:
            self._endpoints.failed(exc, address)
            raise

    def _follow_leader(self) -> None:
        """Move to the leader the replica beside this client names, and end a stream held elsewhere.

        A leader that hangs (SIGSTOP, a partition) keeps its streams open: without this the
        client would notice only when its calls time out, long after a new leader, which
        expects the job's agents to subscribe within seconds, took over.
        """
        leader = self._leader_hint() if self._leader_hint is not None else ""
        if not leader or not self._endpoints.follow(leader):
            return
        with self._stream_lock:
            stream = self._stream if self._stream_address not in ("", leader) else None
        if stream is not None:
            logger.info("job %s: the leader is %s now; subscribing there", self.job_id, leader)
            stream.cancel()

    def _follow_loop(self) -> None:
        while not self._health_stop.wait(HINT_POLL) and not self._closed.is_set():
            self._follow_leader()

    def _health_loop(self) -> None:
        healthy = True
        while not self._health_stop.wait(self._health_interval) and not self._closed.is_set():
            address = self._endpoints.current
            try:
                self.health_check()
                if not healthy:
                    logger.info("controller %s answers again", address)
                healthy = True
            except grpc.RpcError as exc:
                if healthy:
                    logger.warning("controller %s health check failed: %s", address, exc.code())
                healthy = False

    # --- reports ------------------------------------------------------------------

    def _report(self, name: str, request: Any, deadline: float | None = None) -> int:
        """Send report ``name`` (the RPC) until the controller takes it or the report deadline passes.

        A controller that does not know the job or agent (it restarted
        without its state) is joined again (Init, Register) and the report
        re-sent; any other refusal is re-sent once after re-registering, as
        the reference does. Connection errors are retried with backoff, so a
        report survives a controller restart (or a fail-over: a standby's
        refusal sends it to the leader at once). Returns the last code: 0 when
        taken, else why not (599 when the controller stayed unreachable).
        """
        patience = self._report_deadline if deadline is None else deadline
        until = time.monotonic() + patience
        attempt = 0
        code: int = Code.SERVER_INNER_ERROR
        info = f"controller unreachable for {round(patience, 1):g} s"
        retried_other = False
        last: BaseException | None = None
        while True:
            address, stub = self._endpoints.pick()
            try:
                status = getattr(stub, name)(request, timeout=self._attempt_timeout(until))
                code, info = int(status.code), status.info
                if status.code == Code.OK:
                    return 0
                if status.code not in _REJOIN_CODES:
                    if retried_other:
                        break
                    retried_other = True
                logger.info(
                    "%s for job %s answered %s (%s); joining again",
                    name,
                    self.job_id,
                    status.code,
                    status.info,
                )
                self.rejoin(until)
                continue
            except grpc.RpcError as exc:
                last = exc
                logger.warning("%s for job %s failed: %s", name, self.job_id, exc.code())
                code, info = (
                    Code.SERVER_INNER_ERROR,
                    f"controller unreachable for {round(patience, 1):g} s ({_brief(exc)})",
                )
                self._endpoints.failed(exc, address)
            except TaskdError as exc:  # joining again failed: the report cannot be taken now
                code, info = Code.SERVER_INNER_ERROR, str(exc)
                last = exc
            if not self._pause(attempt, until, last, address):
                break
            attempt += 1
        logger.error("%s for job %s not taken: %s (code %s)", name, self.job_id, info, int(code))
        return int(code)

    def _faults(self, name: str, fault_ranks: Mapping[int, int]) -> list[pb.FaultRank] | None:
        """``fault_ranks`` for the wire; None (logged) when a caller's dict cannot be sent.

        The seed API answers a bad argument with a non-zero code, never an exception.
        """
        try:
            return fault_dict_to_pb(fault_ranks)
        except ProtocolError as exc:
            logger.error("%s for job %s not sent: %s", name, self.job_id, exc)
            return None

    def report_stop_complete(self, code: int, msg: str, fault_ranks: Mapping[int, int]) -> int:
        """Workers are stopped (``code`` 0) or could not be (non-zero); 409 for bad ``fault_ranks``."""
        faults = self._faults("ReportStopComplete", fault_ranks)
        if faults is None:
            return int(Code.INVALID_PARAM)
        req = pb.StopCompleteRequest(
            jobId=self.job_id,
            status=pb.Status(code=code, info=msg),
            faultRanks=faults,
            agentId=self.agent_id,
            uuid=self.cycle_uuid,
        )
        return self._report("ReportStopComplete", req)

    def report_recover_strategy(self, fault_ranks: Mapping[int, int], strategy_list: Iterable[str]) -> int:
        """The strategies this client can carry out; 409 for bad ``fault_ranks``."""
        faults = self._faults("ReportRecoverStrategy", fault_ranks)
        if faults is None:
            return int(Code.INVALID_PARAM)
        req = pb.RecoverStrategyRequest(
            jobId=self.job_id,
            faultRanks=faults,
            strategies=[str(s) for s in strategy_list],
            agentId=self.agent_id,
            uuid=self.cycle_uuid,
        )
        return self._report("ReportRecoverStrategy", req)

    def report_recover_status(
        self, code: int, msg: str, fault_ranks: Mapping[int, int], strategy: str
    ) -> int:
        """Result of carrying out ``strategy`` (ranks in ``isolateRankIds``); 409 for bad ``fault_ranks``."""
        faults = self._faults("ReportRecoverStatus", fault_ranks)
        if faults is None:
            return int(Code.INVALID_PARAM)
        req = pb.RecoverStatusRequest(
            jobId=self.job_id,
            status=pb.Status(code=code, info=msg),
            strategy=strategy,
            isolateRankIds=[f.rankId for f in faults],
            agentId=self.agent_id,
            uuid=self.cycle_uuid,
        )
        return self._report("ReportRecoverStatus", req)

    def report_process_fault(
        self,
        fault_ranks: Mapping[int, int],
        fault_codes: Mapping[int, object] | None = None,
        *,
        detail: str = "",
        started_cycle: int | None = None,
    ) -> int:
        """Processes of the job failed: ``{global_rank: fault_type}``; 409 (logged) for bad arguments.

        :param fault_codes: the seed API's ``{global_rank: code}`` (MindIO's error
            codes, say); the controller keeps them in its journal with the fault.
        :param detail: TaskD extension: evidence the controller journals with the
            fault (a hung rank's stack), at most 64 KiB.
        :param started_cycle: TaskD extension: the recovery cycle that started the
            failed workers (0: the first start), so the controller can tell the end of
            an incarnation its cycle in flight already replaced from a new fault.
        """
        faults = self._faults("ReportProcessFault", fault_ranks)
        try:
            codes = fault_codes_to_pb(fault_codes)
        except ProtocolError as exc:
            logger.error("ReportProcessFault for job %s not sent: %s", self.job_id, exc)
            faults = None
        if faults is None:
            return int(Code.INVALID_PARAM)
        req = pb.ProcessFaultRequest(
            jobId=self.job_id,
            faultRanks=faults,
            agentId=self.agent_id,
            detail=detail,
            faultCodes=codes,
            startedCycle=started_cycle,
        )
        return self._report("ReportProcessFault", req)

    def report_agent_exit(self, code: int, msg: str, *, deadline: float | None = None) -> int:
        """TaskD extension: this agent's workers all ended (``code`` 0: all exited 0).

        :param deadline: seconds to keep retrying an unreachable controller
            (default: the manager's report deadline).
        """
        req = pb.AgentExitRequest(
            jobId=self.job_id, agentId=self.agent_id, role=self.role, status=pb.Status(code=code, info=msg)
        )
        return self._report("ReportAgentExit", req, deadline)

    def report_worker_events(self, events: Sequence[WorkerEvent], work: Sequence[RankWork] = ()) -> int:
        """TaskD extension: workers started, ended or resumed (journalled for timelines and metrics),
        and how long ranks worked per step (the controller's slow-rank detection).

        Best effort and never slow: one attempt with the RPC timeout; a
        controller without the RPC (a real ClusterD) is not asked again.
        """
        if not (events or work) or not self._worker_events:
            return int(Code.OK)
        req = pb.WorkerEventsRequest(
            jobId=self.job_id,
            agentId=self.agent_id,
            events=[worker_event_to_pb(e) for e in events],
            work=[rank_work_to_pb(w) for w in work],
        )
        address, stub = self._endpoints.pick()
        try:
            status = stub.ReportWorkerEvents(req, timeout=self._rpc_timeout)
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                logger.info("controller %s does not journal worker events; not sending them", address)
                self._worker_events = False
            else:
                logger.warning("ReportWorkerEvents for job %s failed: %s", self.job_id, exc.code())
                self._endpoints.failed(exc, address)
            return int(Code.SERVER_INNER_ERROR)
        if status.code != Code.OK:
            logger.warning(
                "ReportWorkerEvents for job %s answered %s: %s", self.job_id, status.code, status.info
            )
        return int(status.code)

    # --- shutdown ----------------------------------------------------------------------

    def abandon_retries(self) -> None:
        """Make every retry (connecting, reports) give up at its next wait; safe from a signal handler.

        For a caller that is stopping: a launcher told to stop while the
        controller cannot be reached must not wait out the connect deadline.
        """
        self._closed.set()

    def close(self) -> None:
        """End :meth:`start_subscribe`, stop the health thread and close the channel."""
        self._closed.set()
        self._health_stop.set()
        with self._stream_lock:
            if self._stream is not None:
                self._stream.cancel()
        with _active_lock:
            if self in _active:
                _active.remove(self)
        self._endpoints.close()

    def __enter__(self) -> DLRecoverManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
