"""A fork server that stops answering (SIGSTOP, a request it reads too late) never holds a recovery.

Real servers and workers throughout: the server is SIGSTOPped, workers are
SIGKILLed, and what is checked is what the agent sees (exit codes, which
process started a worker, whether anything is left behind).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from taskd_core.forkserver import _wire as wire
from taskd_core.forkserver.client import (
    ForkedProcess,
    ForkLauncher,
    ForkServerSettings,
    ServerState,
)
from taskd_core.testing import process_running, wait_until

WAIT = 60.0
SETTINGS = ForkServerSettings(preload=(), learn=False, ready_timeout=WAIT)
SERVER = Path(wire.__file__).with_name("_server.py")


@pytest.fixture
def launchers() -> Iterator[Callable[..., ForkLauncher]]:
    made: list[ForkLauncher] = []

    def make(command: list[str], settings: ForkServerSettings = SETTINGS) -> ForkLauncher:
        launcher = ForkLauncher(command, settings)
        made.append(launcher)
        return launcher

    yield make
    for launcher in made:
        if launcher.server is not None:
            _resume(launcher.server.pid)
        launcher.close()


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_worker_killed_under_a_stopped_server_is_seen_dead_and_restarted_by_exec(
    tmp_path: Path, launchers: Callable[..., ForkLauncher]
) -> None:
    script = tmp_path / "sleep.py"
    script.write_text("import time; time.sleep(120)")
    argv = [sys.executable, str(script)]
    launcher = launchers(argv)
    worker = launcher.start(argv, dict(os.environ))
    sick = launcher.server
    assert isinstance(worker, ForkedProcess) and sick is not None

    os.kill(sick.pid, signal.SIGSTOP)
    os.kill(worker.pid, signal.SIGKILL)

    # The stopped server cannot reap it: the status is the zombie's own.
    assert worker.wait(WAIT) == -signal.SIGKILL
    again = launcher.start(argv, dict(os.environ))
    assert isinstance(again, subprocess.Popen)  # exec'd at once, not forked by the stopped server
    assert sick.state in (ServerState.UNHEALTHY, ServerState.DEAD) and "stopped" in sick.reason
    wait_until(lambda: not process_running(sick.pid), what="the stopped server to be killed")
    replacement = wait_until(lambda: launcher.server is not sick and launcher.server, "a new fork server")
    assert replacement.wait_ready(WAIT)
    third = launcher.start(argv, dict(os.environ))
    assert isinstance(third, ForkedProcess) and third.server is replacement
    for proc in (again, third):
        proc.kill()
        assert proc.wait(WAIT) == -signal.SIGKILL
    assert not process_running(worker.pid)


def test_the_first_start_does_not_wait_for_a_server_stopped_while_it_preloads(
    tmp_path: Path, launchers: Callable[..., ForkLauncher], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "slow.py").write_text("import time; time.sleep(120)")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    script = tmp_path / "w.py"
    script.write_text("import sys; sys.exit(6)")
    argv = [sys.executable, str(script)]
    # ready_timeout is the whole wait: only the stop can end it early.
    launcher = launchers(argv, ForkServerSettings(preload=("slow",), learn=False, ready_timeout=300.0))
    sick = launcher.server
    assert sick is not None
    os.kill(sick.pid, signal.SIGSTOP)

    worker = launcher.start(argv, dict(os.environ))

    assert isinstance(worker, subprocess.Popen) and worker.wait(WAIT) == 6
    assert sick.state in (ServerState.UNHEALTHY, ServerState.DEAD)


def test_taskd_run_recovers_past_a_stopped_fork_server_and_leaves_nothing(tmp_path: Path) -> None:
    """SIGSTOP the server, SIGKILL a worker: the job restarts it by exec and finishes; nothing is left."""
    script = tmp_path / "w.py"
    script.write_text(
        "import os, sys, time\n"
        "restart = os.environ['TASKD_RESTART_COUNT']\n"
        f"open(os.path.join({str(tmp_path)!r}, f\"{{os.environ['RANK']}}-{{restart}}\"), 'w')"
        ".write(f'{os.getpid()} {os.getppid()}')\n"
        "if restart == '0':\n"
        "    time.sleep(120)\n"
    )
    run = subprocess.Popen(
        [Path(sys.executable).with_name("taskd"), "run", "--nproc", "2", "--", sys.executable, str(script)],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "run.log", "wb"),  # noqa: SIM115 - closed with the test's tmp dir
        start_new_session=True,
    )
    server = 0
    try:
        first = wait_until(lambda: all((tmp_path / f"{r}-0").exists() for r in (0, 1)), "the first workers")
        assert first
        pids = {r: [int(x) for x in (tmp_path / f"{r}-0").read_text().split()] for r in (0, 1)}
        server = pids[0][1]
        assert server != run.pid and _ppid(server) == run.pid  # forked by the launcher's fork server
        os.kill(server, signal.SIGSTOP)
        os.kill(pids[0][0], signal.SIGKILL)

        assert run.wait(WAIT) == 0
        restarted = {r: [int(x) for x in (tmp_path / f"{r}-1").read_text().split()] for r in (0, 1)}
        assert all(ppid == run.pid for _, ppid in restarted.values())  # exec'd by the launcher itself
        log = (tmp_path / "run.log").read_text()
        assert f"fork server {server} is unhealthy: stopped" in log
        wait_until(
            lambda: not any(process_running(p) for p in [server, *(p for p, _ in pids.values())]),
            what="the stopped server and the first workers to be gone",
        )
    finally:
        _resume(server)
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(WAIT)


@pytest.fixture
def raw_server() -> Iterator[socket.socket]:
    """A server started by hand, to say to it what the agent never would."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "--fd", str(theirs.fileno())], pass_fds=(theirs.fileno(),)
    )
    theirs.close()
    try:
        ready = wire.recv(ours)
        assert ready is not None and isinstance(ready[0], wire.Ready)
        yield ours
    finally:
        ours.close()
        assert proc.wait(WAIT) == 0  # EOF: the server ends by itself


def _spawn(tmp_path: Path, deadline: float) -> wire.Spawn:
    script = tmp_path / "w.py"
    script.write_text("")
    return wire.Spawn(
        1, deadline, (str(script),), (), None, str(script), str(tmp_path), {}, str(tmp_path), "py"
    )


def test_the_server_refuses_a_request_read_after_its_deadline(
    tmp_path: Path, raw_server: socket.socket
) -> None:
    with open(os.devnull, "wb") as null:
        wire.send(raw_server, _spawn(tmp_path, time.monotonic() - 1.0), [null.fileno()] * 3)
    answer = wire.recv(raw_server)

    assert answer is not None and answer[0] == wire.Failed(1, "the request expired before the server read it")


def test_the_server_answers_what_it_cannot_read_and_keeps_serving(
    tmp_path: Path, raw_server: socket.socket
) -> None:
    raw_server.send(b'{"op": "spawn", "id": 1}')
    bad = wire.recv(raw_server)
    with open(os.devnull, "wb") as null:
        wire.send(raw_server, _spawn(tmp_path, time.monotonic() + WAIT), [null.fileno()] * 3)
    spawned = wire.recv(raw_server)
    exited = wire.recv(raw_server)

    assert bad is not None and isinstance(bad[0], wire.Failed) and bad[0].id is None
    assert spawned is not None and isinstance(spawned[0], wire.Spawned)
    assert exited is not None and exited[0] == wire.Exited(spawned[0].pid, 0)


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b'{"op": "nope"}',
        b'{"op": "exited", "pid": 1}',
        b'{"op": "exited", "pid": 1, "code": 0, "x": 1}',
    ],
)
def test_the_wire_rejects_what_is_not_one_of_its_messages(data: bytes) -> None:
    with pytest.raises(ValueError):
        wire.decode(data)


def test_every_message_survives_the_wire() -> None:
    messages: list[wire.Message] = [
        wire.Ready(7, ("torch",), {"x": "ImportError: no"}),
        wire.Refused("CUDA"),
        wire.Spawn(1, 2.5, ("a.py", "x"), ("py", "a.py", "x"), None, "/a.py", "/", {"K": "V"}, "/", "python"),
        wire.Spawned(1, 9),
        wire.Failed(None, "bad"),
        wire.Exited(9, -9),
        wire.Importing(("a", "b")),
        wire.Imported(()),
    ]
    assert [wire.decode(wire.encode(m)) for m in messages] == messages


@pytest.mark.parametrize("gone", ["before-ready", "ready-unread", "after-ready"])
def test_a_server_whose_agent_is_gone_ends_quietly(gone: str) -> None:
    """The agent closes its end (or dies: the kernel closes it) before the server said ready
    (BrokenPipeError), with the Ready message unread (ConnectionResetError) or once it read it
    (end of file): the server ends 0 with nothing on the stderr the user's log gets."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "--fd", str(theirs.fileno()), "--preload", "json"],
        pass_fds=(theirs.fileno(),),
        stderr=subprocess.PIPE,
    )
    theirs.close()
    try:
        if gone == "ready-unread":
            ours.settimeout(WAIT)
            ours.recv(wire.MAX_MESSAGE, socket.MSG_PEEK)  # sent, and left in our queue
        elif gone == "after-ready":
            ready = wire.recv(ours)
            assert ready is not None and isinstance(ready[0], wire.Ready)
        ours.close()
        _, err = proc.communicate(timeout=WAIT)
    finally:
        ours.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and err == b"", err.decode(errors="replace")
