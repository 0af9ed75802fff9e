"""The worker's side of progress reporting (:mod:`taskd_core.worker`), without an agent or against a bare socket."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from taskd_core.errors import ConfigError
from taskd_core.worker import ProgressReporter


@pytest.mark.parametrize(
    ("name", "timeout", "message"),
    [("", None, "section name"), ("a b", None, "section name"), ("x" * 65, None, "section name"),
     ("step", 0.0, "positive"), ("step", float("inf"), "positive")],
)
def test_worker_api_refuses_bad_sections(name: str, timeout: float | None, message: str) -> None:
    reporter = ProgressReporter(None)
    with pytest.raises(ConfigError, match=message):
        reporter.enter(name, timeout)


def test_beats_closer_than_the_gap_are_not_sent(tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as agent:
        agent.bind(str(tmp_path / "agent.sock"))
        agent.settimeout(5)
        reporter = ProgressReporter(str(tmp_path / "agent.sock"))
        for _ in range(50):
            reporter.heartbeat()
        reporter.done()
        pid, _, op = agent.recv(512).decode().split()
        assert (int(pid), op) == (os.getpid(), "beat")
        assert agent.recv(512).decode().split()[2] == "done"
        reporter.close()


def test_worker_api_outside_taskd_does_nothing() -> None:
    reporter = ProgressReporter(None)
    reporter.heartbeat()
    with reporter.section("step"):
        pass
    reporter.close()


