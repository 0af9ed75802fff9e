"""Prometheus metrics of the controller: what ``/metrics`` shows (docs/metrics.md lists them).

Two sources, so a scrape costs the same for 1 job as for 1000:

* counters and histograms move as the journal is written: :class:`ControllerMetrics`
  is the runtime's :class:`~taskd_core.controller.runtime.JournalObserver`, so every
  number agrees with the journal (faults, cycles, strategies, escalations, worker
  starts, kill → restart times...);
* gauges (jobs by state, agents, journal size) are read from the live controller
  at scrape time by :class:`_LiveCollector`, on the controller's event loop, which
  is the only thread that touches job state.

RPC counts and latencies come from :class:`RpcMetricsInterceptor`. Each
controller has its own :class:`~prometheus_client.CollectorRegistry`: no
module-global state, several controllers per process (tests) do not mix.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.server
import logging
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import Collector

from taskd_core.controller.machine import JournalEntry
from taskd_core.controller.runtime import ControllerGauges
from taskd_core.errors import ConfigError
from taskd_core.models import FaultType
from taskd_core.rpc.security import ServerTls
from taskd_core.values import cannot_bind

logger = logging.getLogger(__name__)

#: Recovery phases last from milliseconds (warm restarts) to minutes (cold restarts, deadlines).
_RECOVERY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)
_RPC_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.5)
#: Seconds a scrape waits for the event loop to read the gauges.
_READ_TIMEOUT = 5.0
#: Seconds a ``/metrics`` client has for its TLS handshake and for each read.
METRICS_IO_TIMEOUT = 5.0
#: Connections ``/metrics`` serves at once; more are closed at once (a scraper needs one).
METRICS_CONNECTIONS = 64
_FAULT_NAMES = {t.value: t.name.lower().replace("_", "-") for t in FaultType}


class ControllerMetrics:
    """The controller's metrics in their own registry; counters fed from the journal."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        self.rpcs = Counter(
            "taskd_rpc_requests", "RPCs answered, by method and Status code", ["method", "code"], registry=r
        )
        self.rpc_seconds = Histogram(
            "taskd_rpc_duration_seconds",
            "Time to answer an RPC",
            ["method"],
            buckets=_RPC_BUCKETS,
            registry=r,
        )
        self.faults = Counter(
            "taskd_faults", "Faulty ranks reported, by fault type", ["fault_type"], registry=r
        )
        self.cycles_started = Counter("taskd_recovery_cycles_started", "Recovery cycles started", registry=r)
        self.cycles = Counter(
            "taskd_recovery_cycles",
            "Recovery cycles ended, by the last strategy tried and outcome (recovered, given-up)",
            ["strategy", "outcome"],
            registry=r,
        )
        self.decisions = Counter(
            "taskd_strategy_decisions", "Strategies chosen by the controller", ["strategy"], registry=r
        )
        self.escalations = Counter(
            "taskd_escalations",
            "Strategies that failed, moving the job down the ladder",
            ["strategy"],
            registry=r,
        )
        self.given_up = Counter("taskd_jobs_given_up", "Jobs given up (killMaster sent)", registry=r)
        self.signals = Counter(
            "taskd_signals_sent", "Signals sent to jobs, by signal type", ["type"], registry=r
        )
        self.deadlines = Counter(
            "taskd_deadlines_passed", "Waits that ended at their deadline, by state", ["state"], registry=r
        )
        self.cycle_seconds = Histogram(
            "taskd_recovery_cycle_duration_seconds",
            "Cycle start (stopTrain) to its end",
            ["outcome"],
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.fault_to_strategy = Histogram(
            "taskd_fault_to_strategy_seconds",
            "First fault of a cycle to the controller's first strategy decision",
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.kill_to_restart = Histogram(
            "taskd_kill_to_restart_seconds",
            "A faulty worker's exit to its rank's next process start (agents' clocks)",
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.kill_to_resumed = Histogram(
            "taskd_kill_to_resumed_seconds",
            "A faulty worker's exit to its rank resuming training (progress-aware adapters only)",
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.worker_starts = Counter("taskd_worker_starts", "Worker processes started", registry=r)
        self.worker_exits = Counter(
            "taskd_worker_exits", "Worker processes ended, by outcome (ok, failed)", ["outcome"], registry=r
        )
        self.steps_lost = Counter(
            "taskd_steps_lost",
            "Training steps redone after faults: per recovery cycle, the most any rank lost "
            "(last step reached before it stopped - step resumed from; where workers report steps)",
            registry=r,
        )
        self.slow_ranks = Counter(
            "taskd_slow_ranks_found",
            "Ranks found slower than their peers (slow-rank events), by what was done (warn, replace)",
            ["action"],
            registry=r,
        )
        self.journal_written = Counter(
            "taskd_journal_entries_written", "Journal entries written since start", registry=r
        )
        # Per job: time of the first fault not yet answered by a decision, cycle start,
        # last strategy, ranks faulted in the cycle, their exit times and last steps.
        self._fault_at: dict[str, float] = {}
        self._cycle_at: dict[str, float] = {}
        self._strategy: dict[str, str] = {}
        self._faulty: dict[str, set[int]] = {}
        self._failed_at: dict[str, dict[int, float]] = {}
        self._resume_from: dict[str, dict[int, float]] = {}
        self._last_step: dict[str, dict[int, int]] = {}
        #: steps lost counted so far in the job's current cycle (ranks of one job redo the same steps).
        self._cycle_lost: dict[str, int] = {}
        #: labelled children by (metric, label values); few: labels have few values.
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def attach(self, read: Callable[[], ControllerGauges]) -> None:
        """Serve the live gauges that ``read`` returns (called at every scrape)."""
        self.registry.register(_LiveCollector(read))

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, kept: labels() takes a lock and builds its key on every call."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self._child(self.rpcs, method, code).inc()
        self._child(self.rpc_seconds, method).observe(seconds)

    # --- the journal ------------------------------------------------------------

    def journalled(self, job_id: str, entries: Sequence[JournalEntry], now: float) -> None:
        self.journal_written.inc(len(entries))
        for entry in entries:
            handler = _HANDLERS.get(entry.kind)
            if handler is not None:
                handler(self, job_id, entry.detail, now)

    def _on_fault(self, job: str, detail: Any, now: float) -> None:
        ranks: dict[str, str] = detail.get("ranks", {})
        for kind in ranks.values():
            self._child(self.faults, _FAULT_NAMES.get(kind, kind)).inc()
        if "covered" in detail:  # the cycle in flight already replaced these workers
            return
        self._faulty.setdefault(job, set()).update(int(rank) for rank in ranks)
        self._fault_at.setdefault(job, now)

    def _on_cycle_started(self, job: str, detail: Any, now: float) -> None:
        self.cycles_started.inc()
        self._cycle_at[job] = now
        self._cycle_lost[job] = 0

    def _on_decision(self, job: str, detail: Any, now: float) -> None:
        strategy = str(detail.get("strategy", ""))
        self._child(self.decisions, strategy).inc()
        self._strategy[job] = strategy
        first = self._fault_at.pop(job, None)
        if first is not None and not detail.get("after"):
            self.fault_to_strategy.observe(now - first)

    def _on_strategy_failed(self, job: str, detail: Any, now: float) -> None:
        self._child(self.escalations, str(detail.get("strategy", ""))).inc()

    def _end_cycle(self, job: str, outcome: str, now: float) -> None:
        start = self._cycle_at.pop(job, None)
        if start is not None:
            self._child(self.cycles, self._strategy.pop(job, "none"), outcome).inc()
            self._child(self.cycle_seconds, outcome).observe(now - start)

    def _on_recovered(self, job: str, detail: Any, now: float) -> None:
        self._end_cycle(job, "recovered", now)

    def _on_given_up(self, job: str, detail: Any, now: float) -> None:
        self.given_up.inc()
        self._end_cycle(job, "given-up", now)
        self._forget(job)

    def _on_signal(self, job: str, detail: Any, now: float) -> None:
        self._child(self.signals, str(detail.get("type", ""))).inc()

    def _on_deadline(self, job: str, detail: Any, now: float) -> None:
        self._child(self.deadlines, str(detail.get("state", ""))).inc()

    def _on_worker_started(self, job: str, detail: Any, now: float) -> None:
        self.worker_starts.inc()
        rank = int(detail["rank"])
        exited = self._failed_at.get(job, {}).pop(rank, None)
        if exited is not None:
            self.kill_to_restart.observe(max(0.0, float(detail["at"]) - exited))
            self._resume_from.setdefault(job, {})[rank] = exited

    def _on_worker_exited(self, job: str, detail: Any, now: float) -> None:
        rank = int(detail["rank"])
        failed = rank in self._faulty.get(job, set())
        outcome = "failed" if failed else "ok" if detail.get("exit_code") == 0 else "stopped"
        self._child(self.worker_exits, outcome).inc()
        if failed:
            self._faulty[job].discard(rank)
            self._failed_at.setdefault(job, {})[rank] = float(detail["at"])
        if "step" in detail:
            self._last_step.setdefault(job, {})[rank] = int(detail["step"])

    def _on_worker_resumed(self, job: str, detail: Any, now: float) -> None:
        rank = int(detail["rank"])
        exited = self._resume_from.get(job, {}).pop(rank, None)
        if exited is not None:
            self.kill_to_resumed.observe(max(0.0, float(detail["at"]) - exited))
        last = self._last_step.get(job, {}).pop(rank, None)
        if last is not None and "step" in detail:
            lost, counted = last - int(detail["step"]), self._cycle_lost.get(job, 0)
            if lost > counted:
                self.steps_lost.inc(lost - counted)
                self._cycle_lost[job] = lost

    def _on_slow_rank(self, job: str, detail: Any, now: float) -> None:
        self._child(self.slow_ranks, str(detail.get("action", ""))).inc(len(detail.get("ranks", ())))

    def _on_finished(self, job: str, detail: Any, now: float) -> None:
        self._forget(job)

    def _forget(self, job: str) -> None:
        self._fault_at.pop(job, None)
        self._faulty.pop(job, None)
        self._failed_at.pop(job, None)
        self._resume_from.pop(job, None)
        self._last_step.pop(job, None)
        self._cycle_lost.pop(job, None)


_Handler = Callable[[ControllerMetrics, str, Any, float], None]
_HANDLERS: dict[str, _Handler] = {
    "fault": ControllerMetrics._on_fault,
    "cycle started": ControllerMetrics._on_cycle_started,
    "strategy chosen": ControllerMetrics._on_decision,
    "strategy failed": ControllerMetrics._on_strategy_failed,
    "cycle succeeded": ControllerMetrics._on_recovered,
    "job given up": ControllerMetrics._on_given_up,
    "job finished": ControllerMetrics._on_finished,
    "signal": ControllerMetrics._on_signal,
    "deadline": ControllerMetrics._on_deadline,
    "worker started": ControllerMetrics._on_worker_started,
    "worker exited": ControllerMetrics._on_worker_exited,
    "worker resumed": ControllerMetrics._on_worker_resumed,
    "slow-rank": ControllerMetrics._on_slow_rank,
}


class _LiveCollector(Collector):
    """Gauges read from the controller at scrape time."""

    def __init__(self, read: Callable[[], ControllerGauges]) -> None:
        self._read = read

    def describe(self) -> Iterable[Metric]:
        # Without describe() the registry would call collect() at registration.
        return []

    def collect(self) -> Iterable[Metric]:
        try:
            gauges = self._read()
        except (TimeoutError, concurrent.futures.TimeoutError, RuntimeError) as exc:
            logger.warning("metrics: could not read the controller's state (%s)", exc)
            return
        jobs = GaugeMetricFamily("taskd_jobs", "Jobs known to the controller, by state", labels=["state"])
        for state, count in gauges.jobs_by_state.items():
            jobs.add_metric([state.value], count)
        yield jobs
        yield GaugeMetricFamily(
            "taskd_agents_registered", "Agents registered and not exited", value=gauges.agents_registered
        )
        yield GaugeMetricFamily(
            "taskd_agents_connected", "Agents with a live signal stream", value=gauges.agents_connected
        )
        yield GaugeMetricFamily(
            "taskd_journal_entries", "Entries in the controller's event journal", value=gauges.journal_entries
        )
        yield GaugeMetricFamily(
            "taskd_slow_ranks", "Ranks slower than their peers now, over every job", value=gauges.slow_ranks
        )
        yield GaugeMetricFamily(
            "taskd_state_writes_held",
            "Writes of the controller's state not durable yet (held while the storage refuses them)",
            value=gauges.writes_held,
        )
        yield CounterMetricFamily(
            "taskd_state_write_failures",
            "Writes the controller's storage refused (a full disk, a read-only file, etcd away), each try",
            value=gauges.write_failures,
        )


def on_loop(
    loop: asyncio.AbstractEventLoop, read: Callable[[], ControllerGauges]
) -> Callable[[], ControllerGauges]:
    """``read`` run on ``loop`` from any other thread (the scrape's), bounded in time."""

    async def call() -> ControllerGauges:
        return read()

    def threadsafe() -> ControllerGauges:
        return asyncio.run_coroutine_threadsafe(call(), loop).result(_READ_TIMEOUT)

    return threadsafe


# --- RPCs ---------------------------------------------------------------------------


def _code_of(reply: object) -> str:
    """The Status code an answer carries (``Status`` itself, or a message with a ``status``)."""
    status = getattr(reply, "status", reply)
    return str(getattr(status, "code", "ok"))


# grpc ships no type information, so its base class is Any to the checker.
class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Counts and times every ``Recover`` RPC by method and answered code.

    Unary answers carry the protocol's ``Status.code``; a signal stream is
    counted once it ends, with its gRPC status name (``OK``, ``NOT_FOUND``...).
    """

    def __init__(self, metrics: ControllerMetrics, service: str) -> None:
        self._metrics = metrics
        self._prefix = f"/{service}/"
        #: wrapped handler per method: the service's handlers never change, so wrap each once.
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = details.method
        wrapped = self._wrapped.get(method)
        if wrapped is not None:
            return wrapped
        handler = await continuation(details)
        if handler is None or not method.startswith(self._prefix):
            return handler
        name = method[len(self._prefix) :]
        if handler.unary_unary is not None:
            wrapped = grpc.unary_unary_rpc_method_handler(
                self._unary(name, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        elif handler.unary_stream is not None:
            wrapped = grpc.unary_stream_rpc_method_handler(
                self._stream(name, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        else:
            return handler
        self._wrapped[method] = wrapped
        return wrapped

    def _unary(self, name: str, inner: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            code = "error"
            try:
                reply = await inner(request, context)
                code = _code_of(reply)
                return reply
            finally:
                # Counted once the answer is on its way, not before.
                asyncio.get_running_loop().call_soon(
                    self._metrics.observe_rpc, name, code, time.perf_counter() - start
                )

        return call

    def _stream(
        self, name: str, inner: Callable[..., AsyncIterator[Any]]
    ) -> Callable[..., AsyncIterator[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            start = time.perf_counter()
            try:
                async for item in inner(request, context):
                    yield item
            finally:
                status = context.code()
                code = "OK" if status is None else status.name
                self._metrics.observe_rpc(name, code, time.perf_counter() - start)

        return call


# --- the HTTP endpoint ---------------------------------------------------------------


class _MetricsServer(http.server.ThreadingHTTPServer):
    """Serves each connection on its own thread, TLS handshake included, at most ``slots`` at once.

    The accept thread never waits for a client: a connection that sends
    nothing (or stops half-way through its handshake) holds only its own
    thread, until :data:`METRICS_IO_TIMEOUT`; past ``slots`` connections,
    new ones are closed at once.
    """

    daemon_threads = True
    block_on_close = False
    # The listen backlog: beyond it a connection waits for the client's SYN retry (seconds), not for us.
    request_queue_size = 2 * METRICS_CONNECTIONS

    def __init__(
        self,
        address: tuple[str, int],
        family: socket.AddressFamily,
        handler: type[http.server.BaseHTTPRequestHandler],
        context: ssl.SSLContext | None,
        slots: int,
    ) -> None:
        self.address_family = family
        self._context = context
        self._slots = threading.BoundedSemaphore(slots)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            request.settimeout(METRICS_IO_TIMEOUT)
            if self._context is not None:
                try:
                    request = self._context.wrap_socket(request, server_side=True)
                except OSError as exc:  # ssl.SSLError and timeouts alike: this client only
                    logger.debug("metrics: TLS handshake with %s failed: %s", client_address, exc)
                    self.shutdown_request(request)
                    return
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _tls_context(tls: ServerTls) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls.cert, tls.key)
    if tls.client_ca:
        context.load_verify_locations(cafile=tls.client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class MetricsEndpoint:
    """``/metrics`` over HTTP (HTTPS with ``tls``) on its own threads (see :class:`_MetricsServer`)."""

    def __init__(
        self,
        metrics: ControllerMetrics,
        host: str,
        port: int,
        tls: ServerTls | None = None,
        *,
        max_connections: int = METRICS_CONNECTIONS,
    ) -> None:
        fields = {"registry": metrics.registry, "timeout": METRICS_IO_TIMEOUT}
        handler = type("Handler", (MetricsHandler,), fields)
        try:
            # The files were checked as PEM when the gRPC server's credentials were made.
            context = _tls_context(tls) if tls is not None else None
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"--metrics-port: cannot use the TLS files for /metrics ({exc})") from None
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            self._server = _MetricsServer((host, port), family, handler, context, max_connections)
        except OSError as exc:
            raise cannot_bind(f"--metrics-port {port}", host, port, exc) from None
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="taskd-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)
