"""Test support: an msrun-like process manager over real child processes, and waiting helpers.

:class:`FakeMsrun` implements msrun 2.10's four callbacks the way
``mindspore/parallel/cluster/process_entity/_api.py`` does, including the
quirks measured on the real one:

* ``kill_workers`` SIGKILLs each worker's process group and returns at once;
  right after ``kill_workers([-1])`` ``monitor_rank_status`` still reports the
  old pids as running (forced here for the next call, and for any call while
  the process has not died yet, so the adapter must not trust it);
* a rank never started is ``{"pid": None, "status": 200}``;
* a worker that vanished without exit code 0 is status 300;
* ``start_all_workers`` kills leftovers first; ``start_worker_list`` wants a list.

Workers are ``sys.executable`` children in sessions of their own (as msrun
starts them) running :data:`WORKER`: they exit 0 once ``<dir>/release``
exists, exit 7 while ``<dir>/crash-<rank>`` exists, and give up after a
minute. A scheduler child (``MS_ROLE=MS_SCHED``) exits once ``release`` exists.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from taskd_core.testing import process_running
from taskd_mindspore.scheduler import find_scheduler

#: Calls of monitor_rank_status that see killed pids as running even if they died already
#: (after these, as in msrun, they look running until they are really dead).
STALE_MONITOR_CALLS = 1

WORKER = r"""
import os, sys, time
d, rank = sys.argv[1], sys.argv[2]
if rank != "-1":  # the scheduler's start is not a worker's
    with open(os.path.join(d, "starts.log"), "a") as f:
        f.write(f"{rank} {os.getpid()} {os.environ.get('TASKD_RESTART_COUNT', '-')}\n")
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    if os.path.exists(os.path.join(d, f"crash-{rank}")):
        sys.exit(7)
    if os.path.exists(os.path.join(d, "release")):
        sys.exit(0)
    time.sleep(0.05)
sys.exit(3)
"""


@dataclass
class FakeMsrun:
    """msrun's ``_ProcessManager`` callbacks over real children (see the module docstring)."""

    workdir: Path
    local_worker_num: int = 2
    node_rank: int = 0
    #: when True, kill_workers does nothing (a KILL_WORKER that fails silently).
    ignore_kill: bool = False
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    everything: list[subprocess.Popen[bytes]] = field(default_factory=list)
    stale: dict[int, int] = field(default_factory=dict)
    stale_calls: int = 0
    calls: list[tuple[str, Any]] = field(default_factory=list)

    def callbacks(self) -> dict[str, Any]:
        return {
            "KILL_WORKER": self.kill_workers,
            "START_ALL_WORKER": self.start_all_workers,
            "START_WORKER_LIST": self.start_worker_list,
            "MONITOR": self.monitor_rank_status,
        }

    def _spawn(self, rank: int, role: str) -> subprocess.Popen[bytes]:
        env = dict(os.environ, MS_ROLE=role)
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(self.workdir), str(rank)],
            env=env,
            start_new_session=role == "MS_WORKER",
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.everything.append(proc)
        return proc

    def start_scheduler(self) -> subprocess.Popen[bytes]:
        return self._spawn(-1, "MS_SCHED")

    def kill_workers(self, pids: list[int]) -> int:
        self.calls.append(("KILL_WORKER", list(pids)))
        if self.ignore_kill:
            return 0
        chosen = {r: p for r, p in self.procs.items() if -1 in pids or p.pid in pids}
        for proc in chosen.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        if -1 in pids:
            self.stale = {r: p.pid for r, p in chosen.items()}
            self.stale_calls = STALE_MONITOR_CALLS
        return 0

    def monitor_rank_status(self, local_ranks: list[int]) -> dict[int, dict[str, Any]]:
        ranks = range(self.local_worker_num) if -1 in local_ranks else local_ranks
        out: dict[int, dict[str, Any]] = {}
        stale = self.stale_calls > 0
        self.stale_calls = max(0, self.stale_calls - 1)
        for r in ranks:
            global_rank = self.node_rank * self.local_worker_num + r
            proc = self.procs.get(r)
            if proc is None:
                out[r] = {"pid": None, "status": 200, "global_rank": global_rank}
                continue
            killed = self.stale.get(r) == proc.pid
            status = None if killed and (stale or process_running(proc.pid)) else proc.poll()
            if status is not None and status != 0 and not process_running(proc.pid):
                status = 300
            out[r] = {"pid": proc.pid, "status": status, "global_rank": global_rank,
                      "local_rank": r, "node_id": self.node_rank}
        return out

    def start_all_workers(self) -> int:
        self.calls.append(("START_ALL_WORKER", None))
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for r in range(self.local_worker_num):
            self.procs[r] = self._spawn(r, "MS_WORKER")
        return 0

    def start_worker_list(self, rank_ids: list[int]) -> int:
        self.calls.append(("START_WORKER_LIST", rank_ids))
        if not isinstance(rank_ids, list):
            raise TypeError(f"The type of 'rank_ids' must be a list, but got:{rank_ids}")
        for r in rank_ids:
            self.procs[r] = self._spawn(r, "MS_WORKER")
        return 0

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def starts(self) -> list[tuple[int, int, str]]:
        """(rank, pid, TASKD_RESTART_COUNT) of every worker start, in order."""
        path = self.workdir / "starts.log"
        lines = path.read_text().split("\n") if path.exists() else []
        return [(int(r), int(p), c) for r, p, c in (line.split() for line in lines if line)]

    def close(self) -> None:
        for proc in self.everything:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        # Schedulers the adapter started in place of ours are children of this process too.
        for _ in range(10):
            extra = find_scheduler(os.getpid())
            if extra is None:
                break
            os.kill(extra.pid, signal.SIGKILL)
            os.waitpid(extra.pid, 0)
