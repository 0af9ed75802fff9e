"""The worker side of hang detection: heartbeats and named sections, for any framework.

A worker tells its node agent that it makes progress; the agent declares it
hung when it stops (:mod:`taskd_core.agent.hangs`)::

    from taskd_core import worker

    start = load_checkpoint()                 # steps already done (0 on a fresh start)
    worker.resumed(start)                     # training continues from there
    for step in range(start, steps):
        with worker.section("step"):          # timeout learned from the job's own step times
            train_step()
        worker.step(step + 1)                 # steps done so far; also a heartbeat
    with worker.section("checkpoint", timeout=120):
        save()
    worker.done()                             # no more beats to expect (also sent at exit)

``heartbeat()`` says "still making progress" without a step number.
``step(n, busy=seconds)`` also says how long the step *worked* (computed,
loaded data: its wall time less the time it waited in collectives); the
controller compares these figures across ranks to find a rank that is slower
than its peers (``slow-rank`` events, docs/events.md). ``LiveSession``
measures them itself. With
``resumed`` and ``step`` the agent also journals where each worker resumed
and the last step it reached before it died (``worker resumed`` /
``worker exited`` events, docs/events.md): the controller counts the steps a
fault cost (``taskd_steps_lost_total``) and the time from a worker's death to
its rank resuming (``taskd_kill_to_resumed_seconds``), and ``taskd timeline``
draws the ``resumed`` and ``stepping`` phases of a recovery.

Every call is at most one non-blocking datagram on a Unix socket whose path
the launcher passes in ``TASKD_PROGRESS_SOCKET``. Beats and steps closer than
0.1 s apart are not sent: the next datagram (or ``done()``) carries the latest
step, so the step the agent knows of a worker killed at once lags by at most
0.1 s of training. Without the socket (the script runs outside TaskD) every
call does nothing, and a lost agent never blocks or fails training. The
module imports nothing heavy and never gRPC: it is imported by workers.

When a reporter is first created it also registers a stack dump through
:mod:`faulthandler` on :data:`STACK_SIGNAL`, written to a per-process file
the agent reads when ``py-spy`` is not installed.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import logging
import operator
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from taskd_core.errors import ConfigError
from taskd_core.values import check_seconds

logger = logging.getLogger(__name__)

#: Environment variable naming the agent's datagram socket.
SOCKET_ENV = "TASKD_PROGRESS_SOCKET"
#: Signal on which a worker writes every thread's Python stack to :func:`stack_file`.
STACK_SIGNAL = signal.SIGUSR2
#: Longest section name; names travel in one datagram.
MAX_NAME = 64
#: Beats closer together than this are not sent: the agent needs no finer grain, and a
#: job of 10 ms steps would otherwise send it 100 datagrams a second per rank.
MIN_BEAT_GAP = 0.1
#: Largest step count (the journal's ``step`` is a signed 64-bit integer).
MAX_STEP = 2**63 - 1


def stack_file(socket_path: str | Path, pid: int) -> Path:
    """Where worker ``pid`` writes its stack dump (next to the agent's socket)."""
    return Path(socket_path).parent / f"stack-{pid}.txt"


def check_name(name: str) -> str:
    """A section name that fits the wire: 1..64 printable characters, no spaces."""
    if not name or len(name) > MAX_NAME or not name.isprintable() or any(c.isspace() for c in name):
        raise ConfigError(
            f"section name {name[:80]!r} must be 1..{MAX_NAME} printable characters without spaces"
        )
    return name


def check_step(number: int) -> int:
    """A step count that fits the wire: an integer in 0..2**63-1 (numpy integers do)."""
    try:
        value = operator.index(number)
    except TypeError:
        value = -1
    if isinstance(number, bool) or not 0 <= value <= MAX_STEP:
        raise ConfigError(f"a step count must be an integer in 0..{MAX_STEP}, not {number!r}")
    return value


class ProgressReporter:
    """Sends one process's progress to the agent listening at ``address`` (None: reports nothing)."""

    def __init__(self, address: str | None) -> None:
        self.address = address
        self._sock: socket.socket | None = None
        self._stack_out: IO[str] | None = None
        self._last_beat = -MIN_BEAT_GAP
        #: the latest step given to :meth:`step`, until a datagram carried it.
        self._step: int | None = None
        #: the first step after :meth:`resumed` goes out at once: it dates the ``stepping`` phase.
        self._step_due = False
        #: busy seconds and the steps they cover, given to :meth:`step` since the last datagram.
        self._busy = 0.0
        self._busy_steps = 0
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
            self._install_stack_dump(address)
            # Tear-down after training (destroying process groups, freeing tensors) can take
            # seconds of silence that must not read as a hang.
            atexit.register(self.done)

    def _install_stack_dump(self, address: str) -> None:
        try:
            self._stack_out = open(stack_file(address, os.getpid()), "w", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
            faulthandler.register(STACK_SIGNAL, file=self._stack_out, all_threads=True)
        except (OSError, RuntimeError, ValueError) as exc:  # no dump then; py-spy may still work
            logger.warning("cannot arrange a stack dump on %s: %s", STACK_SIGNAL.name, exc)

    def _send(self, message: str, when: float | None = None) -> None:
        if self._sock is None or self.address is None:
            return
        # The agent reads messages in batches; the sender's time keeps them exact.
        stamp = time.monotonic() if when is None else when
        try:
            self._sock.sendto(f"{os.getpid()} {stamp:.6f} {message}".encode(), self.address)
        except OSError:
            # The agent is gone or its queue is full: progress reports are best effort by design.
            pass

    def heartbeat(self) -> None:
        """This process made progress (call it once per step, or more often)."""
        now = time.monotonic()
        if self._step_due or now - self._last_beat >= MIN_BEAT_GAP:
            self._last_beat, self._step_due = now, False
            self._send_step(now)

    def _send_step(self, when: float | None = None) -> None:
        """The latest step (with the busy time of the steps since the last one sent), else a beat."""
        step, self._step = self._step, None
        if step is None:
            self._send("beat", when)
        elif self._busy_steps:
            busy, steps, self._busy, self._busy_steps = self._busy, self._busy_steps, 0.0, 0
            self._send(f"step {step} {busy:.6f} {steps}", when)
        else:
            self._send(f"step {step}", when)

    def step(self, number: int, busy: float | None = None) -> None:
        """``number`` steps are done (committed): a heartbeat that also says how far training got.

        :param busy: seconds this step worked on this rank (its wall time less
            its waits in collectives); None: not measured.
        """
        self._step = check_step(number)
        if busy is not None:
            check_seconds(busy, "worker.step: busy")
            self._busy += busy
            self._busy_steps += 1
        self.heartbeat()

    def resumed(self, number: int) -> None:
        """Training (re)starts here with ``number`` steps done, as loaded from a checkpoint (0: none).

        Call it once per process, when the state is loaded and before the first step.
        """
        self._send(f"resumed {check_step(number)}")
        self._step_due = True

    def enter(self, name: str, timeout: float | None = None) -> None:
        """Begin section ``name``; it must end within ``timeout`` seconds (None: a learned timeout)."""
        check_name(name)
        if timeout is not None:
            check_seconds(timeout, f"section {name!r}: timeout", positive=True)
        self._send(f"enter {name} {'-' if timeout is None else repr(float(timeout))}")

    def leave(self, name: str) -> None:
        """End section ``name``; its duration teaches the agent this section's normal length."""
        self._send(f"leave {check_name(name)}")

    def done(self) -> None:
        """This process will make no more progress reports (training is over): stop expecting them."""
        if self._step is not None:  # the last step the beat gap held back
            self._send_step()
        self._send("done")

    @contextlib.contextmanager
    def section(self, name: str, timeout: float | None = None) -> Iterator[None]:
        """``with`` form of :meth:`enter` / :meth:`leave`."""
        self.enter(name, timeout)
        try:
            yield
        finally:
            self.leave(name)

    def close(self) -> None:
        """Stop reporting; the stack dump is no longer arranged."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._stack_out is not None:
            faulthandler.unregister(STACK_SIGNAL)
            self._stack_out.close()
            self._stack_out = None


@functools.cache
def _reporter_of(pid: int) -> ProgressReporter:
    return ProgressReporter(os.environ.get(SOCKET_ENV) or None)


def reporter() -> ProgressReporter:
    """This process's reporter, built once per process from ``TASKD_PROGRESS_SOCKET``.

    Keyed by pid: a worker forked from a process that already reported (a fork
    server) gets its own, with its own stack dump file.
    """
    return _reporter_of(os.getpid())


def heartbeat() -> None:
    """This worker made progress (see :meth:`ProgressReporter.heartbeat`)."""
    reporter().heartbeat()


def step(number: int, busy: float | None = None) -> None:
    """``number`` steps done, the last worked ``busy`` seconds (see :meth:`ProgressReporter.step`)."""
    reporter().step(number, busy)


def resumed(number: int) -> None:
    """Training resumes with ``number`` steps done (see :meth:`ProgressReporter.resumed`)."""
    reporter().resumed(number)


def done() -> None:
    """No more heartbeats from this worker (see :meth:`ProgressReporter.done`)."""
    reporter().done()


def section(name: str, timeout: float | None = None) -> contextlib.AbstractContextManager[None]:
    """A named section with its own timeout (see :meth:`ProgressReporter.section`)."""
    return reporter().section(name, timeout)
