"""Helpers shared by the bench scripts: statistics, tables, /proc, child processes, the controller journal.

Not a benchmark itself. The scripts next to it import it as ``_common``
(they are run as ``python bench/<name>.py``, so this directory is on ``sys.path``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any, Self, TypeVar

from taskd_core.client.query import QueryClient
from taskd_core.errors import QueryRefusedError
from taskd_core.models import Code, Credentials, JobStatus, JournalEvent
from taskd_core.testing import free_port as free_port
from taskd_core.testing import process_running

logger = logging.getLogger(__name__)
T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit in the main thread, so ``finally`` blocks stop what the bench started."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


# --- statistics and tables ------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True, slots=True)
class Summary:
    n: int
    median: float
    p99: float
    low: float
    high: float

    def as_dict(self) -> dict[str, float]:
        return {"n": self.n, "median": self.median, "p99": self.p99, "min": self.low, "max": self.high}


def summarize(values: Iterable[float | None]) -> Summary:
    """Median, p99, min and max of the values that are not None (NaN for none)."""
    present = [v for v in values if v is not None]
    if not present:
        return Summary(0, math.nan, math.nan, math.nan, math.nan)
    return Summary(len(present), percentile(present, 50), percentile(present, 99), min(present), max(present))


def ratio(numerator: float, denominator: float) -> float:
    if math.isnan(numerator) or math.isnan(denominator) or denominator == 0:
        return math.nan
    return numerator / denominator


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None or math.isnan(value):
        return "N/A"
    return f"{value:.{digits}f}"


def fmt_range(summary: Mapping[str, float], digits: int = 2) -> str:
    """``median (min–max)`` of a :meth:`Summary.as_dict`, or N/A."""
    if not summary["n"]:
        return "N/A"
    return f"{fmt(summary['median'], digits)} ({fmt(summary['min'], digits)}–{fmt(summary['max'], digits)})"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path | None, data: Mapping[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


# --- the machine and /proc -------------------------------------------------------------------


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def machine() -> dict[str, Any]:
    """What the figures were taken on."""
    model = "unknown"
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_kib = 0
    with open("/proc/meminfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
                break
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "memory_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(),
        "loadavg_at_start": load_average(),
    }


def _stat_fields(pid: int) -> list[str]:
    """Fields of /proc/<pid>/stat after the command name; index 0 is field 3 (state)."""
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
        stat = f.read()
    return stat[stat.rfind(")") + 2 :].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` itself so far (threads included, children not)."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid``'s threads by kind: ``main`` (the main thread), else the thread's name.

    Python threads carry the process's name, gRPC's core threads their own
    (``grpc_global_tim``, ``event_engine``, ...), so this is a cheap profile.
    """
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = "main" if int(tid) == pid else stat[stat.index("(") + 1 : stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return out


def _boot_time() -> float:
    """Wall-clock time of boot, to the microsecond (``btime`` in /proc/stat is whole seconds only)."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


_BOOT_TIME = _boot_time()


def start_time(pid: int) -> float | None:
    """Wall-clock time ``pid`` was forked (resolution 1/CLK_TCK, i.e. 10 ms), or None when it is gone."""
    try:
        return _BOOT_TIME + int(_stat_fields(pid)[19]) / _CLK_TCK
    except OSError:
        return None


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS")


def poll_until(probe: Callable[[], T | None], timeout: float, what: str, interval: float = 0.02) -> T:
    """Call ``probe`` until it returns something truthy, and return that.

    :raises TimeoutError: naming ``what``, at the deadline.
    """
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f}s")
        time.sleep(interval)
    return value


def processes_with_env(entry: str) -> list[int]:
    """Live processes whose environment holds ``entry`` (``NAME=VALUE``), which children inherit."""
    needle = entry.encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in environ and process_running(int(name)):
            found.append(int(name))
    return found


# --- child processes ----------------------------------------------------------------------------


#: Whether a pid is a live process (zombies count as gone).
pid_alive = process_running


class Children:
    """Processes a benchmark starts or is handed; all are gone after :meth:`close`.

    ``close`` stops them in reverse order of start: SIGTERM to each (to its
    whole process group when it leads one; launchers then stop their own
    workers), up to ``grace`` seconds for it to end, SIGKILL to what is left;
    finally SIGKILL to any extra pid registered with :meth:`adopt` (workers
    that a launcher started in sessions of their own).
    """

    def __init__(self, grace: float = 10.0) -> None:
        self.grace = grace
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []
        self._adopted: set[int] = set()

    def start(
        self,
        args: Sequence[str],
        *,
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``args`` in a new session, output to ``log`` (or nowhere)."""
        out: IO[bytes] | int = subprocess.DEVNULL
        if log is not None:
            out = open(log, "ab")  # noqa: SIM115 - closed in close()
            self._logs.append(out)
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(
            list(args),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
        )
        logger.debug("started pid %s: %s", proc.pid, " ".join(args))
        return self.own(proc)

    def own(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        """Stop ``proc`` (started elsewhere) in :meth:`close` too."""
        self._procs.append(proc)
        return proc

    def adopt(self, pids: Iterable[int]) -> None:
        self._adopted.update(pids)

    def close(self) -> None:
        # Last started, first stopped: a launcher that hosts the others' controller outlives them.
        for proc in reversed(self._procs):
            if proc.poll() is None:
                _signal_tree(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(self.grace)
                except subprocess.TimeoutExpired:
                    logger.warning(
                        "pid %s (%s) still alive %.0fs after SIGTERM; SIGKILL",
                        proc.pid,
                        proc.args,
                        self.grace,
                    )
            _signal_tree(proc.pid, signal.SIGKILL)  # orphans keep the group id after their leader is gone
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                logger.error("pid %s survived SIGKILL", proc.pid)
        for pid in self._adopted:
            if pid_alive(pid):
                logger.warning("leftover pid %s: SIGKILL", pid)
                _signal_tree(pid, signal.SIGKILL)
        for log in self._logs:
            log.close()
        self._procs.clear()
        self._logs.clear()
        self._adopted.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _signal_tree(pid: int, sig: signal.Signals) -> None:
    """``sig`` to the process group ``pid`` leads (even if ``pid`` is gone), else to ``pid`` alone."""
    try:
        os.killpg(pid, sig)
        return
    except PermissionError:
        return
    except ProcessLookupError:
        pass  # no group led by pid: a process started without a session of its own
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# --- the controller's view of a job ------------------------------------------------------------


def job_status(
    address: str, job_id: str, events: int = 100, timeout: float = 5.0, token: str = ""
) -> JobStatus | None:
    """The controller's view of ``job_id`` with its newest ``events`` journal entries (None: unknown job).

    :param token: the job's token (``TASKD_JOB_TOKEN`` of its launchers), which a job registered with one needs.
    """
    with QueryClient(address, Credentials(token=token), timeout=timeout) as controller:
        try:
            return controller.job(job_id, events)
        except QueryRefusedError as exc:
            if exc.code == Code.UNREGISTERED:
                return None
            raise


def job_events(
    address: str, job_id: str, events: int = 100, timeout: float = 5.0, token: str = ""
) -> tuple[JournalEvent, ...]:
    """The newest ``events`` journal entries of ``job_id``, oldest first (none for an unknown job)."""
    view = job_status(address, job_id, events, timeout, token)
    return view.events if view is not None else ()
