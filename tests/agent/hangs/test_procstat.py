"""What /proc says of real processes: state letters, CPU time, parents, and a worker's state over time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from taskd_core.agent.hangs.procstat import ProcState, parent_of, read_stat
from taskd_core.testing import wait_until

SPIN = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end: pass\n"


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_stopped_process_is_in_state_t(child: subprocess.Popen[bytes]) -> None:
    assert read_stat(child.pid) is not None
    os.kill(child.pid, signal.SIGSTOP)
    wait_until(lambda: (read_stat(child.pid) or ("", 0))[0] == "T", "state T")


def test_the_parent_of_a_child_is_this_process(child: subprocess.Popen[bytes]) -> None:
    assert parent_of(child.pid) == os.getpid()


def test_a_gone_process_has_no_state() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait(timeout=30)
    assert read_stat(proc.pid) is None and parent_of(proc.pid) is None
    assert ProcState(proc.pid).sample(time.monotonic()) is None


def test_proc_state_dates_a_stop_from_the_first_look_that_saw_it(child: subprocess.Popen[bytes]) -> None:
    state = ProcState(child.pid)
    try:
        assert state.sample(1.0) in ("R", "S") and state.odd_state == ""
        os.kill(child.pid, signal.SIGSTOP)
        wait_until(lambda: state.sample(2.0) == "T", "state T")
        assert state.sample(3.0) == "T" and (state.odd_state, state.odd_since) == ("T", 2.0)
        os.kill(child.pid, signal.SIGCONT)
        wait_until(lambda: state.sample(4.0) != "T", "the stop to end")
        assert state.odd_state == ""
    finally:
        state.close()


def test_a_spinning_process_is_busy_and_a_sleeping_one_is_not(child: subprocess.Popen[bytes]) -> None:
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    busy, idle = ProcState(spinner.pid), ProcState(child.pid)
    try:

        def busy_after_half_a_second() -> bool:
            busy.sample(time.monotonic())
            idle.sample(time.monotonic())
            time.sleep(0.1)
            return busy.busy()

        wait_until(busy_after_half_a_second, "the spinner to count as busy")
        assert not idle.busy()
    finally:
        busy.close()
        idle.close()
        spinner.kill()
        spinner.wait(timeout=30)
