"""Progress watching: finds a worker that stopped making progress, and keeps its stack.

:class:`ProgressWatcher` combines three signals, all on the agent's side of one node:

* **/proc state** (:mod:`.procstat`), for any process and without code: a worker
  stopped (``T``) or in uninterruptible sleep (``D``) longer than a bound is hung;
* **heartbeats and named sections** sent by :mod:`taskd_core.worker` to the
  :mod:`.inbox` socket: a worker silent past its heartbeat timeout, or inside a
  section past the section's timeout, is hung;
* **torch elastic's file timers** (the :mod:`.inbox` FIFO): an expired timer is a
  hang of that worker.

Steps that say how long they worked are kept for the controller (:mod:`.work`),
which finds slow ranks from them.

Timeouts are explicit (a section's own, ``heartbeat_timeout``) or learned
(:class:`~.config.LearnedTimeout`, per signal name).

Ranks blocked in a collective with a hung peer go silent at the same moment
as the culprit. A worker past its deadline is therefore declared at once only
when it burns CPU (a spinning loop) or is stopped / in ``D``; a worker that
merely sleeps gets one more timeout first, in which the culprit is found and
killed and the sleepers' collectives fail — they end as deaths of the same
cycle, not as new hangs. A job where every rank sleeps (a real deadlock) is
still found, after twice the timeout.

Before a hang is reported, the worker's stack is taken (:mod:`.stacks`) and
written into the worker's own output.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from taskd_core.agent.hangs.config import LearnedTimeout, ProgressConfig
from taskd_core.agent.hangs.hang import Hang, HangSignal
from taskd_core.agent.hangs.inbox import Datagram, Inbox, TimerRequest
from taskd_core.agent.hangs.procstat import ODD_STATES, ProcState, parent_of
from taskd_core.agent.hangs.stacks import capture_stack, write_to_worker_output
from taskd_core.agent.hangs.steps import STEP_OPS, StepTracker, WorkerId, parse_step
from taskd_core.agent.hangs.work import WorkSamples, parse_work
from taskd_core.models import RankWork, WorkerEvent

logger = logging.getLogger(__name__)

#: The learned heartbeat's name among the sections.
HEARTBEAT = "heartbeat"
#: Hops up the parent chain from a reporting pid to the worker the adapter knows (``bash -c python ...``).
_MAX_ANCESTRY = 8
#: Step datagrams kept from processes not tracked yet, and for how long (seconds): a worker
#: that resumes within milliseconds of its start is ahead of the agent's next look.
_EARLY_STEPS = 256
_EARLY_FOR = 30.0


@dataclass(slots=True)
class _Worker:
    """What the watcher knows about one live worker process."""

    local_rank: int
    global_rank: int
    proc: ProcState
    last_beat: float | None = None
    #: open sections, innermost last: (name, entered at, explicit timeout).
    sections: list[tuple[str, float, float | None]] = field(default_factory=list)
    #: torch timers by scope: (expiration on the wall clock, timeout it was armed with).
    timers: dict[str, tuple[float, float]] = field(default_factory=dict)
    declared: bool = False


@dataclass(frozen=True, slots=True)
class _Expiry:
    signal: HangSignal
    name: str
    deadline: float
    timeout: float
    learned: bool


class ProgressWatcher:
    """Watches the workers of one node for hangs, in a thread of its own.

    :param on_hang: called (from the watcher's thread) after a hang was
        declared and its stack taken; the agent then collects it with
        :meth:`take_hangs`.
    :param on_events: called while workers' step events wait to be collected
        with :meth:`take_worker_events`.
    """

    def __init__(
        self,
        config: ProgressConfig,
        on_hang: Callable[[], None],
        on_events: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        self._on_hang = on_hang
        self._on_events = on_events
        self._lock = threading.Lock()
        self._workers: dict[int, _Worker] = {}
        self._owner: dict[int, int] = {}
        self._hangs: list[Hang] = []
        self._learned: dict[str, LearnedTimeout] = {}
        self._steps = StepTracker()
        self._work = WorkSamples()
        #: (pid, op, args, sent) of step datagrams from pids not tracked yet.
        self._early: collections.deque[tuple[int, str, tuple[str, ...], float]] = collections.deque(
            maxlen=_EARLY_STEPS
        )
        #: one reader of the socket at a time, so datagrams are handled in the order sent.
        self._reading = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._inbox = Inbox()

    @property
    def socket_path(self) -> str | None:
        """Where workers send their datagrams (published as ``TASKD_PROGRESS_SOCKET``)."""
        return self._inbox.socket_path

    @property
    def timer_file(self) -> str | None:
        """torch's timer FIFO (published as ``TORCHELASTIC_TIMER_FILE``)."""
        return self._inbox.timer_file

    # --- life cycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Open the socket and the timer FIFO, publish them to workers, start watching."""
        self._inbox.open()
        self._thread = threading.Thread(target=self._run, name="taskd-progress", daemon=True)
        self._thread.start()
        logger.info("watching progress: socket %s, torch timer file %s", self.socket_path, self.timer_file)

    def close(self) -> None:
        self._stop.set()
        # Idle, the thread waits a second for its next scan: on every job's exit, without this.
        self._inbox.wake()
        if self._thread is not None:
            self._thread.join(timeout=self.config.stack_timeout + 5.0)
        with self._lock:
            for worker in self._workers.values():
                worker.proc.close()
            self._workers.clear()
        self._inbox.close()

    # --- the agent's side -------------------------------------------------------------------

    def track(self, workers: Mapping[int, tuple[int, int]]) -> None:
        """The live workers: ``{pid: (local rank, global rank)}``; others are forgotten."""
        with self._lock:
            for pid in list(self._workers):
                if pid not in workers:
                    self._workers.pop(pid).proc.close()
            for pid, (local_rank, global_rank) in workers.items():
                known = self._workers.get(pid)
                if known is None or (known.local_rank, known.global_rank) != (local_rank, global_rank):
                    if known is not None:
                        known.proc.close()
                    self._workers[pid] = _Worker(local_rank, global_rank, ProcState(pid))
            self._owner = {p: o for p, o in self._owner.items() if o in self._workers}
            self._steps.keep(self._workers)
            self._replay_early()

    def _replay_early(self) -> None:
        """Give the step tracker the kept datagrams of pids tracked now (called with the lock held)."""
        early, self._early = list(self._early), collections.deque(maxlen=_EARLY_STEPS)
        horizon = time.monotonic() - _EARLY_FOR
        for pid, op, args, sent in early:
            if self._worker_of(pid) is not None:
                self._record_step(pid, op, args, sent)
            elif sent > horizon:
                self._early.append((pid, op, args, sent))

    def last_step(self, pid: int) -> int | None:
        """The last step tracked worker ``pid`` reported, counting datagrams sent up to now."""
        if self._inbox.is_open:
            self._drain_socket(time.monotonic())
        with self._lock:
            return self._steps.last_step(pid)

    def take_worker_events(self) -> list[WorkerEvent]:
        """Workers' ``resumed`` and ``stepping`` events since the last call (see :mod:`.steps`)."""
        with self._lock:
            return self._steps.take_events()

    def take_work(self) -> list[RankWork]:
        """Workers' work per step since the last call (see :mod:`.work`)."""
        with self._lock:
            return self._work.take(time.monotonic())

    def take_hangs(self) -> list[Hang]:
        """Hangs declared since the last call."""
        with self._lock:
            hangs, self._hangs = self._hangs, []
        return hangs

    def describe(self) -> str:
        """The timeouts in use, one line (``taskd status`` shows it per agent)."""
        c = self.config
        with self._lock:
            parts = [f"stopped {c.stopped_bound:g}s", f"D-state {c.disk_sleep_bound:g}s"]
            if c.heartbeat_timeout is not None:
                parts.append(f"{HEARTBEAT} {c.heartbeat_timeout:g}s (configured)")
            for name, learned in sorted(self._learned.items()):
                if name != HEARTBEAT or c.heartbeat_timeout is None:
                    parts.append(f"{name} {learned.describe()}")
            timers = sum(len(w.timers) for w in self._workers.values())
        if timers:
            parts.append(f"{timers} torch timer(s) armed")
        return "; ".join(parts)

    # --- the watcher's thread ----------------------------------------------------------------

    def _run(self) -> None:
        # The socket is read as soon as datagrams arrive, not once per scan: Linux queues
        # at most net.unix.max_dgram_qlen (default 10) datagrams per socket and a
        # non-blocking sender's next ones are lost, whatever SO_RCVBUF says.
        next_scan = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now < next_scan:
                self._inbox.wait(next_scan - now)
                self._drain_socket(time.monotonic())
                continue
            self._drain_socket(now)
            self._drain_fifo()
            try:
                self._scan(now)
            except Exception:  # the watch must outlive one bad reading
                logger.exception("progress scan failed")
            with self._lock:
                idle = not self._workers
            next_scan = now + (1.0 if idle else self.config.poll)

    def _drain_socket(self, now: float) -> None:
        with self._reading:
            for message in self._inbox.datagrams(now):
                self._on_message(message)
        with self._lock:
            pending = self._steps.pending or self._work.due(now)
        if pending:
            self._on_events()

    def _on_message(self, message: Datagram) -> None:
        """Apply one worker datagram; it counts from when it was sent, not when this batch was read."""
        pid, op, args, now = message.pid, message.op, message.args, message.sent
        with self._lock:
            worker = self._worker_of(pid)
            # ``step N`` or ``step N BUSY K`` (the work of the K steps up to N).
            if op in STEP_OPS and (len(args) == 1 or (op == "step" and len(args) == 3)):
                if worker is None:
                    self._early.append((pid, op, args, now))
                else:
                    self._record_step(pid, op, args, now)
            if worker is None:
                return
            if op in ("beat", "step"):
                if worker.last_beat is not None and not worker.sections:
                    self._learn(HEARTBEAT).add(now - worker.last_beat)
                worker.last_beat = now
            elif op == "enter" and len(args) == 2:
                timeout = None if args[1] == "-" else _positive(args[1])
                worker.sections.append((args[0], now, timeout))
            elif op == "leave" and len(args) == 1:
                self._leave(worker, args[0], now)
            elif op == "done":
                worker.last_beat = None
                worker.sections.clear()

    def _leave(self, worker: _Worker, name: str, now: float) -> None:
        """``worker`` left section ``name`` (and those it opened inside): a sample of the section's time."""
        for i in range(len(worker.sections) - 1, -1, -1):
            entered_name, entered, _ = worker.sections[i]
            if entered_name == name:
                self._learn(name).add(now - entered)
                del worker.sections[i:]
                break
        if worker.last_beat is not None:
            worker.last_beat = now

    def _drain_fifo(self) -> None:
        for request in self._inbox.timer_requests():
            with self._lock:
                self._on_timer(request)

    def _on_timer(self, request: TimerRequest) -> None:
        """Arm or disarm a torch timer of a tracked worker (called with the lock held)."""
        worker = self._worker_of(request.pid)
        if worker is None:
            return
        if request.expiration < 0:
            worker.timers.pop(request.scope, None)
        else:
            worker.timers[request.scope] = (request.expiration, max(request.expiration - time.time(), 0.0))

    def _worker_of(self, pid: int) -> _Worker | None:
        """The tracked worker ``pid`` is, or descends from (called with the lock held)."""
        owner = self._owner.get(pid)
        if owner is None:
            candidate: int | None = pid
            for _ in range(_MAX_ANCESTRY):
                if candidate is None or candidate <= 1:
                    break
                if candidate in self._workers:
                    owner = self._owner[pid] = candidate
                    break
                candidate = parent_of(candidate)
        return self._workers.get(owner) if owner is not None else None

    def _record_step(self, pid: int, op: str, args: tuple[str, ...], sent: float) -> None:
        """Hand a step datagram of tracked ``pid`` to the step tracker (called with the lock held)."""
        owner = self._owner[pid]
        worker = self._workers[owner]
        self._steps.record(WorkerId(owner, worker.local_rank, worker.global_rank), op, args[0], sent)
        step = parse_step(args[0])
        work = parse_work(*args[1:]) if len(args) == 3 else None
        if step is not None and work is not None:
            self._work.record(worker.global_rank, owner, step, *work)

    def _learn(self, name: str) -> LearnedTimeout:
        learned = self._learned.get(name)
        if learned is None:
            learned = self._learned[name] = LearnedTimeout(self.config)
        return learned

    def _expiry(self, worker: _Worker, now: float) -> _Expiry | None:
        """The earliest deadline this worker has to meet (called with the lock held)."""
        candidates = []
        if worker.sections:
            name, entered, explicit = worker.sections[-1]
            timeout = explicit if explicit is not None else self._learn(name).value
            candidates.append(_Expiry(HangSignal.SECTION, name, entered + timeout, timeout, explicit is None))
        elif worker.last_beat is not None:
            explicit = self.config.heartbeat_timeout
            timeout = explicit if explicit is not None else self._learn(HEARTBEAT).value
            candidates.append(
                _Expiry(
                    HangSignal.HEARTBEAT, HEARTBEAT, worker.last_beat + timeout, timeout, explicit is None
                )
            )
        wall_offset = now - time.time()
        for scope, (expiration, timeout) in worker.timers.items():
            candidates.append(_Expiry(HangSignal.TIMER, scope, expiration + wall_offset, timeout, False))
        return min(candidates, key=lambda e: e.deadline, default=None)

    def _scan(self, now: float) -> None:
        declared: list[tuple[int, _Worker, _Expiry, float]] = []
        with self._lock:
            for pid, worker in self._workers.items():
                if worker.declared:
                    continue
                found = self._check(worker, now)
                if found is not None:
                    worker.declared = True
                    declared.append((pid, worker, *found))
        for pid, worker, expiry, waited in declared:
            self._declare(pid, worker, expiry, waited)

    def _check(self, worker: _Worker, now: float) -> tuple[_Expiry, float] | None:
        """The deadline ``worker`` missed and how long it waited, if it hangs (called with the lock held)."""
        state = worker.proc.sample(now)
        if state is None:
            return None
        odd = self._odd_state(worker.proc, now)
        if odd is not None:
            return odd
        expiry = self._expiry(worker, now)
        if expiry is None or now < expiry.deadline:
            return None
        # A sleeping worker may be blocked in a collective with the real culprit: give that one a
        # timeout to be found.
        if worker.proc.busy() or state in ODD_STATES or now >= expiry.deadline + expiry.timeout:
            return expiry, now - expiry.deadline + expiry.timeout
        return None

    def _odd_state(self, proc: ProcState, now: float) -> tuple[_Expiry, float] | None:
        """A stopped or ``D``-state worker past its bound: the bound it missed and how long it waited."""
        if not proc.odd_state:
            return None
        stopped = proc.odd_state == "T"
        bound = self.config.stopped_bound if stopped else self.config.disk_sleep_bound
        if now - proc.odd_since < bound:
            return None
        kind = HangSignal.STOPPED if stopped else HangSignal.DISK_SLEEP
        expiry = _Expiry(kind, f"state {proc.odd_state}", proc.odd_since + bound, bound, False)
        return expiry, now - proc.odd_since

    def _declare(self, pid: int, worker: _Worker, expiry: _Expiry, waited: float) -> None:
        logger.warning(
            "rank %s (pid %s): no progress on %s %r for %.1fs (timeout %.1fs); taking its stack",
            worker.global_rank,
            pid,
            expiry.signal.value,
            expiry.name,
            waited,
            expiry.timeout,
        )
        started = time.monotonic()
        stack = capture_stack(pid, self.socket_path, self.config.stack_timeout)
        hang = Hang(
            pid=pid,
            local_rank=worker.local_rank,
            global_rank=worker.global_rank,
            signal=expiry.signal,
            name=expiry.name,
            waited=waited,
            timeout=expiry.timeout,
            learned=expiry.learned,
            stack=stack,
            stack_seconds=time.monotonic() - started,
        )
        write_to_worker_output(pid, f"\n=== taskd: {hang.reason}; its stack:\n{stack}\n")
        logger.warning("%s; stack:\n%s", hang.reason, stack)
        with self._lock:
            self._hangs.append(hang)
        self._on_hang()


def _positive(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None
