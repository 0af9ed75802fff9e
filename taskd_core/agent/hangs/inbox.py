"""Where workers' progress reaches the agent: a datagram socket, and torch's timer FIFO.

* The Unix datagram socket of :mod:`taskd_core.worker` (``TASKD_PROGRESS_SOCKET``):
  one :class:`Datagram` each, ``PID MONOTONIC-TIME OP [ARGS]`` (beats, sections,
  steps, done).
* torch elastic's ``FileTimerServer`` protocol at ``TORCHELASTIC_TIMER_FILE``: a
  FIFO of JSON lines from ``FileTimerClient`` (:class:`TimerRequest`), so
  scripts using ``expires(after=...)`` work unchanged. torch's own server is not
  used: it kills the worker (before anyone could take its stack) and then its
  own process — the agent.

Both paths are published in the agent's environment, which every launcher's
workers inherit (msrun builds its workers' environment from its own):
:func:`publish` puts them there, and the :class:`Publication` it returns puts
back what was there before.
"""

from __future__ import annotations

import json
import logging
import math
import os
import select
import shutil
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from taskd_core.scratch import scratch_dir
from taskd_core.worker import SOCKET_ENV

logger = logging.getLogger(__name__)

#: torch elastic's variable naming the timer FIFO (``torch.distributed.elastic.timer``).
TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"
#: Most datagrams read in one drain, so a flood cannot keep the reader from its other work.
_DRAIN_MAX = 100_000


@dataclass(frozen=True, slots=True)
class Datagram:
    """One message of :class:`~taskd_core.worker.ProgressReporter`: ``PID MONOTONIC-TIME OP [ARGS]``."""

    pid: int
    #: when it was sent (CLOCK_MONOTONIC is one clock for every process), never later than it was read.
    sent: float
    op: str
    args: tuple[str, ...]


def parse_datagram(data: bytes, now: float) -> Datagram | None:
    """The message in ``data``, read at ``now``; None when it is not one."""
    message = data.decode(errors="replace").split()
    if len(message) < 3 or not message[0].isdigit():
        return None
    try:
        sent = min(float(message[1]), now)
    except ValueError:
        return None
    if not math.isfinite(sent):
        return None
    return Datagram(int(message[0]), sent, message[2], tuple(message[3:]))


@dataclass(frozen=True, slots=True)
class TimerRequest:
    """One request of torch's ``FileTimerClient``: arm ``scope`` of ``pid`` until ``expiration``.

    ``expiration`` is on the wall clock; a negative one disarms the scope.
    """

    pid: int
    scope: str
    expiration: float


def parse_timer_request(line: bytes) -> TimerRequest | None:
    """The request on one line of the FIFO; None when it is malformed."""
    try:
        request = json.loads(line)
        return TimerRequest(int(request["pid"]), str(request["scope_id"]), float(request["expiration_time"]))
    except (ValueError, KeyError, TypeError):
        return None


@dataclass(slots=True)
class Publication:
    """Paths put into ``os.environ`` for workers to inherit, and the values they replaced."""

    published: dict[str, str]
    #: name -> its value before (None: it was not set).
    replaced: dict[str, str | None]

    def withdraw(self) -> None:
        """Put back what was there, but not over what another watcher of this process published since."""
        for name, value in self.replaced.items():
            if os.environ.get(name) != self.published[name]:
                continue
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self.replaced.clear()


def publish(values: Mapping[str, str], before: Mapping[str, str]) -> Publication:
    """Put ``values`` into ``os.environ``; ``before``: what they replace (the user's environment)."""
    publication = Publication(dict(values), {name: before.get(name) for name in values})
    os.environ.update(values)
    return publication


def _published_by_a_watcher(env: Mapping[str, str]) -> bool:
    """The environment's progress socket and timer file are a running watcher's (one directory)."""
    sock, timer = env.get(SOCKET_ENV), env.get(TIMER_FILE_ENV)
    return sock is not None and timer is not None and Path(sock).parent == Path(timer).parent


class Inbox:
    """The progress socket and the timer FIFO of one watcher, from :meth:`open` to :meth:`close`."""

    def __init__(self) -> None:
        self._dir: Path | None = None
        self._sock: socket.socket | None = None
        self._fifo: tuple[int, int] | None = None
        self._fifo_buf = b""
        self._publication: Publication | None = None
        self.socket_path: str | None = None
        self.timer_file: str | None = None

    @property
    def is_open(self) -> bool:
        return self._sock is not None

    def open(self) -> None:
        """Create the socket and the FIFO in a directory of their own, and publish both paths."""
        self._dir = scratch_dir("progress")
        self.socket_path = str(self._dir / "progress.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.socket_path)
        self._sock.setblocking(False)
        # Messages wait here between scans; the kernel caps the size at its rmem_max.
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        # What another watcher of this process published is its own, not the user's: neither
        # used nor put back at close.
        before = {} if _published_by_a_watcher(os.environ) else dict(os.environ)
        self.timer_file = before.get(TIMER_FILE_ENV) or str(self._dir / "timer.fifo")
        if os.path.lexists(self.timer_file):
            os.remove(self.timer_file)
        os.mkfifo(self.timer_file)
        # Our own write end keeps the FIFO from reading as end-of-file between clients.
        reader = os.open(self.timer_file, os.O_RDONLY | os.O_NONBLOCK)
        self._fifo = (reader, os.open(self.timer_file, os.O_WRONLY | os.O_NONBLOCK))
        self._publication = publish({SOCKET_ENV: self.socket_path, TIMER_FILE_ENV: self.timer_file}, before)

    def wait(self, timeout: float) -> None:
        """Until a datagram arrives, or ``timeout``."""
        assert self._sock is not None
        select.select([self._sock], [], [], timeout)

    def wake(self) -> None:
        """End a :meth:`wait` now (an empty datagram, which is no message)."""
        if self.socket_path is None:
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as waker:
            try:
                waker.sendto(b"", self.socket_path)
            except OSError:
                pass  # queue full or socket gone: the wait ends on its own

    def datagrams(self, now: float) -> Iterator[Datagram]:
        """The datagrams waiting, read at ``now``, in the order they were sent."""
        assert self._sock is not None
        for _ in range(_DRAIN_MAX):
            try:
                data = self._sock.recv(512)
            except OSError:  # BlockingIOError: drained
                return
            message = parse_datagram(data, now)
            if message is not None:
                yield message

    def timer_requests(self) -> list[TimerRequest]:
        """The complete requests written to the FIFO since the last call."""
        assert self._fifo is not None
        try:
            while chunk := os.read(self._fifo[0], 65536):
                self._fifo_buf += chunk
        except BlockingIOError:
            pass
        *lines, self._fifo_buf = self._fifo_buf.split(b"\n")
        requests = []
        for line in lines:
            request = parse_timer_request(line)
            if request is None:
                logger.warning("ignoring a malformed torch timer request: %r", line[:200])
            else:
                requests.append(request)
        return requests

    def close(self) -> None:
        """Take the paths back from the environment and remove the socket, the FIFO and their directory."""
        if self._publication is not None:
            self._publication.withdraw()
            self._publication = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._fifo is not None:
            for fd in self._fifo:
                os.close(fd)
            self._fifo = None
            if self.timer_file and os.path.lexists(self.timer_file):
                os.remove(self.timer_file)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
