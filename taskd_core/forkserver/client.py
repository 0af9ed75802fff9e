"""Warm worker starts: the agent's side of the fork server.

A worker restart used to be a cold ``python script.py``: interpreter start,
``import torch``, the lazy ``torch._dynamo`` import of the first optimizer
step and the script's own imports, seconds each time. The fork server is a
process of the job's own interpreter, started by a fresh ``exec`` (never forked
from the launcher, which holds gRPC threads), that imports the framework once
and then forks each worker; see :mod:`taskd_core.forkserver._server`
for the server and for what a forked child looks like to its script.

:class:`ForkLauncher` is what adapters use: :meth:`ForkLauncher.start` takes
a worker's command as ``Popen`` would and returns a ``Popen``-like process,
forked when the command is a Python script or module of the job's interpreter
(:class:`PythonCommand`), else started by ``exec`` exactly as before. If the
server died or a fork failed, the worker is started by ``exec`` and a new
server is started in the background. Deaths of forked workers reach the agent
through pidfds as for any worker; their exit status comes from the server,
which reaps them.

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
from pathlib import Path
from typing import IO, Any

from taskd_core.errors import TaskdError
from taskd_core.forkserver import _server as wire

logger = logging.getLogger(__name__)

#: What a torch job imports before its first step; ``torch._dynamo`` is the lazy import of the first
#: ``torch.optim`` step. Modules that are not installed are skipped.
TORCH_PRELOAD = ("torch", "torch.distributed", "torch.optim", "torch._dynamo", "torch.nn.parallel")
#: Interpreter flags that a forked child inherits from a server started with the same flags.
_SAME_FLAGS = frozenset("bBdEOqRsuv")
_FLAGS_WITH_ARG = frozenset("WX")
#: Environment read while the interpreter starts or while the preloaded modules are imported: a
#: worker whose values differ from the server's cannot be forked from it.
_STARTUP_ENV_PREFIXES = ("PYTHON", "LD_")
_TORCH_IMPORT = re.compile(r"^\s*(import|from)\s+torch\b", re.MULTILINE)
_STARTUP_ENV = frozenset({"OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"})
#: Seconds a fork request may take (the server may be importing learned modules).
_SPAWN_TIMEOUT = 30.0
#: Seconds to wait for the exit status of a forked worker whose death the pidfd already showed.
_REAP_GRACE = 5.0
#: New servers started in a row for servers that died before they were ready.
_RESPAWNS = 2
#: Seconds a closed server gets to kill its children and exit before it is SIGKILLed.
_CLOSE_GRACE = 5.0


class ForkServerError(TaskdError):
    """The fork server could not start a worker; the caller starts it by ``exec`` instead."""


@dataclass(frozen=True, slots=True)
class ForkServerSettings:
    """Whether workers are forked from a fork server, and what the server imports first."""

    enabled: bool = True
    #: modules imported before serving (not installed ones are skipped); None: :data:`TORCH_PRELOAD`
    #: when the job's script imports torch, else nothing (the server still learns).
    preload: tuple[str, ...] | None = None
    #: also import the installed modules the workers imported, after their first start.
    learn: bool = True
    #: seconds the first start waits for the server to finish preloading before it execs instead.
    ready_timeout: float = 120.0


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

    def request(self, argv: Sequence[str], cwd: str) -> dict[str, Any]:
        """What the server needs to make the child look like ``argv`` started in ``cwd``."""
        if self.module is not None:
            # runpy puts the module's file in argv[0]; the interpreter first puts "-m" there.
            return {
                "argv": ["-m", *self.args],
                "orig_argv": list(argv),
                "module": self.module,
                "file": None,
                "path0": cwd,
            }
        assert self.script is not None
        # The interpreter's __main__.__file__ is the script joined to the cwd (not normalised);
        # sys.path[0] is the directory of the script with symlinks resolved.
        file = self.script if os.path.isabs(self.script) else cwd.rstrip(os.sep) + os.sep + self.script
        return {
            "argv": [self.script, *self.args],
            "orig_argv": list(argv),
            "module": None,
            "file": file,
            "path0": os.path.dirname(os.path.realpath(file)),
        }


def _startup_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_ENV_PREFIXES) or k in _STARTUP_ENV}


class ForkedProcess:
    """A worker forked by the fork server, with ``Popen``'s interface (pid, poll, wait, returncode).

    The exit status comes from the server, which reaps the worker; if the
    server died first, the worker died with it (``PR_SET_PDEATHSIG``) and its
    status is reported as killed by SIGKILL.
    """

    def __init__(self, server: ForkServer, pid: int, args: Sequence[str]) -> None:
        self.server = server
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
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
        if self.returncode is None:
            code = self.server.exit_code(self.pid, _REAP_GRACE if self._ended() else 0.0)
            if code is None and self.server.dead and self._ended():
                logger.warning(
                    "forked worker %s ended with the fork server; its exit status is lost", self.pid
                )
                code = -signal.SIGKILL
            if code is not None:
                self._set(code)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the worker's end; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.server.wait_exit(self.pid, 0.05 if remaining is None else min(remaining, 0.05))
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
        self._state = "starting"  # starting -> ready | refused; any -> dead
        self.reason = ""
        self.preloaded: list[str] = []
        self.learned: list[str] = []
        self._exits: dict[int, int] = {}
        self._replies: dict[int, dict[str, Any]] = {}
        self._next_id = 0
        self._send_lock = threading.Lock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server_file = str(Path(wire.__file__).resolve())
        command = [job.interpreter, *job.flags, server_file, "--fd", str(theirs.fileno())]
        command += ["--preload", ",".join(preload)] + (["--learn"] if settings.learn else [])
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
    def dead(self) -> bool:
        return self._state == "dead"

    @property
    def usable(self) -> bool:
        return self._state in ("starting", "ready")

    def wait_ready(self, timeout: float) -> bool:
        """Whether the server is ready to fork, waiting up to ``timeout`` seconds for it."""
        with self._cond:
            self._cond.wait_for(lambda: self._state != "starting", max(timeout, 0.0))
            return self._state == "ready"

    def _read(self) -> None:
        started = time.monotonic()
        try:
            while True:
                received = wire.recv_message(self.sock)
                if received is None:
                    break
                message, fds = received
                for fd in fds:
                    os.close(fd)
                self._on_message(message, started)
        except (OSError, ValueError) as exc:
            logger.warning("fork server %s: lost the control socket: %s", self.pid, exc)
        with self._cond:
            died = self._state != "refused"
            if died:
                self._state = "dead"
            self._cond.notify_all()
        if died and self._on_dead is not None:
            self._on_dead(self)

    def _on_message(self, message: dict[str, Any], started: float) -> None:
        op = message.get("op")
        with self._cond:
            if op == "ready":
                self._state = "ready"
                self.was_ready = True
                self.preloaded = list(message["preloaded"])
                logger.info(
                    "fork server %s ready after %.2fs: preloaded %s%s",
                    self.pid,
                    time.monotonic() - started,
                    ",".join(self.preloaded) or "nothing",
                    f"; not importable: {message['failed']}" if message["failed"] else "",
                )
            elif op == "refused":
                self._state = "refused"
                self.reason = str(message["reason"])
                logger.error(
                    "fork server %s refuses to serve: %s; workers start by exec", self.pid, self.reason
                )
            elif op in ("spawned", "failed"):
                self._replies[int(message["id"])] = message
            elif op == "exited":
                self._exits[int(message["pid"])] = int(message["code"])
            elif op == "learned":
                self.learned += message["modules"]
                logger.info(
                    "fork server %s imported %s modules the workers use", self.pid, len(message["modules"])
                )
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
        differ = sorted(k for k in _startup_env(env).items() ^ _startup_env(self.env).items())
        if differ:
            raise ForkServerError(
                f"the worker's startup environment differs from the server's ({differ[0][0]})"
            )
        with self._cond:
            if self._state != "ready":
                raise ForkServerError(f"fork server is {self._state}")
            self._next_id += 1
            request_id = self._next_id
        request = {
            "op": "spawn",
            "id": request_id,
            "env": dict(env),
            "cwd": cwd,
            # What exec would name the process: the basename of the file it ran.
            "comm": os.path.basename(command.interpreter),
            **command.request(argv, cwd),
        }
        try:
            with self._send_lock:
                wire.send_message(self.sock, request, stdio)
        except OSError as exc:
            raise ForkServerError(f"cannot reach the fork server: {exc}") from exc
        with self._cond:
            self._cond.wait_for(lambda: request_id in self._replies or self._state == "dead", _SPAWN_TIMEOUT)
            reply = self._replies.pop(request_id, None)
        if reply is None:
            raise ForkServerError(
                "the fork server did not answer" if not self.dead else "the fork server died"
            )
        if reply["op"] != "spawned":
            raise ForkServerError(f"the fork server could not fork: {reply.get('reason')}")
        return ForkedProcess(self, int(reply["pid"]), argv)

    def exit_code(self, pid: int, timeout: float) -> int | None:
        """The exit code of forked worker ``pid`` if the server reaped it (waiting up to ``timeout``)."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self._state == "dead", timeout)
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float) -> None:
        self.exit_code(pid, timeout)

    def close(self) -> None:
        """End the server: it SIGKILLs what is left of its children and exits."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already gone
        try:
            self.process.wait(_CLOSE_GRACE)
        except subprocess.TimeoutExpired:
            logger.warning("fork server %s did not exit within %.1fs; killing it", self.pid, _CLOSE_GRACE)
            self.process.kill()
            self.process.wait(_CLOSE_GRACE)
        if threading.current_thread() is not self._reader:  # a replacement may be started from the reader
            self._reader.join(_CLOSE_GRACE)
        self.sock.close()


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
    """

    def __init__(
        self,
        command: Sequence[str],
        settings: ForkServerSettings,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
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
        self._job = PythonCommand.parse(command, cwd or os.getcwd(), os.environ.get("PATH"))
        if self._job is None:
            logger.info("%s is not a Python script or module: workers start by exec", " ".join(command[:3]))
            return
        self._replace()

    def _replace(self) -> None:
        """Start a new server (it preloads in the background), keeping what the last one learned."""
        assert self._job is not None
        old = self.server
        if old is not None:
            self._learned += [m for m in old.learned if m not in self._learned]
            old.close()
        first = self.settings.preload
        if first is None:
            first = TORCH_PRELOAD if self._job.imports_torch(self.cwd or os.getcwd()) else ()
        preload = [*first, *(m for m in self._learned if m not in first)]
        try:
            self.server = ForkServer(self._job, self.settings, preload, self.env, self._on_dead)
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
