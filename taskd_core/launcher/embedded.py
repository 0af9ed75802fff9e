"""Which controller a launcher talks to: the one rule shared by ``taskd run`` and the framework adapters.

Launchers do not make users run a controller for a single job. The rule:

1. an explicit controller address (``--controller HOST:PORT``) always wins;
2. otherwise node 0 starts an embedded controller inside its own launcher
   process, listening on ``controller_port`` — on every interface, or only on
   ``127.0.0.1`` when the job's master address is loopback (a one-machine job
   needs no open port);
3. every other node reaches it at ``MASTER_ADDR:controller_port``, the same
   host that serves the job's rendezvous.

The embedded controller lives exactly as long as the ``with`` block, so it
ends with node 0's launcher: the job's state is in memory unless a state file
is given. Before leaving the block, node 0 should :func:`wait_for_agents`, so
that the other nodes' agents can still report their end to it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from taskd_core.errors import ConfigError
from taskd_core.launcher.spec import check_host, check_port, is_loopback
from taskd_core.models import JobPolicy
from taskd_core.rpc import recover_pb2 as pb
from taskd_core.rpc import recover_pb2_grpc

logger = logging.getLogger(__name__)

#: The reference controller's (ClusterD's) gRPC port; the default for multi-node jobs.
DEFAULT_CONTROLLER_PORT = 8899
#: How often :func:`wait_for_agents` asks the controller again.
_AGENT_POLL = 0.2


@dataclass(frozen=True, slots=True)
class ControllerEndpoint:
    """The controller a node's agent uses, and whether this process hosts it."""

    address: str
    embedded: bool


def parse_address(address: str, what: str = "controller address") -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[::1]:PORT``) split and checked; raises :class:`ConfigError`."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ConfigError(f"{what}: {address!r} is not HOST:PORT")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    check_host(host, what)
    port = int(port_text)
    check_port(port, what)
    return host, port


@contextlib.contextmanager
def controller_address(
    explicit: str | None,
    *,
    node_rank: int,
    master_addr: str,
    controller_port: int,
    policy: JobPolicy,
    state: str = ":memory:",
) -> Iterator[ControllerEndpoint]:
    """Yield the controller this node's agent must use (``HOST:PORT``, and whether it is embedded here).

    :param explicit: an address given by the user; used as it is (checked).
    :param node_rank: only node 0 starts an embedded controller.
    :param master_addr: the job's master host; the other nodes reach node 0 there.
    :param controller_port: port of the embedded controller; 0 (any free port)
        only works for a one-node job, whose agent is told the bound port.
    :param policy: default recovery policy of the embedded controller.
    :param state: its SQLite state file, ``":memory:"`` for none.
    :raises ConfigError: for an address or port that cannot work.
    """
    if explicit:
        parse_address(explicit)
        yield ControllerEndpoint(explicit, embedded=False)
        return
    check_port(controller_port, "controller port", allow_zero=node_rank == 0)
    if node_rank != 0:
        yield ControllerEndpoint(f"{master_addr}:{controller_port}", embedded=False)
        return
    # Imported here: only node 0 without --controller needs the controller's code.
    from taskd_core.controller.server import EmbeddedController

    bind = "127.0.0.1" if is_loopback(master_addr) else "0.0.0.0"
    with EmbeddedController(listen=f"{bind}:{controller_port}", state=state, defaults=policy) as controller:
        logger.info("embedded controller listening on %s:%s", bind, controller.port)
        # Node 0's own agent always reaches it over loopback, whatever interface serves the others.
        yield ControllerEndpoint(f"127.0.0.1:{controller.port}", embedded=True)


def wait_for_agents(address: str, job_id: str, agents: int, timeout: float) -> bool:
    """Wait until ``agents`` agents of ``job_id`` have reported their end to the controller at ``address``.

    Node 0 calls this before its embedded controller stops with it: an agent
    on another node that is still finishing would otherwise lose the
    controller and could not report. True when all have ended, False at the
    deadline (logged; the caller goes on regardless).
    """
    deadline = time.monotonic() + timeout
    ended = 0
    with grpc.insecure_channel(address) as channel:
        stub = recover_pb2_grpc.RecoverStub(channel)
        while True:
            remaining = deadline - time.monotonic()
            try:
                reply = stub.QueryStatus(pb.StatusQuery(jobId=job_id), timeout=max(remaining, 0.1))
                jobs = [j for j in reply.jobs if j.jobId == job_id]
                ended = sum(1 for a in jobs[0].agents if a.exitState) if jobs else 0
            except grpc.RpcError as exc:
                logger.warning("cannot ask the controller about job %s: %s", job_id, exc.details())
                return False
            if ended >= agents:
                return True
            if remaining <= 0:
                logger.warning(
                    "only %s of %s agents of job %s ended within %.1fs", ended, agents, job_id, timeout
                )
                return False
            time.sleep(min(_AGENT_POLL, remaining))
