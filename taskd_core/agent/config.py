"""The agent's settings: :class:`AgentConfig` holding the dispatcher's :class:`DispatchConfig`.

These are the inner links of the launcher settings chain
(:class:`~taskd_core.launcher.settings.NodeSettings` holds an
:class:`AgentConfig`, which holds a :class:`DispatchConfig`); each default is
defined here once and the launchers' flags read it from these classes. Kept
apart from the agent itself so that building settings imports no gRPC.
"""

from __future__ import annotations

import signal as signals
from dataclasses import dataclass, field

from taskd_core.agent.hangs.config import ProgressConfig
from taskd_core.errors import ConfigError
from taskd_core.models import CONNECT_TIMEOUT, Credentials
from taskd_core.values import check_catchable, check_seconds

#: Seconds between SIGTERM and SIGKILL when stopping workers, unless the launcher is told otherwise.
STOP_TIMEOUT = 30.0


@dataclass(frozen=True, slots=True)
class DispatchConfig:
    """How the controller's actions are carried out on this node."""

    #: seconds between SIGTERM and SIGKILL when stopping workers.
    stop_timeout: float = STOP_TIMEOUT
    #: signal that asks a worker to save its state and exit (``dump``).
    dump_signal: signals.Signals = signals.SIGUSR1
    #: seconds workers get to save before they are stopped.
    dump_grace: float = 30.0
    #: seconds every local worker gets to join a live recovery round before the
    #: node reports ``recover-live`` as failed (the controller then restarts the job).
    live_timeout: float = 60.0

    def __post_init__(self) -> None:
        check_seconds(self.stop_timeout, "stop timeout")
        check_catchable(self.dump_signal, "dump signal")
        check_seconds(self.dump_grace, "dump grace")
        check_seconds(self.live_timeout, "live timeout")


@dataclass(frozen=True, slots=True)
class RestartBackoff:
    """How a worker that keeps failing right after its start is slowed down.

    See :mod:`taskd_core.agent.crashloop`.

    ``initial`` 0 turns the backoff off.
    """

    initial: float = 1.0
    cap: float = 30.0
    #: a worker that ran this long was healthy: its failure starts no streak.
    healthy_after: float = 10.0

    def __post_init__(self) -> None:
        check_seconds(self.initial, "restart backoff")
        check_seconds(self.cap, "restart backoff cap")
        check_seconds(self.healthy_after, "healthy after")

    def delay(self, streak: int) -> float:
        """Seconds to hold back the report of the ``streak``-th quick failure in a row."""
        if streak <= 1 or self.initial <= 0:
            return 0.0
        return min(self.cap, self.initial * 2.0 ** min(streak - 2, 30))


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Where the agent reports and how it treats its workers."""

    job_id: str
    #: the controller's ``HOST:PORT``; empty until the launcher has applied the embedding rule.
    controller: str = ""
    node_rank: int = 0
    #: identity among the job's agents; defaults to ``node-<node_rank>``.
    agent_id: str | None = None
    role: str = "taskd agent"
    #: how long to keep trying to reach the controller before giving up.
    connect_timeout: float = CONNECT_TIMEOUT
    #: how long a report keeps retrying while the controller is unreachable.
    report_deadline: float = 60.0
    #: seconds between HealthCheck calls; a lost stream is noticed without them,
    #: so the agent checks less often than the reference client's 1 s.
    health_interval: float = 5.0
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    #: TLS files, the job token and the launch identity the agent presents to the controller.
    credentials: Credentials = field(default_factory=Credentials)
    #: hang detection: bounds, timeouts, or off.
    progress: ProgressConfig = field(default_factory=ProgressConfig)
    restart_backoff: RestartBackoff = field(default_factory=RestartBackoff)

    @property
    def identity(self) -> str:
        """The agent id it registers with: :attr:`agent_id`, else ``node-<node_rank>``."""
        return self.agent_id or f"node-{self.node_rank}"

    def __post_init__(self) -> None:
        if not self.job_id:
            raise ConfigError("the agent needs a job id")
        if self.node_rank < 0:
            raise ConfigError(f"node rank must be >= 0, not {self.node_rank}")
        check_seconds(self.connect_timeout, "connect timeout")
        check_seconds(self.report_deadline, "report deadline")
        check_seconds(self.health_interval, "health interval", positive=True)
