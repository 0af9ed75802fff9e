"""The settings every launcher shares, each defined once, and the one builder of :class:`NodeSettings`.

Each :class:`Option` is a flag (``taskd run --stop-timeout``, ``taskdrun
--taskd-stop-timeout``), an environment variable (``TASKD_STOP_TIMEOUT``: the
name in capitals), a parser from :mod:`taskd_core.values` and the field of the
settings chain it sets, whose default is the option's. A flag not given falls
back to its variable, then to the launcher's own default, then to the field's
(as torchrun's ``env`` argparse action does; the help names the variable).
:class:`OptionValues` is that lookup; msrun, which has no TaskD flags, reads the
variables alone. :func:`node_settings` is the builder all three launchers share.
"""

from __future__ import annotations

import argparse
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from taskd_core.agent.config import AgentConfig, DispatchConfig, RestartBackoff
from taskd_core.agent.hangs.config import ProgressConfig
from taskd_core.controller.policy import parse_slow_rank, parse_strategies
from taskd_core.errors import ConfigError
from taskd_core.forkserver.client import ForkServerSettings
from taskd_core.launcher.environment import controller_from_env, job_id_from_env
from taskd_core.launcher.identity import controller_host, default_job_id, job_credentials
from taskd_core.launcher.interrupt import STOP_SIGNALS
from taskd_core.launcher.settings import NodeSettings, default_of, embedded_port
from taskd_core.models import JobPolicy
from taskd_core.scratch import check_temp_dir
from taskd_core.snapshots.settings import SnapshotSettings
from taskd_core.values import (
    DEFAULT_CONTROLLER_PORT,
    argtype,
    check_creatable_dir,
    parse_controller,
    parse_count,
    parse_modules,
    parse_port,
    parse_seconds,
    parse_signal,
    parse_switch,
)

#: A parser of one setting's text: ``(text, what)`` -> value, :class:`ConfigError` naming ``what``.
Parser = Callable[[str, str], Any]

_CONTROLLER = "controller"
_POLICY = "recovery policy (embedded controller only)"
_WARM = "warm restarts"
_HANGS = "hang detection"
#: Seconds between the health checks of a node of a job with several nodes, unless set.
NODE_HEALTH_INTERVAL = 1.0
_SNAPSHOTS = "memory snapshots"


def _positive_seconds(text: str, what: str) -> float:
    return parse_seconds(text, what, positive=True)


def _strategies(text: str, what: str) -> Any:
    return parse_strategies(text, key=what or "strategies")


def _directory(text: str, what: str) -> Path:
    return check_creatable_dir(Path(text), what or "snapshot directory")


def _slow_rank(text: str, what: str) -> Any:
    return parse_slow_rank(text.strip(), what or "slow-rank")


def _dump_signal(text: str, what: str) -> signal.Signals:
    return parse_signal(text, what, catchable=True)


@dataclass(frozen=True, slots=True)
class Option:
    """One shared setting: flag ``--<prefix><name>``, variable ``TASKD_<NAME>``, parser, field and help."""

    name: str
    parse: Parser
    help: str
    group: str
    #: the chain's field this option sets, whose default it shares; None: the builder's own rule.
    target: tuple[type[Any], str] | None = None
    metavar: str = "SECONDS"
    #: on/off: a flag ``--<name>`` when off by default, ``--no-<name>`` when on; the variable takes 1/0.
    switch: bool = False
    #: False: the flag only, the builder applies its own environment rule (told in the help).
    from_env: bool = True
    #: what a default of None means, for the help.
    unset: str = ""

    @property
    def variable(self) -> str:
        return "TASKD_" + self.name.upper().replace("-", "_")

    @property
    def default(self) -> Any:
        return None if self.target is None else default_of(*self.target)

    def flag(self, prefix: str) -> str:
        off = self.switch and self.default is True
        return f"--{prefix}{'no-' if off else ''}{self.name}"

    def from_flag(self, text: str) -> Any:
        """The value of the flag's text (argparse names the flag in the error)."""
        return self.parse(text, "")

    def dest(self, prefix: str) -> str:
        return (prefix + self.name).replace("-", "_")


#: Every shared setting, in the order of ``--help``.
OPTIONS: tuple[Option, ...] = (
    Option(
        "controller",
        lambda t, w: parse_controller(t),
        "",
        _CONTROLLER,
        metavar="HOST:PORT[,...]",
        from_env=False,
    ),
    Option("controller-port", parse_count, "", _CONTROLLER, metavar="PORT"),
    Option(
        "metrics-port",
        parse_port,
        "node 0's embedded controller serves Prometheus /metrics on this port (docs/metrics.md)",
        _CONTROLLER,
        (NodeSettings, "metrics_port"),
        metavar="PORT",
        unset="off",
    ),
    Option(
        "job-id",
        lambda t, w: t,
        "job id, the same on every node (default: $TASKD_JOB_ID, else $MINDX_TASK_ID, else unique per "
        "launch)",
        _CONTROLLER,
        metavar="ID",
        from_env=False,
    ),
    Option(
        "tls-ca",
        lambda t, w: t,
        "CA of the controller's certificate: talk TLS (default: $TASKD_TLS_CA). $TASKD_TLS_CERT and "
        "$TASKD_TLS_KEY add a client certificate (mutual TLS); on node 0 they also make the embedded "
        "controller serve mutual TLS. The job token is $TASKD_JOB_TOKEN (see docs/security.md)",
        _CONTROLLER,
        metavar="FILE",
        from_env=False,
    ),
    Option(
        "insecure",
        parse_switch,
        "let node 0's embedded controller serve plaintext on a non-loopback master address",
        _CONTROLLER,
        (NodeSettings, "insecure"),
        switch=True,
    ),
    Option(
        "connect-timeout",
        parse_seconds,
        "seconds to keep trying to reach the controller",
        _CONTROLLER,
        (AgentConfig, "connect_timeout"),
    ),
    Option(
        "report-deadline",
        parse_seconds,
        "seconds a report keeps retrying an unreachable controller",
        _CONTROLLER,
        (AgentConfig, "report_deadline"),
    ),
    Option(
        "health-interval",
        _positive_seconds,
        "seconds between the agent's health checks of the controller (> 0)",
        _CONTROLLER,
        (AgentConfig, "health_interval"),
    ),
    Option(
        "linger",
        parse_seconds,
        "node 0 hosting the controller: seconds to wait for the other nodes' agents to end",
        _CONTROLLER,
        (NodeSettings, "linger"),
    ),
    Option(
        "stop-timeout",
        parse_seconds,
        "seconds between SIGTERM and SIGKILL when workers are stopped",
        _CONTROLLER,
        (DispatchConfig, "stop_timeout"),
    ),
    Option(
        "dump-grace",
        parse_seconds,
        "seconds workers get to save after the dump signal",
        _CONTROLLER,
        (DispatchConfig, "dump_grace"),
    ),
    Option(
        "live-timeout",
        parse_seconds,
        "seconds every local worker gets to join a live recovery round (recover-live) before the node "
        "reports it failed and the job falls back to a full restart",
        _CONTROLLER,
        (DispatchConfig, "live_timeout"),
    ),
    Option(
        "restart-backoff",
        parse_seconds,
        "delay before restarting a worker that failed right after its start for the 2nd time in a row, "
        "doubling each further time; 0 turns it off",
        _CONTROLLER,
        (RestartBackoff, "initial"),
    ),
    Option(
        "restart-backoff-max",
        parse_seconds,
        "longest restart backoff delay",
        _CONTROLLER,
        (RestartBackoff, "cap"),
    ),
    Option(
        "healthy-after",
        parse_seconds,
        "seconds a worker must run for its failure not to count as a crash loop",
        _CONTROLLER,
        (RestartBackoff, "healthy_after"),
    ),
    Option(
        "dump-signal",
        _dump_signal,
        "signal asking workers to save their state, one they can catch",
        _CONTROLLER,
        (DispatchConfig, "dump_signal"),
        metavar="SIGNAL",
    ),
    Option(
        "fork-server",
        parse_switch,
        "start every worker by exec instead of forking Python workers from a fork server that has already "
        "imported the framework",
        _WARM,
        (ForkServerSettings, "enabled"),
        switch=True,
    ),
    Option(
        "fork-server-preload",
        parse_modules,
        "modules the fork server imports before its first fork, comma separated, '' for none; modules not "
        "installed are skipped, and the server also imports the installed modules the workers imported",
        _WARM,
        (ForkServerSettings, "preload"),
        metavar="MODULES",
        unset="torch; taskd run: torch if the script imports torch, else none",
    ),
    Option(
        "strategies",
        _strategies,
        "strategies the embedded controller may choose, comma separated",
        _POLICY,
        (JobPolicy, "strategies"),
        metavar="LIST",
    ),
    Option(
        "max-cycles",
        parse_count,
        "recovery cycles before the job is given up",
        _POLICY,
        (JobPolicy, "max_cycles"),
        metavar="N",
    ),
    Option(
        "cycle-window",
        parse_seconds,
        "seconds over which the cycle budget counts; 0: the job's whole life",
        _POLICY,
        (JobPolicy, "cycle_window"),
    ),
    Option(
        "slow-rank",
        _slow_rank,
        "what a rank slower than its peers gets: warn (journal, metric, taskd status) or replace",
        _POLICY,
        (JobPolicy, "slow_rank"),
        metavar="POLICY",
    ),
    Option(
        "report-timeout",
        parse_seconds,
        "deadline of each of the embedded controller's waits for the agents",
        _POLICY,
        (JobPolicy, "report_timeout"),
    ),
    Option(
        "node-lost-timeout",
        _positive_seconds,
        "seconds without a health check after which a node counts as lost (hung, cut off) and a waiting "
        "spare takes its place",
        _POLICY,
        (JobPolicy, "node_lost_timeout"),
    ),
    Option(
        "spare-wait",
        parse_seconds,
        "seconds a lost node's place waits for a spare when none stands by (0: the node is given up at once)",
        _POLICY,
        (JobPolicy, "spare_wait"),
    ),
    Option(
        "flush-seconds",
        parse_seconds,
        "window in which the embedded controller collects faults that arrive together",
        _POLICY,
        (JobPolicy, "flush_seconds"),
    ),
    Option(
        "hang-detection",
        parse_switch,
        "do not watch workers for hangs (stopped, D state, heartbeats, sections, torch file timers)",
        _HANGS,
        (ProgressConfig, "enabled"),
        switch=True,
    ),
    Option(
        "hang-timeout",
        _positive_seconds,
        "seconds without a heartbeat that make a rank hung",
        _HANGS,
        (ProgressConfig, "heartbeat_timeout"),
        unset="learned from the job",
    ),
    Option(
        "hang-floor", _positive_seconds, "lowest learned timeout, seconds", _HANGS, (ProgressConfig, "floor")
    ),
    Option(
        "hang-ceiling",
        _positive_seconds,
        "highest learned timeout (and the one before learning), seconds",
        _HANGS,
        (ProgressConfig, "ceiling"),
    ),
    Option(
        "stopped-bound",
        _positive_seconds,
        "seconds a rank may stay stopped (state T)",
        _HANGS,
        (ProgressConfig, "stopped_bound"),
    ),
    Option(
        "disk-sleep-bound",
        _positive_seconds,
        "seconds a rank may stay in uninterruptible sleep (state D)",
        _HANGS,
        (ProgressConfig, "disk_sleep_bound"),
    ),
    Option(
        "snapshots",
        parse_switch,
        "keep no node keeper for memory snapshots (taskd_pytorch.snapshot, docs/snapshots.md)",
        _SNAPSHOTS,
        (SnapshotSettings, "enabled"),
        switch=True,
    ),
    Option(
        "snapshot-memory",
        parse_count,
        "MiB this node's memory snapshots may take, own and peer copies; a snapshot over its rank's share "
        "is skipped with a warning",
        _SNAPSHOTS,
        (SnapshotSettings, "memory_mib"),
        metavar="MIB",
        unset="half of the free space of the snapshot directory's tmpfs",
    ),
    Option(
        "snapshot-copies",
        parse_count,
        "copies of each rank's snapshot kept on other nodes",
        _SNAPSHOTS,
        (SnapshotSettings, "copies"),
        metavar="N",
    ),
    Option(
        "snapshot-dir",
        _directory,
        "where the node's snapshot directory is made (a tmpfs: its files are memory)",
        _SNAPSHOTS,
        (SnapshotSettings, "directory"),
        metavar="DIR",
    ),
)
_BY_NAME = {option.name: option for option in OPTIONS}


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, signal.Signals):
        return value.name
    if isinstance(value, tuple):
        return ",".join(str(getattr(v, "value", v)) for v in value)
    return str(value)


def _help(option: Option, default: Any) -> str:
    if not option.from_env:
        return option.help
    if option.switch:
        state = option.name.replace("-", " ")
        return f"{option.help} ({state}: ${option.variable}, 1 or 0, else {_shown(option.default)})"
    otherwise = option.unset if default is None else _shown(default)
    return f"{option.help} (default: ${option.variable}{', else ' if otherwise else ''}{otherwise})"


def add_node_options(
    parser: argparse.ArgumentParser,
    prefix: str = "",
    *,
    published: bool = False,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add every :data:`OPTIONS` flag, named ``--<prefix><name>``; a flag not given stays None.

    :param published: the launcher publishes its embedded controller's address
        in its rendezvous (see :func:`embedded_port`); the help says so.
    :param defaults: the launcher's own defaults by option name (as :class:`OptionValues` takes them),
        shown in the help.
    """
    own = defaults or {}
    if published:
        embedded = (
            "the node the rendezvous makes rank 0 hosts an embedded controller and publishes its address "
            "in the rendezvous store; with an etcd rendezvous every node runs a replica of it, "
            "its state in that etcd"
        )
        port_default = "any free port; the other nodes read it from the rendezvous store"
    else:
        embedded = "node 0 hosts an embedded controller and the other nodes reach it at the master address"
        port_default = f"any free port on one node, {DEFAULT_CONTROLLER_PORT} on several"
    shown = {
        "controller": f"a running controller, or every replica of one, comma-separated (default: "
        f"$TASKD_CONTROLLER, else $MINDX_SERVER_IP:8899 as in ClusterD; without either, {embedded})",
        "controller-port": f"port of the embedded controller (default: $TASKD_CONTROLLER_PORT, else "
        f"{port_default})",
    }
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in OPTIONS:
        title = f"TaskD {option.group}" if prefix and option.group in (_CONTROLLER, _WARM) else option.group
        group = groups.setdefault(option.group, parser.add_argument_group(title))
        default = own.get(option.name, option.default)
        text = (shown.get(option.name) or _help(option, default)).replace("%", "%%")
        if option.switch:
            group.add_argument(
                option.flag(prefix),
                dest=option.dest(prefix),
                action="store_const",
                const=not option.default,
                default=None,
                help=text,
            )
        else:
            group.add_argument(
                option.flag(prefix),
                dest=option.dest(prefix),
                type=argtype(option.from_flag),
                default=None,
                metavar=option.metavar,
                help=text,
            )


@dataclass(frozen=True, slots=True)
class OptionValues:
    """Where each shared setting comes from: its flag, else ``TASKD_<NAME>``, else the launcher's default,
    else its field's default.

    ``args`` None reads the environment alone (msrun).
    """

    env: Mapping[str, str]
    args: argparse.Namespace | None = None
    prefix: str = ""
    #: the launcher's own defaults by option name (``taskdrun``: a shorter flush window).
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def flag(self, name: str) -> Any:
        """The flag's value, None when not given (or without flags)."""
        return None if self.args is None else getattr(self.args, _BY_NAME[name].dest(self.prefix), None)

    def given(self, name: str) -> str | None:
        """Where the user gave ``name``: the flag or the variable; None when neither did."""
        option = _BY_NAME[name]
        if self.flag(name) is not None:
            return option.flag(self.prefix)
        if option.from_env and self.env.get(option.variable, "").strip():
            return option.variable
        return None

    def __getitem__(self, name: str) -> Any:
        option = _BY_NAME[name]
        value = self.flag(name)
        if value is not None:
            return value
        text = self.env.get(option.variable, "").strip() if option.from_env else ""
        if text:
            return option.parse(text, option.variable)
        return self.defaults.get(name, option.default)

    def fields(self, cls: type[Any]) -> dict[str, Any]:
        """The values of every option that sets a field of ``cls``, by field name."""
        return {o.target[1]: self[o.name] for o in OPTIONS if o.target is not None and o.target[0] is cls}


def node_settings(
    values: OptionValues,
    *,
    launcher: str,
    shared: str,
    node_rank: int,
    nnodes: int,
    master_addr: str,
    job_id: str | None = None,
    controller_state: str = ":memory:",
    stop_signals: tuple[signal.Signals, ...] = STOP_SIGNALS,
    published: bool = False,
    multi_node_port: int = DEFAULT_CONTROLLER_PORT,
) -> NodeSettings:
    """The :class:`NodeSettings` of one node, from its :class:`OptionValues`: the builder every launcher uses.

    :param launcher: the launcher's name, which starts its default job ids.
    :param shared: what every node of this launch is given alike (see :func:`launch_identity`).
    :param job_id: the launcher's own job id when neither the flag nor the environment gives one;
        None: unique per launch (:func:`default_job_id`).
    :param published: the launcher will publish its embedded controller's
        address on a :class:`~taskd_core.launcher.settings.ControllerBoard` (see :func:`embedded_port`).
    :param multi_node_port: the embedded controller's port on several nodes when none is given.
    :raises ConfigError: for a value or a combination that cannot work, naming the flag or variable.
    """
    env = values.env
    check_temp_dir(env)
    controller = values.flag("controller") or controller_from_env(env) or ""
    if controller:
        # The budget is the controller's policy: a setting the controller never hears must not look obeyed.
        for name in ("max-cycles", "cycle-window"):
            source = values.given(name)
            if source is not None:
                raise ConfigError(
                    f"{source} sets the budget of the embedded controller, but this job uses the "
                    f"controller at {controller}: set it in that controller's policy (taskd controller "
                    f"--{name} or its --policy file) and drop it here"
                )
        source = values.given("slow-rank")
        if source is not None:
            raise ConfigError(
                f"{source} sets the embedded controller's slow-rank policy, but this job uses the "
                f"controller at {controller}: set slow_rank in that controller's --policy file, drop it here"
            )
    credentials = job_credentials(
        env,
        tls_ca=values.flag("tls-ca"),
        nnodes=nnodes,
        controller_host=controller_host(controller) if controller else master_addr,
        shared=shared,
    )
    launch = credentials.launch
    checks = values.fields(AgentConfig)
    if nnodes > 1 and values.given("health-interval") is None:
        # The controller finds a hung node by its missing health checks: several per timeout.
        checks["health_interval"] = min(checks["health_interval"], NODE_HEALTH_INTERVAL)
    agent = AgentConfig(
        job_id=values.flag("job-id") or job_id_from_env(env) or job_id or default_job_id(launcher, launch),
        controller=controller,
        node_rank=node_rank,
        dispatch=DispatchConfig(**values.fields(DispatchConfig)),
        credentials=credentials,
        progress=ProgressConfig(**values.fields(ProgressConfig)),
        restart_backoff=RestartBackoff(**values.fields(RestartBackoff)),
        **checks,
    )
    return NodeSettings(
        agent=agent,
        nnodes=nnodes,
        master_addr=master_addr,
        controller_port=embedded_port(
            values["controller-port"],
            nnodes=nnodes,
            controller=controller,
            multi_node=multi_node_port,
            published=published,
        ),
        controller_state=controller_state,
        # Every node's agent must answer before a cycle step ends.
        policy=JobPolicy(**values.fields(JobPolicy), expected_agents=nnodes),
        stop_signals=stop_signals,
        fork_server=ForkServerSettings(**values.fields(ForkServerSettings)),
        snapshots=SnapshotSettings(**values.fields(SnapshotSettings)),
        **values.fields(NodeSettings),
    )
