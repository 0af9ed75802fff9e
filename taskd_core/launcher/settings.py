"""Launcher settings: the chain's outer link, :class:`NodeSettings`, and the embedded controller's port rule.

The chain, each default defined once at its own link::

    NodeSettings                  (here: the node's place in the job, the embedded controller)
      └─ agent: AgentConfig       (taskd_core.agent.config: controller, deadlines, identity)
           └─ dispatch: DispatchConfig   (how actions are carried out on the workers)

``taskd run``, ``taskdrun`` and ``MSRunPlugin`` build it with one builder,
:func:`taskd_core.launcher.flags.node_settings`, from the shared flags and the
environment; the values themselves are checked by :mod:`taskd_core.values`.
"""

from __future__ import annotations

import dataclasses
import signal
from dataclasses import dataclass, field
from typing import Any, Protocol

from taskd_core.agent.config import AgentConfig
from taskd_core.controller.etcd_client import EtcdTls
from taskd_core.errors import ConfigError
from taskd_core.forkserver.client import ForkServerSettings
from taskd_core.launcher.interrupt import STOP_SIGNALS
from taskd_core.models import JobPolicy
from taskd_core.snapshots.settings import SnapshotSettings
from taskd_core.values import (
    DEFAULT_CONTROLLER_PORT,
    LOCALHOST,
    MAX_NODES,
    check_count,
    check_host,
    check_port,
    check_seconds,
)


def default_of(cls: type[Any], name: str) -> Any:
    """The default of field ``name`` of dataclass ``cls``, where it is defined."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            return f.default
    raise AttributeError(f"{cls.__name__} has no field {name!r}")


def embedded_port(
    port: int | None,
    *,
    nnodes: int,
    controller: str,
    multi_node: int = DEFAULT_CONTROLLER_PORT,
    published: bool = False,
) -> int:
    """The port of node 0's embedded controller.

    Given ``port`` wins; otherwise one node takes any free port (nobody else
    needs to find it) and several nodes take ``multi_node``, a port every
    node knows. Port 0 with several nodes and no explicit ``controller``
    cannot work: the other nodes could not find it — unless the launcher
    ``published`` the bound port on a :class:`ControllerBoard`, when any free
    port is the default on any number of nodes.
    """
    if port is None:
        return 0 if nnodes == 1 or published else multi_node
    check_port(port, "controller port", allow_zero=True)
    if port == 0 and nnodes > 1 and not controller and not published:
        raise ConfigError("controller port 0 only works for one node: the other nodes must know the port")
    return port


class ControllerBoard(Protocol):
    """Where the node hosting the embedded controller announces its address and the others read it.

    For launchers whose nodes learn their rank from a rendezvous (``taskdrun``):
    no node knows beforehand that it will be node 0, so none can know a fixed address.
    """

    def publish(self, address: str) -> None:
        """Announce ``HOST:PORT`` to the job's other nodes."""

    def lookup(self, timeout: float) -> str:
        """The announced ``HOST:PORT``, waiting up to ``timeout`` seconds.

        :raises TaskdError: at the deadline.
        """


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """Where this node sits in its job, the controller it embeds or reaches, and its agent's settings.

    ``agent.controller`` is the explicit controller address; empty applies the
    embedding rule (:func:`taskd_core.launcher.embedded.controller_address`).
    """

    agent: AgentConfig
    nnodes: int = 1
    #: the job's master host: where other nodes reach node 0's embedded controller.
    master_addr: str = LOCALHOST
    #: where node 0 publishes its embedded controller's address for the others (see ``controller_address``).
    board: ControllerBoard | None = None
    controller_port: int = DEFAULT_CONTROLLER_PORT
    #: state of an embedded controller: a SQLite file, ``":memory:"``, or ``etcd://HOSTS/PREFIX``
    #: (then every node runs a replica of the job's controller on it).
    controller_state: str = ":memory:"
    #: TLS files for the etcd of an ``etcd://`` state; None: plaintext.
    etcd_tls: EtcdTls | None = None
    #: port of an embedded controller's Prometheus ``/metrics`` (0: any free port); None: off.
    metrics_port: int | None = None
    #: recovery policy of an embedded controller.
    policy: JobPolicy = field(default_factory=JobPolicy)
    #: node 0 with an embedded controller: seconds to wait for the other agents to end.
    linger: float = 60.0
    #: signals that stop the job while the agent runs (``taskdrun`` adds SIGHUP, as torchrun does).
    stop_signals: tuple[signal.Signals, ...] = STOP_SIGNALS
    #: let an embedded controller on a non-loopback address serve plaintext.
    insecure: bool = False
    #: warm restarts: whether and how Python workers are forked from a fork server.
    fork_server: ForkServerSettings = field(default_factory=ForkServerSettings)
    #: memory snapshots: the node keeper's directory, budget and peer copies.
    snapshots: SnapshotSettings = field(default_factory=SnapshotSettings)

    def __post_init__(self) -> None:
        check_count(self.nnodes, "nnodes", low=1, high=MAX_NODES)
        if self.agent.node_rank >= self.nnodes:
            raise ConfigError(
                f"node rank {self.agent.node_rank} is outside 0..{self.nnodes - 1} (nnodes {self.nnodes})"
            )
        check_host(self.master_addr, "master address")
        check_seconds(self.linger, "linger")
        if self.metrics_port is not None:
            check_port(self.metrics_port, "metrics port", allow_zero=True)

    @property
    def job_id(self) -> str:
        return self.agent.job_id

    @property
    def node_rank(self) -> int:
        return self.agent.node_rank
