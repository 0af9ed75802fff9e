"""The lifeline guard, with real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from taskd_core.forkserver.lifeline import Lifeline
from taskd_core.testing import process_running, wait_gone

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


def test_an_orderly_close_kills_nothing_and_ends_the_guard() -> None:
    worker = subprocess.Popen(SLEEP, start_new_session=True)
    try:
        lifeline = Lifeline()
        lifeline.adopt(worker.pid)
        lifeline.close()
        assert not process_running(lifeline.guard_pid)
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
        wait_gone([kept], "the adopted group", 10.0)
        assert process_running(freed)  # released: never touched
    finally:
        for pid in (kept, freed):
            if process_running(pid):
                os.kill(pid, signal.SIGKILL)
