"""What ``taskd run`` launches on one node: :class:`LaunchSpec` and the worker environment it implies."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from taskd_core.agent.config import DispatchConfig
from taskd_core.errors import ConfigError
from taskd_core.launcher.settings import default_of
from taskd_core.values import LOCALHOST, MAX_LOCAL_WORKERS, check_count, check_host, check_port, check_seconds

#: torchrun's default rendezvous port, used when several nodes must agree on one.
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """The workers of one node: ``nproc`` copies of ``command``, ranked within ``nnodes`` nodes.

    Global rank of local worker ``i`` is ``node_rank * nproc + i`` (every node
    runs the same number of workers, as torchrun assumes).
    """

    command: tuple[str, ...]
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = LOCALHOST
    master_port: int = DEFAULT_MASTER_PORT
    job_id: str = "default"
    #: per-rank logs go to ``<log_dir>/rank<R>/restart<K>.log``; None: inherit the launcher's streams.
    log_dir: Path | None = None
    #: workers do not talk to each other, so a healthy one survives a peer's restart (recover-in-place).
    independent_workers: bool = False
    #: extra environment for every worker (applied before the rank variables, which always win).
    env: dict[str, str] = field(default_factory=dict, hash=False)
    #: seconds a leftover worker gets between SIGTERM and SIGKILL when restart_all finds one running.
    stop_timeout: float = default_of(DispatchConfig, "stop_timeout")
    cwd: Path | None = None

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError("no command to launch: give it after '--'")
        check_count(self.nproc, "nproc", low=1, high=MAX_LOCAL_WORKERS)
        check_count(self.nnodes, "nnodes", low=1)
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"node rank {self.node_rank} is outside 0..{self.nnodes - 1} (nnodes {self.nnodes})"
            )
        if not self.job_id:
            raise ConfigError("job id must not be empty")
        check_seconds(self.stop_timeout, "stop timeout")
        check_host(self.master_addr, "master address")
        check_port(self.master_port, "master port")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc + local_rank

    def worker_env(self, local_rank: int, restart_count: int) -> dict[str, str]:
        """The environment variables that tell worker ``local_rank`` who it is (torchrun's names)."""
        env = dict(self.env)
        env.update(
            RANK=str(self.global_rank(local_rank)),
            LOCAL_RANK=str(local_rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.nproc),
            GROUP_RANK=str(self.node_rank),
            NODE_RANK=str(self.node_rank),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
            TASKD_RESTART_COUNT=str(restart_count),
            TORCHELASTIC_RESTART_COUNT=str(restart_count),
            TASKD_JOB_ID=self.job_id,
        )
        return env

    def log_path(self, local_rank: int, restart_count: int) -> Path | None:
        if self.log_dir is None:
            return None
        return self.log_dir / f"rank{self.global_rank(local_rank)}" / f"restart{restart_count}.log"
