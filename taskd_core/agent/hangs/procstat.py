"""What ``/proc/PID/stat`` says of a worker: its state letter, its CPU time, its parent.

A worker stopped (``T``) or in uninterruptible sleep (``D``) longer than a
bound is hung without any code of its own; and a worker past a deadline is
declared at once only when it burns CPU (a spinning loop), since ranks
blocked in a collective with a hung peer sleep. :class:`ProcState` keeps one
worker's stat file open and remembers what successive reads showed.
"""

from __future__ import annotations

import collections
import os

#: Share of one core above which a silent worker counts as busy (spinning), not asleep in a collective.
_BUSY_SHARE = 0.1
#: Seconds of CPU samples kept per worker to judge whether it is busy.
_CPU_WINDOW = 2.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: The states that are a hang once they last: stopped, and uninterruptible sleep.
ODD_STATES = ("T", "D")


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


class ProcState:
    """One live worker's ``/proc`` state over time; not thread-safe (the watcher holds its lock)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        #: the state letter of :data:`ODD_STATES` the worker is in, and since when; "" when in none.
        self.odd_state = ""
        self.odd_since = 0.0
        self._cpu: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        #: its stat file, kept open: re-reading costs one pread instead of open/read/close.
        self._fd: int | None = None

    def sample(self, now: float) -> str | None:
        """Read the state now; its letter, or None when the process is gone or unreadable."""
        if self._fd is None:
            try:
                self._fd = os.open(f"/proc/{self.pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
        stat = read_stat(self.pid, self._fd)
        if stat is None:
            return None
        state, ticks = stat
        self._cpu.append((now, ticks))
        while len(self._cpu) > 2 and now - self._cpu[1][0] >= _CPU_WINDOW:
            self._cpu.popleft()
        if state in ODD_STATES:
            if self.odd_state != state:
                self.odd_state, self.odd_since = state, now
        else:
            self.odd_state = ""
        return state

    def busy(self) -> bool:
        """Whether it used a tenth of a core or more over the recent samples (half a second at least)."""
        (t0, ticks0), (t1, ticks1) = self._cpu[0], self._cpu[-1]
        if t1 - t0 < 0.5:
            return False
        return (ticks1 - ticks0) / _CLOCK_TICKS / (t1 - t0) >= _BUSY_SHARE

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
