"""Where workers' progress arrives: the datagram socket, torch's timer FIFO, and their publication."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from taskd_core.agent.hangs.inbox import (
    TIMER_FILE_ENV,
    Datagram,
    Inbox,
    TimerRequest,
    parse_datagram,
    parse_timer_request,
)
from taskd_core.testing import wait_until
from taskd_core.worker import SOCKET_ENV, ProgressReporter


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither path set before a test; whatever a test leaves is undone after it."""
    monkeypatch.delenv(SOCKET_ENV, raising=False)
    monkeypatch.delenv(TIMER_FILE_ENV, raising=False)


@pytest.fixture
def inbox() -> Iterator[Inbox]:
    opened = Inbox()
    opened.open()
    try:
        yield opened
    finally:
        opened.close()


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"12 5.5 beat", Datagram(12, 5.5, "beat", ())),
        (b"12 5.5 enter load 30", Datagram(12, 5.5, "enter", ("load", "30"))),
        (b"12 99 step 7", Datagram(12, 10.0, "step", ("7",))),  # sent "after" it was read: read time
    ],
)
def test_a_datagram_is_pid_time_op_and_arguments(data: bytes, expected: Datagram) -> None:
    assert parse_datagram(data, now=10.0) == expected


@pytest.mark.parametrize(
    "data", [b"", b"x", b"12 5.5", b"abc 1 beat", b"-1 1 beat", b"12 nan beat", b"12 -inf beat", b"12 x beat", b"\xff" * 400]
)
def test_junk_is_no_datagram(data: bytes) -> None:
    assert parse_datagram(data, now=10.0) is None


def test_torch_timer_requests() -> None:
    armed = {"version": 1, "pid": 7, "scope_id": "step", "expiration_time": 123.5, "signal": 9}
    assert parse_timer_request(json.dumps(armed).encode()) == TimerRequest(7, "step", 123.5)
    disarmed = {**armed, "expiration_time": -1}
    assert parse_timer_request(json.dumps(disarmed).encode()) == TimerRequest(7, "step", -1.0)


@pytest.mark.parametrize(
    "line", [b"", b"{", b"[]", b'{"pid": 7}', b'{"pid": "x", "scope_id": "s", "expiration_time": 1}', b"\xff"]
)
def test_malformed_timer_requests_are_none(line: bytes) -> None:
    assert parse_timer_request(line) is None


def test_workers_datagrams_arrive_in_the_order_sent(inbox: Inbox) -> None:
    assert os.environ[SOCKET_ENV] == inbox.socket_path and os.environ[TIMER_FILE_ENV] == inbox.timer_file
    reporter = ProgressReporter(os.environ[SOCKET_ENV])
    try:
        reporter.resumed(3)
        reporter.enter("load", 30.0)
        reporter.leave("load")
        reporter.done()
        got: list[Datagram] = []

        def all_four() -> bool:
            got.extend(inbox.datagrams(now=float("inf")))
            return len(got) >= 4

        wait_until(all_four, "four datagrams")
    finally:
        reporter.close()
    assert [(d.pid, d.op, d.args) for d in got] == [
        (os.getpid(), "resumed", ("3",)),
        (os.getpid(), "enter", ("load", "30.0")),
        (os.getpid(), "leave", ("load",)),
        (os.getpid(), "done", ()),
    ]


def test_a_timer_request_counts_once_its_line_is_complete(inbox: Inbox, caplog: pytest.LogCaptureFixture) -> None:
    assert inbox.timer_file is not None and stat.S_ISFIFO(os.stat(inbox.timer_file).st_mode)
    line = json.dumps({"pid": 7, "scope_id": "step", "expiration_time": 50.0}).encode()
    fd = os.open(inbox.timer_file, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, b"not json\n" + line[:10])
        assert inbox.timer_requests() == []
        assert "malformed torch timer request" in caplog.text
        os.write(fd, line[10:] + b"\n")
        assert inbox.timer_requests() == [TimerRequest(7, "step", 50.0)]
    finally:
        os.close(fd)


def test_close_removes_the_files_and_takes_the_paths_back(inbox: Inbox) -> None:
    paths = [Path(p) for p in (inbox.socket_path, inbox.timer_file) if p is not None]
    inbox.close()
    assert not any(p.exists() for p in paths) and not paths[0].parent.exists()
    assert SOCKET_ENV not in os.environ and TIMER_FILE_ENV not in os.environ


def test_a_users_timer_file_is_served_and_put_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A script run under torchrun-like tooling may name the FIFO itself; the agent serves it there."""
    users = str(tmp_path / "user-timer")
    monkeypatch.setenv(TIMER_FILE_ENV, users)
    inbox = Inbox()
    inbox.open()
    try:
        assert inbox.timer_file == users and stat.S_ISFIFO(os.stat(users).st_mode)
    finally:
        inbox.close()
    assert os.environ[TIMER_FILE_ENV] == users and not os.path.lexists(users)


@pytest.mark.parametrize("first_closed", [0, 1])
def test_two_inboxes_in_one_process_keep_their_own_files_and_leave_the_environment_as_found(first_closed: int) -> None:
    """Two node agents in one process (tests do this): the second must not take the first's timer FIFO for
    a user's, and whichever closes last must not put back a path of the other's, gone with its directory."""
    inboxes = [Inbox(), Inbox()]
    for inbox in inboxes:
        inbox.open()
    assert inboxes[0].timer_file != inboxes[1].timer_file
    assert os.environ[TIMER_FILE_ENV] == inboxes[1].timer_file
    inboxes[first_closed].close()
    inboxes[1 - first_closed].close()
    assert TIMER_FILE_ENV not in os.environ and SOCKET_ENV not in os.environ
