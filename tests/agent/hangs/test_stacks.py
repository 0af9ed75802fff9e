"""A hung worker's stack, taken from real processes: py-spy, else the worker's faulthandler dump, in one budget."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from taskd_core.agent.hangs import stacks
from taskd_core.testing import wait_until
from taskd_core.worker import SOCKET_ENV

ROOT = Path(__file__).resolve().parents[3]
HANGS = Path(__file__).parents[1] / "workers" / "hangs.py"


class Worker:
    """A ``hangs.py`` worker whose worker API reports to a socket of the test's."""

    def __init__(self, tmp: Path, mode: str) -> None:
        self.socket_path = str(tmp / "progress.sock")
        self._agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._agent.bind(self.socket_path)
        env = {**os.environ, "PYTHONPATH": str(ROOT), SOCKET_ENV: self.socket_path}
        self.proc = subprocess.Popen([sys.executable, str(HANGS), mode], env=env, stdout=subprocess.PIPE)

    def stack_once_in(self, function: str) -> str:
        """Its stack, once that shows ``function`` (the worker gets there after its beats)."""

        def stack() -> str:
            taken = stacks.capture_stack(self.proc.pid, self.socket_path, 5.0)
            return taken if function in taken else ""

        return wait_until(stack, f"a stack in {function}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self._agent.close()


@pytest.fixture
def spinning(tmp_path: Path) -> Iterator[Worker]:
    w = Worker(tmp_path, "spin")
    try:
        yield w
    finally:
        w.close()


def test_faulthandler_dump_without_py_spy(spinning: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stacks, "py_spy", lambda: None)
    stack = spinning.stack_once_in("spin_without_heartbeat")
    assert stack.startswith("(faulthandler dump)")


def test_py_spy_reads_the_stack_first(spinning: Worker) -> None:
    stack = spinning.stack_once_in("spin_without_heartbeat")
    assert not stack.startswith("(faulthandler dump)") and f"Process {spinning.proc.pid}" in stack


def test_a_stuck_py_spy_leaves_the_rest_of_the_budget_to_the_faulthandler_dump(
    spinning: Worker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """py-spy is cut off at its share of the stack budget; the dump still comes within the rest of it."""
    monkeypatch.setattr(stacks, "py_spy", lambda: None)
    spinning.stack_once_in("spin_without_heartbeat")
    stuck = tmp_path / "py-spy"
    stuck.write_text("#!/bin/sh\nexec sleep 600\n")
    stuck.chmod(0o755)
    monkeypatch.setattr(stacks, "py_spy", lambda: str(stuck))
    stack = stacks.capture_stack(spinning.proc.pid, spinning.socket_path, 4.0)
    assert stack.startswith("(faulthandler dump)") and "spin_without_heartbeat" in stack


def test_a_worker_without_the_worker_api_and_no_py_spy_has_no_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stacks, "py_spy", lambda: None)
    proc = subprocess.Popen(["sleep", "60"])
    try:
        stack = stacks.capture_stack(proc.pid, str(tmp_path / "progress.sock"), 1.0)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert stack.startswith("(no stack: py-spy is not installed")


def test_the_stack_goes_into_the_workers_own_output(tmp_path: Path) -> None:
    w = Worker(tmp_path, "stop")
    try:
        assert w.proc.stdout is not None and w.proc.stdout.readline() == b"waiting for SIGSTOP\n"
        stacks.write_to_worker_output(w.proc.pid, "=== taskd: its stack\n")
        assert w.proc.stdout.readline() == b"=== taskd: its stack\n"
    finally:
        w.close()


def test_py_spy_is_installed_for_the_tests() -> None:
    assert stacks.py_spy() is not None
