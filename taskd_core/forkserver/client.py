"""Warm worker starts: the agent's side of the fork server.

A worker restart used to be a cold ``python script.py``: interpreter start,
``import torch``, the lazy ``torch._dynamo`` import of the first optimizer
step and the script's own imports, seconds each time. The fork server is a
process of the job's own interpreter, started by a fresh ``exec`` (never forked
from the launcher, which holds gRPC threads), that imports the framework once
and then forks each worker; see :mod:`taskd_core.forkserver._server`
for the server and for what a forked child looks like to its script, and
:mod:`taskd_core.forkserver._wire` for what the two sides say.

:class:`ForkLauncher` is what adapters use: :meth:`ForkLauncher.start` takes
a worker's command as ``Popen`` would and returns a ``Popen``-like process,
forked when the command is a Python script or module of the job's interpreter
(:class:`PythonCommand`), else started by ``exec`` exactly as before.

First starts: the server imports only what the first workers need (``torch``
for a torch job) before it forks them, and what they import beyond that once
they run (it learns), so the first workers start no later than exec'd ones would.

Faults: a server that died, refused to serve or was declared unhealthy (it
stayed stopped, ``T`` in ``/proc``, for :data:`STOPPED_BOUND` seconds, or stayed
silent for :data:`ANSWER_BOUND` seconds while a request waited and it had not
said it was importing a module) is killed with its whole process group and
replaced in the background; meanwhile every start execs, and no worker waits on
it. Deaths of forked workers reach the agent
through pidfds as for any worker; their exit status comes from the server,
which reaps them, or, when the server is slow to say, from the zombie's own
``/proc/<pid>/stat``.

If the launcher is SIGKILLed, the server sees its control socket close,
SIGKILLs every worker's process group and exits; workers also carry
``PR_SET_PDEATHSIG = SIGKILL`` towards the server.
"""

from __future__ import annotations

import logging
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import IO, Any

from taskd_core.errors import TaskdError
from taskd_core.forkserver import _wire as wire

logger = logging.getLogger(__name__)

#: What a torch job imports before its first step; ``torch._dynamo`` is the lazy import of the first
#: ``torch.optim`` step. A preload to ask for, not the default (:data:`TORCH_FIRST`).
TORCH_PRELOAD = ("torch", "torch.distributed", "torch.optim", "torch._dynamo", "torch.nn.parallel")
#: What the server of a torch job imports before it forks the first workers (``import torch`` brings
#: ``torch.distributed``, ``torch.optim`` and ``torch.nn.parallel`` along); the rest of
#: :data:`TORCH_PRELOAD` it learns from the workers that import it (``torch._dynamo`` is 2 s that a
#: job without ``torch.optim`` steps never pays, and that would hold a restart waiting on the server).
TORCH_FIRST = ("torch",)
#: The exit code reported for a forked worker that ended while its server could not say how (the server
#: stopped or sick and the zombie already gone): a failure, with the reason in the log.
STATUS_UNKNOWN = 255
#: Seconds a server may stay stopped (``T``/``t`` in ``/proc``: SIGSTOP, a debugger) while a start
#: waits on it before it is declared unhealthy; a brief stop (``py-spy dump``) passes.
STOPPED_BOUND = 0.5
#: Interpreter flags that a forked child inherits from a server started with the same flags.
_SAME_FLAGS = frozenset("bBdEOqRsuv")
_FLAGS_WITH_ARG = frozenset("WX")
#: Environment read while the interpreter starts or while the preloaded modules are imported: a
#: worker whose values differ from the server's cannot be forked from it.
_STARTUP_ENV_PREFIXES = ("PYTHON", "LD_")
_TORCH_IMPORT = re.compile(r"^\s*(import|from)\s+torch\b", re.MULTILINE)
_STARTUP_ENV = frozenset({"OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"})
#: Seconds a server that is not importing may stay silent while a fork request waits: then it is
#: unhealthy. One that said it imports a module is waited for (the forked worker gets the module;
#: an exec'd one would import it itself, beside the server's import, on the same cores).
ANSWER_BOUND = 3.0
#: Seconds the server has to read a fork request at all; past that the worker is started by exec and
#: the server refuses the request when it reads it.
_SPAWN_DEADLINE = 30.0
#: Seconds past the deadline for the answer to arrive.
_REPLY_MARGIN = 1.0
#: Seconds to wait for the exit status of a forked worker that is dead and already reaped.
_STATUS_GRACE = 1.0
#: How often a wait on the server looks at its process state.
_HEALTH_POLL = 0.05
#: New servers started in a row for servers that died before they were ready.
_RESPAWNS = 2
#: Seconds a closed server gets to kill its children and exit before it is SIGKILLed.
_CLOSE_GRACE = 5.0
_STOPPED_STATES = (b"T", b"t")


class ForkServerError(TaskdError):
    """The fork server could not start a worker; the caller starts it by ``exec`` instead."""


class ServerState(str, Enum):
    """A fork server's life: starting → ready | refused; ready → unhealthy (killed); any → dead."""

    STARTING = "starting"
    READY = "ready"
    REFUSED = "refused"
    UNHEALTHY = "unhealthy"
    DEAD = "dead"


@dataclass(frozen=True, slots=True)
class ForkServerSettings:
    """Whether workers are forked from a fork server, and what the server imports first."""

    enabled: bool = True
    #: modules imported before the first fork (not installed ones are skipped; :data:`TORCH_PRELOAD`
    #: makes restarts warm from the start, at the first workers' expense); None: :data:`TORCH_FIRST`
    #: when the job imports torch, else nothing (the server still learns).
    preload: tuple[str, ...] | None = None
    #: also import the installed modules the workers imported, after their first start.
    learn: bool = True
    #: seconds the first start waits for the server to finish preloading before it execs instead.
    ready_timeout: float = 120.0
    #: modules the server imports right after its preload, with the framework's code around each of its
    #: forks: any of ``before_fork()``, ``after_fork_in_parent()``, ``after_fork_in_child()`` (run around
    #: the server's forks only, not those the workers make). If one cannot be imported the server refuses
    #: to serve and every worker starts by exec; a ``before_fork`` that raises makes that start exec; an
    #: ``after_fork_in_child`` that raises ends the worker with exit code 1 and the error on its stderr.
    hooks: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PythonCommand:
    """A worker command the fork server can run: ``INTERPRETER [FLAGS] (SCRIPT | -m MODULE) [ARGS]``."""

    interpreter: str
    flags: tuple[str, ...]
    module: str | None
    script: str | None
    args: tuple[str, ...]

    @classmethod
    def parse(cls, argv: Sequence[str], cwd: str, path: str | None) -> PythonCommand | None:
        """The command as a :class:`PythonCommand`, or None when only ``exec`` can run it faithfully.

        :param cwd: the worker's working directory (relative scripts and interpreters resolve there).
        :param path: the worker's ``PATH``, to find a bare interpreter name.
        """
        if not argv:
            return None
        exe = argv[0]
        found = os.path.join(cwd, exe) if os.sep in exe else shutil.which(exe, path=path)
        if found is None or not Path(found).name.startswith("python") or not os.access(found, os.X_OK):
            return None
        flags: list[str] = []
        rest = list(argv[1:])
        while rest and rest[0].startswith("-") and rest[0] != "-":
            token = rest.pop(0)
            if token == "-m":
                if not rest:
                    return None
                return cls(os.path.abspath(found), tuple(flags), rest[0], None, tuple(rest[1:]))
            letters = token[1:]
            if letters and letters[0] in _FLAGS_WITH_ARG:
                if len(letters) == 1 and not rest:
                    return None
                flags += [token] if len(letters) > 1 else [token, rest.pop(0)]
                continue
            if not letters or not set(letters) <= _SAME_FLAGS:
                return None  # -c, -i, -I, -P, -S, -x, --long options: only the interpreter itself
            flags.append(token)
        if not rest:
            return None
        script = os.path.join(cwd, rest[0])
        if not os.path.isfile(script) or script.endswith(".pyc") or zipfile.is_zipfile(script):
            return None  # the interpreter's own error, a compiled file or a zip app: exec
        return cls(os.path.abspath(found), tuple(flags), None, rest[0], tuple(rest[1:]))

    def imports_torch(self, cwd: str) -> bool:
        """Whether the script has an ``import torch``/``from torch`` line (for a module: unknown, False)."""
        if self.script is None:
            return False
        try:
            source = Path(cwd, self.script).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return False
        return _TORCH_IMPORT.search(source) is not None

    def request(
        self, argv: Sequence[str], cwd: str, env: Mapping[str, str], request_id: int, deadline: float
    ) -> wire.Spawn:
        """The server's request to make a child look like ``argv`` started in ``cwd`` with ``env``."""
        # What exec would name the process: the basename of the file it ran.
        comm = os.path.basename(self.interpreter)
        if self.module is not None:
            # runpy puts the module's file in argv[0]; the interpreter first puts "-m" there.
            return wire.Spawn(
                request_id, deadline, ("-m", *self.args), tuple(argv), self.module, None, cwd, env, cwd, comm
            )
        assert self.script is not None
        # The interpreter's __main__.__file__ is the script joined to the cwd (not normalised);
        # sys.path[0] is the directory of the script with symlinks resolved.
        file = self.script if os.path.isabs(self.script) else cwd.rstrip(os.sep) + os.sep + self.script
        path0 = os.path.dirname(os.path.realpath(file))
        return wire.Spawn(
            request_id, deadline, (self.script, *self.args), tuple(argv), None, file, path0, env, cwd, comm
        )


def _startup_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_ENV_PREFIXES) or k in _STARTUP_ENV}


def _stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: the fields start after the last ')'.
    return stat[stat.rfind(b")") + 2 :].split()


def _stopped(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] in _STOPPED_STATES


def _zombie_code(pid: int, pidfd: int) -> int | None:
    """The exit code of ``pid`` while it is a zombie nobody reaped yet (its parent may be stopped)."""
    fields = _stat(pid)
    # Field 52 of stat, the wait status (Linux 3.5+), is the 50th after the name.
    if fields is None or fields[0] != b"Z" or len(fields) < 50:
        return None
    try:
        # Still there after the read: the number was not reused between the two, so the read was ours.
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return None
    return os.waitstatus_to_exitcode(int(fields[49]))


class ForkedProcess:
    """A worker forked by the fork server, with ``Popen``'s interface (pid, poll, wait, returncode).

    The exit status comes from the server, which reaps the worker, or from
    the zombie itself while the server has not reaped it (a stopped server);
    if the server died first, the worker died with it (``PR_SET_PDEATHSIG``)
    and is reported as killed by SIGKILL; a worker that ended while its server
    could not tell how is reported as :data:`STATUS_UNKNOWN`.
    """

    def __init__(self, server: ForkServer, pid: int, args: Sequence[str]) -> None:
        self.server = server
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._lock = threading.Lock()
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # already reaped by the server: its status is on the way
            self._pidfd = None

    def _ended(self) -> bool:
        if self._pidfd is None:
            return True
        return bool(select.select([self._pidfd], [], [], 0)[0])

    def poll(self) -> int | None:
        """The exit code once the worker ended (negative: killed by that signal), else None."""
        with self._lock:
            if self.returncode is None:
                code = self.server.exit_code(self.pid, 0.0)
                if code is None and self._ended():
                    code = self._status_of_dead()
                if code is not None:
                    self._set(code)
            return self.returncode

    def _status_of_dead(self) -> int:
        if self._pidfd is not None:
            code = _zombie_code(self.pid, self._pidfd)
            if code is not None:
                self.server.note_unreaped()
                return code
        # Reaped: the server's word is on its way, unless the server is gone or sick.
        code = self.server.exit_code(self.pid, _STATUS_GRACE)
        if code is not None:
            return code
        if self.server.state is ServerState.DEAD:
            logger.warning("forked worker %s ended with the fork server; its exit status is lost", self.pid)
            return -signal.SIGKILL
        logger.warning(
            "forked worker %s ended, but fork server %s (%s) did not say how within %.1fs: counted as "
            "failed with exit code %s",
            self.pid,
            self.server.pid,
            self.server.state.value,
            _STATUS_GRACE,
            STATUS_UNKNOWN,
        )
        return STATUS_UNKNOWN

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the worker's end; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            step = 0.05 if remaining is None else min(remaining, 0.05)
            if self.server.usable:
                self.server.exit_code(self.pid, step)  # returns as soon as the server reaps it
            else:
                time.sleep(step)  # nobody will say: the pidfd, looked at by poll(), tells
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _set(self, code: int) -> None:
        self.returncode = code
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:
        if getattr(self, "_pidfd", None) is not None:
            os.close(self._pidfd)  # type: ignore[arg-type]


class ForkServer:
    """One fork server process and the thread that reads what it says.

    Creating it starts the process and returns at once; the server preloads
    in the background and is usable once :meth:`wait_ready` says so.
    """

    def __init__(
        self,
        job: PythonCommand,
        settings: ForkServerSettings,
        preload: Sequence[str],
        env: Mapping[str, str],
        on_dead: Callable[[ForkServer], None] | None = None,
    ) -> None:
        self.job = job
        self._on_dead = on_dead
        self.was_ready = False
        self.env = {**os.environ, **env}
        self._cond = threading.Condition()
        self._state = ServerState.STARTING
        self.reason = ""
        self.preloaded: list[str] = []
        self.learned: list[str] = []
        #: whether the server announced imports it has not finished (it reads no request meanwhile).
        self.importing = False
        #: when the server was first seen stopped (``T``), None while it runs.
        self._stopped_since: float | None = None
        #: when the server last said anything.
        self._last_heard = time.monotonic()
        self._exits: dict[int, int] = {}
        self._replies: dict[int, wire.Spawned | wire.Failed] = {}
        self._waiting: set[int] = set()
        self._next_id = 0
        self._send_lock = threading.Lock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server_file = str(Path(__file__).with_name("_server.py").resolve())
        command = [job.interpreter, *job.flags, server_file, "--fd", str(theirs.fileno())]
        command += ["--preload", ",".join(preload)]
        command += ["--hooks", ",".join(settings.hooks)] + (["--learn"] if settings.learn else [])
        try:
            self.process = subprocess.Popen(
                command,
                pass_fds=(theirs.fileno(),),
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                # Its own session: a terminal's Ctrl-C reaches the launcher, which stops the workers.
                start_new_session=True,
            )
        except OSError as exc:
            ours.close()
            raise ForkServerError(f"cannot start the fork server with {job.interpreter}: {exc}") from exc
        finally:
            theirs.close()
        self.sock = ours
        self._reader = threading.Thread(
            target=self._read, name=f"taskd-forkserver-{self.process.pid}", daemon=True
        )
        self._reader.start()
        logger.info(
            "fork server pid %s starting: %s, preloading %s",
            self.process.pid,
            job.interpreter,
            ",".join(preload) or "nothing",
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def state(self) -> ServerState:
        return self._state

    @property
    def dead(self) -> bool:
        return self._state is ServerState.DEAD

    @property
    def usable(self) -> bool:
        return self._state in (ServerState.STARTING, ServerState.READY)

    def wait_ready(self, timeout: float) -> bool:
        """Whether the server is ready to fork, waiting up to ``timeout`` seconds for it."""
        with self._cond:
            self._wait(lambda: self._state is not ServerState.STARTING, time.monotonic() + timeout)
            return self._state is ServerState.READY

    def _wait(self, done: Callable[[], bool], until: float) -> bool:
        """Wait (holding ``_cond``) until ``done()``, ``until`` or the server is found unusable.

        A server that stays stopped for :data:`STOPPED_BOUND` meanwhile is declared unhealthy.
        """
        while not done():
            now = time.monotonic()
            if not self.usable or now >= until or not self._check_health(now):
                return False
            self._cond.wait(min(_HEALTH_POLL, until - now))
        return True

    def _check_health(self, now: float) -> bool:
        """Whether the server may still answer (holding ``_cond``): not stopped for too long.

        How long it has been stopped counts from the first time anyone saw it stopped (a worker's
        death it did not reap, say), so a restart that follows does not wait the bound again.
        """
        if not _stopped(self.pid):
            self._stopped_since = None
            return True
        if self._stopped_since is None:
            self._stopped_since = now
        if now - self._stopped_since < STOPPED_BOUND:
            return True
        self._declare_unhealthy(f"stopped for {now - self._stopped_since:.1f}s (state T in /proc)")
        return False

    def note_unreaped(self) -> None:
        """A worker died and the server has not reaped it: start counting a stop now."""
        with self._cond:
            if self.usable:
                self._check_health(time.monotonic())

    def _declare_unhealthy(self, why: str) -> None:
        """Kill the server and its process group; its reader then sees it dead and a new one starts."""
        if not self.usable:
            return
        self._state = ServerState.UNHEALTHY
        self.reason = why
        logger.error(
            "fork server %s is unhealthy: %s; killing it (its forked workers die with it), workers start "
            "by exec while a new server starts",
            self.pid,
            why,
        )
        _kill_group(self.pid)
        self._cond.notify_all()

    def _read(self) -> None:
        started = time.monotonic()
        try:
            while True:
                received = wire.recv(self.sock)
                if received is None:
                    break
                message, fds = received
                for fd in fds:
                    os.close(fd)
                self._on_message(message, started)
        except (OSError, ValueError) as exc:
            logger.warning("fork server %s: lost the control socket: %s", self.pid, exc)
        with self._cond:
            died = self._state is not ServerState.REFUSED
            if died:
                self._state = ServerState.DEAD
            self._cond.notify_all()
        if died and self._on_dead is not None:
            self._on_dead(self)

    def _on_message(self, message: wire.Message, started: float) -> None:
        with self._cond:
            self._last_heard = time.monotonic()
            match message:
                case wire.Ready():
                    self._state = ServerState.READY
                    self.was_ready = True
                    self.preloaded = list(message.preloaded)
                    logger.info(
                        "fork server %s ready after %.2fs: preloaded %s%s",
                        self.pid,
                        time.monotonic() - started,
                        ",".join(self.preloaded) or "nothing",
                        f"; not importable: {dict(message.failed)}" if message.failed else "",
                    )
                case wire.Refused():
                    self._state = ServerState.REFUSED
                    self.reason = message.reason
                    logger.error(
                        "fork server %s refuses to serve: %s; workers start by exec", self.pid, self.reason
                    )
                case wire.Spawned() | wire.Failed() if message.id in self._waiting:
                    self._replies[message.id] = message
                case wire.Spawned():
                    # Forked after its start had given up on it (and exec'd the worker): not wanted.
                    logger.warning("fork server %s forked pid %s too late; killing it", self.pid, message.pid)
                    _kill_group(message.pid)
                case wire.Exited():
                    self._exits[message.pid] = message.code
                case wire.Importing():
                    self.importing = True
                case wire.Imported():
                    self.importing = False
                    self.learned += message.modules
                    if message.modules:
                        logger.info("fork server %s imported %s more modules", self.pid, len(message.modules))
                case _:
                    pass  # a late answer nobody waits for, or a request only the server takes
            if isinstance(message, wire.Spawned):
                # The pid is a new process now: an exit status kept for an earlier holder is stale.
                self._exits.pop(message.pid, None)
            self._cond.notify_all()

    def spawn(
        self,
        command: PythonCommand,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        stdio: Sequence[int],
    ) -> ForkedProcess:
        """Fork a worker running ``command``; :class:`ForkServerError` when the server cannot."""
        if command.interpreter != self.job.interpreter or command.flags != self.job.flags:
            raise ForkServerError(f"{' '.join(argv[:2])} is not this server's interpreter and flags")
        differ = self.startup_difference(env)
        if differ is not None:
            raise ForkServerError(f"the worker's startup environment differs from the server's ({differ})")
        with self._cond:
            if self._state is not ServerState.READY:
                raise ForkServerError(f"fork server is {self._state.value}")
            # A stopped server would not answer: found out before anything is asked of it.
            if not self._wait(lambda: not _stopped(self.pid), time.monotonic() + 2 * STOPPED_BOUND):
                raise ForkServerError(f"fork server is {self._state.value}: {self.reason}")
            self._next_id += 1
            request_id = self._next_id
            self._waiting.add(request_id)
        sent = time.monotonic()
        deadline = sent + _SPAWN_DEADLINE

        def silent() -> bool:
            return not self.importing and time.monotonic() - max(sent, self._last_heard) > ANSWER_BOUND

        try:
            with self._send_lock:
                wire.send(self.sock, command.request(argv, cwd, dict(env), request_id, deadline), stdio)
            with self._cond:
                self._wait(lambda: request_id in self._replies or silent(), deadline + _REPLY_MARGIN)
                reply = self._replies.pop(request_id, None)
                if reply is None and self.usable and not self.importing:
                    self._declare_unhealthy(f"silent for {ANSWER_BOUND:g}s while a fork request waited")
        except OSError as exc:
            raise ForkServerError(f"cannot reach the fork server: {exc}") from exc
        finally:
            with self._cond:
                self._waiting.discard(request_id)
        if reply is None:
            why = (
                f"importing for {_SPAWN_DEADLINE:g}s"
                if self.usable
                else f"{self._state.value}: {self.reason}"
            )
            raise ForkServerError(f"the fork server did not answer ({why})")
        if isinstance(reply, wire.Failed):
            raise ForkServerError(f"the fork server could not fork: {reply.reason}")
        return ForkedProcess(self, reply.pid, argv)

    def startup_difference(self, env: Mapping[str, str]) -> str | None:
        """A variable read at interpreter start or preload whose value in ``env`` is not the server's."""
        differ = sorted(name for name, _ in _startup_env(env).items() ^ _startup_env(self.env).items())
        return differ[0] if differ else None

    def exit_code(self, pid: int, timeout: float) -> int | None:
        """The exit code of forked worker ``pid`` if the server reaped it (waiting up to ``timeout``)."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or not self.usable, timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        """End the server: it SIGKILLs what is left of its children and exits."""
        preloading = self._state is ServerState.STARTING  # taken first: the shutdown makes it dead
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already gone
        if preloading or _stopped(self.pid):
            # One still preloading reads nothing until it is done (and has no child yet); a stopped one
            # reads nothing at all: neither would see the socket close.
            _kill_group(self.pid)
        try:
            self.process.wait(_CLOSE_GRACE)
        except subprocess.TimeoutExpired:
            logger.warning("fork server %s did not exit within %.1fs; killing it", self.pid, _CLOSE_GRACE)
            _kill_group(self.pid)
            self.process.wait(_CLOSE_GRACE)
        if threading.current_thread() is not self._reader:  # a replacement may be started from the reader
            self._reader.join(_CLOSE_GRACE)
        self.sock.close()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # gone already


def _fd(stream: int | IO[Any] | None, default: int) -> int:
    if stream is None:
        return default
    if isinstance(stream, int):
        return stream
    return stream.fileno()


class ForkLauncher:
    """Starts a job's workers: forked from a fork server when it can, by ``exec`` otherwise.

    :param command: the job's worker command; if it is not a Python command
        (:class:`PythonCommand`), no server is started and every start execs.
    :param settings: what the server preloads and learns.
    :param cwd: the workers' working directory (None: the launcher's).
    :param env: environment every worker shares beyond the launcher's (``TASKD_JOB_ID``, say); the
        server is started with it, so ``/proc/<pid>/environ`` of a forked worker (the server's
        initial environment, whatever the worker's ``os.environ`` says) shows it too.
    :param imports_torch: whether the job is a torch job (what to preload when ``settings.preload``
        is None); None: whether the script has an ``import torch`` line.
    """

    def __init__(
        self,
        command: Sequence[str],
        settings: ForkServerSettings,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        *,
        imports_torch: bool | None = None,
    ) -> None:
        job = PythonCommand.parse(command, cwd or os.getcwd(), os.environ.get("PATH"))
        if job is None:
            logger.info("%s is not a Python script or module: workers start by exec", " ".join(command[:3]))
        self._setup(job, settings, cwd, env, imports_torch)

    @classmethod
    def for_interpreter(
        cls,
        interpreter: str,
        flags: Sequence[str],
        settings: ForkServerSettings,
        *,
        imports_torch: bool,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ForkLauncher:
        """A launcher for workers run by ``interpreter`` with ``flags``, before their script is known.

        The server starts at once, so that it preloads while the launcher still reads its options
        (``taskdrun`` learns its script only from torch's own argument parser, which imports torch).
        """
        launcher = cls.__new__(cls)
        job = PythonCommand(interpreter, tuple(flags), None, None, ())
        launcher._setup(job, settings, cwd, env, imports_torch)
        return launcher

    def _setup(
        self,
        job: PythonCommand | None,
        settings: ForkServerSettings,
        cwd: str | None,
        env: Mapping[str, str] | None,
        imports_torch: bool | None,
    ) -> None:
        self.settings = settings
        self.cwd = cwd
        self.env = dict(env or {})
        self.server: ForkServer | None = None
        self._learned: list[str] = []
        self._lock = threading.RLock()
        self._closed = False
        #: replacements left for servers that die before they were ever ready (a broken interpreter, say).
        self._respawns = _RESPAWNS
        self._started_once = False
        self._job = job
        if job is not None:
            torch_job = job.imports_torch(cwd or os.getcwd()) if imports_torch is None else imports_torch
            self._first = _first_stage(settings.preload, torch_job)
            self._replace()

    def fits(self, env: Mapping[str, str]) -> bool:
        """Whether workers started with environment ``env`` can be forked from this launcher's server."""
        server = self.server
        return server is not None and server.startup_difference(env) is None

    def _replace(self) -> None:
        """Start a new server (it preloads in the background), keeping what the last one learned."""
        assert self._job is not None
        old = self.server
        first = list(self._first)
        if old is not None:
            self._learned += [m for m in old.learned if m not in self._learned]
            old.close()
            # A replacement serves restarts, which never wait for it: everything at once.
            first += [m for m in self._learned if m not in first]
        try:
            self.server = ForkServer(self._job, self.settings, first, self.env, self._on_dead)
        except ForkServerError as exc:
            logger.error("%s; workers start by exec", exc)
            self.server = None

    def _on_dead(self, server: ForkServer) -> None:
        """The server died: start a new one right away, so that it preloads while the recovery goes on."""
        with self._lock:
            if self._closed or self.server is not server:
                return  # closed on purpose, or already replaced
            self._respawns = _RESPAWNS if server.was_ready else self._respawns - 1
            if self._respawns < 0:
                logger.error(
                    "fork server %s died before it was ever ready, again; workers start by exec", server.pid
                )
                self.server = None
                return
            logger.warning(
                "fork server %s died (exit %s); starting a new one", server.pid, server.process.poll()
            )
            self._replace()

    def start(
        self,
        args: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None = None,
        stdin: int | IO[Any] | None = None,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
    ) -> subprocess.Popen[bytes] | ForkedProcess:
        """Start one worker in its own session, as ``Popen(..., start_new_session=True)`` would.

        ``env`` is the worker's whole environment; the streams take what
        ``Popen`` takes (None inherits the launcher's, ``subprocess.DEVNULL``,
        ``subprocess.STDOUT`` for stderr, a descriptor or a file object).
        """
        work_dir = os.path.abspath(cwd or self.cwd or os.getcwd())
        with self._lock:
            forked = self._fork(args, env, work_dir, stdin, stdout, stderr)
        return forked if forked is not None else _exec(args, env, cwd, stdin, stdout, stderr)

    def _fork(
        self,
        args: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        stdin: int | IO[Any] | None,
        stdout: int | IO[Any] | None,
        stderr: int | IO[Any] | None,
    ) -> ForkedProcess | None:
        server = self.server
        if server is None or not server.usable:
            return None
        command = PythonCommand.parse(args, cwd, env.get("PATH"))
        if command is None:
            return None
        # Only the first start waits for the preload: later, a slow server must not delay a recovery.
        if not server.wait_ready(0.0 if self._started_once else self.settings.ready_timeout):
            if server.usable:
                logger.warning(
                    "fork server %s is not ready; starting %s by exec", server.pid, " ".join(args[:2])
                )
            return None
        self._started_once = True
        devnull = os.open(os.devnull, os.O_RDWR) if subprocess.DEVNULL in (stdin, stdout, stderr) else -1
        try:
            out = devnull if stdout == subprocess.DEVNULL else _fd(stdout, 1)
            stdio = [
                devnull if stdin == subprocess.DEVNULL else _fd(stdin, 0),
                out,
                out
                if stderr == subprocess.STDOUT
                else devnull
                if stderr == subprocess.DEVNULL
                else _fd(stderr, 2),
            ]
            return server.spawn(command, args, env, cwd, stdio)
        except ForkServerError as exc:
            logger.warning("cannot fork %s (%s); starting it by exec", " ".join(args[:2]), exc)
            return None
        finally:
            if devnull >= 0:
                os.close(devnull)

    def close(self) -> None:
        """Stop the server (and with it any forked worker still running)."""
        with self._lock:
            self._closed = True
            server, self.server = self.server, None
        # Outside the lock: the server's reader thread takes it when it sees the server end.
        if server is not None:
            server.close()


def _first_stage(preload: tuple[str, ...] | None, torch_job: bool) -> tuple[str, ...]:
    """What the server imports before its first fork."""
    if preload is not None:
        return preload
    return TORCH_FIRST if torch_job else ()


def _exec(
    args: Sequence[str],
    env: Mapping[str, str],
    cwd: str | None,
    stdin: int | IO[Any] | None,
    stdout: int | IO[Any] | None,
    stderr: int | IO[Any] | None,
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        list(args), env=dict(env), cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, start_new_session=True
    )


def start_worker(
    launcher: ForkLauncher | None,
    args: Sequence[str],
    env: Mapping[str, str],
    cwd: str | None = None,
    stdin: int | IO[Any] | None = None,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
) -> subprocess.Popen[bytes] | ForkedProcess:
    """Start a worker in its own session: through ``launcher``, or by ``exec`` without one."""
    if launcher is not None:
        return launcher.start(args, env, cwd, stdin, stdout, stderr)
    return _exec(args, env, cwd, stdin, stdout, stderr)
