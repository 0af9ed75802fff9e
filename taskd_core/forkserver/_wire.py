"""The fork server's wire: every message the agent and the server exchange, and their one encoding.

Standard library only: :mod:`taskd_core.forkserver._server` runs as a file in
the job's interpreter, where TaskD may not even be installed, and loads this
file by its path; the agent side (:mod:`taskd_core.forkserver.client`) imports
it as part of the package. One message per ``SOCK_SEQPACKET`` packet, a JSON
object whose ``"op"`` names the message's class; file descriptors travel with
it as ``SCM_RIGHTS``.

Server → agent: :class:`Ready` or :class:`Refused` once, then :class:`Spawned`
or :class:`Failed` per :class:`Spawn`, :class:`Exited` as soon as a child is
reaped, and :class:`Importing` / :class:`Imported` around the modules it imports
while it serves (it answers nothing in between). Agent → server: :class:`Spawn`
(with the child's stdin, stdout and stderr as three descriptors).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

#: Largest message either side sends (argv + environment of one worker).
MAX_MESSAGE = 1 << 22
#: Descriptors a :class:`Spawn` carries: stdin, stdout, stderr.
STDIO_FDS = 3
#: The server's name in ``ps``/``top`` (``/proc/<pid>/comm``); each child takes the interpreter's back.
SERVER_NAME = b"taskd-forksrv"
#: Names the job's cgroup (:mod:`taskd_core.forkserver.jobscope`) in a worker's environment: a
#: forked worker moves itself into a cgroup of its own there before running any user code.
SCOPE_CGROUP_ENV = "TASKD_SCOPE_CGROUP"


@dataclass(frozen=True, slots=True)
class Ready:
    """The server imported what the first workers need and serves from now on."""

    op: ClassVar[str] = "ready"
    pid: int
    preloaded: tuple[str, ...]
    #: module → why it could not be imported (it is skipped).
    failed: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Refused:
    """The server will not fork (a device context exists, a fork hook failed); it exits."""

    op: ClassVar[str] = "refused"
    reason: str


@dataclass(frozen=True, slots=True)
class Spawn:
    """Fork a child that becomes ``python [flags] (file | -m module) argv[1:]`` started in ``cwd``."""

    op: ClassVar[str] = "spawn"
    id: int
    #: ``time.monotonic()`` (one clock for every process of the machine) after which the server must
    #: not fork this child any more: the agent has started it by exec instead.
    deadline: float
    argv: tuple[str, ...]
    orig_argv: tuple[str, ...]
    module: str | None
    file: str | None
    path0: str | None
    env: Mapping[str, str]
    cwd: str
    #: what exec would name the process (``/proc/<pid>/comm``).
    comm: str


@dataclass(frozen=True, slots=True)
class Spawned:
    op: ClassVar[str] = "spawned"
    id: int
    pid: int


@dataclass(frozen=True, slots=True)
class Failed:
    """The server did not fork request ``id`` (None: a request it could not read)."""

    op: ClassVar[str] = "failed"
    id: int | None
    reason: str


@dataclass(frozen=True, slots=True)
class Exited:
    """Child ``pid`` was reaped; ``code`` as ``Popen.returncode`` (``-N``: killed by signal N)."""

    op: ClassVar[str] = "exited"
    pid: int
    code: int


@dataclass(frozen=True, slots=True)
class Importing:
    """The server imports ``modules`` now and reads no request until :class:`Imported`."""

    op: ClassVar[str] = "importing"
    modules: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Imported:
    """The server is back to serving; ``modules`` of the batch are imported (the rest may follow)."""

    op: ClassVar[str] = "imported"
    modules: tuple[str, ...]


Message = Ready | Refused | Spawn | Spawned | Failed | Exited | Importing | Imported
_CLASSES: dict[str, type[Message]] = {
    cls.op: cls for cls in (Ready, Refused, Spawn, Spawned, Failed, Exited, Importing, Imported)
}


def encode(message: Message) -> bytes:
    fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    return json.dumps({"op": message.op, **fields}).encode()


def decode(data: bytes) -> Message:
    """The message in ``data``; ValueError when it is not one this wire knows."""
    try:
        payload: dict[str, Any] = json.loads(data)
        cls = _CLASSES[payload.pop("op")]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a fork server message: {data[:80]!r}") from exc
    names = {f.name for f in dataclasses.fields(cls)}
    if payload.keys() != names:
        raise ValueError(f"fork server message {cls.op!r} has fields {sorted(payload)}, not {sorted(names)}")
    # JSON has lists only; the messages hold tuples.
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in payload.items()}
    return cls(**values)


def send(sock: socket.socket, message: Message, fds: Sequence[int] = ()) -> None:
    """Send one message (one packet); ``fds`` travel with it as ``SCM_RIGHTS``."""
    data = encode(message)
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv(sock: socket.socket) -> tuple[Message, list[int]] | None:
    """The next message and its descriptors; None at EOF (the peer closed or died)."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, STDIO_FDS)
    if not data:
        _close(fds)
        return None
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        _close(fds)
        raise ValueError("fork server message truncated")
    try:
        return decode(data), fds
    except ValueError:
        _close(fds)
        raise


def _close(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)
