"""The lifeline guard, with real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from taskd_core import testing
from taskd_core.forkserver.lifeline import Lifeline
from taskd_core.testing import process_running, wait_gone

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


def test_an_orderly_close_ends_the_guard_and_leaves_other_processes_alone() -> None:
    """The guard kills nothing on close; the scope ends only the job's own processes (this one was
    neither started after the lifeline nor adopted)."""
    outsider = subprocess.Popen(SLEEP, start_new_session=True)
    try:
        lifeline = Lifeline()
        lifeline.close()
        assert not process_running(lifeline.guard_pid)
        assert outsider.poll() is None
    finally:
        outsider.kill()
        outsider.wait()


_LAUNCHER = """
import subprocess, sys
from taskd_core.forkserver.lifeline import Lifeline
# Started first and tracked by the marker alone: only the guard's group kill could reach it.
freed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
lifeline = Lifeline(cgroup=False)
kept = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
lifeline.adopt(kept.pid)
lifeline.adopt(freed.pid)
lifeline.release(freed.pid)
print(kept.pid, freed.pid, flush=True)
import time; time.sleep(120)
"""


def test_the_guard_kills_adopted_groups_when_the_launcher_is_sigkilled() -> None:
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    kept, freed = map(int, launcher.stdout.readline().split())
    try:
        launcher.kill()
        launcher.wait()
        wait_gone([kept], "the adopted group", 10.0)
        assert process_running(freed)  # released: never touched
    finally:
        for pid in (kept, freed):
            if process_running(pid):
                os.kill(pid, signal.SIGKILL)


#: argv: CGROUP (1/0). A launcher with one adopted worker; the worker leaves two children in
#: sessions of their own (one exec'd, one only forked) and a temporary directory of the launcher
#: exists. Prints the worker's and the children's pids, the directory and the job's cgroup.
_ESCAPING_LAUNCHER = """
import os, subprocess, sys, time
from taskd_core.forkserver.lifeline import Lifeline
from taskd_core.scratch import scratch_dir
lifeline = Lifeline(cgroup=sys.argv[1] == "1")
worker = subprocess.Popen([sys.executable, "-c", '''
import os, subprocess, sys, time
exec_child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        time.sleep(120)
    os._exit(0)
print(os.getpid(), exec_child.pid, os.read(r, 20).decode(), flush=True)
time.sleep(120)
'''], start_new_session=True, stdout=subprocess.PIPE, text=True)
lifeline.adopt(worker.pid)
print(worker.stdout.readline().strip(), scratch_dir("progress"), lifeline.scope.cgroup, flush=True)
time.sleep(120)
"""


def _cgroup_param(use: bool) -> object:
    from taskd_core.forkserver.jobscope import JobScope

    scope = JobScope(cgroup=use)
    try:
        usable = scope.cgroup is not None
    finally:
        scope.close()
    reason = "no writable cgroup v2 hierarchy here (the marker-only path is tested beside)"
    return pytest.param(
        use,
        id="cgroup" if use else "marker",
        marks=[] if usable or not use else [pytest.mark.skip(reason=reason)],
    )


@pytest.mark.parametrize("use_cgroup", [_cgroup_param(True), _cgroup_param(False)])
def test_the_guard_ends_escaped_processes_and_temp_dirs_of_a_sigkilled_launcher(use_cgroup: bool) -> None:
    """setsid() children of a worker, exec'd or only forked, and the launcher's temporary directories
    are gone once a SIGKILLed launcher's guard ran; so is the job's cgroup."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", _ESCAPING_LAUNCHER, "1" if use_cgroup else "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert launcher.stdout is not None
    *pids, scratch, cgroup = launcher.stdout.readline().split()
    procs = [int(pid) for pid in pids]
    try:
        assert all(process_running(pid) for pid in procs) and os.path.isdir(scratch)
        assert (cgroup != "None") == use_cgroup
        launcher.kill()
        launcher.wait()
        wait_gone(procs, "the worker and its escaped children", 30.0)
        testing.wait_until(lambda: not os.path.exists(scratch), "the launcher's temp dir to go", 30.0)
        testing.wait_until(
            lambda: cgroup == "None" or not os.path.exists(cgroup), "the job's cgroup to go", 30.0
        )
    finally:
        for pid in procs:
            if process_running(pid):
                os.kill(pid, signal.SIGKILL)


_WORKER_WITH_ESCAPEE = [
    sys.executable,
    "-c",
    "import subprocess, sys, time\n"
    "sys.stdin.readline()\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
    "print(child.pid, flush=True); time.sleep(120)",
]


@pytest.mark.parametrize("use_cgroup", [_cgroup_param(True), _cgroup_param(False)])
def test_sweep_ends_what_stopped_workers_left_and_close_ends_the_rest(use_cgroup: bool) -> None:
    """sweep(pids) ends what those workers left outside their groups (a cgroup says whose; the marker
    only knows the job's); sweep() and close() end every process of the job that left its group."""
    lifeline = Lifeline(cgroup=use_cgroup)
    workers = [
        subprocess.Popen(
            _WORKER_WITH_ESCAPEE,
            start_new_session=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for worker in workers:
            lifeline.adopt(worker.pid)
            assert worker.stdin is not None
            worker.stdin.write("go\n")  # only once adopted: an exec'd worker is moved just after its start
            worker.stdin.close()
        escapees = [int(w.stdout.readline()) for w in workers if w.stdout is not None]
        os.killpg(workers[0].pid, signal.SIGKILL)  # the worker's group: its escapee is not in it
        workers[0].wait()
        assert process_running(escapees[0])
        lifeline.sweep([workers[0].pid])
        if use_cgroup:
            assert not process_running(escapees[0])
        assert process_running(escapees[1]) and workers[1].poll() is None
        lifeline.sweep()  # a worker itself is the launcher's child: its group is the launcher's to stop
        assert not [pid for pid in escapees if process_running(pid)]
    finally:
        lifeline.close()
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
            worker.wait()


def test_a_new_scope_removes_empty_job_cgroups_whose_launcher_is_gone() -> None:
    """A launcher killed with its guard (a node's whole tree) leaves its cgroup; the next one removes it
    if it is empty and its launcher's pid is gone, and keeps a live launcher's."""
    from taskd_core.forkserver.jobscope import JobScope

    probe = JobScope()
    if probe.cgroup is None:
        probe.close()
        pytest.skip("no writable cgroup v2 hierarchy here")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    abandoned = probe.cgroup.parent / f"taskd-{gone.pid}-0123456789abcdef"
    (abandoned / "w1").mkdir(parents=True)
    try:
        scope = JobScope()
        scope.close()
        assert not abandoned.exists()
        assert probe.cgroup.is_dir()  # this process's own: kept
    finally:
        probe.close()
        for path in (abandoned / "w1", abandoned):
            if path.exists():
                path.rmdir()
