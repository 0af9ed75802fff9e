"""A torch elastic agent whose workers the TaskD node agent controls rank by rank.

:class:`TaskdElasticAgent` subclasses torch's ``LocalElasticAgent`` and keeps
what torch does: rendezvous through any handler of torch's registry, rank
assignment and the torchrun worker environment (``_initialize_workers``, the
template method every ``SimpleElasticAgent`` uses), logs as ``LogsSpecs``
says, and launching through ``start_processes``. What it changes:

* the group's one all-or-nothing process context becomes one context per
  local rank (:class:`~taskd_pytorch.processes.RankProcesses`), so a single
  rank can be stopped and started again with the same environment;
* workers meet in a store of their own per restart round
  hosted by group rank 0's agent (:mod:`taskd_pytorch.bootstrap`), never in the
  agents' shared rendezvous store;
* a whole-group restart keeps the last rendezvous round when every node of
  it restarts (:mod:`taskd_pytorch.rendezvous_reuse`), instead of paying
  torch's polling of a new round;
* with the c10d and etcd-v2 backends, the agents of a round share a store of TaskD's
  (:mod:`taskd_pytorch.membership`), so that a spare can take a lost node's
  seat in the round (:meth:`TaskdElasticAgent.stand_in`) without a new one;
* the rendezvous runs where a stop signal can end the wait
  (:func:`~taskd_pytorch.rendezvous.run_interruptibly`), and the launcher may
  join the first round on its own (:meth:`TaskdElasticAgent.join`) to learn its
  group rank before any worker starts: that rank decides which node hosts the
  job's controller.

torch's own control loop (``run``/``_invoke_run`` with its monitor interval
and restart budget) is not used: the node agent calls :meth:`restart_all`,
:meth:`restart_list`, :meth:`stop` and :meth:`statuses`. The subclass
overrides the methods torch declares abstract in ``SimpleElasticAgent``
(``_start_workers``, ``_stop_workers``, ``_monitor_workers``, ``_shutdown``)
and wraps ``_rendezvous``, so torch's own ``run()`` would still work with it;
nothing of torch is patched.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from string import Template

import torch
from torch.distributed import Store  # type: ignore[attr-defined]  # re-exported without __all__
from torch.distributed.elastic.agent.server.api import RunResult, Worker, WorkerGroup, WorkerSpec
from torch.distributed.elastic.agent.server.api import WorkerState as TorchState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs
from torch.distributed.elastic.utils.api import macros

from taskd_core.agent.config import STOP_TIMEOUT
from taskd_core.errors import ConfigError, LauncherInterrupted
from taskd_core.forkserver.client import ForkLauncher
from taskd_core.forkserver.lifeline import Lifeline
from taskd_core.launcher.interrupt import StopRequest
from taskd_core.models import WorkerState, WorkerStatus
from taskd_core.snapshots.keeper import Keeper
from taskd_pytorch.bootstrap import USE_AGENT_STORE, RoundStores
from taskd_pytorch.live._channel import JOB_TOKEN_ENV, LIVE_DIR_ENV, LiveChannel
from taskd_pytorch.membership import Epoch, JobStore
from taskd_pytorch.processes import Launch, RankProcesses
from taskd_pytorch.rendezvous import run_interruptibly
from taskd_pytorch.rendezvous_reuse import Regroup, RoundReuse

logger = logging.getLogger(__name__)

#: The torch release whose protected agent API (``_initialize_workers``,
#: ``_rendezvous``, the abstract worker methods) this module was verified against.
VERIFIED_TORCH = "2.13"
#: Restart counter the workers see; grows with every start of the whole group.
RESTART_COUNT_ENV = "TASKD_RESTART_COUNT"
#: Unknown global rank of a worker that was never started (no rendezvous yet).
NO_RANK = -1
#: How often the agent looks whether its workers joined a live round.
_ROUND_POLL = 0.005


class TaskdElasticAgent(LocalElasticAgent):
    """Runs one node's workers of a torchrun-style job for the TaskD node agent.

    :param spec: torch's worker spec; ``spec.max_restarts`` is the
        controller's cycle budget and only reaches workers as ``TORCHELASTIC_MAX_RESTARTS``.
    :param logs_specs: where worker output goes.
    :param start_method: multiprocessing start method for function entrypoints.
    :param log_line_prefix_template: torch's ``${role_name}``/``${rank}``/``${local_rank}`` template.
    :param stop_timeout: SIGTERM-to-SIGKILL delay when torch's own paths stop workers.
    :param stop: the launcher's stop request: once it fires, a rendezvous in
        progress is abandoned and no worker starts any more.
    :param lifeline: kills the workers should taskdrun die.
    :param launcher: forks Python workers from the node's fork server; None starts them by exec.
    :param store_host: where the workers' store of each round listens (group rank 0) and every
        worker reaches it: loopback, or the address of the interface the job uses.
    :param job_token: the job's token, handed to the workers: it keys their live state hand-over
        (empty: no live recovery, nothing could authenticate the hand-over).
    :param members: the job's keys in the c10d rendezvous store; None for the other backends.
    :param keeper: the node's keeper of memory snapshots, which the workers are told about.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        *,
        start_method: str = "spawn",
        log_line_prefix_template: str | None = None,
        stop_timeout: float = STOP_TIMEOUT,
        stop: StopRequest | None = None,
        lifeline: Lifeline | None = None,
        launcher: ForkLauncher | None = None,
        store_host: str = "127.0.0.1",
        job_token: str = "",
        keeper: Keeper | None = None,
        members: JobStore | None = None,
    ) -> None:
        if spec.virtual_local_rank:
            raise ConfigError("taskdrun does not support --virtual-local-rank")
        if not torch.__version__.startswith(VERIFIED_TORCH + "."):
            logger.warning(
                "taskd-pytorch was verified with torch %s; torch %s may have changed the elastic agent API "
                "it uses",
                VERIFIED_TORCH,
                torch.__version__,
            )
        super().__init__(
            spec,
            logs_specs,
            start_method=start_method,
            log_line_prefix_template=log_line_prefix_template,
            shutdown_timeout=int(stop_timeout),
        )
        # Names carry a taskd_ prefix: LocalElasticAgent owns the plain private ones.
        self._taskd_procs = RankProcesses(spec.role, logs_specs, start_method, lifeline, launcher)
        self._taskd_prefix = log_line_prefix_template
        self._taskd_stop_timeout = stop_timeout
        self._taskd_starts = 0
        # The node agent serialises its hook calls; this also guards direct callers.
        self._taskd_lock = threading.RLock()
        self._taskd_round_stores = RoundStores(store_host)
        self._taskd_token = job_token
        self._taskd_tokenless_told = False
        self._taskd_live = LiveChannel.create()
        self._taskd_stop = stop or StopRequest()
        #: the launcher joined the current round itself (:meth:`join`); the next start uses it.
        self._taskd_joined = False
        self._taskd_reuse = RoundReuse(spec.rdzv_handler)
        self._taskd_members = members
        self._taskd_round_no = 0
        #: a spare took a node's seat: its next start joins the round as the others restart it ...
        self._taskd_seated = False
        #: ... but not the node agent's first start, which comes before the cycle's restart.
        self._taskd_seat_idle = False
        self._taskd_keeper = keeper

    # --- what the launcher does first -------------------------------------------------

    def join(self) -> tuple[int, Store]:
        """Join the first rendezvous round now; returns this node's group rank and the round's store.

        The next :meth:`restart_all` starts the workers in this round instead
        of joining another one.

        :raises LauncherInterrupted: when the stop request fires while waiting.
        """
        with self._taskd_lock:
            group = self.get_worker_group()
            self._rendezvous(group)
            self._taskd_joined = True
            if group.store is None:
                raise ConfigError("the rendezvous gave this node no store")
            self._publish_epoch()
            return group.group_rank, group.store

    def stand_in(self, group_rank: int) -> None:
        """Take lost node ``group_rank``'s seat in the job's round: a spare the controller promoted.

        The seat is the lost node's: its group rank, its global ranks, the
        round's world size and store. The workers start with the job's next
        whole-group restart (the recovery cycle's), not before: the first
        :meth:`restart_all`, the node agent's own start, starts none.
        """
        members = self._taskd_members
        if members is None:
            raise ConfigError("only the c10d rendezvous lets a spare take a node's seat")
        with self._taskd_lock:
            self._seat(group_rank, members.epoch().group_world_size)
            self._taskd_seated = self._taskd_seat_idle = True
            logger.info("taking the seat of node %s", group_rank)

    def resize(self, group_rank: int, group_world_size: int) -> None:
        """The job shrank or grew (``--nnodes=MIN:MAX``): the next restart makes this node ``group_rank``
        of ``group_world_size``.

        The round is kept when the other nodes restart too (the agreement of
        :mod:`taskd_pytorch.rendezvous_reuse`, over the new number of nodes):
        a lost node's keep-alive in torch's round never has to expire, and a
        node that joins takes a seat as a spare does (:meth:`stand_in`).
        """
        with self._taskd_lock:
            self._seat(group_rank, group_world_size)
            logger.info(
                "the job has %s nodes now: this node restarts as node %s", group_world_size, group_rank
            )

    def _seat(self, group_rank: int, group_world_size: int) -> None:
        """Make this node ``group_rank`` of ``group_world_size`` nodes, its workers ranked contiguously."""
        group = self.get_worker_group()
        size = group.spec.local_world_size
        world = group_world_size * size
        # torch annotates these as None (set by its own rendezvous); the seat sets them instead.
        group.group_rank = group_rank  # type: ignore[assignment]
        group.group_world_size = group_world_size  # type: ignore[assignment]
        group.workers = [
            Worker(
                local_rank=i,
                global_rank=group_rank * size + i,
                role_rank=group_rank * size + i,
                world_size=world,
                role_world_size=world,
            )
            for i in range(size)
        ]
        logger.info(
            "node %s: global ranks %s of %s", group_rank, [w.global_rank for w in group.workers], world
        )

    def _take_seat(self, group: WorkerGroup) -> None:
        """The round as the other agents of the job restart it now (see :mod:`taskd_pytorch.membership`)."""
        assert self._taskd_members is not None
        epoch = self._taskd_members.epoch()
        group.store = self._taskd_members.round(epoch.round_no)  # type: ignore[assignment]  # as above
        self._taskd_round_no, self._taskd_starts = epoch.round_no, epoch.starts
        self._taskd_reuse.resume(epoch.restarts)

    def _join_live(self) -> dict[int, int]:
        """A seated spare starts its workers in the other nodes' current start (live recovery).

        Same workers' store and restart count as theirs, so the new workers meet
        them in the live round their agent announced and receive the state from
        a replica; the next whole-group restart is the job's next start, as on
        every node.
        """
        self._taskd_seated = self._taskd_seat_idle = False
        group = self.get_worker_group()
        self._take_seat(group)
        # The epoch names the next start; the others' workers run in the one before it.
        pids = self._taskd_procs.start_all(self._launches(group, self._taskd_starts - 1))
        logger.info("seated spare: local workers %s join the running workers' live round", sorted(pids))
        return pids

    def _publish_epoch(self) -> None:
        group = self.get_worker_group()
        if self._taskd_members is not None and group.group_world_size is not None:
            self._taskd_members.publish(
                Epoch(
                    self._taskd_round_no,
                    self._taskd_starts,
                    self._taskd_reuse.restarts,
                    group.group_world_size,
                )
            )

    # --- what the TaskD hooks do ------------------------------------------------------

    def restart_all(self) -> dict[int, int]:
        """Stop leftovers, join the next rendezvous round and start every local worker; returns pids."""
        with self._taskd_lock:
            group = self.get_worker_group()
            if self._taskd_seat_idle:
                self._taskd_seat_idle = False
                logger.info("seated as a spare: the workers start with the job's next restart")
                return {}
            self._taskd_procs.stop(None, self._taskd_stop_timeout)
            group.state = TorchState.STOPPED
            # A whole group starts from its checkpoints, in live round 0 of a new store.
            self._taskd_live.reset()
            if self._taskd_seated:
                self._taskd_seated = False
                self._take_seat(group)
            # torch's template method: rendezvous, rank assignment, then our _start_workers.
            self._initialize_workers(group)
            self._taskd_starts += 1
            self._publish_epoch()
            return {w.local_rank: w.id for w in group.workers}

    def restart_list(self, local_ranks: Sequence[int]) -> dict[int, int]:
        """Start only the given local workers again, with their previous rank and environment.

        A seated spare (:meth:`stand_in`) has no previous environment: it starts
        every local worker of its seat in the start the other nodes' workers run
        in, so that they join those workers' live round (:meth:`_join_live`).
        """
        with self._taskd_lock:
            self._check_ranks(local_ranks)
            pids = self._join_live() if self._taskd_seated else self._taskd_procs.start(local_ranks)
            for worker in self.get_worker_group().workers:
                worker.id = pids.get(worker.local_rank, worker.id)
            return pids

    def live_ready(self) -> bool:
        """Every local worker uses the live API (``taskd_pytorch.live``), so it survives a peer's loss.

        A seated spare's workers have not started: they can join the others' live
        round, unless the seat is group rank 0's, whose agent hosted the workers'
        store (gone with the lost node). Whether the job's script uses the API, the
        other nodes say. Never without the job's token: a state hand-over nobody
        can authenticate is not offered.
        """
        group = self.get_worker_group()
        if self._taskd_seated:
            opted_in = group.group_rank != 0
        else:
            opted_in = self._taskd_live.opted_in(range(group.spec.local_world_size))
        if opted_in and not self._taskd_token:
            if not self._taskd_tokenless_told:
                self._taskd_tokenless_told = True
                logger.warning(
                    "live recovery is off: without TASKD_JOB_TOKEN nothing authenticates the state a "
                    "replica hands a replacement; set it to the same secret on every node (a lost rank "
                    "restarts the job from its checkpoint meanwhile)"
                )
            return False
        return opted_in

    def begin_round(self, round_no: int) -> None:
        """Announce live recovery round ``round_no`` to the local workers."""
        self._taskd_live.begin_round(round_no)

    def await_round(self, round_no: int, timeout: float) -> bool:
        """True once every local worker joined ``round_no``; False if one ended, could not join it
        (a peer lost as it formed), or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        size = self.get_worker_group().spec.local_world_size
        while time.monotonic() < deadline:
            joined = [self._taskd_live.joined(rank) or 0 for rank in range(size)]
            if all(r >= round_no for r in joined):
                return True
            broke = [r for r in range(size) if (self._taskd_live.failed(r) or 0) >= round_no]
            if broke:
                logger.warning("live round %s: local ranks %s could not join it", round_no, broke)
                return False
            with self._taskd_lock:
                ended = [
                    r for r in range(size) if self._taskd_procs.status(r).state is not WorkerState.RUNNING
                ]
            if ended:
                logger.warning("live round %s: local ranks %s ended before joining it", round_no, ended)
                return False
            time.sleep(_ROUND_POLL)
        logger.warning("live round %s: local workers did not all join within %ss", round_no, timeout)
        return False

    def close(self) -> None:
        """Stop every worker and remove what this agent created on disk."""
        self.stop(None, self._taskd_stop_timeout)
        self._taskd_live.remove()

    def stop(self, local_ranks: Sequence[int] | None, timeout: float) -> None:
        """Stop the given local workers (all when None) and reap them."""
        with self._taskd_lock:
            if local_ranks is not None:
                self._check_ranks(local_ranks)
            self._taskd_procs.stop(local_ranks, timeout)

    def statuses(self) -> dict[int, WorkerStatus]:
        """Every local worker's state, keyed by local rank."""
        with self._taskd_lock:
            group = self.get_worker_group()
            global_ranks = {w.local_rank: w.global_rank for w in group.workers}
            out = {}
            for rank in range(group.spec.local_world_size):
                seen = self._taskd_procs.status(rank)
                out[rank] = WorkerStatus(
                    rank, global_ranks.get(rank, NO_RANK), seen.state, seen.pid, seen.exit_code
                )
            return out

    def _check_ranks(self, local_ranks: Sequence[int]) -> None:
        size = self.get_worker_group().spec.local_world_size
        bad = [r for r in local_ranks if not 0 <= r < size]
        if bad:
            raise ConfigError(f"local ranks {bad} do not exist; this node runs local ranks 0..{size - 1}")

    # --- torch's rendezvous and abstract worker methods --------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        if self._taskd_joined:
            self._taskd_joined = False
            return
        # The workers keep their ranks: only their store (new per start) and restart count change.
        group = worker_group
        if self._taskd_reuse.decide(group.store, group.group_world_size, self._taskd_stop) is Regroup.KEEP:
            return
        rendezvous = functools.partial(super()._rendezvous, worker_group)
        run_interruptibly(rendezvous, self._taskd_stop, "rendezvous")
        if self._taskd_members is not None and group.store is not None:
            group.store, self._taskd_round_no = self._taskd_members.round_store(group.store, group.group_rank)
        self._taskd_reuse.formed()

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, int]:
        return self._taskd_procs.start_all(self._launches(worker_group, self._taskd_starts))

    def _launches(self, worker_group: WorkerGroup, starts: int) -> dict[int, Launch]:
        """Every local worker's launch in whole-group start ``starts`` (its store, its restart count)."""
        spec = worker_group.spec
        if self._taskd_stop.signum is not None:
            raise LauncherInterrupted("starting workers", self._taskd_stop.signum)
        if worker_group.store is None or spec.entrypoint is None:
            raise ConfigError("workers cannot start before the rendezvous has given them a store")
        meet = self._taskd_round_stores.meet(worker_group.store, worker_group.group_rank, starts)
        launches = {}
        snapshots = self._taskd_keeper.worker_env() if self._taskd_keeper is not None else {}
        for worker in worker_group.workers:
            env = {
                "LOCAL_RANK": str(worker.local_rank),
                "RANK": str(worker.global_rank),
                "GROUP_RANK": str(worker_group.group_rank),
                "ROLE_RANK": str(worker.role_rank),
                "ROLE_NAME": spec.role,
                "LOCAL_WORLD_SIZE": str(spec.local_world_size),
                "WORLD_SIZE": str(worker.world_size),
                "GROUP_WORLD_SIZE": str(worker_group.group_world_size),
                "ROLE_WORLD_SIZE": str(worker.role_world_size),
                "MASTER_ADDR": meet.master_addr,
                "MASTER_PORT": str(meet.master_port),
                "TORCHELASTIC_RESTART_COUNT": str(starts),
                "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
                "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
                "TORCHELASTIC_USE_AGENT_STORE": USE_AGENT_STORE,
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
                LIVE_DIR_ENV: str(self._taskd_live.path),
                RESTART_COUNT_ENV: str(starts),
                **snapshots,
            }
            if self._taskd_token:  # a one-node launch makes its token itself: the workers learn it here
                env[JOB_TOKEN_ENV] = self._taskd_token
            prefix = Template(self._taskd_prefix or "[${role_name}${local_rank}]:").safe_substitute(
                role_name=spec.role, rank=worker.global_rank, local_rank=worker.local_rank
            )
            args = tuple(macros.substitute(list(spec.args), str(worker.local_rank)))
            launches[worker.local_rank] = Launch(spec.entrypoint, args, env, prefix)
        return launches

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._taskd_procs.stop(None, self._taskd_stop_timeout)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        states = {w.global_rank: self._taskd_procs.status(w.local_rank) for w in worker_group.workers}
        failures = {rank: s.failure for rank, s in states.items() if s.failure is not None}
        if failures:
            return RunResult(state=TorchState.FAILED, failures=failures)
        if states and all(s.state is WorkerState.EXITED for s in states.values()):
            return RunResult(state=TorchState.SUCCEEDED, return_values=dict.fromkeys(states))
        return RunResult(state=TorchState.HEALTHY)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        self._taskd_procs.stop(None, timeout, death_sig)
