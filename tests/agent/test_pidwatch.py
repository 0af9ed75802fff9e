"""Death detection through pidfds, on real child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from taskd_core.agent.pidwatch import PidWatch, wait_gone


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_wait_returns_the_pid_that_died(sleeper: subprocess.Popen[bytes]) -> None:
    watch = PidWatch()
    try:
        assert watch.watch([sleeper.pid]) == set()
        os.kill(sleeper.pid, signal.SIGKILL)
        assert watch.wait(30) == {sleeper.pid}
    finally:
        watch.close()


def test_wake_interrupts_a_wait(sleeper: subprocess.Popen[bytes]) -> None:
    watch = PidWatch()
    try:
        watch.watch([sleeper.pid])
        threading.Timer(0.05, watch.wake).start()
        assert watch.wait(30) == set()
        assert sleeper.poll() is None
    finally:
        watch.close()


def test_a_reaped_pid_is_reported_gone_at_once() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    watch = PidWatch()
    try:
        assert watch.watch([proc.pid]) == {proc.pid}
    finally:
        watch.close()


def test_wait_gone_lists_survivors(sleeper: subprocess.Popen[bytes]) -> None:
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # Ended but not reaped, whatever the machine's load: a short wait must not depend on start-up speed.
        os.waitid(os.P_PID, quick.pid, os.WEXITED | os.WNOWAIT)
        assert wait_gone([sleeper.pid, quick.pid], timeout=0.2) == {sleeper.pid}
    finally:
        quick.wait()
