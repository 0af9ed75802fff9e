"""Shared fixtures: an in-process controller and raw-stub agents that talk to it.

``controller_factory(**policy)`` starts an :class:`EmbeddedController` on
127.0.0.1 port 0 with short deadlines; ``make_agent(address, job, ...)`` gives a
:class:`RawAgent` that speaks the wire protocol with the generated stubs (no
client library), so controller tests do not depend on the client's code.
Everything started here is stopped at teardown.
"""

from __future__ import annotations

import dataclasses
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from taskd_core.controller.policy import PolicyBook
from taskd_core.controller.quotas import Quotas
from taskd_core.controller.runtime import Limits
from taskd_core.controller.server import EmbeddedController
from taskd_core.models import Credentials, JobPolicy, Strategy
from taskd_core.rpc import recover_pb2 as pb
from taskd_core.rpc import recover_pb2_grpc
from taskd_core.rpc.security import ServerTls, open_channel
from taskd_core.testing import wait_until
from tests.etcd_server import EtcdServer

#: Generous ceiling for anything a test waits for; never an assertion on speed.
WAIT = 20.0
ROOT = Path(__file__).resolve().parent.parent

#: Short deadlines so cycles end quickly in tests.
TEST_POLICY = JobPolicy(
    strategies=tuple(Strategy),
    report_timeout=10.0,
    flush_seconds=0.0,
    max_cycles=5,
)


def token_file(path: Path, token: str) -> str:
    """Write ``token`` to a file only its owner may read (TaskD refuses others) and return the path."""
    path.write_text(token + "\n")
    path.chmod(0o600)
    return str(path)


class RawAgent:
    """One agent of a job, driven by a test through the generated stub."""

    def __init__(
        self,
        address: str,
        job_id: str,
        agent_id: str = "",
        role: str = "taskd",
        node_rank: int = 0,
        rank_ids: tuple[int, ...] = (),
        credentials: Credentials | None = None,
    ) -> None:
        self.job_id = job_id
        self.agent_id = agent_id
        self.info = pb.ClientInfo(
            jobId=job_id, role=role, agentId=agent_id, nodeRank=node_rank, rankIds=[str(r) for r in rank_ids]
        )
        self.channel = open_channel(address, credentials or Credentials())
        self.stub = recover_pb2_grpc.RecoverStub(self.channel)
        self.signals: queue.Queue[pb.ProcessManageSignal | grpc.RpcError | None] = queue.Queue()
        self._call: Any = None
        self._reader: threading.Thread | None = None

    def join(self) -> RawAgent:
        """Init, Register and Subscribe, checking each answer."""
        assert self.stub.Init(self.info, timeout=WAIT).code == 0
        assert self.stub.Register(self.info, timeout=WAIT).code == 0
        self.subscribe()
        return self

    def subscribe(self) -> None:
        self.signals = queue.Queue()
        self._call = self.stub.SubscribeProcessManageSignal(self.info)
        sink = self.signals
        call = self._call

        def read() -> None:
            try:
                for msg in call:
                    sink.put(msg)
                sink.put(None)
            except grpc.RpcError as exc:
                sink.put(exc)

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    def cut(self) -> None:
        """Drop the signal stream the way a dying connection would."""
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            self._reader.join(WAIT)

    def resubscribe(self) -> None:
        """Subscribe again once the controller has noticed the old stream is gone."""
        me = self.agent_id or self.info.role
        wait_until(
            lambda: not any(a.subscribed for a in self.job().agents if a.agentId == me),
            f"controller to drop {me}'s old stream",
            WAIT,
        )
        self.subscribe()

    def next_signal(self, timeout: float = WAIT, keepalive: bool = False) -> pb.ProcessManageSignal:
        """The next signal (keep-alives skipped unless asked for); fails on stream end."""
        end = time.monotonic() + timeout
        while True:
            try:
                item = self.signals.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"agent {self.agent_id or self.info.role}: no signal within {timeout}s")
            if isinstance(item, pb.ProcessManageSignal):
                if keepalive or item.signalType != "keep-alive":
                    return item
                continue
            raise AssertionError(f"signal stream ended: {item!r}")

    def stream_end(self, timeout: float = WAIT) -> grpc.RpcError | None:
        """Skip signals until the stream ends; the error it ended with, if any."""
        end = time.monotonic() + timeout
        while True:
            item = self.signals.get(timeout=max(0.0, end - time.monotonic()))
            if not isinstance(item, pb.ProcessManageSignal):
                return item

    def expect(self, signal_type: str, **fields: Any) -> pb.ProcessManageSignal:
        sig = self.next_signal()
        assert sig.signalType == signal_type, sig
        for name, value in fields.items():
            got = list(getattr(sig, name)) if name in ("actions", "nodeRankIds") else getattr(sig, name)
            assert got == value, f"{name}: {got!r} != {value!r} in {sig}"
        return sig

    # --- reports (return the Status code) ---------------------------------------

    def fault(self, faults: dict[int, int] | None = None, job_id: str | None = None) -> pb.Status:
        ranks = [pb.FaultRank(rankId=str(r), faultType=str(t)) for r, t in (faults or {0: 1}).items()]
        return self.stub.ReportProcessFault(
            pb.ProcessFaultRequest(jobId=job_id or self.job_id, faultRanks=ranks, agentId=self.agent_id),
            timeout=WAIT,
        )

    def stopped(self, code: int = 0, uuid: str = "") -> pb.Status:
        return self.stub.ReportStopComplete(
            pb.StopCompleteRequest(
                jobId=self.job_id, status=pb.Status(code=code), agentId=self.agent_id, uuid=uuid
            ),
            timeout=WAIT,
        )

    def strategies(self, names: list[str], uuid: str = "") -> pb.Status:
        return self.stub.ReportRecoverStrategy(
            pb.RecoverStrategyRequest(jobId=self.job_id, strategies=names, agentId=self.agent_id, uuid=uuid),
            timeout=WAIT,
        )

    def status(self, code: int = 0, strategy: str = "", uuid: str = "") -> pb.Status:
        return self.stub.ReportRecoverStatus(
            pb.RecoverStatusRequest(
                jobId=self.job_id,
                status=pb.Status(code=code),
                strategy=strategy,
                agentId=self.agent_id,
                uuid=uuid,
            ),
            timeout=WAIT,
        )

    def exited(self, code: int = 0) -> pb.Status:
        return self.stub.ReportAgentExit(
            pb.AgentExitRequest(
                jobId=self.job_id, agentId=self.agent_id, role=self.info.role, status=pb.Status(code=code)
            ),
            timeout=WAIT,
        )

    def recover(self, cycle: int) -> None:
        """One whole recovery cycle of rank 0 (fault, stop, strategies, recover), until the job is idle."""
        assert self.fault({0: 1}).code == 0
        stop = self.expect("stopTrain", cycle=cycle)
        assert self.stopped(uuid=stop.uuid).code == 0
        self.expect("globalFault")
        assert self.strategies(["recover", "exit"], uuid=stop.uuid).code == 0
        self.expect("changeStrategy", changeStrategy="recover")
        assert self.status(0, "recover", uuid=stop.uuid).code == 0
        wait_until(lambda: self.job().state == "idle", "the job to be idle again", WAIT)

    def set_report_timeout(self, seconds: float) -> None:
        """Waits the job enters from now on end after ``seconds``; armed ones keep their deadline."""
        request = pb.JobPolicyRequest(
            jobId=self.job_id,
            recoveryEnabled=True,
            reportTimeoutSeconds=seconds,
            flushSeconds=-1,
            maxCycles=-1,
        )
        assert self.stub.SetJobPolicy(request, timeout=WAIT).code == 0

    def job(self, events: int = 0) -> pb.JobView:
        reply = self.stub.QueryStatus(pb.StatusQuery(jobId=self.job_id, events=events), timeout=WAIT)
        assert reply.status.code == 0, reply.status
        return reply.jobs[0]

    def close(self) -> None:
        self.cut()
        self.channel.close()


@pytest.fixture
def controller_factory() -> Iterator[Callable[..., EmbeddedController]]:
    """Start controllers: ``controller_factory(state=..., keepalive_interval=..., **policy_fields)``;
    ``listen``, ``tls``, ``insecure``, ``allow_legacy``, ``admin_token_file``, ``limits``, ``quotas`` and
    ``job_token`` go to the server."""
    started: list[EmbeddedController] = []

    def start(
        state: str = ":memory:",
        keepalive_interval: float = 0.5,
        policies: PolicyBook | None = None,
        *,
        listen: str = "127.0.0.1:0",
        tls: ServerTls | None = None,
        insecure: bool = False,
        allow_legacy: bool | None = None,
        admin_token_file: str = "",
        limits: Limits | None = None,
        quotas: Quotas | None = None,
        job_token: str = "",
        **policy: Any,
    ) -> EmbeddedController:
        defaults = dataclasses.replace(TEST_POLICY, **policy)
        ctl = EmbeddedController(
            listen=listen,
            state=state,
            defaults=defaults,
            policies=policies,
            keepalive_interval=keepalive_interval,
            tls=tls,
            insecure=insecure,
            allow_legacy=allow_legacy,
            admin_token_file=admin_token_file,
            limits=limits,
            quotas=quotas,
            job_token=job_token,
        )
        started.append(ctl)
        return ctl

    yield start
    for ctl in started:
        ctl.stop()


@pytest.fixture
def outside_host() -> str:
    """An address of this machine that other hosts reach (not loopback); skips where there is none."""
    import socket

    from taskd_core.values import is_loopback

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("203.0.113.1", 9))  # TEST-NET-3: picks the route's source address, sends nothing
        except OSError:
            pytest.skip("this machine has no route beyond loopback")
        host = str(probe.getsockname()[0])
    if is_loopback(host):
        pytest.skip("this machine has no address beyond loopback")
    return host


@pytest.fixture
def controller(controller_factory: Callable[..., EmbeddedController]) -> EmbeddedController:
    """A fresh in-memory controller with the test policy (every strategy, 10 s deadlines, no flush)."""
    return controller_factory()


@pytest.fixture
def make_agent() -> Iterator[Callable[..., RawAgent]]:
    """``make_agent(address, job_id, agent_id="", role="taskd", node_rank=0, rank_ids=())``."""
    agents: list[RawAgent] = []

    def make(address: str, job_id: str, agent_id: str = "", **kw: Any) -> RawAgent:
        agent = RawAgent(address, job_id, agent_id, **kw)
        agents.append(agent)
        return agent

    yield make
    for agent in agents:
        agent.close()


class ControllerProcess:
    """``python -m taskd_core controller`` as a child process, its output in a log file."""

    def __init__(self, state: Path | str, args: tuple[str, ...], log: Path) -> None:
        port_file = log.with_suffix(".port")
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "taskd_core",
                    "controller",
                    "--listen",
                    "127.0.0.1:0",
                    "--state",
                    str(state),
                    "--port-file",
                    str(port_file),
                    *args,
                ],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.address = wait_until(
            lambda: port_file.exists() and port_file.read_text().strip(),
            "controller port file",
            WAIT,
            unless=lambda: self.proc.poll() is not None and f"controller exited at start:\n{log.read_text()}",
        )

    def health(self) -> int:
        """The health service's answer (SERVING only on a leading replica); -1 when it does not answer."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(self.address) as channel:
            try:
                return int(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status)
            except grpc.RpcError:
                return -1

    def wait_serving(self, timeout: float = 3 * WAIT) -> ControllerProcess:
        """Wait until this replica leads (an etcd state's replica may first stand by)."""
        from grpc_health.v1 import health_pb2

        wait_until(lambda: self.health() == health_pb2.HealthCheckResponse.SERVING, "the replica to lead", timeout)
        return self

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(WAIT)

    def terminate(self) -> int:
        """SIGTERM, then the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(WAIT)


@pytest.fixture
def controller_process(tmp_path: Path) -> Iterator[Callable[..., ControllerProcess]]:
    """``controller_process(state_path, *extra_args)`` starts a controller child.

    Children still running at teardown are killed.
    """
    started: list[ControllerProcess] = []

    def start(state: Path | str, *args: str) -> ControllerProcess:
        started.append(ControllerProcess(state, args, tmp_path / f"controller-{len(started)}.log"))
        return started[-1]

    yield start
    for child in started:
        if child.proc.poll() is None:
            child.kill()


@dataclasses.dataclass(frozen=True)
class Pki:
    """Real certificates (trustme): a CA, the controller's and a client's, and an unrelated CA."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str

    def server(self, mutual: bool = False) -> ServerTls:
        return ServerTls(self.server_cert, self.server_key, self.ca if mutual else "")

    def client(self, token: str = "", *, cert: bool = True, launch: str = "") -> Credentials:
        if not cert:
            return Credentials(tls_ca=self.ca, token=token, launch=launch)
        return Credentials(self.ca, self.client_cert, self.client_key, token, launch)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    import trustme

    root = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost", "127.0.0.2")
    client = ca.issue_cert("agent.taskd.test")
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    other.cert_pem.write_to_path(str(root / "other-ca.pem"))
    for name, cert in (("server", server), ("client", client)):
        (root / f"{name}.pem").write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
        cert.private_key_pem.write_to_path(str(root / f"{name}.key"))
    return Pki(
        str(root / "ca.pem"),
        str(root / "server.pem"),
        str(root / "server.key"),
        str(root / "client.pem"),
        str(root / "client.key"),
        str(root / "other-ca.pem"),
    )


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd for the session (tests keep apart by prefix: ``etcd.url()`` makes a fresh one)."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data").start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(params=["sqlite", "etcd"])
def state_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A ``--state`` for each backend: a SQLite file, and a fresh prefix on the session's etcd."""
    if request.param == "sqlite":
        return str(tmp_path / "state.db")
    server: EtcdServer = request.getfixturevalue("etcd")
    return server.url()
