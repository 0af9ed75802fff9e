"""Progress watching: finds a worker that stopped making progress, and keeps its stack.

Three signals, all on the agent's side of one node:

* **/proc state**, for any process and without code: a worker stopped (``T``)
  or in uninterruptible sleep (``D``) longer than a bound is hung;
* **heartbeats and named sections** sent by :mod:`taskd_core.worker` over a
  Unix datagram socket (``TASKD_PROGRESS_SOCKET``): a worker silent past its
  heartbeat timeout, or inside a section past the section's timeout, is hung;
* **torch elastic's file timers**: the FIFO protocol of torch's
  ``FileTimerServer`` at ``TORCHELASTIC_TIMER_FILE``, so scripts using
  ``FileTimerClient`` / ``expires(after=...)`` work unchanged; an expired timer
  is a hang of that worker. torch's own server is not used: it kills the worker
  (before anyone could take its stack) and then its own process — the agent.

Timeouts are explicit (a section's own, ``heartbeat_timeout``) or learned: a
multiple of the p99 of the job's recent intervals (per signal name), clamped
to a floor and a ceiling; the ceiling applies until enough samples exist.

Ranks blocked in a collective with a hung peer go silent at the same moment
as the culprit. A worker past its deadline is therefore declared at once only
when it burns CPU (a spinning loop) or is stopped / in ``D``; a worker that
merely sleeps gets one more timeout first, in which the culprit is found and
killed and the sleepers' collectives fail — they end as deaths of the same
cycle, not as new hangs. A job where every rank sleeps (a real deadlock) is
still found, after twice the timeout.

Before a hang is reported, the worker's Python stack (every thread) is taken
with ``py-spy dump`` when installed, else through the ``faulthandler`` dump the
worker API arranges, and written into the worker's own output.
"""

from __future__ import annotations

import bisect
import collections
import enum
import json
import logging
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from taskd_core.agent.hangs.steps import STEP_OPS, StepTracker, WorkerId
from taskd_core.errors import ConfigError
from taskd_core.models import WorkerEvent
from taskd_core.values import check_seconds
from taskd_core.worker import SOCKET_ENV, STACK_SIGNAL, stack_file

logger = logging.getLogger(__name__)

#: torch elastic's variable naming the timer FIFO (``torch.distributed.elastic.timer``).
TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"
#: The learned heartbeat's name among the sections.
HEARTBEAT = "heartbeat"
#: Longest stack text kept for the journal; a deep stack of many threads is cut, not dropped.
MAX_STACK = 32_000
#: Share of one core above which a silent worker counts as busy (spinning), not asleep in a collective.
_BUSY_SHARE = 0.1
#: Seconds of CPU samples kept per worker to judge whether it is busy.
_CPU_WINDOW = 2.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: Hops up the parent chain from a reporting pid to the worker the adapter knows (``bash -c python ...``).
_MAX_ANCESTRY = 8
#: Step datagrams kept from processes not tracked yet, and for how long (seconds): a worker
#: that resumes within milliseconds of its start is ahead of the agent's next look.
_EARLY_STEPS = 256
_EARLY_FOR = 30.0


class HangSignal(str, enum.Enum):
    """What showed that a worker stopped making progress."""

    STOPPED = "stopped"
    DISK_SLEEP = "uninterruptible-sleep"
    HEARTBEAT = "heartbeat"
    SECTION = "section"
    TIMER = "timer"


@dataclass(frozen=True, slots=True)
class ProgressConfig:
    """Bounds of the progress watch; every value in seconds unless named otherwise."""

    enabled: bool = True
    #: a worker in state ``T`` longer than this is hung.
    stopped_bound: float = 0.5
    #: a worker in state ``D`` longer than this is hung.
    disk_sleep_bound: float = 60.0
    #: explicit heartbeat timeout; None learns it from the job's beat intervals.
    heartbeat_timeout: float | None = None
    #: learned timeout = multiplier x p99 of the recent intervals, within floor..ceiling.
    multiplier: float = 5.0
    floor: float = 3.0
    ceiling: float = 300.0
    #: samples needed before a learned value replaces the ceiling, and how many recent ones count.
    min_samples: int = 10
    window: int = 200
    #: how often /proc and the deadlines are checked.
    poll: float = 0.2
    #: bound on taking one worker's stack (py-spy, then the faulthandler dump, share it): the
    #: hung rank is killed, and the job recovers, only after its stack is taken.
    stack_timeout: float = 2.0

    def __post_init__(self) -> None:
        for name in ("stopped_bound", "disk_sleep_bound", "floor", "ceiling", "poll", "stack_timeout"):
            check_seconds(getattr(self, name), f"hang detection: {name.replace('_', ' ')}", positive=True)
        if not (math.isfinite(self.multiplier) and self.multiplier > 0):
            raise ConfigError(f"hang detection: multiplier must be a positive number, not {self.multiplier}")
        if self.heartbeat_timeout is not None:
            check_seconds(self.heartbeat_timeout, "hang detection: heartbeat timeout", positive=True)
        if self.floor > self.ceiling:
            raise ConfigError(f"hang detection: floor {self.floor}s is above ceiling {self.ceiling}s")
        if self.min_samples < 1 or self.window < self.min_samples:
            raise ConfigError(
                f"hang detection: need 1 <= min samples ({self.min_samples}) <= window ({self.window})"
            )


@dataclass(frozen=True, slots=True)
class Hang:
    """One worker declared hung, with the evidence for the journal."""

    pid: int
    local_rank: int
    global_rank: int
    signal: HangSignal
    #: what stopped: the section or timer scope, the /proc state, or ``heartbeat``.
    name: str
    #: seconds without progress when declared, and the timeout that applied.
    waited: float
    timeout: float
    learned: bool
    stack: str
    #: seconds taking the stack took.
    stack_seconds: float = 0.0

    @property
    def reason(self) -> str:
        how = "learned" if self.learned else "configured"
        return (
            f"rank {self.global_rank} (pid {self.pid}) hung: {self.signal.value} {self.name!r}, "
            f"no progress for {self.waited:.1f}s (timeout {self.timeout:.1f}s, {how})"
        )

    def evidence(self) -> str:
        """The reason and the stack, cut to fit one journal entry."""
        text = f"{self.reason}\nstack taken in {self.stack_seconds:.2f}s\n{self.stack}"
        return text if len(text) <= MAX_STACK else text[: MAX_STACK - 20] + "\n... (cut)\n"


class LearnedTimeout:
    """A timeout that follows the observed durations of one signal (p99 x multiplier, clamped)."""

    def __init__(self, config: ProgressConfig) -> None:
        self._config = config
        self._recent: collections.deque[float] = collections.deque(maxlen=config.window)
        self._sorted: list[float] = []
        self.count = 0

    def add(self, seconds: float) -> None:
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(seconds)
        bisect.insort(self._sorted, seconds)
        self.count += 1

    @property
    def p99(self) -> float | None:
        if len(self._sorted) < self._config.min_samples:
            return None
        return self._sorted[max(0, math.ceil(0.99 * len(self._sorted)) - 1)]

    @property
    def value(self) -> float:
        p99 = self.p99
        if p99 is None:
            return self._config.ceiling
        return min(self._config.ceiling, max(self._config.floor, self._config.multiplier * p99))

    def describe(self) -> str:
        p99 = self.p99
        if p99 is None:
            return f"{self.value:.1f}s (learning: {len(self._sorted)}/{self._config.min_samples} samples)"
        return f"{self.value:.1f}s (learned: p99 {p99:.3f}s of {len(self._sorted)})"


@dataclass(slots=True)
class _Worker:
    """What the watcher knows about one live worker process."""

    local_rank: int
    global_rank: int
    last_beat: float | None = None
    #: open sections, innermost last: (name, entered at, explicit timeout).
    sections: list[tuple[str, float, float | None]] = field(default_factory=list)
    #: torch timers by scope: (expiration on the wall clock, timeout it was armed with).
    timers: dict[str, tuple[float, float]] = field(default_factory=dict)
    odd_state: str = ""
    odd_since: float = 0.0
    cpu: collections.deque[tuple[float, int]] = field(default_factory=lambda: collections.deque(maxlen=64))
    declared: bool = False
    #: its /proc stat file, kept open: re-reading costs one pread instead of open/read/close.
    stat_fd: int | None = None

    def forget(self) -> None:
        if self.stat_fd is not None:
            os.close(self.stat_fd)
            self.stat_fd = None


@dataclass(frozen=True, slots=True)
class _Expiry:
    signal: HangSignal
    name: str
    deadline: float
    timeout: float
    learned: bool


def read_stat(pid: int, fd: int | None = None) -> tuple[str, int] | None:
    """``(state letter, CPU ticks)`` of ``pid`` from /proc (through ``fd``, its open stat file, if given)."""
    try:
        if fd is None:
            with open(f"/proc/{pid}/stat", "rb") as f:
                raw = f.read()
        else:
            raw = os.pread(fd, 1024, 0)
    except OSError:
        return None
    stat = raw.decode("ascii", errors="replace")
    # The command name may hold spaces and parentheses: fields start after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    if len(fields) < 13:
        return None
    return fields[0], int(fields[11]) + int(fields[12])


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


def py_spy() -> str | None:
    """The ``py-spy`` executable: on PATH or beside this interpreter (a virtualenv's bin)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else None


def _published_by_a_watcher(env: Mapping[str, str]) -> bool:
    """The environment's progress socket and timer file are a running watcher's (one directory)."""
    sock, timer = env.get(SOCKET_ENV), env.get(TIMER_FILE_ENV)
    return sock is not None and timer is not None and Path(sock).parent == Path(timer).parent


def capture_stack(pid: int, socket_path: str | None, timeout: float) -> str:
    """Every thread's Python stack of ``pid``: py-spy, else the worker's faulthandler dump.

    Both share ``timeout``: a py-spy slowed down by a busy machine leaves the
    rest of it to the dump, which the worker writes itself in microseconds.
    """
    deadline = time.monotonic() + timeout
    spy = py_spy()
    if spy is not None:
        try:
            # --nonblocking reads memory without ptrace-stopping the target: safe on a stopped or
            # D-state worker.
            done = subprocess.run(
                [spy, "dump", "--pid", str(pid), "--nonblocking"],
                capture_output=True,
                text=True,
                # The dump gets a share of the time in any case.
                timeout=timeout * 0.75,
                check=False,
            )
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout
            logger.warning(
                "py-spy could not read pid %s: %s", pid, (done.stderr or done.stdout).strip()[-500:]
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            logger.warning("py-spy could not read pid %s: %s", pid, exc)
    if socket_path is not None:
        dumped = _faulthandler_dump(pid, stack_file(socket_path, pid), deadline - time.monotonic())
        if dumped:
            return "(faulthandler dump)\n" + dumped
    return "(no stack: py-spy is not installed and the worker arranged no faulthandler dump)\n"


def _faulthandler_dump(pid: int, path: Path, timeout: float) -> str:
    try:
        before = path.stat().st_size
    except OSError:
        return ""  # the worker never used the worker API, so nobody listens on the dump signal
    try:
        os.kill(pid, STACK_SIGNAL)
        # A stopped worker runs no handler; it is killed right after, so letting it run is harmless.
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        return ""
    deadline = time.monotonic() + timeout
    size = before
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            now = path.stat().st_size
        except OSError:
            return ""
        if now > before and now == size:  # grew, then stopped growing: the dump is complete
            break
        size = now
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            f.seek(before)
            return f.read()
    except OSError:
        return ""


def write_to_worker_output(pid: int, text: str) -> None:
    """Append ``text`` to the worker's own stdout (its log file under every launcher here)."""
    try:
        with open(f"/proc/{pid}/fd/1", "a", encoding="utf-8") as out:
            out.write(text)
    except OSError as exc:
        logger.info("cannot write into the output of pid %s: %s", pid, exc)


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
        #: (pid, op, step, sent) of step datagrams from pids not tracked yet.
        self._early: collections.deque[tuple[int, str, str, float]] = collections.deque(maxlen=_EARLY_STEPS)
        #: one reader of the socket at a time, so datagrams are handled in the order sent.
        self._reading = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dir: Path | None = None
        self._sock: socket.socket | None = None
        self._fifo: tuple[int, int] | None = None
        self._fifo_buf = b""
        self._env_before: dict[str, str | None] = {}
        self.socket_path: str | None = None
        self.timer_file: str | None = None

    # --- life cycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Open the socket and the timer FIFO, publish them to workers, start watching."""
        self._dir = Path(tempfile.mkdtemp(prefix="taskd-progress-"))
        self.socket_path = str(self._dir / "progress.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.socket_path)
        self._sock.setblocking(False)
        # Messages wait here between scans; the kernel caps the size at its rmem_max.
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        # What another watcher of this process published is its own, not the user's: neither
        # used nor put back at close.
        before = {} if _published_by_a_watcher(os.environ) else dict(os.environ)
        self.timer_file = before.get(TIMER_FILE_ENV) or str(self._dir / "timer.fifo")
        if os.path.lexists(self.timer_file):
            os.remove(self.timer_file)
        os.mkfifo(self.timer_file)
        # Our own write end keeps the FIFO from reading as end-of-file between clients.
        reader = os.open(self.timer_file, os.O_RDONLY | os.O_NONBLOCK)
        self._fifo = (reader, os.open(self.timer_file, os.O_WRONLY | os.O_NONBLOCK))
        # Every launcher's workers inherit the launcher's environment (msrun builds
        # its workers' environment from its own), so this reaches all of them.
        for name, value in ((SOCKET_ENV, self.socket_path), (TIMER_FILE_ENV, self.timer_file)):
            self._env_before[name] = before.get(name)
            os.environ[name] = value
        self._thread = threading.Thread(target=self._run, name="taskd-progress", daemon=True)
        self._thread.start()
        logger.info("watching progress: socket %s, torch timer file %s", self.socket_path, self.timer_file)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.stack_timeout + 5.0)
        with self._lock:
            for worker in self._workers.values():
                worker.forget()
            self._workers.clear()
        published = {SOCKET_ENV: self.socket_path, TIMER_FILE_ENV: self.timer_file}
        for name, value in self._env_before.items():
            if os.environ.get(name) != published[name]:
                continue  # another watcher of this process published its own since
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._env_before.clear()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._fifo is not None:
            for fd in self._fifo:
                os.close(fd)
            self._fifo = None
            if self.timer_file and os.path.lexists(self.timer_file):
                os.remove(self.timer_file)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # --- the agent's side -------------------------------------------------------------------

    def track(self, workers: Mapping[int, tuple[int, int]]) -> None:
        """The live workers: ``{pid: (local rank, global rank)}``; others are forgotten."""
        with self._lock:
            for pid in list(self._workers):
                if pid not in workers:
                    self._workers.pop(pid).forget()
            for pid, (local_rank, global_rank) in workers.items():
                known = self._workers.get(pid)
                if known is None or (known.local_rank, known.global_rank) != (local_rank, global_rank):
                    if known is not None:
                        known.forget()
                    self._workers[pid] = _Worker(local_rank, global_rank)
            self._owner = {p: o for p, o in self._owner.items() if o in self._workers}
            self._steps.keep(self._workers)
            early, self._early = list(self._early), collections.deque(maxlen=_EARLY_STEPS)
            horizon = time.monotonic() - _EARLY_FOR
            for pid, op, step, sent in early:
                if self._worker_of(pid) is not None:
                    self._record_step(pid, op, step, sent)
                elif sent > horizon:
                    self._early.append((pid, op, step, sent))

    def last_step(self, pid: int) -> int | None:
        """The last step tracked worker ``pid`` reported, counting datagrams sent up to now."""
        if self._sock is not None:
            self._drain_socket(time.monotonic())
        with self._lock:
            return self._steps.last_step(pid)

    def take_worker_events(self) -> list[WorkerEvent]:
        """Workers' ``resumed`` and ``stepping`` events since the last call (see :mod:`.steps`)."""
        with self._lock:
            return self._steps.take_events()

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

    def timeout_of(self, name: str) -> float | None:
        """The learned timeout of a heartbeat or section name (None before its first sample)."""
        with self._lock:
            learned = self._learned.get(name)
            return None if learned is None else learned.value

    # --- the watcher's thread ----------------------------------------------------------------

    def _run(self) -> None:
        # The socket is read as soon as datagrams arrive, not once per scan: Linux queues
        # at most net.unix.max_dgram_qlen (default 10) datagrams per socket and a
        # non-blocking sender's next ones are lost, whatever SO_RCVBUF says. Messages
        # carry their own time (CLOCK_MONOTONIC is one clock for every process).
        assert self._sock is not None
        next_scan = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now < next_scan:
                select.select([self._sock], [], [], next_scan - now)
                self._drain_socket(time.monotonic())
                continue
            self._drain_socket(now)
            self._drain_fifo(now)
            try:
                self._scan(now)
            except Exception:  # the watch must outlive one bad reading
                logger.exception("progress scan failed")
            with self._lock:
                idle = not self._workers
            next_scan = now + (1.0 if idle else self.config.poll)

    def _drain_socket(self, now: float) -> None:
        assert self._sock is not None
        with self._reading:
            for _ in range(100_000):
                try:
                    data = self._sock.recv(512)
                except OSError:  # BlockingIOError: drained
                    break
                self._on_message(data.decode(errors="replace").split(), now)
        with self._lock:
            pending = self._steps.pending
        if pending:
            self._on_events()

    def _on_message(self, message: list[str], now: float) -> None:
        """``PID MONOTONIC-TIME OP [ARGS]`` from :class:`~taskd_core.worker.ProgressReporter`."""
        if len(message) < 3 or not message[0].isdigit():
            return
        try:
            sent = min(float(message[1]), now)
        except ValueError:
            return
        if not math.isfinite(sent):
            return
        pid, op, parts = int(message[0]), message[2], [message[0], *message[2:]]
        now = sent  # when it happened, not when this batch was read
        with self._lock:
            worker = self._worker_of(pid)
            if worker is None:
                if op in STEP_OPS and len(parts) == 3:
                    self._early.append((pid, op, parts[2], now))
                return
            if op in STEP_OPS and len(parts) == 3:
                self._record_step(pid, op, parts[2], now)
            if op in ("beat", "step"):
                if worker.last_beat is not None and not worker.sections:
                    self._learn(HEARTBEAT).add(now - worker.last_beat)
                worker.last_beat = now
            elif op == "enter" and len(parts) == 4:
                timeout = None if parts[3] == "-" else _positive(parts[3])
                worker.sections.append((parts[2], now, timeout))
            elif op == "leave" and len(parts) == 3:
                for i in range(len(worker.sections) - 1, -1, -1):
                    name, entered, _ = worker.sections[i]
                    if name == parts[2]:
                        self._learn(name).add(now - entered)
                        del worker.sections[i:]
                        break
                if worker.last_beat is not None:
                    worker.last_beat = now
            elif op == "done":
                worker.last_beat = None
                worker.sections.clear()

    def _drain_fifo(self, now: float) -> None:
        assert self._fifo is not None
        try:
            while chunk := os.read(self._fifo[0], 65536):
                self._fifo_buf += chunk
        except BlockingIOError:
            pass
        *lines, self._fifo_buf = self._fifo_buf.split(b"\n")
        for line in lines:
            try:
                request = json.loads(line)
                pid, scope = int(request["pid"]), str(request["scope_id"])
                expiration = float(request["expiration_time"])
            except (ValueError, KeyError, TypeError):
                logger.warning("ignoring a malformed torch timer request: %r", line[:200])
                continue
            with self._lock:
                worker = self._worker_of(pid)
                if worker is None:
                    continue
                if expiration < 0:
                    worker.timers.pop(scope, None)
                else:
                    worker.timers[scope] = (expiration, max(expiration - time.time(), 0.0))

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

    def _record_step(self, pid: int, op: str, step: str, sent: float) -> None:
        """Hand a step datagram of tracked ``pid`` to the step tracker (called with the lock held)."""
        owner = self._owner[pid]
        worker = self._workers[owner]
        self._steps.record(WorkerId(owner, worker.local_rank, worker.global_rank), op, step, sent)

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
                found = self._check(pid, worker, now)
                if found is not None:
                    worker.declared = True
                    declared.append((pid, worker, *found))
        for pid, worker, expiry, waited in declared:
            self._declare(pid, worker, expiry, waited)

    def _check(self, pid: int, worker: _Worker, now: float) -> tuple[_Expiry, float] | None:
        if worker.stat_fd is None:
            try:
                worker.stat_fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
        stat = read_stat(pid, worker.stat_fd)
        if stat is None:
            return None
        state, ticks = stat
        worker.cpu.append((now, ticks))
        while len(worker.cpu) > 2 and now - worker.cpu[1][0] >= _CPU_WINDOW:
            worker.cpu.popleft()
        if state in ("T", "D"):
            if worker.odd_state != state:
                worker.odd_state, worker.odd_since = state, now
            stopped = state == "T"
            bound = self.config.stopped_bound if stopped else self.config.disk_sleep_bound
            if now - worker.odd_since >= bound:
                kind = HangSignal.STOPPED if stopped else HangSignal.DISK_SLEEP
                return _Expiry(
                    kind, f"state {state}", worker.odd_since + bound, bound, False
                ), now - worker.odd_since
        else:
            worker.odd_state = ""
        expiry = self._expiry(worker, now)
        if expiry is None or now < expiry.deadline:
            return None
        # A sleeping worker may be blocked in a collective with the real culprit: give that one a
        # timeout to be found.
        if self._busy(worker) or state in ("T", "D") or now >= expiry.deadline + expiry.timeout:
            return expiry, now - expiry.deadline + expiry.timeout
        return None

    @staticmethod
    def _busy(worker: _Worker) -> bool:
        (t0, ticks0), (t1, ticks1) = worker.cpu[0], worker.cpu[-1]
        if t1 - t0 < 0.5:
            return False
        return (ticks1 - ticks0) / _CLOCK_TICKS / (t1 - t0) >= _BUSY_SHARE

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
