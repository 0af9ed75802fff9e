"""Which controller a launcher talks to: the one rule shared by ``taskd run`` and the framework adapters.

Launchers do not make users run a controller for a single job. The rule:

1. an explicit controller address (``--controller HOST:PORT``) always wins;
2. otherwise node 0 starts an embedded controller inside its own launcher
   process, listening on ``controller_port`` where the other nodes dial it
   (:func:`bind_host`): on the master address itself when that is loopback (a
   one-machine job needs no open port; ``127.0.0.2`` is loopback too), else on
   every interface;
3. every other node reaches it at ``MASTER_ADDR:controller_port``, the same
   host that serves the job's rendezvous.

A launcher whose nodes learn their rank from a rendezvous (``taskdrun`` with
torchrun's c10d or etcd rendezvous, where no node knows beforehand that it is
node 0) passes a :class:`ControllerBoard` instead: the node the rendezvous made
rank 0 starts the controller (on any free port unless one is given) and
publishes its address there, and every other node reads it from there.

A state in etcd (``state="etcd://HOSTS/PREFIX"``) changes the rule: no node is
special. Every node starts a controller *replica* on that state, one of them
is elected leader, and each announces its address in the job's
:class:`~taskd_core.launcher.roster.Roster`; every agent is given all the
replicas (its own first) and follows the leader, whichever node it is on, so
the loss of any node (the leader's included) leaves the job a controller.

The embedded controller lives exactly as long as the ``with`` block, so it
ends with node 0's launcher: the job's state is in memory unless a state file
is given. Before leaving the block, node 0 should :func:`~taskd_core.launcher.node.wait_for_agents`, so
that the other nodes' agents can still report their end to it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from taskd_core.controller.etcd_client import EtcdTls, is_etcd_url, parse_etcd_url
from taskd_core.launcher.settings import ControllerBoard
from taskd_core.models import Credentials, JobPolicy
from taskd_core.values import LOCALHOST, check_port, is_loopback, join_address, parse_controller

if TYPE_CHECKING:
    from taskd_core.controller.server import EmbeddedController
    from taskd_core.rpc.security import ServerTls

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ControllerEndpoint:
    """The controller a node's agent uses, and whether this process hosts it."""

    address: str
    embedded: bool
    #: the leading replica's address as this process's replica knows it (a replicated controller only).
    leader: Callable[[], str] | None = None


def bind_host(master_addr: str) -> str:
    """Where node 0's embedded controller listens so that the nodes dialling ``master_addr`` reach it.

    A loopback master address is bound itself (``localhost`` as ``127.0.0.1``):
    every node dials exactly it, and nothing beyond this machine can. Any other
    master address is served on every interface of its family, which includes
    the one the master address names (a name may resolve to an address behind
    a NAT or a service, which could not be bound).
    """
    if is_loopback(master_addr):
        return LOCALHOST if master_addr.lower() == "localhost" else master_addr
    try:
        family = ipaddress.ip_address(master_addr).version
    except ValueError:
        family = 4
    return "::" if family == 6 else "0.0.0.0"


def dial_host(bind: str, master_addr: str, *, tls: bool) -> str:
    """Where node 0's own agent reaches the controller bound at ``bind``.

    Over loopback whatever interface serves the others; with TLS at the master
    address, the name its certificate carries for the other nodes.
    """
    if tls:
        return master_addr
    if is_loopback(bind):
        return bind
    return "::1" if bind == "::" else LOCALHOST


@contextlib.contextmanager
def controller_address(
    explicit: str | None,
    *,
    node_rank: int,
    master_addr: str,
    controller_port: int,
    policy: JobPolicy,
    state: str = ":memory:",
    credentials: Credentials | None = None,
    insecure: bool = False,
    metrics_port: int | None = None,
    board: ControllerBoard | None = None,
    lookup_timeout: float = 60.0,
    nnodes: int = 1,
    job_id: str = "",
    etcd_tls: EtcdTls | None = None,
    agent_id: str = "",
) -> Iterator[ControllerEndpoint]:
    """Yield the controller this node's agent must use (``HOST:PORT``, and whether it is embedded here).

    :param explicit: an address given by the user; used as it is (checked).
    :param node_rank: only node 0 starts an embedded controller.
    :param master_addr: the job's master host; the other nodes reach node 0 there.
    :param controller_port: port of the embedded controller; 0 (any free port)
        only works for a one-node job, whose agent is told the bound port, or with a ``board``.
    :param policy: default recovery policy of the embedded controller.
    :param state: its SQLite state file, ``":memory:"`` for none; an ``etcd://`` URL makes
        every node run a replica (see the module).
    :param credentials: with a certificate and key, the embedded controller serves mutual
        TLS with them, requiring client certificates signed by their CA.
    :param insecure: let it serve plaintext on a non-loopback address.
    :param metrics_port: where it serves Prometheus ``/metrics`` (same interface, HTTPS with TLS); None: off.
    :param board: where node 0 publishes the controller's address and the
        other nodes read it (they then ignore ``master_addr`` and ``controller_port``).
    :param lookup_timeout: seconds the other nodes wait for the address on the board
        (with an etcd state: for the other replicas to announce themselves).
    :param nnodes: the job's nodes; with an etcd state, the replicas an agent waits to know.
    :param job_id: the job, whose token signs the replicas' addresses.
    :param etcd_tls: TLS files for an etcd that requires them.
    :param agent_id: the id of the agent this process runs beside an etcd replica (see
        :func:`replicated_controller`).
    :raises ConfigError: for an address or port that cannot work, or plaintext beyond loopback.
    """
    if explicit:
        yield ControllerEndpoint(parse_controller(explicit), embedded=False)
        return
    if is_etcd_url(state):
        with replicated_controller(
            state,
            host=master_addr,
            controller_port=controller_port,
            policy=policy,
            credentials=credentials or Credentials(),
            insecure=insecure,
            metrics_port=metrics_port,
            nnodes=nnodes,
            job_id=job_id,
            etcd_tls=etcd_tls,
            lookup_timeout=lookup_timeout,
            agent_id=agent_id,
        ) as endpoint:
            yield endpoint
        return
    check_port(controller_port, "controller port", allow_zero=node_rank == 0 or board is not None)
    if node_rank != 0:
        address = board.lookup(lookup_timeout) if board else join_address(master_addr, controller_port)
        yield ControllerEndpoint(address, embedded=False)
        return
    own = credentials or Credentials()
    tls = server_tls(own)
    # It serves this launch's token only: another local user can neither register on it nor flood it.
    with _embedded(
        master_addr, controller_port, policy, state, tls, insecure, metrics_port, job_token=own.token
    ) as controller:
        bind = bind_host(master_addr)
        logger.info(
            "embedded controller listening on %s (%s)",
            join_address(bind, controller.port),
            "mutual TLS" if tls else "plaintext",
        )
        if board is not None:
            board.publish(join_address(master_addr, controller.port))
        host = dial_host(bind, master_addr, tls=tls is not None)
        yield ControllerEndpoint(join_address(host, controller.port), embedded=True)


@contextlib.contextmanager
def _embedded(
    host: str,
    port: int,
    policy: JobPolicy,
    state: str,
    tls: ServerTls | None,
    insecure: bool,
    metrics_port: int | None,
    **replica: Any,
) -> Iterator[EmbeddedController]:
    """An embedded controller where the other nodes reach ``host`` (:func:`bind_host`), on ``port``."""
    # Imported here: only a node that embeds a controller needs the controller's code.
    from taskd_core.controller.server import EmbeddedController

    bind = bind_host(host)
    with EmbeddedController(
        listen=join_address(bind, port),
        state=state,
        defaults=policy,
        tls=tls,
        insecure=insecure,
        metrics_port=metrics_port,
        **replica,
    ) as controller:
        if controller.metrics_port is not None:
            scheme = "https" if tls else "http"
            logger.info(
                "embedded controller metrics on %s://%s/metrics",
                scheme,
                join_address(bind, controller.metrics_port),
            )
        yield controller


def server_tls(credentials: Credentials) -> ServerTls | None:
    """What an embedded controller serves: mutual TLS with the agent's own files, when it has them."""
    from taskd_core.rpc.security import ServerTls

    if not (credentials.tls_cert and credentials.tls_key):
        return None
    return ServerTls(credentials.tls_cert, credentials.tls_key, credentials.tls_ca)


@contextlib.contextmanager
def replicated_controller(
    state: str,
    *,
    host: str,
    controller_port: int,
    policy: JobPolicy,
    credentials: Credentials,
    insecure: bool,
    metrics_port: int | None,
    nnodes: int,
    job_id: str,
    etcd_tls: EtcdTls | None,
    lookup_timeout: float,
    agent_id: str = "",
) -> Iterator[ControllerEndpoint]:
    """This node's replica of the job's controller on the etcd ``state``; yields every replica's address.

    The replica listens where the other nodes reach ``host`` (:func:`bind_host`), on
    ``controller_port`` (0: any free one), and is advertised at ``host``. Leaving the
    block stops it and takes it out of the roster; the last replica of the job
    removes the job's state from etcd. ``agent_id`` is this node's agent, which lives and
    dies with this process: a replica that finds this one's process gone while it led
    declares that agent lost at once (:class:`~taskd_core.controller.election.ReplicaIdentity`).
    """
    from taskd_core.launcher.roster import Roster

    check_port(controller_port, "controller port", allow_zero=True)
    tls = server_tls(credentials)
    target = parse_etcd_url(state, etcd_tls)
    # Port 0 is the bound one: on one machine the replicas' addresses differ by it alone.
    replica = {
        "advertise": join_address(host, 0),
        "etcd_tls": etcd_tls,
        "job_token": credentials.token,
        "beside": agent_id,
    }
    with _embedded(host, controller_port, policy, state, tls, insecure, metrics_port, **replica) as served:
        advertised = join_address(host, served.port)
        logger.info(
            "controller replica listening on %s (%s), state %s: %s",
            join_address(bind_host(host), served.port),
            "mutual TLS" if tls else "plaintext",
            state,
            "leading" if served.leading else f"standing by, leader {served.leader or 'unknown'}",
        )
        roster = Roster(target, job_id, credentials.token)
        try:
            roster.announce(advertised)
            addresses = roster.addresses(nnodes, lookup_timeout)
            yield ControllerEndpoint(",".join(addresses), embedded=True, leader=lambda: served.leader)
        finally:
            served.stop()
            roster.close(last_clears=target.prefix.encode() + b"/")
