"""Processes that leave their worker's process group (``setsid``) end with the worker's stop, the
job's end and a SIGKILLed ``taskd run`` (issue 28, finding 6)."""

from __future__ import annotations

import glob
import os
import signal
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from taskd_core import testing
from taskd_core.forkserver.jobscope import JobScope

from .harness import Cluster, TaskdRun, job_processes, wait_until, worker_command

#: argv: OUT MODE. Each start leaves OUT/start-<rank>-<restart>-<pid> and two grandchildren in
#: sessions of their own (one exec'd by subprocess, one only forked), each writing
#: OUT/escaped-<rank>-<restart>-<pid>; with "scrubbed" the exec'd one drops the whole
#: environment. Then "finish" exits 0, "wait" runs until OUT/finish appears.
WORKER = textwrap.dedent(
    """
    import os, pathlib, subprocess, sys, time
    out, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
    tag = f"{os.environ['RANK']}-{os.environ['TASKD_RESTART_COUNT']}"
    sleeper = "import os, pathlib, sys, time; pathlib.Path(sys.argv[1], f'escaped-' + sys.argv[2] + f'-{os.getpid()}').touch(); time.sleep(300)"
    subprocess.Popen([sys.executable, "-c", sleeper, str(out), tag], start_new_session=True,
                     env={} if mode == "scrubbed" else None)
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            (out / f"escaped-{tag}-{os.getpid()}").touch()
            time.sleep(300)
        os._exit(0)
    (out / f"start-{tag}-{os.getpid()}").touch()
    deadline = time.monotonic() + (0.5 if mode == "finish" else 200)
    while time.monotonic() < deadline and not (out / "finish").exists():
        time.sleep(0.05)
    """
)


def worker(tmp_path: Path, mode: str) -> list[str]:
    return worker_command(tmp_path, WORKER, mode)


def files(tmp_path: Path, kind: str) -> dict[str, list[int]]:
    """{"<rank>-<restart>": [pids]} of the ``kind`` files (start, escaped) so far."""
    found: dict[str, list[int]] = {}
    for path in (tmp_path / "out").glob(f"{kind}-*"):
        _, rank, restart, pid = path.name.split("-")
        found.setdefault(f"{rank}-{restart}", []).append(int(pid))
    return found


def escaped(tmp_path: Path, tags: list[str]) -> list[int]:
    return sorted(pid for tag, pids in files(tmp_path, "escaped").items() if tag in tags for pid in pids)


def running(pids: list[int]) -> list[int]:
    return [pid for pid in pids if testing.process_running(pid)]


@pytest.fixture(autouse=True)
def _end_escaped(tmp_path: Path) -> Iterator[None]:
    """Whatever the test's outcome, no escaped child outlives it (the scrubbed ones carry no job id)."""
    yield
    for pid in running(escaped(tmp_path, list(files(tmp_path, "escaped")))):
        os.kill(pid, signal.SIGKILL)


def scratch_dirs(launcher_pid: int) -> list[str]:
    """The temporary directories launcher ``launcher_pid`` made (``taskd_core.scratch``)."""
    return glob.glob(os.path.join(tempfile.gettempdir(), f"taskd-*-{launcher_pid}-*"))


def cgroups_here() -> bool:
    scope = JobScope()
    try:
        return scope.cgroup is not None
    finally:
        scope.close()


#: Workers forked warm from the fork server (the default), or started by exec.
WARMTH = pytest.mark.parametrize("warmth", [[], ["--no-fork-server"]], ids=["forked", "exec"])


@WARMTH
def test_escaped_children_of_a_stopped_worker_end_with_the_recovery(
    tmp_path: Path, cluster: Cluster, warmth: list[str]
) -> None:
    """A recovery restarts both workers: what the first ones left in their own sessions is gone."""
    run = cluster.node(0, 1, 2, worker(tmp_path, "wait"), *warmth)
    wait_until(
        "both workers and their 4 escaped children",
        lambda: len(escaped(tmp_path, ["0-0", "1-0"])) == 4,
        cluster,
    )
    first = escaped(tmp_path, ["0-0", "1-0"])
    assert running(first) == first
    os.kill(files(tmp_path, "start")["1-0"][0], signal.SIGKILL)
    wait_until(
        "the restarted workers' escaped children",
        lambda: len(escaped(tmp_path, ["0-1", "1-1"])) == 4,
        cluster,
    )
    assert running(first) == [], run.output()
    (tmp_path / "out" / "finish").touch()
    assert run.wait() == 0, run.output()
    assert running(escaped(tmp_path, ["0-1", "1-1"])) == []


@WARMTH
def test_escaped_children_end_with_the_job(tmp_path: Path, cluster: Cluster, warmth: list[str]) -> None:
    """Workers exit 0 and leave children in their own sessions: `taskd run` ends them before it exits."""
    run = cluster.node(0, 1, 2, worker(tmp_path, "finish"), *warmth)
    assert run.wait() == 0, run.output()
    left = escaped(tmp_path, ["0-0", "1-0"])
    assert len(left) == 4
    assert running(left) == []
    assert "left behind outside their process groups" in run.output()
    assert scratch_dirs(run.proc.pid) == []


@pytest.mark.parametrize("mode", ["wait", "scrubbed"])
@WARMTH
def test_escaped_children_end_with_a_sigkilled_launcher(
    tmp_path: Path, cluster: Cluster, warmth: list[str], mode: str
) -> None:
    """SIGKILL of `taskd run`: its lifeline's guard ends the escaped children too (with a cgroup, even
    one that dropped its whole environment)."""
    if mode == "scrubbed" and not cgroups_here():
        pytest.skip("no writable cgroup v2 hierarchy here: only the environment marker tracks the job")
    run: TaskdRun = cluster.node(0, 1, 2, worker(tmp_path, mode), *warmth)
    wait_until("4 escaped children", lambda: len(escaped(tmp_path, ["0-0", "1-0"])) == 4, cluster)
    left = escaped(tmp_path, ["0-0", "1-0"])
    assert scratch_dirs(run.proc.pid) != []  # the hang watcher's
    run.proc.kill()
    run.wait()
    testing.wait_until(
        lambda: not running(left),
        "the guard to end the escaped children",
        30.0,
        explain=lambda: f"left: {running(left)}",
    )
    testing.wait_until(lambda: not job_processes(cluster.job_id), "the guard to end every job process", 30.0)
    testing.wait_until(
        lambda: not scratch_dirs(run.proc.pid), "the guard to remove the temporary directories", 30.0
    )
