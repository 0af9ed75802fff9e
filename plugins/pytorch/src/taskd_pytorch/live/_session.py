"""The live session: a worker's process group that can be rebuilt in place, and its step loop."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import GradBucket, PrefixStore, TCPStore  # type: ignore[attr-defined]

from taskd_core import worker
from taskd_core.authstream import verify
from taskd_core.errors import ConfigError, TaskdError
from taskd_pytorch.listen import job_interface, listening_store
from taskd_pytorch.live._channel import JOB_TOKEN_ENV, LIVE_DIR_ENV, LiveChannel
from taskd_pytorch.live._state import (
    StateTransferError,
    capture,
    check_registrable,
    fetch,
    prepare,
    restore,
    serve,
    state_key,
)
from taskd_pytorch.live._work import WorkClock

if TYPE_CHECKING:
    from torch.distributed.checkpoint.storage import StorageReader

    from taskd_pytorch.live._snapshots import SnapshotLoop, State
    from taskd_pytorch.snapshot import Source

logger = logging.getLogger(__name__)

#: How long one wait on a collective lasts before the channel is looked at again.
_WAIT_SLICE = timedelta(milliseconds=50)
#: The key of a round's store under which the replica publishes where it serves the state.
_TRANSFER_KEY = "state-transfer"
#: How often a worker whose group broke looks for the agent's new round.
_ROUND_POLL = 0.005
#: How a DDP all-reduce the session gave up on fails (DDP re-raises it as a RuntimeError with this text).
_DDP_LEFT = "left DDP's all-reduce"


class PeerLost(TaskdError):
    """A peer of this worker's process group is gone; the step runs again in the next round."""


class LiveRecoveryError(TaskdError):
    """This worker could not rejoin its job; it exits and the controller falls back to a full restart."""


class LiveSession:
    """One worker's membership in a data-parallel job that survives the loss of ranks.

    :param backend: the process group's backend (``"gloo"``; any backend whose
        ``init_process_group`` accepts a store works the same way).
    :param collective_timeout: seconds one collective, or the formation of a
        group, may take before it counts as a lost peer (gloo waits 30 min).
    :param rejoin_timeout: seconds a worker whose group broke waits for its
        agent to announce the next round before it gives up and exits.
    :param heartbeat: every committed step is a heartbeat for the node agent's
        hang detection (:mod:`taskd_core.worker`); turn it off to report progress yourself.
    :param sharded: the state is sharded (FSDP2, ZeRO), so no replica holds
        a lost rank's part: it is snapshotted to the node keeper's memory
        instead (:meth:`restore`), and a lost rank is recovered by a restart of
        every rank from the newest snapshot every rank can get.
    :param snapshot_every: with ``sharded``: a snapshot every this many
        committed steps (0: none, the script's disk checkpoints only).
    :param state: the job's replicated state by name: modules, optimizers,
        schedulers, tensors and lists of tensors. A replacement rank receives
        all of it, plus the step counter, from a live replica.
    """

    def __init__(
        self,
        *,
        backend: str = "gloo",
        collective_timeout: float = 300.0,
        rejoin_timeout: float = 300.0,
        heartbeat: bool = True,
        sharded: bool = False,
        snapshot_every: int = 1,
        **state: object,
    ) -> None:
        for name, obj in state.items():
            check_registrable(name, obj)
        _check_sharding(sharded, snapshot_every, state)
        self._state = state
        self._backend = backend
        self._collective_timeout = timedelta(seconds=collective_timeout)
        self._rejoin_timeout = rejoin_timeout
        self._heartbeat = heartbeat
        env = _Env.read()
        self.rank, self.world_size, self._local_rank = env.rank, env.world_size, env.local_rank
        self._prefix = f"taskd/live/{env.restart}/"
        self._master_addr = env.master_addr
        self._token = env.token
        self._run_id = env.run_id
        if env.hosts_store:
            # Plain torchrun: rank 0 hosts the store; on the job's interface only, not on every one.
            self._store = listening_store(
                job_interface(env.master_addr), env.master_port, self._collective_timeout
            )
        else:
            self._store = TCPStore(env.master_addr, env.master_port, timeout=self._collective_timeout)
        self._channel = LiveChannel(env.live_dir) if env.live_dir is not None else None
        #: steps committed on every rank: the number of the next step to run.
        self.step = 0
        #: the round of the process group this worker is in (-1: none yet).
        self.round = -1
        #: why the last step failed; only text, see :meth:`_fail`.
        self._failure: str | None = None
        self._stop_requested = False
        #: each step's work (its time less its collectives'), reported with the step it commits.
        self._work = WorkClock()
        self._ddp_waits = _RoundWatch(self._new_round, self._collective_timeout, self._work)
        #: groups left with collectives pending: freeing one waits for them, so it is kept until they end.
        self._abandoned: list[tuple[object, list[dist.Work]]] = []
        #: this round's collectives :meth:`all_reduce` gave up on, still pending.
        self._left: list[dist.Work] = []
        #: sharded state's snapshots (None: replicated state, handed over live).
        self._snapshots: SnapshotLoop | None = None
        if sharded:
            # Here, not at the top: DCP's import (about a second) only for the scripts that snapshot.
            from taskd_pytorch.live._snapshots import SnapshotLoop

            self._snapshots = SnapshotLoop(self.rank, snapshot_every)

    # --- the loop ------------------------------------------------------------------

    def start(self, step: int = 0) -> int:
        """Join the job with ``step`` steps done (from this rank's checkpoint); returns the job's step.

        A rank that replaces a lost one receives the job's state from a live
        replica here, so the value returned may be ahead of ``step``.
        """
        self.step = step
        first = self._first_round()
        if first is not None:
            self._join(first, fresh=True)
            if self._snapshots is None:
                # Where this process resumed (the agent journals it; the steps a fault cost follow from it).
                worker.resumed(self.step)
        return self.step

    def restore(
        self,
        state: Callable[[int], State],
        load: Callable[[State], int],
        fallback: Callable[[], StorageReader | None] | None = None,
    ) -> int:
        """Sharded state: every rank loads the newest step all of them can get; returns it.

        Call it once after :meth:`start`, with the model sharded on the
        session's group. ``state(step)`` gives what DCP saves (the
        ``get_state_dict`` dictionaries and the step), ``load(state)`` puts a
        loaded one in place and returns its step, ``fallback()`` the disk
        checkpoint's reader (None: none). The restore is collective: the ranks
        agree on one step, found in their own node's memory, else in a peer's
        copy, else on disk (:attr:`restored_from` says which); from then on
        every ``snapshot_every``-th committed step is snapshotted. Without a
        node keeper (plain ``torchrun``, ``--taskd-no-snapshots``) it says so
        once and restores from ``fallback()`` only.
        """
        if self._snapshots is None:
            raise ConfigError(
                "LiveSession.restore() is for sharded state: make the session with sharded=True"
            )
        if self.round < 0:
            raise ConfigError("call LiveSession.start() before LiveSession.restore()")
        self.step = self._snapshots.restore(state, load, fallback, self.step)
        worker.resumed(self.step)
        return self.step

    @property
    def restored_from(self) -> Source | None:
        """Where :meth:`restore` took the state from (``Source.NONE``: nothing; None: replicated state)."""
        return self._snapshots.source if self._snapshots is not None else None

    @property
    def snapshot_wait(self) -> float:
        """Seconds the steps waited for their snapshots to complete."""
        return self._snapshots.waited if self._snapshots is not None else 0.0

    def steps(self, stop: int) -> Iterator[LiveStep]:
        """One :class:`LiveStep` per step until ``stop`` steps are committed; a failed step comes again."""
        if self._stop_requested:
            return
        if self.round < 0:
            raise ConfigError("call LiveSession.start() before iterating its steps")
        if self._snapshots is not None and not self._snapshots.ready:
            raise ConfigError("call LiveSession.restore() before iterating the steps of sharded state")
        while self.step < stop and not self._stop_requested:
            if self._failure is not None or self._new_round() is not None:
                self._recover()
                if self._stop_requested:
                    return
            yield LiveStep(self, self.step)

    def request_stop(self) -> None:
        """End :meth:`steps` at the next step boundary, also while waiting for a new round.

        Safe to call from a signal handler (for example the dump signal's).
        """
        self._stop_requested = True

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        """``dist.all_reduce`` that leaves at once when the agent announces a new round.

        A collective blocked on a stopped (not dead) peer never fails by
        itself before the group's timeout; this one is waited for in short
        slices and gives up as soon as the node's agent says the job moved on.
        """
        launched = self._work.now()
        work = dist.all_reduce(tensor, op=op, async_op=True)
        deadline = time.monotonic() + self._collective_timeout.total_seconds()
        while not _waited(work):
            new = self._new_round()
            if new is not None or time.monotonic() > deadline:
                # Still pending on a stopped peer (a hung node): freeing its group would wait for it.
                self._left.append(work)
            if new is not None:
                raise PeerLost(f"rank {self.rank}: round {new} announced while waiting for all_reduce")
            if time.monotonic() > deadline:
                raise PeerLost(f"rank {self.rank}: all_reduce took longer than {self._collective_timeout}")
        self._work.pending(launched, self._work.now())

    @property
    def ddp_comm_hook(self) -> Callable[[object, GradBucket], torch.futures.Future[torch.Tensor]]:
        """DDP's gradient all-reduce (an average), left at once when the agent announces a new round.

        Register it on every ``DistributedDataParallel`` wrapper:
        ``ddp.register_comm_hook(None, session.ddp_comm_hook)``. DDP reduces
        inside ``backward()``, where :meth:`all_reduce`'s waiting in slices
        cannot run; without the hook, a rank whose two ring neighbours survive
        a loss stays blocked there, and the round cannot form.
        """
        # A lambda: DDP compares a hook's annotations with its own classes, and this
        # module's annotations are strings.
        return lambda state, bucket: self._reduce_bucket(bucket)

    def _reduce_bucket(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        tensor = bucket.buffer().div_(self.world_size)
        return self._ddp_waits.watch(dist.all_reduce(tensor, async_op=True), tensor, self.rank)

    def close(self) -> None:
        """Leave the process group (at the end of training), once the last snapshot is complete."""
        if self._snapshots is not None:
            self._snapshots.settle()
        worker.done()
        self._leave()
        self._ddp_waits.close()

    def _leave(self) -> None:
        # Whatever still refers to the failed collective (a traceback in a cycle) goes
        # first, so that the group's connections really close.
        gc.collect()
        # A left collective ends (fails) once the peer it waits on has left too.
        self._abandoned = [(g, works) for g, works in self._abandoned if not _ended(works)]
        if dist.is_initialized():
            left = self._ddp_waits.abandon(f"rank {self.rank} {_DDP_LEFT}: it left round {self.round}")
            left, self._left = left + self._left, []
            if left:
                self._abandoned.append((dist.group.WORLD, left))
            dist.destroy_process_group()

    # --- steps ---------------------------------------------------------------------

    def _commit(self, number: int) -> None:
        self.step = number + 1
        if self._snapshots is not None:
            self._snapshots.committed(self.step)
        busy = self._work.commit()
        if self._heartbeat:
            # Every committed step tells the node agent this rank makes progress (hang detection),
            # how far training got (the steps a fault costs) and how long it worked (slow ranks).
            worker.step(self.step, busy=busy)

    def _fail(self, exc: BaseException) -> None:
        logger.warning(
            "rank %s: step %s failed (%s); it runs again once the group is rebuilt", self.rank, self.step, exc
        )
        # Not the exception: its traceback holds the failed collective, which keeps
        # the old group's connections open, so peers blocked on them never fail
        # and this rank's own teardown of the group waits for them.
        self._failure = f"{type(exc).__name__}: {exc}"
        self._work.reset()

    @property
    def _live(self) -> bool:
        """A lost peer is recovered in place (else its error ends this worker, and the job restarts)."""
        return self._channel is not None and self._snapshots is None

    # --- rounds --------------------------------------------------------------------

    def _first_round(self) -> int | None:
        """The round a starting worker joins (None: a stop was requested while it waited for one)."""
        if self._channel is None:
            return 0
        current = self._channel.current_round()
        if current not in (self._channel.joined(self._local_rank), self._channel.failed(self._local_rank)):
            return current
        # An earlier process of this rank was in the current round, so that round lost this
        # rank: the agent started this one before the controller chose the next round.
        self.round = current
        return self._await_round(f"replacing local rank {self._local_rank} of round {current}")

    def _new_round(self) -> int | None:
        if self._channel is None:
            return None
        current = self._channel.current_round()
        return current if current > self.round else None

    def _recover(self) -> None:
        # No steps while the group is rebuilt: the section's bound, not the learned step time, applies.
        bound = self._rejoin_timeout + self._collective_timeout.total_seconds()
        with worker.section("live-recovery", timeout=bound):
            self._rebuild()

    def _rebuild(self) -> None:
        self._work.reset()  # the wait for a round is no step's work
        failure, self._failure = self._failure or "a new round was announced", None
        if self._channel is None:
            raise LiveRecoveryError(
                f"rank {self.rank} lost a peer ({failure}) but runs without a TaskD agent "
                f"({LIVE_DIR_ENV} is not set); start the job with taskdrun for live recovery"
            )
        # The round this rank was in broke: its agent need not wait for it any longer.
        self._channel.mark_failed(self._local_rank, self.round)
        # At once, not when the next round comes: peers blocked on this rank (a ring
        # all-reduce waits on its neighbour, not on the dead rank) fail only when its
        # connections close, and would otherwise wait, silent, until the round is announced.
        self._leave()
        new = self._await_round(f"losing a peer ({failure})")
        if new is not None:
            self._join(new, fresh=False)

    def _await_round(self, why: str) -> int | None:
        """The next round the agent announces (None: a stop was requested meanwhile)."""
        deadline = time.monotonic() + self._rejoin_timeout
        while True:
            new = self._new_round()
            if new is not None:
                return new
            if self._stop_requested:
                return None
            if time.monotonic() > deadline:
                raise LiveRecoveryError(
                    f"rank {self.rank}: no new round was announced within {self._rejoin_timeout}s of {why}"
                )
            time.sleep(_ROUND_POLL)

    def _join(self, round_no: int, *, fresh: bool) -> None:
        """Join ``round_no``; while a peer is lost as a round forms (a node lost during the hand-over),
        the next one the agent announces, as fresh as before (a rank that has no state yet still needs it)."""
        while True:
            try:
                self._form(round_no, fresh=fresh)
                return
            except Exception as exc:
                if self._channel is None or not (isinstance(exc, StateTransferError) or _peer_failure(exc)):
                    raise
                # Tells the agent at once that this rank will not be in the round (it reports it failed).
                self._channel.mark_failed(self._local_rank, round_no)
                logger.warning("rank %s: round %s broke as it formed (%s)", self.rank, round_no, exc)
                self._leave()
                new = self._await_round(f"round {round_no} breaking ({exc})")
                if new is None:
                    return
                round_no = new

    def _form(self, round_no: int, *, fresh: bool) -> None:
        began = time.monotonic()
        store = PrefixStore(f"{self._prefix}{round_no}/", self._store)
        dist.init_process_group(
            self._backend,
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=self._collective_timeout,
        )
        self.round = round_no
        self._sync(fresh, store)
        if self._channel is not None and self._snapshots is None:
            # Opts the node into live recovery. Sharded state never is: a survivor's modules are
            # bound to the group they were sharded on, and no replica holds a lost rank's shard.
            self._channel.mark_joined(self._local_rank, round_no)
        logger.info(
            "rank %s joined round %s at step %s in %.3fs",
            self.rank,
            round_no,
            self.step,
            time.monotonic() - began,
        )

    def _sync(self, fresh: bool, store: PrefixStore) -> None:
        """Every rank ends with the state of the most advanced live replica (its socket: ``_state``)."""
        # One tensor collective, not all_gather_object's pickling and two collectives.
        mine = torch.tensor([self.step, int(fresh)], dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine)
        table = [(int(row[0]), bool(row[1])) for row in rows]
        source = _source(table)
        target = table[source][0]
        needy = [r for r, (step, new) in enumerate(table) if r != source and (new or step < target)]
        timeout = self._collective_timeout.total_seconds()
        if not table[source][1] and needy:
            key = self._hand_over_key()
            # Binds every proof and signed address to this round of this job.
            context = f"{self._run_id}\0{self._prefix}{self.round}".encode()
            if self.rank == source:
                began = time.monotonic()
                outgoing = prepare(capture(self._state))
                publish = partial(self._publish, store)
                serve(outgoing, needy, self._master_addr, publish, timeout, key, context)
                logger.info(
                    "rank %s sent the state of step %s (%d bytes) to ranks %s in %.3fs",
                    self.rank,
                    target,
                    outgoing.nbytes,
                    needy,
                    time.monotonic() - began,
                )
            elif self.rank in needy:
                try:
                    address = _replica_address(store, key, context, timeout)
                    values = fetch(address, self.rank, capture(self._state), timeout, key, context)
                    restore(self._state, values)
                except StateTransferError as exc:
                    # Part of the state may be in place: this process ends, its replacement loads the
                    # checkpoint and (the round marked failed) waits for the next round.
                    if self._channel is not None:
                        self._channel.mark_failed(self._local_rank, self.round)
                    raise LiveRecoveryError(f"rank {self.rank}: receiving the state failed: {exc}") from exc
        self.step = target

    def _publish(self, store: PrefixStore, address: str) -> None:
        """Where this replica serves the state; a hand-over the job moved on from (a receiver's node
        lost, a new round announced) ends here instead of at its timeout."""
        new = self._new_round()
        if new is not None:
            raise PeerLost(f"rank {self.rank}: round {new} was announced while it handed the state over")
        store.set(_TRANSFER_KEY, address)

    def _hand_over_key(self) -> bytes:
        if not self._token:
            raise LiveRecoveryError(
                f"rank {self.rank}: the state hand-over needs the job's token ({JOB_TOKEN_ENV}) to "
                "authenticate it, and this worker has none; set it to the same secret on every node"
            )
        return state_key(self._token)


def _replica_address(store: PrefixStore, key: bytes, context: bytes, timeout: float) -> str:
    """The address the round's replica published, signed with the job's key; forged ones are skipped.

    Anyone who reaches the store can put a value there before the replica
    does: such a value does not verify, and the replica's own overwrites it.
    """
    deadline = time.monotonic() + timeout
    forged = 0
    while True:
        remaining = deadline - time.monotonic()
        try:
            store.wait([_TRANSFER_KEY], timedelta(seconds=max(remaining, 0.001)))
            value = store.get(_TRANSFER_KEY).decode("utf-8", "replace")
        except RuntimeError as exc:  # the store's timeout, or the store is gone
            raise StateTransferError(
                f"no replica published a signed address for the state within {timeout:g}s "
                f"({forged} forged value(s) skipped): {exc}"
            ) from exc
        address = verify(key, context, value)
        if address is not None:
            return address
        if not forged:
            logger.warning("skipped an address for the state that the job's key did not sign: %r", value[:99])
        forged += 1
        if time.monotonic() > deadline:
            raise StateTransferError(
                f"no replica published a signed address for the state within {timeout:g}s "
                f"({forged} forged value(s) skipped)"
            )
        time.sleep(_ROUND_POLL)


def _source(table: list[tuple[int, bool]]) -> int:
    """The rank whose state every rank takes: a live replica with the most steps, lowest rank first.

    With no live replica (the job's first start, or a full restart) every rank
    loaded the same checkpoint, so the most advanced rank is only a tie-break.
    """
    live = [r for r, (_, new) in enumerate(table) if not new] or list(range(len(table)))
    return max(live, key=lambda r: (table[r][0], -r))


class LiveStep:
    """One training step as a context manager: it commits when its block ends without error.

    When a peer is lost inside the block, the error is swallowed and the same
    step comes again from :meth:`LiveSession.steps` once the group is rebuilt.
    Other errors propagate as usual. Leaving the block early (``break``,
    ``return``) also commits the step: decide to stop before entering it, or
    call :meth:`LiveSession.request_stop`.
    """

    def __init__(self, session: LiveSession, number: int) -> None:
        self._session = session
        #: the step's number (steps done before it).
        self.number = number

    def __enter__(self) -> LiveStep:
        self._session._ddp_waits.release_finished()
        self._session._work.begin()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is None:
            self._session._commit(self.number)
            return False
        if _peer_failure(exc) and self._session._live:
            self._session._fail(exc)
            return True
        return False


class _RoundWatch:
    """Completes DDP's all-reduce futures, or fails them when a new round is announced.

    One thread of ours, started with the first collective, waits for each
    collective in short slices and looks at the round in between. Never a
    callback on the collective's own future: that runs Python on a gloo
    thread, which needs the GIL, while a group's destructor joins those
    threads holding it (the script hung when a DDP wrapper was freed).
    """

    def __init__(
        self, new_round: Callable[[], int | None], timeout: timedelta, work: WorkClock | None = None
    ) -> None:
        self._new_round = new_round
        #: where each collective's pending span goes (the session's step clock).
        self._work = work or WorkClock()
        self._timeout = timeout.total_seconds()
        self._lock = threading.Condition()
        self._pending: deque[_Reduction] = deque()
        self._left: list[dist.Work] = []
        #: completed collectives of the current step, kept so that the last reference is ours (below).
        self._finished: list[dist.Work] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    def watch(self, work: dist.Work, tensor: torch.Tensor, rank: int) -> torch.futures.Future[torch.Tensor]:
        reduction = _Reduction(
            work, tensor, torch.futures.Future(), time.monotonic() + self._timeout, self._work.now()
        )
        with self._lock:
            self._pending.append(reduction)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, args=(rank,), name="taskd-live-ddp", daemon=True
                )
                self._thread.start()
            self._lock.notify()
        return reduction.result

    def release_finished(self) -> None:
        """Drop the collectives completed so far (at a step's start: gloo's threads are long done with them).

        A collective launched inside ``backward()`` holds a Python object
        (autograd's context); whoever drops the last reference takes the GIL.
        If that were a gloo thread just after the collective completed, a
        script freeing its DDP wrapper right after its last step (whose
        process group joins those threads while holding the GIL) would never
        exit. Held here, the last reference goes on a thread that has the GIL.
        """
        with self._lock:
            self._finished.clear()

    def abandon(self, why: str) -> list[dist.Work]:
        """The collectives left pending since the last call; those still waited for fail with ``why``."""
        self._fail_pending(PeerLost(why))
        with self._lock:
            left, self._left = self._left, []
        return left

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()

    def _run(self, rank: int) -> None:
        while (head := self._head()) is not None:
            try:
                finished = _waited(head.work)
            except Exception as exc:  # the collective's own failure (a dead peer)
                if self._settled(head):
                    head.result.set_exception(exc)  # type: ignore[arg-type]  # torch's stub names the value type
                continue
            if finished:
                if self._settled(head):
                    self._work.pending(head.launched, self._work.now())
                    head.result.set_result(head.tensor)
                continue
            new = self._new_round()
            if new is not None:
                self._fail_pending(PeerLost(f"rank {rank} {_DDP_LEFT}: round {new} was announced"))
            elif time.monotonic() > head.deadline:
                self._fail_pending(PeerLost(f"rank {rank} {_DDP_LEFT}: it took over {self._timeout}s"))

    def _head(self) -> _Reduction | None:
        with self._lock:
            while not self._pending and not self._closed:
                self._lock.wait()
            return None if self._closed else self._pending[0]

    def _settled(self, reduction: _Reduction) -> bool:
        """Takes ``reduction`` off the queue; False if a new round failed it meanwhile."""
        with self._lock:
            if not self._pending or self._pending[0] is not reduction:
                return False
            self._pending.popleft()
            self._finished.append(reduction.work)
            return True

    def _fail_pending(self, lost: PeerLost) -> None:
        with self._lock:
            failed = list(self._pending)
            self._pending.clear()
            self._left.extend(r.work for r in failed)
        for reduction in failed:
            reduction.result.set_exception(lost)  # type: ignore[arg-type]  # torch's stub names the value type


@dataclass(frozen=True)
class _Reduction:
    """One DDP bucket's all-reduce and the future DDP waits on."""

    work: dist.Work
    tensor: torch.Tensor
    result: torch.futures.Future[torch.Tensor]
    deadline: float
    #: when it was launched, on the session's work clock.
    launched: float


def _waited(work: dist.Work) -> bool:
    """Waits one slice for ``work``: True when it completed, False when it still runs; raises its failure."""
    try:
        work.wait(timeout=_WAIT_SLICE)
    except RuntimeError:
        if not work.is_completed():
            return False
        # It may have completed just after the slice ran out: its own outcome, not the timeout.
        work.wait()
    return True


def _ended(works: list[dist.Work]) -> bool:
    return all(w.is_completed() for w in works)


def _check_sharding(sharded: bool, every: int, state: dict[str, object]) -> None:
    """``ConfigError`` unless the session's state is either replicated (registered) or sharded."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ConfigError(f"snapshot_every must be a whole number of steps, 0 or more, not {every!r}")
    if sharded and state:
        raise ConfigError(
            f"LiveSession got sharded=True and replicated state ({', '.join(state)}): register the state "
            "a replica can hand over, or snapshot sharded state with restore(), not both"
        )
    if every != 1 and not sharded:
        raise ConfigError(
            "snapshot_every is for sharded state (sharded=True); replicated state is handed over"
        )


def _peer_failure(exc: BaseException) -> bool:
    """An error that a lost or stopped peer causes in a collective (gloo raises plain RuntimeErrors)."""
    if isinstance(exc, PeerLost | dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("gloo" in text.lower() or _DDP_LEFT in text)


class _Env:
    """What the launcher tells a worker, read once."""

    def __init__(self, env: dict[str, str]) -> None:
        try:
            self.rank = int(env["RANK"])
            self.world_size = int(env["WORLD_SIZE"])
            self.local_rank = int(env.get("LOCAL_RANK", "0"))
            self.master_addr = env["MASTER_ADDR"]
            self.master_port = int(env["MASTER_PORT"])
        except (KeyError, ValueError) as exc:
            raise ConfigError(
                f"LiveSession needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from its launcher ({exc}); "
                "start the script with taskdrun"
            ) from exc
        self.restart = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        # Keys the state a replica hands over (taskdrun passes it on; every node of a job has the same).
        self.token = env.get(JOB_TOKEN_ENV, "").strip()
        self.run_id = env.get("TORCHELASTIC_RUN_ID", "")
        # torchrun and taskdrun host the workers' store in the agent, which outlives any rank.
        self.hosts_store = env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and self.rank == 0
        live_dir = env.get(LIVE_DIR_ENV)
        self.live_dir = Path(live_dir) if live_dir else None

    @classmethod
    def read(cls) -> _Env:
        return cls(dict(os.environ))
