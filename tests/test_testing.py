"""``taskd_core.testing``, the toolkit the suite and adapter authors use: waits, ports, process checks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from taskd_core.testing import (
    WaitTimeout,
    descendants,
    free_port,
    is_unreaped_child,
    process_group,
    process_running,
    wait_for_file,
    wait_gone,
    wait_until,
)

#: A process that starts a child of its own, prints both pids and sleeps.
FAMILY = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def test_a_wait_returns_the_first_truthy_value() -> None:
    values = iter([0, None, "", "found"])
    assert wait_until(lambda: next(values), "a value", 5.0, interval=0.001) == "found"


def test_a_wait_that_times_out_names_what_it_waited_for_and_explains() -> None:
    with pytest.raises(WaitTimeout, match=r"waiting for the moon: timed out after 0.05s\nlogs: none") as failed:
        wait_until(lambda: False, "the moon", 0.05, explain=lambda: "logs: none")
    # An AssertionError for pytest, a TimeoutError for code that waits outside tests.
    assert isinstance(failed.value, AssertionError) and isinstance(failed.value, TimeoutError)


def test_unless_ends_a_wait_at_once_with_its_reason() -> None:
    calls: list[int] = []
    with pytest.raises(WaitTimeout, match="waiting for workers: the agent ended: exit 3"):
        wait_until(lambda: calls.append(1), "workers", 60.0, unless=lambda: "the agent ended: exit 3")
    assert calls == []  # the reason came first: the predicate never ran


def test_wait_for_file_waits_for_content(tmp_path: Path) -> None:
    path = tmp_path / "port"
    path.write_text("  \n")
    with pytest.raises(WaitTimeout, match="port"):
        wait_for_file(path, 0.05)
    path.write_text("1234\n")
    assert wait_for_file(path) == "1234\n"


def test_a_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
    assert 0 < port < 65536


def test_a_process_tree_is_found_and_seen_gone() -> None:
    parent = subprocess.Popen([sys.executable, "-c", FAMILY], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert descendants(parent.pid) == [child]
        assert process_group(parent.pid) == sorted([parent.pid, child])
        assert process_running(parent.pid) and process_running(child)
        os.killpg(parent.pid, signal.SIGKILL)
        wait_gone([child], "the child")  # reaped by init once orphaned
        wait_until(lambda: is_unreaped_child(parent.pid), "the parent to be a zombie of ours")
        assert not process_running(parent.pid) and process_group(parent.pid) == []
    finally:
        _kill_group(parent)


def test_wait_gone_names_the_survivors() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        with pytest.raises(WaitTimeout, match=rf"still running: \[{sleeper.pid}\]"):
            wait_gone([sleeper.pid], "the sleeper", 0.05)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_importing_it_loads_nothing_heavy() -> None:
    probe = "import sys, taskd_core.testing; print(sorted({'grpc', 'torch', 'pytest', 'mindspore'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Cleanup whatever the test left of ``proc``'s group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
