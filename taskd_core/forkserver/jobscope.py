"""Every process of one launcher's job, including those that left their worker's process group.

A worker's process group is not a boundary: a child that calls ``setsid()`` (a
daemonized helper, ``subprocess.Popen(start_new_session=True)``) leaves it, and
a group signal no longer reaches it. :class:`JobScope` tracks the job's processes by
two things a child keeps whatever it does to its session:

- a **cgroup v2** directory per job (``taskd-<launcher's owner tag>-<token>`` beside the launcher's own
  cgroup), with one child cgroup per worker, where the machine lets the launcher make one (a
  writable cgroup2 hierarchy: root, or a delegated subtree). Every process a worker
  starts is born in its cgroup and an unprivileged one cannot leave it; ``cgroup.kill``
  ends the whole subtree at once. A fork server's worker moves itself in before running
  any user code; an exec'd worker is moved by the launcher right after its start, so a
  child it forks in the first microseconds may stay outside, where the marker finds it.
- an **environment marker**, ``TASKD_SCOPE``, set in the launcher's environment so that
  every worker and whatever it execs inherits it (``/proc/<pid>/environ``). It is the
  whole mechanism where no cgroup can be made; a process that execs with a scrubbed
  environment leaves it, which ``docs/security.md`` says.

Why not only ``PR_SET_CHILD_SUBREAPER`` in the launcher: orphans would stay its
descendants, but nothing would say which worker they came from, the launcher (whose
children are reaped by ``Popen`` per pid) would collect their zombies, and after a
SIGKILL of the launcher they are init's again: the lifeline's guard, which ends the
scope then, needs a name for them that outlives the launcher. The cgroup and the
marker are such names.

Standard library only, and nothing the lifeline's guard needs beyond what it is sent:
it reads the same files itself.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import time
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

#: The environment variable carrying the scopes a process belongs to (``:``-separated tokens:
#: a launcher started inside another job's worker adds its own).
SCOPE_ENV = "TASKD_SCOPE"
#: Bound on waiting for killed processes to disappear (SIGKILL cannot be caught: only a process
#: stuck in the kernel takes longer).
_KILL_GRACE = 10.0
_POLL = 0.02


def _own_cgroup_dir() -> tuple[Path | None, str]:
    """This process's cgroup v2 directory, or None and why not."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError as exc:
        return None, f"cannot read /proc: {exc}"
    path = next((line[3:] for line in lines if line.startswith("0::")), None)
    if path is None:
        return None, "this process is in no cgroup v2 hierarchy"
    for mount in mounts:
        before, _, after = mount.partition(" - ")
        if after.split(" ", 1)[0] == "cgroup2":
            # mountinfo: the mount's root within the hierarchy (field 4), then its mount point (field 5).
            fields = before.split()
            root, point = fields[3], fields[4]
            relative = os.path.relpath(path, root)
            if relative.startswith(".."):
                return None, f"this process's cgroup {path} is outside the mounted cgroup2 hierarchy"
            return Path(point, relative).resolve(), ""
    return None, "no cgroup2 hierarchy is mounted"


def _make_job_cgroup(token: str) -> tuple[Path | None, str]:
    """A new cgroup for the job beside the launcher's own, or None and why not."""
    own, why = _own_cgroup_dir()
    if own is None:
        return None, why
    _remove_abandoned(own)
    job = own / f"taskd-{owner_tag()}-{token}"
    try:
        job.mkdir()
    except OSError as exc:
        return None, f"cannot make a cgroup in {own}: {exc.strerror}"
    if not (job / "cgroup.kill").exists():  # the root cgroup has none: asked of the new one
        job.rmdir()
        return None, f"cgroups in {own} have no cgroup.kill (Linux before 5.14)"
    return job, ""


def _remove_abandoned(parent: Path) -> None:
    """Remove the empty job cgroups in ``parent`` whose launcher is gone.

    A launcher and its guard lost together (a node's whole process tree killed) leave their
    job's cgroup behind; an empty cgroup costs little, but they would pile up. One still
    populated is kept (rmdir refuses it), as is one whose launcher runs.
    """
    for entry in abandoned(parent, "taskd-"):
        _remove(entry)


def _start_time(pid: int) -> str:
    """When ``pid`` started (clock ticks after boot, ``/proc/<pid>/stat`` field 22); empty once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return ""
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else ""


def _pid_namespace() -> str:
    """This process's pid namespace (the inode of ``/proc/self/ns/pid``); empty when unknown."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def owner_tag() -> str:
    """``<pid>.<start time>.<pid namespace>`` of this process, for the names of what it must not leave behind.

    With the start time a reused pid is not taken for the owner, and with the namespace the
    pids of another one (a container sharing the directory) are not judged (:func:`abandoned`).
    """
    pid = os.getpid()
    return f"{pid}.{_start_time(pid)}.{_pid_namespace()}"


def abandoned(parent: Path, prefix: str) -> list[Path]:
    """The entries of ``parent`` named ``<prefix><owner tag>-…`` whose owner, of this pid namespace, is gone.

    Gone: its pid runs no more, or runs a process that started at another time. A tag of a pid
    alone (older names) counts as gone only once that pid runs no more.
    """
    try:
        entries = list(parent.iterdir())
    except OSError:
        return []
    namespace = _pid_namespace()
    out = []
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        tag = entry.name[len(prefix) :].split("-", 1)
        pid, started, space = (tag[0].split(".") + ["", ""])[:3]
        if len(tag) != 2 or not pid.isdigit() or not (started.isdigit() or not started):
            continue
        if space and space != namespace:
            continue  # another namespace's pids mean other processes: not ours to judge
        now = _start_time(int(pid))
        if not now or (started and now != started):
            out.append(entry)
    return out


def _write(path: Path, text: str) -> bool:
    try:
        path.write_text(text)
    except OSError:
        return False
    return True


def _procs(cgroup: Path) -> list[int]:
    """The processes of ``cgroup`` and of every cgroup below it."""
    found: list[int] = []
    for here, _dirs, _files in os.walk(cgroup):
        try:
            found += [int(pid) for pid in Path(here, "cgroup.procs").read_text().split()]
        except OSError:
            continue  # removed while we looked
    return found


def _carries(pid: int, token: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:  # gone, or another user's
        return False
    prefix = SCOPE_ENV.encode() + b"="
    values = (entry[len(prefix) :] for entry in environ.split(b"\0") if entry.startswith(prefix))
    return any(token in value.split(b":") for value in values)


def _stat(pid: int) -> tuple[str, int] | None:
    """The state letter and parent pid of ``pid``, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields start after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[0], int(fields[1])


def marked(token: str) -> list[int]:
    """The live processes whose environment carries scope ``token``, except the caller and its children.

    The caller's own children are its workers, stopped by their groups, and its helpers (a fork
    server, a snapshot keeper), which carry the marker but are the launcher's to end; an escaped
    process is someone else's child once its parent, a worker, is gone.
    """
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        stat = _stat(int(entry))
        if stat is not None and stat[0] != "Z" and stat[1] != me and _carries(int(entry), token.encode()):
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def end(cgroups: Iterable[Path], token: str | None) -> list[int]:
    """SIGKILL every process of ``cgroups`` (and below) and, with ``token``, every one it marks; the pids.

    Returns once they are gone (or after a bound, for one stuck in the kernel); emptied
    cgroups are removed. The lifeline's guard calls this too, loading this file by path.
    """
    killed: set[int] = set()
    for cgroup in cgroups:
        if cgroup.is_dir():
            killed.update(_procs(cgroup))
            _write(cgroup / "cgroup.kill", "1")
    if token is not None:
        for pid in marked(token):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
            killed.add(pid)
    deadline = time.monotonic() + _KILL_GRACE
    while any(_alive(pid) for pid in killed) and time.monotonic() < deadline:
        time.sleep(_POLL)
    # A killed process leaves its cgroup a moment after it stops running (once its memory is
    # released): until then the cgroup is still populated and cannot be removed (EBUSY).
    left = [cgroup for cgroup in cgroups if not _remove(cgroup)]
    while left and time.monotonic() < deadline:
        time.sleep(_POLL)
        left = [cgroup for cgroup in left if not _remove(cgroup)]
    return sorted(killed)


def _remove(cgroup: Path) -> bool:
    """Remove ``cgroup`` and the cgroups below it, children first; whether none is left."""
    for here, _dirs, _files in sorted(os.walk(cgroup), key=lambda walked: -len(walked[0])):
        try:
            os.rmdir(here)
        except FileNotFoundError:
            continue
        except OSError:  # still populated
            return False
    return True


class JobScope:
    """One launcher's job: its cgroup (if the machine allows one) and its environment marker.

    :meth:`install` puts the marker into this process's environment, so that every
    process started afterwards carries it; :meth:`close` takes it out again.

    :param cgroup_env: the environment variable that names the job's cgroup to the processes this
        one starts (a fork server's worker joins it itself, before any user code runs).
    :param cgroup: False tracks the job by the marker alone, even where a cgroup could be made.
    """

    def __init__(self, cgroup_env: str | None = None, cgroup: bool = True) -> None:
        self.token = secrets.token_hex(8)
        self._cgroup_env = cgroup_env
        self.cgroup, why = _make_job_cgroup(self.token) if cgroup else (None, "not asked to use a cgroup")
        if self.cgroup is None:
            logger.info("the job's processes are tracked by their environment only: %s", why)
        else:
            logger.debug("the job's processes are tracked in cgroup %s", self.cgroup)
        self._before: dict[str, str | None] = {}

    def install(self) -> None:
        """Mark every process this one starts from now on."""
        outer = os.environ.get(SCOPE_ENV)
        marks = {SCOPE_ENV: self.token if not outer else f"{outer}:{self.token}"}
        if self.cgroup is not None and self._cgroup_env is not None:
            marks[self._cgroup_env] = str(self.cgroup)
        self._before = {name: os.environ.get(name) for name in marks}
        os.environ.update(marks)

    def enter(self, pid: int) -> None:
        """Put worker ``pid`` (and so whatever it starts later) into a cgroup of its own in the job's."""
        if self.cgroup is None:
            return
        own = self.cgroup / f"w{pid}"
        try:
            own.mkdir(exist_ok=True)
        except OSError as exc:
            logger.warning("cannot make the cgroup of pid %s: %s", pid, exc.strerror)
            return
        # A worker that already ended cannot move (ESRCH): nothing of it is left to track.
        _write(own / "cgroup.procs", str(pid))

    def sweep(self, pids: Iterable[int] | None = None) -> list[int]:
        """SIGKILL what is left of workers ``pids`` (of the whole job when None); the pids killed.

        Call it once those workers' groups were stopped: it ends what left them. With a
        cgroup, each worker's own is emptied and removed (a few microseconds, on the path of
        every restart); without one, the marker, which does not say which worker a process
        came from, ends what the whole job left once none of its workers runs (a scan of
        ``/proc``: 25 ms among 140 processes on a loaded machine).
        """
        if self.cgroup is None:
            return self._ended(end([], self.token) if pids is None else [])
        if pids is None:
            cgroups = [c for c in self.cgroup.iterdir() if c.is_dir()] if self.cgroup.is_dir() else []
        else:
            cgroups = [self.cgroup / f"w{pid}" for pid in pids]
        return self._ended(end(cgroups, None))

    def close(self) -> None:
        """End every process of the job still running (by cgroup and by marker), remove its cgroup,
        unmark this process."""
        self._ended(end([] if self.cgroup is None else [self.cgroup], self.token))
        if self.cgroup is not None and self.cgroup.is_dir():
            logger.warning("cgroup %s left behind: a process in it outlived SIGKILL", self.cgroup)
        for name, value in self._before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._before = {}

    @staticmethod
    def _ended(killed: list[int]) -> list[int]:
        if killed:
            logger.warning(
                "ended %s process(es) the job's workers left behind outside their process groups: %s",
                len(killed),
                " ".join(map(str, killed)),
            )
        return killed
