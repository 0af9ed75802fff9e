"""Warm msrun restarts without a MindSpore job: the heartbeat default, the fallbacks, the Popen stand-in,
the forked scheduler, and what the forked processes see (``taskd_mindspore.warm``, ``.forkhooks``)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from ms_support import WORKER, FakeMsrun

from taskd_core.errors import ConfigError
from taskd_core.forkserver import ForkServerSettings
from taskd_core.forkserver.client import ForkedProcess
from taskd_core.testing import process_running, wait_until
from taskd_mindspore.callbacks import CallbackRegistry, MsrunCallbacks
from taskd_mindspore.scheduler import Scheduler, find_scheduler
from taskd_mindspore.warm import (
    FORK_SERVER_ENV,
    HEARTBEAT_ENV,
    WarmStarts,
    _ForkingSubprocess,
    process_environment,
    quick_heartbeat,
    why_not,
)

NO_PRELOAD = ForkServerSettings(preload=(), learn=False, ready_timeout=60.0)


def _callbacks(fake: FakeMsrun) -> MsrunCallbacks:
    registry = CallbackRegistry()
    for name, func in fake.callbacks().items():
        registry.register(name, func)
    return registry.complete()


@pytest.fixture
def warm(tmp_path: Path) -> Iterator[WarmStarts]:
    """Warm starts of this interpreter's scripts, with a fork server that preloads nothing."""
    (tmp_path / "job.py").touch()
    starts = WarmStarts([sys.executable, str(tmp_path / "job.py")], NO_PRELOAD)
    try:
        yield starts
    finally:
        starts.close()


def test_quick_heartbeat_sets_both_bounds_unless_the_user_set_one() -> None:
    """Neither set: both become 1. Either set: nothing changes, the other bound stays MindSpore's default."""
    env: dict[str, str] = {}
    assert quick_heartbeat(env) and env == {k: "1" for k in HEARTBEAT_ENV}
    user = {"MS_RETRY_INTERVAL_UPPER": "9"}
    assert not quick_heartbeat(user) and user == {"MS_RETRY_INTERVAL_UPPER": "9"}
    blank = {"MS_RETRY_INTERVAL_LOWER": " "}
    assert quick_heartbeat(blank) and blank == {k: "1" for k in HEARTBEAT_ENV}


def test_msruns_own_starts_stay_when_warm_starts_do_not_fit(
    msrun_like: FakeMsrun, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Switched off, another MindSpore, or callbacks that are not msrun's: None, said once in the log."""
    callbacks = _callbacks(msrun_like)
    assert why_not(callbacks, {FORK_SERVER_ENV: "0"}) == f"{FORK_SERVER_ENV}=0"
    with pytest.raises(ConfigError, match="TASKD_FORK_SERVER: 'off' is neither 0 .msrun's own starts. nor 1"):
        why_not(callbacks, {FORK_SERVER_ENV: "off"})
    monkeypatch.setitem(sys.modules, "mindspore", types.SimpleNamespace(__version__="2.9.1"))
    assert "MindSpore 2.9.1 is not the 2.10.x" in str(why_not(callbacks, {}))
    monkeypatch.setitem(sys.modules, "mindspore", types.SimpleNamespace(__version__="2.10.0"))
    assert "not those of msrun's process manager" in str(why_not(callbacks, {}))
    with caplog.at_level("WARNING", logger="taskd_mindspore.warm"):
        assert WarmStarts.install(callbacks, {}) is None
    assert [r.getMessage() for r in caplog.records] == [
        "msrun starts its workers itself (no fork server): the callbacks are not those of msrun's process manager"
    ]


def test_the_popen_stand_in_forks_only_msruns_worker_starts(tmp_path: Path, warm: WarmStarts) -> None:
    """Popen(cmd, preexec_fn=os.setsid, stdout=log, stderr=STDOUT) is forked (its own session, the C library's
    environment, the log file msrun opened); any other call, and every other name, is the real subprocess's."""
    script = tmp_path / "w.py"
    script.write_text("import os, sys; print(os.getsid(0) == os.getpid(), os.environ.get('TASKD_C_ONLY')); sys.exit(3)")
    shim = _ForkingSubprocess(subprocess, warm)
    libc = ctypes.CDLL(None)
    libc.setenv(b"TASKD_C_ONLY", b"yes", 1)  # as import mindspore sets OMP_NUM_THREADS: os.environ never sees it
    try:
        with open(tmp_path / "worker.log", "w") as log:
            worker = shim.Popen([sys.executable, str(script)], preexec_fn=os.setsid, stdout=log, stderr=shim.STDOUT)
    finally:
        libc.unsetenv(b"TASKD_C_ONLY")
    assert isinstance(worker, ForkedProcess) and worker.wait(60) == 3
    assert (tmp_path / "worker.log").read_text() == "True yes\n"
    other = shim.Popen([sys.executable, "-c", "pass"], stdout=subprocess.DEVNULL)
    assert isinstance(other, subprocess.Popen) and other.wait(60) == 0
    assert shim.run is subprocess.run


def test_process_environment_is_the_c_librarys() -> None:
    libc = ctypes.CDLL(None)
    libc.setenv(b"TASKD_C_ONLY", b"1", 1)
    try:
        assert process_environment()["TASKD_C_ONLY"] == "1" and "TASKD_C_ONLY" not in os.environ
    finally:
        libc.unsetenv(b"TASKD_C_ONLY")
    assert {k: v for k, v in process_environment().items() if k in os.environ} == dict(os.environ)


def test_a_forked_scheduler_is_replaced_from_the_command_msrun_used(tmp_path: Path, warm: WarmStarts) -> None:
    """The first replacement reads msrun's scheduler from /proc; later ones, forked (their /proc shows the fork
    server), reuse that command; one that died with its fork server is started again; finish ends it."""
    script = tmp_path / "sched.py"
    script.write_text(WORKER)
    # As msrun starts it: Popen without env, i.e. the C library's environment (which the fork server has too).
    original = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), "-1"], env={**process_environment(), "MS_ROLE": "MS_SCHED"}
    )
    scheduler = Scheduler(start=warm.start_scheduler)
    try:
        wait_until(lambda: find_scheduler(os.getpid()) is not None, what="msrun's scheduler")
        assert scheduler.restart(10.0) and not process_running(original.pid)  # and reaped: its Popen sees no status
        first = scheduler._own
        assert isinstance(first, ForkedProcess) and process_running(first.pid)
        assert scheduler.restart(10.0)
        second = scheduler._own
        assert isinstance(second, ForkedProcess) and second.pid != first.pid and first.poll() == -9
        os.kill(second.pid, 9)  # as PR_SET_PDEATHSIG does when its fork server dies
        second.wait(10)
        assert scheduler.restart(10.0)
        third = scheduler._own
        assert third is not None and third.pid != second.pid and process_running(third.pid)
        (tmp_path / "release").touch()
        scheduler.finish(30.0, 10.0)
        assert third.poll() == 0
    finally:
        (tmp_path / "release").touch()
        scheduler.finish(10.0, 5.0)
        if original.poll() is None:
            original.kill()
            original.wait()


def test_without_a_scheduler_nothing_is_started(warm: WarmStarts) -> None:
    assert not Scheduler(start=warm.start_scheduler).restart(1.0)


def test_importing_the_fork_hooks_brings_no_taskd_core_along() -> None:
    """The fork server imports taskd_mindspore.forkhooks: the package __init__ must stay empty of imports."""
    code = "import sys, taskd_mindspore.forkhooks; print(sorted(m for m in sys.modules if m.startswith('taskd')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['taskd_mindspore', 'taskd_mindspore.forkhooks']"
    import taskd_mindspore

    assert taskd_mindspore.MSRunPlugin.__name__ == "MSRunPlugin"
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        taskd_mindspore.nothing  # noqa: B018


def test_the_dump_request_is_a_flag_set_by_the_dump_signal(tmp_path: Path) -> None:
    """DumpRequest installs SIGUSR1; dump_callback saves and stops training at the end of that step."""
    code = textwrap.dedent(
        """
        import os, signal, sys, types
        calls = []
        class Callback: pass
        sys.modules["mindspore"] = types.ModuleType("mindspore")
        sys.modules["mindspore.train"] = types.SimpleNamespace(Callback=Callback)
        from taskd_mindspore.dump import DumpRequest, dump_callback
        request = DumpRequest()
        callback = dump_callback(lambda params: calls.append(("save", params)), request)
        class Context:
            def original_args(self): return "params"
            def request_stop(self): calls.append("stop")
        callback.on_train_step_end(Context())
        before = list(calls)
        os.kill(os.getpid(), signal.SIGUSR1)
        callback.on_train_step_end(Context())
        print(before, request.requested, calls)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] True [('save', 'params'), 'stop']"


@pytest.mark.slow
def test_a_worker_forked_after_import_mindspore_runs_ops_and_ends_up_as_a_fresh_one(tmp_path: Path) -> None:
    """From the MindSpore fork server (MindSpore's fork hooks around each fork): the worker runs MindSpore ops;
    during its start-up it runs as SCHED_BATCH with the wake-up handler, which the last wake-up undoes."""
    script = tmp_path / "w.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, os, signal, sys, time
            import mindspore as ms
            def policies():
                return sorted({os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")})
            early = [policies(), signal.getsignal(signal.SIGURG) is signal.SIG_DFL]
            value = float((ms.Tensor([1.0, 2.0]) * 2).sum().asnumpy())
            time.sleep(5.5)  # past the last wake-up; time.sleep carries on through the handler
            late = [policies(), signal.getsignal(signal.SIGURG) is signal.SIG_DFL]
            print(json.dumps({"early": early, "late": late, "value": value}))
            """
        )
    )
    starts = WarmStarts([sys.executable, str(script)])
    try:
        with open(tmp_path / "out.json", "w") as out:
            worker = starts.start([sys.executable, str(script)], process_environment(), stdout=out)
            assert isinstance(worker, ForkedProcess) and worker.wait(120) == 0
    finally:
        starts.close()
    seen = json.loads((tmp_path / "out.json").read_text().splitlines()[-1])
    assert seen == {"early": [[os.SCHED_BATCH], False], "late": [[os.SCHED_OTHER], True], "value": 6.0}
