"""The fork server's own process: preload the framework once, then fork each worker from it.

Run by :mod:`taskd_core.forkserver.client` as a fresh ``exec`` of the job's
interpreter, with the job's interpreter flags, as a *file* (not ``-m``), so
that nothing of TaskD (gRPC, pluggy, the agent) is ever imported here: this
module and the wire it loads by path (:mod:`taskd_core.forkserver._wire`, the
messages and their encoding, shared with the agent) use the standard library
only. Its agent talks to it over one ``AF_UNIX``/``SOCK_SEQPACKET`` socket.

What it imports, so that the first workers never wait for more than they
need: ``--preload`` before it says :class:`~_wire.Ready` (what the first
workers import anyway: ``torch`` for a torch job), then, once it has forked
children and nothing asked for anything for a moment, the installed modules its
workers reported importing (``--learn``: ``torch._dynamo`` once a worker took
its first optimizer step, say; never what no worker needs), one module at a
time, between requests. A batch is announced (:class:`~_wire.Importing`) and
closed (:class:`~_wire.Imported`): meanwhile the server answers nothing, and a
request whose deadline passed by the time it is read is refused, never forked
late. ``--hooks`` names modules imported right after the preload that
prepare the framework for the server's own forks (:class:`ForkHooks`); one that
fails to import makes the server refuse to serve.

A forked child becomes what ``python [flags] script.py ARGS`` / ``python
[flags] -m module ARGS`` would have been: its own session and process group,
the passed stdio, environment, cwd, ``sys.argv``/``sys.orig_argv``,
``sys.path[0]``, a fresh ``__main__``, the signal dispositions and mask of a
fresh interpreter, new seeds for torch's and numpy's global generators
(``random`` reseeds itself at fork), Python's exit semantics (``sys.exit(n)``,
traceback + 1, ``atexit`` handlers, waiting for non-daemon threads).

Lifetime: the server exits when its control socket reaches EOF (the agent
closed it or died, SIGKILL included), SIGKILLing every child's process group
first. Each child gets ``PR_SET_PDEATHSIG = SIGKILL``, so a SIGKILLed server
takes its children along; the agent sees those deaths and recovers them.
The server does not use ``PR_SET_PDEATHSIG`` itself: it fires when the
*thread* that forked the server exits, and the agent may start a replacement
from a short-lived thread.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import importlib.util
import io
import os
import select
import signal
import socket
import sys
import threading
import time
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from taskd_core.forkserver import _wire as wire
else:

    def _load_wire() -> types.ModuleType:
        """The wire module, loaded from this file's directory (TaskD need not be importable here)."""
        # A name no job module can have: children keep it in sys.modules.
        name = "_taskd_forkserver_wire"
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_wire.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
        return module

    wire = _load_wire()

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
#: Seconds after a child's start at which it reports the modules it imported (then its reporter ends).
LEARN_AFTER = (1.0, 5.0, 30.0)
#: Seconds without a request, after the first fork, before the server imports what its workers reported:
#: a generation's workers are asked for back to back, and none of them may wait for an import.
IDLE_BEFORE_IMPORT = 0.3
#: A child's references to the server's standard streams (see :func:`_become_worker`).
_RETIRED_STDIO: list[object] = []


# --- what runs in the server ------------------------------------------------------------------------


def return_code(status: int) -> int:
    """A ``waitpid`` status as ``Popen.returncode`` reports it."""
    return os.waitstatus_to_exitcode(status)


def device_in_use() -> str | None:
    """The accelerator whose context this process holds (forking it would be broken), or None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if torch.cuda.is_initialized():
        return "CUDA"
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_initialized():
        return "NPU"
    return None


def preload(modules: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Import ``modules``; the ones now imported and, by name, why the others could not be."""
    failed = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in modules:
            try:
                importlib.import_module(name)
            except BaseException as exc:  # noqa: BLE001 - a module may even sys.exit() at import
                failed[name] = f"{type(exc).__name__}: {exc}"
    return [m for m in modules if m not in failed], failed


@dataclass(frozen=True)
class FreshState:
    """What the interpreter looked like before the server changed anything: what every child gets back."""

    dispositions: dict[signal.Signals, Any]
    mask: frozenset[int]
    #: directories of installed modules (stdlib, site-packages): the only ones the server may learn.
    installed: tuple[str, ...]
    #: ``-u`` or ``PYTHONUNBUFFERED``, as the interpreter applied it to this server's own streams.
    unbuffered: bool

    @classmethod
    def now(cls) -> FreshState:
        handlers = {
            s: signal.getsignal(s) for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)
        }
        import site
        import sysconfig

        paths = sysconfig.get_paths()
        dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
        dirs.update(site.getsitepackages())
        return cls(
            # None: a handler not installed from Python, which a fresh interpreter has too.
            {s: h for s, h in handlers.items() if h is not None},
            frozenset(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            tuple(sorted(os.path.join(d, "") for d in dirs)),
            sys.__stdout__ is not None and sys.__stdout__.write_through,
        )


@dataclass(frozen=True)
class ForkHooks:
    """The framework's code around each fork of a worker (MindSpore's ``fork_utils``, say).

    A hook module defines any of ``before_fork()`` (in the server, before it forks),
    ``after_fork_in_parent()`` (in the server, after) and ``after_fork_in_child()``
    (in the child, once its signal dispositions and mask are a fresh interpreter's,
    so that a handler the hook installs stays). Unlike ``os.register_at_fork`` handlers they run
    around the server's forks only, not around those the workers make.
    """

    before: tuple[Callable[[], object], ...] = ()
    parent: tuple[Callable[[], object], ...] = ()
    child: tuple[Callable[[], object], ...] = ()

    @classmethod
    def load(cls, names: Sequence[str]) -> ForkHooks:
        """Import the hook modules; the error of one that cannot be imported propagates."""
        modules = [importlib.import_module(name) for name in names]

        def named(attr: str) -> tuple[Callable[[], object], ...]:
            return tuple(getattr(m, attr) for m in modules if callable(getattr(m, attr, None)))

        return cls(named("before_fork"), named("after_fork_in_parent"), named("after_fork_in_child"))


@dataclass(frozen=True)
class ChildJob:
    """What a forked child runs, handed from the server loop up to :func:`main` in the child."""

    request: wire.Spawn
    stdio: tuple[int, int, int]
    learn_fd: int | None
    fresh: FreshState
    server_pid: int
    #: the server's descriptors the child must not keep.
    server_fds: tuple[int, ...]
    #: the child's fork hooks, run by :func:`_become_worker` (a failure: the worker says so and exits 1).
    child_hooks: tuple[Callable[[], object], ...] = ()


def _run_hooks(hooks: Sequence[Callable[[], object]]) -> str | None:
    """Run ``hooks``; the first one's error, as a line, or None."""
    for hook in hooks:
        try:
            hook()
        except Exception as exc:  # noqa: BLE001 - reported to whoever waits on this fork
            return f"fork hook {getattr(hook, '__module__', '?')}.{getattr(hook, '__name__', '?')}: {exc!r}"
    return None


def _close(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


class Server:
    """The loop: fork on request, reap children, import while idle, exit with the control socket."""

    def __init__(
        self,
        control: socket.socket,
        fresh: FreshState,
        learn: bool,
        hooks: ForkHooks = ForkHooks(),  # noqa: B008 - frozen
    ) -> None:
        self.control = control
        self.fresh = fresh
        self.learn = learn
        self.hooks = hooks
        self.children: dict[int, int] = {}  # pidfd -> pid
        self.learning: dict[int, bytearray] = {}  # read end of a child's module report -> pending bytes
        #: modules to import while nothing else is asked for (an ordered set).
        self.pending: dict[str, None] = {}
        self.forked = False
        self.last_request = time.monotonic()
        self.poller = select.poll()
        self.poller.register(control.fileno(), select.POLLIN)

    def serve(self) -> ChildJob | None:
        """Serve until EOF (None, in the server) or until this process is a freshly forked child (its job)."""
        while True:
            events = self.poller.poll(self._idle_wait())
            if not events:
                self.import_pending()
                continue
            for fd, _ in events:
                if fd == self.control.fileno():
                    try:
                        received = wire.recv(self.control)
                    except ValueError as exc:
                        wire.send(self.control, wire.Failed(None, str(exc)))
                        continue
                    if received is None:
                        self.kill_children()
                        return None
                    job = self.spawn(*received)
                    if job is not None:
                        return job
                elif fd in self.children:
                    self.reap(fd)
                elif fd in self.learning:
                    self.read_learned(fd)

    def _idle_wait(self) -> int | None:
        """Milliseconds ``poll`` may block before pending imports are due; None: no import is due."""
        if not self.pending or not self.forked:
            return None
        return max(0, round((self.last_request + IDLE_BEFORE_IMPORT - time.monotonic()) * 1000))

    def spawn(self, message: wire.Message, fds: list[int]) -> ChildJob | None:
        if not isinstance(message, wire.Spawn) or len(fds) != wire.STDIO_FDS:
            _close(fds)
            reason = f"not a spawn request: {message}"
            wire.send(self.control, wire.Failed(getattr(message, "id", None), reason))
            return None
        self.last_request = time.monotonic()
        if self.last_request > message.deadline:
            # The agent stopped waiting and started the worker by exec: forking it now would make two.
            _close(fds)
            wire.send(self.control, wire.Failed(message.id, "the request expired before the server read it"))
            return None
        if not os.path.isdir(message.cwd):
            _close(fds)
            wire.send(self.control, wire.Failed(message.id, f"no directory {message.cwd}"))
            return None
        learn_r, learn_w = os.pipe() if self.learn else (None, None)
        # Output buffered here must not be written again by the child.
        sys.stdout.flush()
        sys.stderr.flush()
        server_pid = os.getpid()  # taken before the fork: the child's getppid() may already be another
        refused = _run_hooks(self.hooks.before)
        try:
            if refused is not None:
                raise OSError(refused)
            pid = os.fork()
        except OSError as exc:
            _close([*fds, *(x for x in (learn_r, learn_w) if x is not None)])
            _run_hooks(self.hooks.parent)
            wire.send(self.control, wire.Failed(message.id, str(exc)))
            return None
        if pid == 0:
            own = (self.control.fileno(), *self.children, *self.learning, *([learn_r] if learn_r else []))
            return ChildJob(
                message, (fds[0], fds[1], fds[2]), learn_w, self.fresh, server_pid, own, self.hooks.child
            )
        _run_hooks(self.hooks.parent)
        _close(fds)
        self.forked = True
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = pid
        self.poller.register(pidfd, select.POLLIN)
        if learn_r is not None and learn_w is not None:
            os.close(learn_w)
            self.learning[learn_r] = bytearray()
            self.poller.register(learn_r, select.POLLIN)
        wire.send(self.control, wire.Spawned(message.id, pid))
        return None

    def reap(self, pidfd: int) -> None:
        pid = self.children.pop(pidfd)
        self.poller.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        wire.send(self.control, wire.Exited(pid, return_code(status)))

    def read_learned(self, fd: int) -> None:
        chunk = os.read(fd, 1 << 16)
        pending = self.learning[fd]
        pending += chunk
        *lines, rest = bytes(pending).split(b"\n")
        self.learning[fd] = bytearray(rest)
        if not chunk:
            self.poller.unregister(fd)
            os.close(fd)
            del self.learning[fd]
        for name in sorted({n.decode() for n in lines if n} - sys.modules.keys()):
            self.pending[name] = None

    def import_pending(self) -> None:
        """Import pending modules one by one until all are imported or something asks to be served."""
        wire.send(self.control, wire.Importing(tuple(self.pending)))
        done: list[str] = []
        for name in list(self.pending):
            if self.poller.poll(0):
                break  # a request, a child's end or a report: served before the next module
            del self.pending[name]
            if name in sys.modules:
                continue
            done += preload([name])[0]
            unsafe = device_in_use()
            if unsafe:
                # Forking now would hand children a broken device context: stop serving; the agent execs.
                self.refuse(f"{unsafe} initialised by {name}")
        gc.freeze()
        wire.send(self.control, wire.Imported(tuple(done)))

    def refuse(self, reason: str) -> NoReturn:
        wire.send(self.control, wire.Refused(reason))
        self.kill_children()
        _end_server(1)

    def kill_children(self) -> None:
        for pid in self.children.values():
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass  # gone, or its group is gone: nothing left to stop


def _end_server(code: int) -> NoReturn:
    """End the server at once: tearing down a process that imported torch takes a while and helps nobody."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


# --- what runs in a forked child --------------------------------------------------------------------


def _set_name(name: bytes) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)


def _die_with_parent(server_pid: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != server_pid:  # the server died before prctl took effect: die as it would have made us
        os.kill(os.getpid(), signal.SIGKILL)


def _join_job_cgroup(job_cgroup: str | None) -> None:
    """Move into this worker's own cgroup of the job's, where the launcher will look for it.

    Done here, before any user code, so that nothing the worker starts is born outside.
    The launcher moves it there too once it hears of the worker (a failure here costs nothing).
    """
    if not job_cgroup:
        return
    own = os.path.join(job_cgroup, f"w{os.getpid()}")
    try:
        os.makedirs(own, exist_ok=True)
        with open(os.path.join(own, "cgroup.procs"), "w") as f:
            f.write("0")
    except OSError:
        pass


def _stdio(fd: int, write: bool, errors: str, line_buffering: bool, unbuffered: bool) -> io.TextIOWrapper:
    """A standard stream as the interpreter builds it at startup (unbuffered: -u or PYTHONUNBUFFERED)."""
    unbuffered = unbuffered and write
    raw = io.FileIO(fd, "wb" if write else "rb", closefd=False)
    buffer: io.RawIOBase | io.BufferedIOBase
    if unbuffered:
        buffer = raw
    else:
        buffer = io.BufferedWriter(raw) if write else io.BufferedReader(raw)
    encoding = sys.__stdout__.encoding if sys.__stdout__ is not None else "utf-8"
    return io.TextIOWrapper(
        buffer,
        encoding=encoding,
        errors=errors,
        line_buffering=line_buffering and not unbuffered,
        write_through=unbuffered,
    )


def _become_worker(job: ChildJob) -> str | None:
    """Everything of the process that a fresh interpreter would have had differently; a child fork hook's
    error, if one failed."""
    os.setsid()
    _die_with_parent(job.server_pid)
    _set_name(job.request.comm.encode())
    for fd in job.server_fds:
        os.close(fd)
    for target, fd in enumerate(job.stdio):
        if fd != target:
            os.dup2(fd, target)
    for fd in set(job.stdio) - {0, 1, 2}:
        os.close(fd)
    for sig, handler in job.fresh.dispositions.items():
        signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, job.fresh.mask)
    hook_error = _run_hooks(job.child_hooks)
    request = job.request
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    _join_job_cgroup(os.environ.get(wire.SCOPE_CGROUP_ENV))
    out_errors = (sys.__stdout__.errors if sys.__stdout__ is not None else None) or "strict"
    # The server's streams close fds 0-2 when collected: they must outlive the worker's use of them.
    _RETIRED_STDIO.extend((sys.__stdin__, sys.__stdout__, sys.__stderr__, sys.stdin, sys.stdout, sys.stderr))
    unbuffered = job.fresh.unbuffered
    streams = {
        "stdin": _stdio(0, False, out_errors, False, unbuffered),
        "stdout": _stdio(1, True, out_errors, os.isatty(1), unbuffered),
        "stderr": _stdio(2, True, "backslashreplace", True, unbuffered),
    }
    for name, stream in streams.items():
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    sys.argv = list(request.argv)
    sys.orig_argv = list(request.orig_argv)
    if request.path0 is not None:
        sys.path.insert(0, request.path0)
    _reseed()
    if job.learn_fd is not None:
        threading.Thread(
            target=_report_modules, args=(job.learn_fd, job.fresh.installed), name="taskd-learn", daemon=True
        ).start()
    return hook_error


def _reseed() -> None:
    """Fresh seeds for the global generators a fresh process would have seeded from the OS."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def _report_modules(fd: int, installed: Sequence[str]) -> None:
    """Tell the server, a few times early in the worker's life, which installed modules it imported."""
    sent: set[str] = set()
    started = time.monotonic()
    try:
        for at in LEARN_AFTER:
            time.sleep(max(0.0, started + at - time.monotonic()))
            new = []
            for name, module in list(sys.modules.items()):
                path = getattr(module, "__file__", None)
                if name not in sent and isinstance(path, str) and path.startswith(tuple(installed)):
                    new.append(name)
            sent.update(new)
            if new:
                os.write(fd, "".join(f"{n}\n" for n in new).encode())
    except OSError:
        pass  # the server is gone: nothing to learn for
    finally:
        os.close(fd)


def _run_main(request: wire.Spawn) -> None:
    """Run the script or module as ``__main__``, the way the interpreter's own startup does."""
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    if request.module is not None:
        import runpy

        runpy._run_module_as_main(request.module, alter_argv=True)  # type: ignore[attr-defined]
        return
    from importlib.machinery import SourceFileLoader

    path = request.file
    assert path is not None
    main.__dict__.update(__file__=path, __cached__=None, __loader__=SourceFileLoader("__main__", path))
    main.__dict__["__builtins__"] = sys.modules["builtins"]
    with io.open_code(path) as f:
        source = f.read()
    exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)  # noqa: S102 - the job's script, as python runs it


def _trim(exc: BaseException) -> types.TracebackType | None:
    """Drop this module's frames from the exception's traceback (a fresh interpreter has none of them)."""
    tb = exc.__traceback__
    here = _trim.__code__.co_filename
    while tb is not None and tb.tb_frame.f_code.co_filename == here:
        tb = tb.tb_next
    exc.with_traceback(tb)
    return tb


def run_child(job: ChildJob) -> int:
    """The worker's whole life; ends the process the way the interpreter would."""
    hook_error = _become_worker(job)
    if hook_error is not None:
        print(f"taskd fork server: {hook_error}", file=sys.stderr)
        return 1
    try:
        _run_main(job.request)
    except SystemExit:
        raise  # the interpreter's own handling: exit code, message, then atexit
    except KeyboardInterrupt as exc:
        sys.excepthook(type(exc), exc, _trim(exc))
        # Python ends an uncaught KeyboardInterrupt by dying of SIGINT, after its cleanup.
        threading._shutdown()  # type: ignore[attr-defined]
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 128 + signal.SIGINT
    except BaseException as exc:  # noqa: BLE001 - exactly what the interpreter does with an uncaught one
        sys.excepthook(type(exc), exc, _trim(exc))
        return 1
    return 0


# --- entry --------------------------------------------------------------------------------------------


def _names(text: str) -> list[str]:
    return [m for m in text.split(",") if m]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="TaskD fork server (started by the node agent)")
    p.add_argument("--fd", type=int, required=True, help="the control socket inherited from the agent")
    p.add_argument("--preload", default="", help="modules to import before serving, comma separated")
    p.add_argument("--hooks", default="", help="modules with the framework's code around each fork")
    p.add_argument("--learn", action="store_true", help="also import the installed modules workers import")
    args = p.parse_args(argv)
    fresh = FreshState.now()
    _set_name(wire.SERVER_NAME)
    # This file's directory is sys.path[0]: it must not shadow anything; each child sets its own.
    del sys.path[0]
    control = socket.socket(fileno=args.fd)
    try:
        job = _start_serving(control, args, fresh)
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the agent is gone (closed, or SIGKILLed with its launcher): nobody to serve
    if job is None:
        _end_server(0)
    end_child(job)


def _start_serving(control: socket.socket, args: argparse.Namespace, fresh: FreshState) -> ChildJob | None:
    """Preload, say ready and serve: None once the agent is gone, in a forked child its job."""
    done, failed = preload(_names(args.preload))
    try:
        hooks = ForkHooks.load(_names(args.hooks))
    except BaseException as exc:  # noqa: BLE001 - without the framework's hooks, a fork is unsafe
        wire.send(control, wire.Refused(f"a fork hook module failed to import: {type(exc).__name__}: {exc}"))
        _end_server(1)
    unsafe = device_in_use()
    if unsafe:
        wire.send(control, wire.Refused(f"{unsafe} was initialised while preloading"))
        _end_server(1)
    warnings.filterwarnings(
        "ignore", message=".*use of fork\\(\\) may lead to deadlocks", category=DeprecationWarning
    )
    gc.freeze()  # objects from the preload are shared copy-on-write; the collector must not touch them
    wire.send(control, wire.Ready(os.getpid(), tuple(done), failed))
    server = Server(control, fresh, args.learn, hooks)
    try:
        return server.serve()
    except (BrokenPipeError, ConnectionResetError):
        server.kill_children()
        raise


def end_child(job: ChildJob) -> NoReturn:
    """Run the worker, then end as the interpreter would up to its final teardown, which is skipped.

    Threads are joined, ``atexit`` handlers run and stdio is flushed; the
    teardown of every remaining object is not done: a forked worker's gloo
    process group hung there (its device joins a transport thread that never
    ends), as forked ``multiprocessing`` children also skip it.
    """
    try:
        code = run_child(job)
    except SystemExit as exc:
        code = _exit_status(exc)
    threading._shutdown()  # type: ignore[attr-defined]
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _exit_status(exc: SystemExit) -> int:
    """What the interpreter makes of an uncaught ``SystemExit``: None 0, an int itself, else shown and 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
