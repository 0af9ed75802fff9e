"""Launcher settings: one chain of types, and the rules every launcher applies to build it.

The chain, each default defined once at its own link::

    NodeSettings                  (here: the node's place in the job, the embedded controller)
      └─ agent: AgentConfig       (taskd_core.agent.config: controller, deadlines, identity)
           └─ dispatch: DispatchConfig   (how actions are carried out on the workers)

``taskd run``, ``taskdrun`` and ``MSRunPlugin`` all build a
:class:`NodeSettings` with the functions of this module, so they check values
the same way and read the reference's environment the same way:

- the value checks (:func:`check_host`, :func:`check_port`, :func:`parse_address`,
  and the text parsers :func:`parse_seconds`, :func:`parse_count`, :func:`parse_signal`,
  :func:`parse_controller`);
- the environment: :func:`controller_from_env` (``TASKD_CONTROLLER``, else
  ClusterD's ``MINDX_SERVER_IP`` with port 8899 unless it names one) and
  :func:`job_id_from_env` (``TASKD_JOB_ID``, else ``MINDX_TASK_ID``);
- the embedded controller's port rule, :func:`embedded_port`;
- the flags ``taskd run`` and ``taskdrun`` share, warm restarts included (:func:`add_node_options`,
  :func:`node_settings_from_args`; ``taskdrun`` prefixes them with ``taskd-``)
  and the environment names msrun reads (:func:`agent_config_from_env`);
- who the launch is (:func:`launch_identity`, :func:`default_job_id`) and what
  it shows the controller (:func:`job_credentials`: TLS files, the job token).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import ipaddress
import logging
import math
import secrets
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from taskd_core.agent.config import AgentConfig, DispatchConfig, RestartBackoff, check_seconds
from taskd_core.agent.hangs.config import ProgressConfig
from taskd_core.controller.policy import parse_strategies
from taskd_core.errors import ConfigError
from taskd_core.forkserver.client import ForkServerSettings
from taskd_core.launcher.interrupt import STOP_SIGNALS
from taskd_core.models import Credentials, JobPolicy

T = TypeVar("T")
logger = logging.getLogger(__name__)

#: The reference controller's (ClusterD's) gRPC port; the default for multi-node jobs.
DEFAULT_CONTROLLER_PORT = 8899


# --- value checks ---------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_host(host: str, what: str) -> None:
    """Raise :class:`ConfigError` unless ``host`` is an IP address or a plausible host name."""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    labels = host.split(".")
    if (
        not host
        or len(host) > 253
        or not all(
            label
            and len(label) <= 63
            and label.replace("-", "").replace("_", "").isalnum()
            and label[0] != "-"
            for label in labels
        )
    ):
        raise ConfigError(f"{what}: {host!r} is neither an IP address nor a host name")


def check_port(port: int, what: str, *, allow_zero: bool = False) -> None:
    """Raise :class:`ConfigError` unless ``port`` is a TCP port (0 only with ``allow_zero``)."""
    low = 0 if allow_zero else 1
    if not low <= port <= 65535:
        raise ConfigError(f"{what}: {port} is not a TCP port ({low}..65535)")


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


def join_address(host: str, port: int) -> str:
    """``HOST:PORT``, with an IPv6 host in brackets (what :func:`parse_address` reads back)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_seconds(text: str, what: str = "", *, positive: bool = False) -> float:
    """Finite seconds (>= 0, or > 0 with ``positive``) from ``text``; ``what`` names it in errors."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        where = f"{what}: " if what else ""
        rule = "> 0" if positive else ">= 0"
        raise ConfigError(f"{where}{text!r} is not a finite number of seconds {rule}")
    return value


def parse_count(text: str, what: str = "", *, low: int = 0) -> int:
    """A whole number >= ``low`` from ``text``; ``what`` names it in errors."""
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        where = f"{what}: " if what else ""
        raise ConfigError(f"{where}{text!r} is not a whole number >= {low}")
    return value


def parse_port(text: str, what: str = "port") -> int:
    """A TCP port from ``text``: 0..65535 (0 lets the system pick a free one)."""
    port = parse_count(text, what)
    check_port(port, what, allow_zero=True)
    return port


def parse_signal(text: str, what: str = "signal") -> signal.Signals:
    """A signal by name (``USR1``, ``SIGUSR1``) or number."""
    name = text.strip().upper()
    try:
        if name.isdigit():
            return signal.Signals(int(name))
        return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except (KeyError, ValueError):
        raise ConfigError(f"{what}: unknown signal {text!r}") from None


def parse_modules(text: str) -> tuple[str, ...]:
    """Module names, comma separated (``''`` for none)."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if not all(part.isidentifier() for part in n.split("."))]
    if bad:
        raise ConfigError(f"not module names: {', '.join(bad)}")
    return names


def parse_controller(text: str, what: str = "controller address") -> str:
    """A controller address, or several replicas' comma-separated, once each is ``HOST:PORT``."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise ConfigError(f"{what}: {text!r} has an empty address; give HOST:PORT[,HOST:PORT...]")
    for part in parts:
        parse_address(part, what)
    return ",".join(parts)


def controller_host(controller: str) -> str:
    """The host the job-token rule judges (:func:`job_credentials`): any replica beyond loopback counts."""
    hosts = [parse_address(part)[0] for part in controller.split(",")]
    return next((host for host in hosts if not is_loopback(host)), hosts[0])


def argtype(convert: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse ``type=`` from one of the parsers above: its :class:`ConfigError` becomes a usage error."""

    def checked(text: str) -> T:
        try:
            return convert(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    checked.__name__ = getattr(convert, "__name__", "value")
    return checked


# --- the reference's environment --------------------------------------------------------


def controller_from_env(env: Mapping[str, str]) -> str | None:
    """The controller the environment names: ``TASKD_CONTROLLER``, else ClusterD at ``MINDX_SERVER_IP``.

    ``MINDX_SERVER_IP`` is a host in the reference (ClusterD listens on its
    fixed port 8899); a value that already carries a port keeps it.
    :raises ConfigError: naming the variable, for a value that is no address.
    """
    explicit = env.get("TASKD_CONTROLLER", "").strip()
    if explicit:
        return parse_controller(explicit, "TASKD_CONTROLLER")
    server = env.get("MINDX_SERVER_IP", "").strip()
    if not server:
        return None
    has_port = server.rpartition(":")[2].isdigit() and (server.count(":") == 1 or server.startswith("["))
    if not has_port:
        server = f"[{server}]" if ":" in server else server
        server = f"{server}:{DEFAULT_CONTROLLER_PORT}"
    parse_address(server, "MINDX_SERVER_IP")
    return server


def job_id_from_env(env: Mapping[str, str]) -> str | None:
    """The job id the environment names: ``TASKD_JOB_ID``, else the reference's ``MINDX_TASK_ID``."""
    return env.get("TASKD_JOB_ID", "").strip() or env.get("MINDX_TASK_ID", "").strip() or None


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


def default_of(cls: type[Any], name: str) -> Any:
    """The default of field ``name`` of dataclass ``cls``, where it is defined."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            return f.default
    raise AttributeError(f"{cls.__name__} has no field {name!r}")


# --- who the launch is ------------------------------------------------------------------------


def launch_identity(nnodes: int, shared: str) -> str:
    """The identity of one launch of a job, the same on all its nodes.

    One node: random, so every launch differs. Several nodes: derived from
    ``shared``, what every node of the launch is given alike (the master
    address and port, torchrun's rendezvous, msrun's scheduler), so the nodes
    agree without talking; two live launches cannot share those (their
    rendezvous would collide).
    """
    if nnodes == 1:
        return secrets.token_hex(8)
    return hashlib.sha256(shared.encode()).hexdigest()[:16]


def default_job_id(launcher: str, launch: str) -> str:
    """The job id of a launch that names none: unique per launch (see :func:`launch_identity`)."""
    return f"{launcher}-{launch[:12]}"


def job_credentials(
    env: Mapping[str, str], *, tls_ca: str | None, nnodes: int, controller_host: str, launch: str
) -> Credentials:
    """What this node's agent shows the controller: TLS files, the job token and the launch identity.

    The token is ``TASKD_JOB_TOKEN``; a one-node launch without one generates
    its own (nobody else needs to know it). Several nodes must share one: a
    launch without it is refused unless its controller is on loopback, where
    the agents register as a legacy job.
    """
    credentials = Credentials.from_env(env, tls_ca=tls_ca)
    token = credentials.token
    if not token and nnodes == 1:
        token = secrets.token_urlsafe(32)
    elif not token and not is_loopback(controller_host):
        raise ConfigError(
            "a job on several nodes needs TASKD_JOB_TOKEN: set it to the same secret on every node "
            "(see docs/security.md)"
        )
    elif not token:
        logger.warning("TASKD_JOB_TOKEN is not set: the job registers without a token (legacy job)")
    return dataclasses.replace(credentials, token=token, launch=launch)


# --- the chain's outer link ---------------------------------------------------------------


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
    master_addr: str = "127.0.0.1"
    #: where node 0 publishes its embedded controller's address for the others (see ``controller_address``).
    board: ControllerBoard | None = None
    controller_port: int = DEFAULT_CONTROLLER_PORT
    #: SQLite state file of an embedded controller.
    controller_state: str = ":memory:"
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

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ConfigError(f"nnodes must be at least 1, not {self.nnodes}")
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


# --- the flags taskd run and taskdrun share ----------------------------------------------------


def _dest(prefix: str, name: str) -> str:
    return (prefix + name).replace("-", "_")


#: Hang detection's settings: flag name -> (ProgressConfig field, environment variable msrun reads, help).
HANG_OPTIONS: dict[str, tuple[str, str, str]] = {
    "hang-timeout": (
        "heartbeat_timeout",
        "TASKD_HANG_TIMEOUT",
        "seconds without a heartbeat that make a rank hung (default: learned from the job)",
    ),
    "hang-floor": ("floor", "TASKD_HANG_FLOOR", "lowest learned timeout, seconds"),
    "hang-ceiling": (
        "ceiling",
        "TASKD_HANG_CEILING",
        "highest learned timeout (and the one before learning), seconds",
    ),
    "stopped-bound": ("stopped_bound", "TASKD_STOPPED_BOUND", "seconds a rank may stay stopped (state T)"),
    "disk-sleep-bound": (
        "disk_sleep_bound",
        "TASKD_DISK_SLEEP_BOUND",
        "seconds a rank may stay in uninterruptible sleep (state D)",
    ),
}
#: Environment variable that turns hang detection off for msrun jobs ("0").
HANG_DETECTION_ENV = "TASKD_HANG_DETECTION"


def progress_config(enabled: bool, values: Mapping[str, float | None]) -> ProgressConfig:
    """A :class:`ProgressConfig` from :data:`HANG_OPTIONS` values by flag name (None: the default)."""
    given = {HANG_OPTIONS[name][0]: value for name, value in values.items() if value is not None}
    return ProgressConfig(enabled=enabled, **given)  # type: ignore[arg-type]


def _add_hang_options(parser: argparse.ArgumentParser, p: str) -> None:
    g = parser.add_argument_group("hang detection")
    g.add_argument(
        f"{p}no-hang-detection",
        action="store_true",
        help="do not watch workers for hangs (stopped, D state, heartbeats, sections, torch file timers)",
    )
    positive_seconds = argtype(lambda t: parse_seconds(t, positive=True))
    for name, (attr, _, text) in HANG_OPTIONS.items():
        default = default_of(ProgressConfig, attr)
        g.add_argument(
            f"{p}{name}",
            type=positive_seconds,
            default=None,
            metavar="SECONDS",
            help=f"{text}{'' if default is None else f' (default: {default:g})'}",
        )


def add_node_options(parser: argparse.ArgumentParser, prefix: str = "", *, published: bool = False) -> None:
    """Add the agent, controller and policy flags, named ``--<prefix><name>``, defaults from the types.

    :param published: the launcher publishes its embedded controller's address
        in its rendezvous (see :func:`embedded_port`); the help says so.
    """
    p = f"--{prefix}"
    g = parser.add_argument_group("TaskD controller" if prefix else "controller")
    if published:
        embedded = (
            "the node the rendezvous makes rank 0 hosts an embedded controller and publishes its address "
            "in the rendezvous store"
        )
        port_default = "any free port; the other nodes read it from the rendezvous store"
    else:
        embedded = "node 0 hosts an embedded controller and the other nodes reach it at the master address"
        port_default = f"any free port on one node, {DEFAULT_CONTROLLER_PORT} on several"
    g.add_argument(
        f"{p}controller",
        type=argtype(parse_controller),
        default=None,
        metavar="HOST:PORT[,...]",
        help=f"a running controller, or every replica of one, comma-separated (default: $TASKD_CONTROLLER, "
        f"else $MINDX_SERVER_IP:8899 as in ClusterD; without either, {embedded})",
    )
    g.add_argument(
        f"{p}controller-port",
        type=argtype(parse_count),
        default=None,
        metavar="PORT",
        help=f"port of the embedded controller (default: {port_default})",
    )
    g.add_argument(
        f"{p}metrics-port",
        type=argtype(parse_port),
        default=None,
        metavar="PORT",
        help="node 0's embedded controller serves Prometheus /metrics on this port "
        "(default: off; docs/metrics.md)",
    )
    g.add_argument(
        f"{p}job-id",
        default=None,
        metavar="ID",
        help="job id, the same on every node (default: $TASKD_JOB_ID, else $MINDX_TASK_ID, else unique per "
        "launch)",
    )
    g.add_argument(
        f"{p}tls-ca",
        default=None,
        metavar="FILE",
        help="CA of the controller's certificate: talk TLS (default: $TASKD_TLS_CA). $TASKD_TLS_CERT and "
        "$TASKD_TLS_KEY add a client certificate (mutual TLS); on node 0 they also make the embedded "
        "controller "
        "serve mutual TLS. The job token is $TASKD_JOB_TOKEN (see docs/security.md)",
    )
    g.add_argument(
        f"{p}insecure",
        action="store_true",
        help="let node 0's embedded controller serve plaintext on a non-loopback master address",
    )
    seconds = argtype(parse_seconds)
    positive_seconds = argtype(lambda t: parse_seconds(t, positive=True))
    agent_seconds = {
        "connect-timeout": ("seconds to keep trying to reach the controller", AgentConfig, "connect_timeout"),
        "report-deadline": (
            "seconds a report keeps retrying an unreachable controller",
            AgentConfig,
            "report_deadline",
        ),
        "health-interval": (
            "seconds between the agent's health checks of the controller (> 0)",
            AgentConfig,
            "health_interval",
        ),
        "linger": (
            "node 0 hosting the controller: seconds to wait for the other nodes' agents to end",
            NodeSettings,
            "linger",
        ),
        "stop-timeout": (
            "seconds between SIGTERM and SIGKILL when workers are stopped",
            DispatchConfig,
            "stop_timeout",
        ),
        "dump-grace": ("seconds workers get to save after the dump signal", DispatchConfig, "dump_grace"),
        "live-timeout": (
            "seconds every local worker gets to join a live recovery round (recover-live) before "
            "the node reports it failed and the job falls back to a full restart",
            DispatchConfig,
            "live_timeout",
        ),
        "restart-backoff": (
            (
                "delay before restarting a worker that failed right after its start for the 2nd time "
                "in a row, doubling each further time; 0 turns it off"
            ),
            RestartBackoff,
            "initial",
        ),
        "restart-backoff-max": ("longest restart backoff delay", RestartBackoff, "cap"),
        "healthy-after": (
            "seconds a worker must run for its failure not to count as a crash loop",
            RestartBackoff,
            "healthy_after",
        ),
    }
    for name, (text, cls, attr) in agent_seconds.items():
        g.add_argument(
            f"{p}{name}",
            type=positive_seconds if name == "health-interval" else seconds,
            default=default_of(cls, attr),
            metavar="SECONDS",
            help=f"{text} (default: %(default)s)",
        )
    g.add_argument(
        f"{p}dump-signal",
        type=argtype(parse_signal),
        default=default_of(DispatchConfig, "dump_signal"),
        metavar="SIGNAL",
        help="signal asking workers to save their state (default: SIGUSR1)",
    )
    warm = parser.add_argument_group("TaskD warm restarts" if prefix else "warm restarts")
    warm.add_argument(
        f"{p}no-fork-server", dest=_dest(prefix, "fork-server"), action="store_false",
        help="start every worker by exec instead of forking Python workers from a fork server that has "
        "already imported the framework",
    )
    warm.add_argument(
        f"{p}fork-server-preload", type=argtype(parse_modules), default=None, metavar="MODULES",
        help="modules the fork server imports before its first fork, comma separated, '' for none (default: "
        "torch; taskd run: torch if the script imports torch, else none; modules not installed are skipped, "
        "and the server also imports the installed modules the workers imported)",
    )
    policy = JobPolicy()
    pol = parser.add_argument_group("recovery policy (embedded controller only)")
    pol.add_argument(
        f"{p}strategies",
        type=argtype(parse_strategies),
        default=policy.strategies,
        metavar="LIST",
        help="strategies the embedded controller may choose, comma separated (default: "
        + ",".join(s.value for s in policy.strategies)
        + ")",
    )
    pol.add_argument(
        f"{p}max-cycles",
        type=argtype(parse_count),
        default=None,
        metavar="N",
        help=f"recovery cycles before the job is given up (default: {policy.max_cycles})",
    )
    pol.add_argument(
        f"{p}cycle-window",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="seconds over which the cycle budget counts; 0: the job's whole life "
        f"(default: {policy.cycle_window:g})",
    )
    pol.add_argument(
        f"{p}report-timeout",
        type=seconds,
        default=policy.report_timeout,
        metavar="SECONDS",
        help="deadline of each of the embedded controller's waits for the agents (default: %(default)s)",
    )
    pol.add_argument(
        f"{p}flush-seconds",
        type=seconds,
        default=policy.flush_seconds,
        metavar="SECONDS",
        help="window in which the embedded controller collects faults that arrive together "
        "(default: %(default)s)",
    )
    _add_hang_options(parser, p)


def node_settings_from_args(
    args: argparse.Namespace,
    env: Mapping[str, str],
    *,
    prefix: str = "",
    launcher: str,
    shared: str,
    job_id: str | None = None,
    node_rank: int,
    nnodes: int,
    master_addr: str,
    max_cycles: int | None = None,
    controller_state: str = ":memory:",
    stop_signals: tuple[signal.Signals, ...] = STOP_SIGNALS,
    published: bool = False,
) -> NodeSettings:
    """The :class:`NodeSettings` of the flags :func:`add_node_options` added.

    :param launcher: the launcher's name, which starts its default job ids.
    :param shared: what every node of this launch is given alike (see :func:`launch_identity`).
    :param job_id: the launcher's own job id when neither the flag nor the environment gives one;
        None: unique per launch (:func:`default_job_id`).
    :param max_cycles: the launcher's cycle budget when the flag is not given (default: the policy's).
    :param published: the launcher will publish its embedded controller's
        address on a :class:`ControllerBoard` (see :func:`embedded_port`).
    """

    def arg(name: str) -> Any:
        return getattr(args, _dest(prefix, name))

    controller = arg("controller") or controller_from_env(env) or ""
    if controller:
        # The budget is the controller's policy: a flag the controller never hears must not look obeyed.
        for name in ("max-cycles", "cycle-window"):
            if arg(name) is not None:
                raise ConfigError(
                    f"--{prefix}{name} sets the budget of the embedded controller, but this job uses the "
                    f"controller at {controller}: set it in that controller's policy (taskd controller "
                    f"--{name} or its --policy file) and drop the flag here"
                )
    window = arg("cycle-window")
    launch = launch_identity(nnodes, shared)
    credentials = job_credentials(
        env,
        tls_ca=arg("tls-ca"),
        nnodes=nnodes,
        controller_host=controller_host(controller) if controller else master_addr,
        launch=launch,
    )
    cycles = arg("max-cycles")
    if cycles is None:
        cycles = default_of(JobPolicy, "max_cycles") if max_cycles is None else max_cycles
    agent = AgentConfig(
        job_id=arg("job-id") or job_id_from_env(env) or job_id or default_job_id(launcher, launch),
        controller=controller,
        node_rank=node_rank,
        connect_timeout=arg("connect-timeout"),
        report_deadline=arg("report-deadline"),
        health_interval=arg("health-interval"),
        dispatch=DispatchConfig(
            arg("stop-timeout"), arg("dump-signal"), arg("dump-grace"), arg("live-timeout")
        ),
        credentials=credentials,
        progress=progress_config(not arg("no-hang-detection"), {name: arg(name) for name in HANG_OPTIONS}),
        restart_backoff=RestartBackoff(
            arg("restart-backoff"), arg("restart-backoff-max"), arg("healthy-after")
        ),
    )
    return NodeSettings(
        agent=agent,
        nnodes=nnodes,
        master_addr=master_addr,
        controller_port=embedded_port(
            arg("controller-port"), nnodes=nnodes, controller=controller, published=published
        ),
        controller_state=controller_state,
        metrics_port=arg("metrics-port"),
        policy=JobPolicy(
            strategies=arg("strategies"),
            report_timeout=arg("report-timeout"),
            flush_seconds=arg("flush-seconds"),
            max_cycles=cycles,
            cycle_window=default_of(JobPolicy, "cycle_window") if window is None else window,
            # Every node's agent must answer before a cycle step ends.
            expected_agents=nnodes,
        ),
        linger=arg("linger"),
        stop_signals=stop_signals,
        insecure=arg("insecure"),
        fork_server=ForkServerSettings(enabled=arg("fork-server"), preload=arg("fork-server-preload")),
    )


# --- the environment names msrun reads --------------------------------------------------------


def env_seconds(env: Mapping[str, str], key: str, default: float, *, positive: bool = False) -> float:
    """Seconds from ``env[key]``; ``default`` when unset or empty."""
    text = env.get(key, "").strip()
    return parse_seconds(text, key, positive=positive) if text else default


def env_count(env: Mapping[str, str], key: str, default: int) -> int:
    """A whole number >= 0 from ``env[key]``; ``default`` when unset or empty."""
    text = env.get(key, "").strip()
    return parse_count(text, key) if text else default


def agent_config_from_env(
    env: Mapping[str, str], *, job_id: str, node_rank: int, credentials: Credentials | None = None
) -> AgentConfig:
    """The agent's settings from ``TASKD_*`` variables (``TASKD_STOP_TIMEOUT``, ``TASKD_DUMP_GRACE``,
    ``TASKD_CONNECT_TIMEOUT``, ``TASKD_REPORT_DEADLINE``, ``TASKD_HEALTH_INTERVAL``, hang detection's
    ``TASKD_HANG_DETECTION`` (0 turns it off) and the variables of :data:`HANG_OPTIONS`) and the controller's;
    ``credentials`` from :func:`job_credentials`."""

    def seconds(key: str, cls: type[Any], attr: str, positive: bool = False) -> float:
        value: float = env_seconds(env, key, default_of(cls, attr), positive=positive)
        return value

    return AgentConfig(
        job_id=job_id,
        controller=controller_from_env(env) or "",
        node_rank=node_rank,
        connect_timeout=seconds("TASKD_CONNECT_TIMEOUT", AgentConfig, "connect_timeout"),
        report_deadline=seconds("TASKD_REPORT_DEADLINE", AgentConfig, "report_deadline"),
        health_interval=seconds("TASKD_HEALTH_INTERVAL", AgentConfig, "health_interval", positive=True),
        dispatch=DispatchConfig(
            stop_timeout=seconds("TASKD_STOP_TIMEOUT", DispatchConfig, "stop_timeout"),
            dump_grace=seconds("TASKD_DUMP_GRACE", DispatchConfig, "dump_grace"),
        ),
        credentials=credentials or Credentials(),
        progress=progress_from_env(env),
    )


def progress_from_env(env: Mapping[str, str]) -> ProgressConfig:
    switch = env.get(HANG_DETECTION_ENV, "1").strip() or "1"
    if switch not in ("0", "1"):
        raise ConfigError(f"{HANG_DETECTION_ENV}: {switch!r} is neither 0 (off) nor 1 (on)")
    values = {}
    for name, (_, key, _) in HANG_OPTIONS.items():
        text = env.get(key, "").strip()
        values[name] = parse_seconds(text, key, positive=True) if text else None
    return progress_config(switch == "1", values)
