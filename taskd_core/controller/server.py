"""Running the controller: the ``grpc.aio`` server, ``serve()`` and :class:`EmbeddedController`.

``serve()`` is the daemon (``taskd controller``); :class:`EmbeddedController`
runs the same server on its own event loop in a background thread for
launchers and tests::

    with EmbeddedController(defaults=JobPolicy(report_timeout=30)) as ctl:
        client = DLRecoverManager(info, ctl.address)
        ...

Either is one *replica* (:mod:`~taskd_core.controller.replica`): with a SQLite
``state`` it leads at once and alone; with ``state="etcd://HOSTS/PREFIX"`` any
number of them share the state, one leads (health SERVING) and the others
stand by (NOT_SERVING, answering requests with the leader's address). An
embedded replica on etcd is how each node of a job can carry the job's
controller with it: ``EmbeddedController(state="etcd://...", advertise=...)``
returns once it leads or stands by; :attr:`~EmbeddedController.leading`,
:meth:`~EmbeddedController.wait_leading` and :attr:`~EmbeddedController.leader`
say which.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from taskd_core.controller.access import AccessRules
from taskd_core.controller.etcd_client import EtcdTls, is_etcd_url
from taskd_core.controller.metrics import ControllerMetrics, MetricsEndpoint, RpcMetricsInterceptor, on_loop
from taskd_core.controller.policy import PolicyBook, validated
from taskd_core.controller.quotas import Quotas
from taskd_core.controller.replica import Replica, open_election
from taskd_core.controller.runtime import LIVE_GRACE, Controller, Limits
from taskd_core.controller.service import RecoverService
from taskd_core.controller.store import StateStore
from taskd_core.errors import ConfigError, NotLeaderError, TaskdError
from taskd_core.models import JobPolicy
from taskd_core.rpc import SERVICE_NAME, recover_pb2_grpc
from taskd_core.rpc.security import RequestGuard, ServerTls, read_token_file, token_digest
from taskd_core.values import (
    DEFAULT_CONTROLLER,
    LOCALHOST,
    Address,
    cannot_bind,
    is_loopback,
    is_wildcard,
    join_address,
    parse_address,
)

logger = logging.getLogger(__name__)

_KEEPALIVE_MS = 3_000
#: Health service name that answers SERVING while the process runs as a replica, leading or
#: standing by (a liveness probe); "" and "Recover" answer SERVING on the leader alone (readiness).
REPLICA_HEALTH = "taskd.Replica"
#: Bound on how long the stream of a frozen or vanished agent stays "live" (ping after 3 s, 3 s to answer).
STREAM_DEAD_AFTER = 2 * _KEEPALIVE_MS / 1000

#: Server channel options. Real clients ping every 3 s even without calls;
#: grpcio's default (5 min, 2 strikes) would answer them with GOAWAY too_many_pings.
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.http2.min_ping_interval_without_data_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 0),
    # A frozen (SIGSTOPped) or vanished agent holds its agent id until its
    # stream is known dead; its replacement is refused with ALREADY_EXISTS till
    # then. The server pings a connection after 3 s without reads and closes it
    # when a ping stays unanswered for 3 s (ping_timeout_ms: a keepalive ping
    # can be held back behind another unanswered ping, so keepalive_timeout_ms
    # alone never fired, measured ~121 s). The reference waits a minute plus 5 s.
    ("grpc.keepalive_time_ms", _KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", _KEEPALIVE_MS),
    ("grpc.http2.ping_timeout_ms", _KEEPALIVE_MS),
    ("grpc.http2.max_pings_without_data", 0),
    # Without this a second controller could bind the same port and split the agents between them.
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", 4 * 1024 * 1024),
    ("grpc.max_send_message_length", 8 * 1024 * 1024),
)


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """Everything one controller process needs."""

    listen: str = DEFAULT_CONTROLLER
    #: SQLite file of jobs, agents and the journal (":memory:" for throw-away runs), or
    #: ``etcd://HOST:PORT[,HOST:PORT...]/PREFIX`` for replicas sharing the state in etcd.
    state: str = "./taskd-state.db"
    policies: PolicyBook = field(default_factory=PolicyBook)
    keepalive_interval: float = 5.0
    #: seconds in-flight RPCs get to finish at shutdown.
    grace: float = 2.0
    #: serve TLS (mutual TLS when it names a client CA); None: plaintext.
    tls: ServerTls | None = None
    #: allow plaintext on a listener other hosts can reach.
    insecure: bool = False
    #: accept jobs registered without a token; None: only on a loopback listener.
    allow_legacy: bool | None = None
    #: file holding the admin token, which may list and change every job.
    admin_token_file: str = ""
    limits: Limits = field(default_factory=Limits)
    #: also serve the health service alone, in plaintext, on this port of the listen host
    #: (Kubernetes' gRPC probes cannot speak TLS); None: only on the main port.
    health_port: int | None = None
    #: serve Prometheus ``/metrics`` on this port of the listen host (0: any free port); None: off.
    #: With ``tls`` it is served over HTTPS with the same certificate (and client CA).
    metrics_port: int | None = None
    #: seconds an agent whose signal stream ended has to subscribe again before the wait in
    #: flight counts it as a failed answer (instead of waiting out the report timeout).
    stream_grace: float = LIVE_GRACE
    #: ``HOST:PORT`` other hosts reach this replica at (the leader key carries it; standbys
    #: redirect clients there; port 0: the bound port); "" derives it from ``listen`` (a wildcard
    #: host: this host's name).
    advertise: str = ""
    #: etcd: seconds of the leader's lease; a killed leader is replaced about this long later.
    lease_ttl: int = 2
    #: etcd: TLS files (CA, client certificate) where etcd requires them; None: plaintext.
    etcd_tls: EtcdTls | None = None
    #: etcd: make this replica's policy the replicas' policy (the others then stop leading).
    replace_policy: bool = False
    #: etcd: seconds to reach etcd at start before giving up.
    state_timeout: float = 5.0
    #: how much one job token or one host may use (jobs, agents, requests, journal bytes).
    quotas: Quotas = field(default_factory=Quotas)
    #: the one job token this controller serves (a launch's embedded controller); "": any.
    job_token: str = field(default="", repr=False)
    #: etcd: the agent that runs in this replica's process (a launcher's), which ends with it; "": none.
    beside: str = ""

    def access(self) -> AccessRules:
        """The authorisation rules; checks the listener's security (:class:`ConfigError`)."""
        loopback = is_loopback(listen_address(self.listen).host)
        if self.tls is None and not loopback:
            if not self.insecure:
                raise ConfigError(
                    f"--listen {self.listen}: refusing plaintext on an address other hosts can reach; "
                    "give --tls-cert and --tls-key (see docs/security.md), listen on 127.0.0.1, "
                    "or pass --insecure to accept the risk"
                )
            logger.warning(
                "controller on %s serves plaintext (--insecure): anyone on the network can read its traffic "
                "and, with a job's token seen on the wire, act on that job",
                self.listen,
            )
        admin = read_token_file(self.admin_token_file, "--admin-token-file") if self.admin_token_file else ""
        legacy = loopback if self.allow_legacy is None else self.allow_legacy
        if self.job_token:
            legacy = False
        return AccessRules(
            admin_digest=token_digest(admin) if admin else "",
            allow_legacy=legacy,
            only_digest=token_digest(self.job_token) if self.job_token else "",
        )


def listen_address(listen: str, flag: str = "--listen") -> Address:
    """A listener's ``HOST:PORT`` (``[v6]:PORT`` too; port 0 picks one); ConfigError when malformed."""
    return parse_address(listen, flag, allow_zero=True)


class ControllerServer:
    """The gRPC server with the Recover and health services, and its replica; use on one event loop."""

    def __init__(self, config: ControllerConfig) -> None:
        listen_address(config.listen)
        if config.keepalive_interval <= 0:
            raise ConfigError("--keepalive-interval must be greater than 0")
        if config.lease_ttl < 1:
            raise ConfigError(f"--lease-ttl {config.lease_ttl}: give a whole number of seconds, at least 1")
        if config.advertise:
            listen_address(config.advertise, "--advertise")
        self._access = config.access()
        self._credentials = config.tls.credentials() if config.tls is not None else None
        if config.metrics_port is not None and not 0 <= config.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port {config.metrics_port}: expected a port in 0..65535")
        self.config = config
        self.port = 0
        self._replica: Replica | None = None
        self._metrics: ControllerMetrics | None = None
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._probe_server: grpc.aio.Server | None = None
        #: the bound port of the plaintext health listener (0 without one).
        self.health_port = 0
        self._metrics_endpoint: MetricsEndpoint | None = None

    @property
    def metrics_port(self) -> int | None:
        """The bound ``/metrics`` port, None when metrics are off."""
        return self._metrics_endpoint.port if self._metrics_endpoint else None

    @property
    def address(self) -> str:
        """Where clients on this host reach the server (wildcard hosts become loopback)."""
        host = listen_address(self.config.listen).host
        return join_address(LOCALHOST if is_wildcard(host) else host, self.port)

    @property
    def advertised(self) -> str:
        """Where other hosts reach this replica: ``advertise``, else the listener (a wildcard: this host).

        An advertised port 0 is the bound port (a replica listening on any free port).
        """
        if self.config.advertise:
            advertised = listen_address(self.config.advertise, "--advertise")
            return join_address(advertised.host, advertised.port or self.port)
        host = listen_address(self.config.listen).host
        return join_address(socket.getfqdn() if is_wildcard(host) else host, self.port)

    @property
    def replica(self) -> Replica:
        if self._replica is None:
            raise NotLeaderError("the controller is starting")
        return self._replica

    # What the service asks (service.Leadership): the replica's, once there is one.

    def controller(self) -> Controller:
        return self.replica.controller()

    @property
    def leader(self) -> str:
        return self._replica.leader if self._replica is not None else ""

    @property
    def generation(self) -> int:
        return self._replica.generation if self._replica is not None else 0

    def _new_controller(self, store: StateStore) -> Controller:
        return Controller(
            store,
            self.config.policies,
            keepalive_interval=self.config.keepalive_interval,
            stream_grace=self.config.stream_grace,
            access=self._access,
            limits=self.config.limits,
            quotas=self.config.quotas,
            observer=self._metrics,
        )

    async def start(self, timeout: float = 30.0) -> None:
        """Bind, check the state, start serving; returns once this replica leads or stands by."""
        metrics = self._metrics = ControllerMetrics() if self.config.metrics_port is not None else None
        interceptors: list[grpc.aio.ServerInterceptor] = [RequestGuard(SERVICE_NAME)]
        if metrics is not None:
            interceptors.append(RpcMetricsInterceptor(metrics, SERVICE_NAME))
        server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        recover_pb2_grpc.add_RecoverServicer_to_server(RecoverService(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            if self._credentials is not None:
                self.port = server.add_secure_port(self.config.listen, self._credentials)
            else:
                self.port = server.add_insecure_port(self.config.listen)
        except RuntimeError as exc:
            host, port = listen_address(self.config.listen)
            raise cannot_bind(f"--listen {self.config.listen}", host, port, exc) from None
        self._server = server
        try:
            await self._start_replica(server, metrics, timeout)
        except BaseException:
            await self.stop(grace=0)
            raise
        logger.info(
            "controller listening on %s (%s, %s, legacy clients %s, admin token %s)%s",
            self.address,
            "plaintext" if self.config.tls is None else "mutual TLS" if self.config.tls.client_ca else "TLS",
            self.config.state if is_etcd_url(self.config.state) else f"state {self.config.state}",
            "allowed" if self._access.allow_legacy else "refused",
            "set" if self._access.admin_digest else "none",
            "" if self.replica.leading else f"; standing by, leader {self.replica.leader or 'unknown'}",
        )

    async def _start_replica(
        self, server: grpc.aio.Server, metrics: ControllerMetrics | None, timeout: float
    ) -> None:
        election = await open_election(
            self.config.state,
            self.advertised,
            self.config.policies,
            etcd_tls=self.config.etcd_tls,
            lease_ttl=self.config.lease_ttl,
            replace_policy=self.config.replace_policy,
            timeout=self.config.state_timeout,
            beside=self.config.beside,
        )
        replica = self._replica = Replica(election, self._new_controller, self._health, self.advertised)
        if metrics is not None and self.config.metrics_port is not None:
            metrics.attach(on_loop(asyncio.get_running_loop(), replica.gauges))
            host = listen_address(self.config.listen).host
            self._metrics_endpoint = MetricsEndpoint(metrics, host, self.config.metrics_port, self.config.tls)
            scheme = "http" if self.config.tls is None else "https"
            logger.info("metrics on %s://%s/metrics", scheme, join_address(host, self._metrics_endpoint.port))
        await server.start()
        if self.config.health_port is not None:
            await self._start_probe_server(self.config.health_port)
        await replica.start(timeout)
        await self._health.set(REPLICA_HEALTH, health_pb2.HealthCheckResponse.SERVING)

    async def _start_probe_server(self, port: int) -> None:
        """The health service alone, in plaintext: it tells only whether the controller serves."""
        host = listen_address(self.config.listen).host
        probe = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, probe)
        try:
            self.health_port = probe.add_insecure_port(join_address(host, port))
        except RuntimeError as exc:
            raise cannot_bind(f"--health-port {port}", host, port, exc) from None
        self._probe_server = probe
        await probe.start()

    async def stop(self, grace: float | None = None) -> None:
        """Graceful: NOT_SERVING, end signal streams, let calls finish, give up the lead, close the state."""
        await self._health.enter_graceful_shutdown()
        if self._probe_server is not None:
            await self._probe_server.stop(0)
        if self._replica is not None:
            self._replica.end_streams()
        if self._server is not None:
            await self._server.stop(self.config.grace if grace is None else grace)
        if self._replica is not None:
            await self._replica.stop()
        if self._metrics_endpoint is not None:
            self._metrics_endpoint.close()
        logger.info("controller on %s stopped", self.address)


async def serve(
    config: ControllerConfig,
    *,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[ControllerServer], None] | None = None,
    handle_signals: bool = False,
) -> None:
    """Run a controller until ``stop`` is set (or SIGTERM/SIGINT with ``handle_signals``).

    ``on_ready`` gets the running server once its ports are bound (``.address``, ``.metrics_port``).
    """
    stop = stop or asyncio.Event()
    server = ControllerServer(config)
    await server.start()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT) if handle_signals else ()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    stopped: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    try:
        if on_ready is not None:
            on_ready(server)
        ended: list[asyncio.Future[Any]] = [stopped, server.replica.failed]
        await asyncio.wait(ended, return_when=asyncio.FIRST_COMPLETED)
        if server.replica.failed.done() and not server.replica.failed.cancelled():
            server.replica.failed.result()  # raises what ended the replica (the caller reports it)
        logger.info("controller shutting down")
    finally:
        stopped.cancel()
        for sig in signals:
            loop.remove_signal_handler(sig)
        await server.stop()


class EmbeddedController:
    """A controller on a background thread with its own event loop.

    Starts in the constructor and is ready when it returns; :attr:`address`
    (``"127.0.0.1:PORT"``) and :attr:`port` say where it listens, :attr:`metrics_port`
    where ``/metrics`` is served (None unless ``metrics_port`` is given; 0 picks a free port). :meth:`stop`
    (or leaving the ``with`` block) shuts it down gracefully within
    ``stop_timeout`` seconds. ``defaults`` is every job's policy unless
    ``policies`` gives a full :class:`~taskd_core.controller.policy.PolicyBook`.

    With ``state="etcd://HOSTS/PREFIX"`` it is one replica among any number on
    that prefix (in this process or others): it returns once it leads or stands
    by; ``advertise`` is the address the others send clients to, ``lease_ttl``
    how long a lost leader holds on, ``etcd_tls`` the files etcd wants, ``beside`` the agent that
    runs in this process (it ends with this replica; a launcher's own agent).
    ``job_token`` makes it serve that one job token only (a launch's own controller).
    """

    def __init__(
        self,
        listen: str = "127.0.0.1:0",
        state: str = ":memory:",
        defaults: JobPolicy | None = None,
        *,
        policies: PolicyBook | None = None,
        keepalive_interval: float = 5.0,
        grace: float = 1.0,
        start_timeout: float = 10.0,
        tls: ServerTls | None = None,
        insecure: bool = False,
        allow_legacy: bool | None = None,
        admin_token_file: str = "",
        limits: Limits | None = None,
        metrics_port: int | None = None,
        stream_grace: float = LIVE_GRACE,
        advertise: str = "",
        lease_ttl: int = 2,
        etcd_tls: EtcdTls | None = None,
        replace_policy: bool = False,
        state_timeout: float = 5.0,
        quotas: Quotas | None = None,
        job_token: str = "",
        beside: str = "",
    ) -> None:
        book = policies or PolicyBook(validated(defaults or JobPolicy(), "defaults: "))
        self._config = ControllerConfig(
            listen,
            state,
            book,
            keepalive_interval,
            grace,
            tls,
            insecure,
            allow_legacy,
            admin_token_file,
            limits or Limits(),
            metrics_port=metrics_port,
            stream_grace=stream_grace,
            advertise=advertise,
            lease_ttl=lease_ttl,
            etcd_tls=etcd_tls,
            replace_policy=replace_policy,
            state_timeout=state_timeout,
            quotas=quotas or Quotas(),
            job_token=job_token,
            beside=beside,
        )
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._server: ControllerServer | None = None
        self._ready: concurrent.futures.Future[tuple[str, int | None]] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, name="taskd-controller", daemon=True)
        self._thread.start()
        try:
            self.address, self.metrics_port = self._ready.result(timeout=start_timeout)
        except concurrent.futures.TimeoutError:
            self.stop()
            raise ConfigError(
                f"embedded controller on {listen} did not start within {start_timeout}s"
            ) from None
        self.port = parse_address(self.address).port

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as exc:  # handed to the constructing thread, which is waiting for it
            if not self._ready.done():
                self._ready.set_exception(exc)
            elif isinstance(exc, TaskdError):  # a replica that may not go on (its policy was replaced)
                logger.error("embedded controller on %s stopped: %s", self.address, exc)
            else:
                logger.exception("embedded controller failed")
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()

        def ready(server: ControllerServer) -> None:
            self._server = server
            self._ready.set_result((server.address, server.metrics_port))

        await serve(self._config, stop=self._stop, on_ready=ready)

    @property
    def leading(self) -> bool:
        """Whether this replica leads now (always, for a SQLite state)."""
        return self._server is not None and self._server.replica.leading and self._thread.is_alive()

    @property
    def leader(self) -> str:
        """The leading replica's address as this one knows it ("" unknown)."""
        return self._server.leader if self._server is not None else ""

    @property
    def generation(self) -> int:
        return self._server.generation if self._server is not None else 0

    def wait_leading(self, timeout: float) -> bool:
        """Wait until this replica leads, at most ``timeout`` seconds; whether it does."""
        if self._server is None or not self._thread.is_alive():
            return False
        waiting = asyncio.run_coroutine_threadsafe(self._server.replica.wait_leading(timeout), self._loop)
        try:
            return waiting.result(timeout + 1.0)
        except concurrent.futures.TimeoutError:
            waiting.cancel()
            return False

    def stop(self, timeout: float = 5.0) -> None:
        """Shut down gracefully; waits at most ``timeout`` seconds. Idempotent."""
        if self._thread.is_alive() and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("embedded controller on %s did not stop within %.1fs", self.address, timeout)

    def __enter__(self) -> EmbeddedController:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
