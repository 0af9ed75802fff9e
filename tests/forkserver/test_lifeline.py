"""The lifeline guard, with real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from taskd_core.forkserver.lifeline import Lifeline

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pid: int, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_an_orderly_close_kills_nothing_and_ends_the_guard() -> None:
    worker = subprocess.Popen(SLEEP, start_new_session=True)
    try:
        lifeline = Lifeline()
        lifeline.adopt(worker.pid)
        lifeline.close()
        assert not alive(lifeline.guard_pid)
        assert worker.poll() is None
    finally:
        worker.kill()
        worker.wait()


_LAUNCHER = """
import subprocess, sys
from taskd_core.forkserver.lifeline import Lifeline
lifeline = Lifeline()
kept = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
freed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
lifeline.adopt(kept.pid)
lifeline.adopt(freed.pid)
lifeline.release(freed.pid)
print(kept.pid, freed.pid, flush=True)
import time; time.sleep(120)
"""


def test_the_guard_kills_adopted_groups_when_the_launcher_is_sigkilled() -> None:
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    kept, freed = map(int, launcher.stdout.readline().split())
    try:
        launcher.kill()
        launcher.wait()
        assert wait_dead(kept)
        assert alive(freed)  # released: never touched
    finally:
        for pid in (kept, freed):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
