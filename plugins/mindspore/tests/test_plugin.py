"""MSRunPlugin and the taskd agent API, the two ways msrun hands over its workers, tested the same way."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from ms_support import FakeMsrun

from taskd_core.testing import process_running, wait_until
from taskd_mindspore import AgentApi, CallbackError, MSRunPlugin

Starter = Callable[[FakeMsrun, Mapping[str, str]], None]


def _via_plugin(fake: FakeMsrun, env: Mapping[str, str]) -> None:
    # The path msrun imports, as the seed document writes it.
    from taskd.python.framework.agent.ms_mgr.msrun_plugin import MSRunPlugin

    plugin = MSRunPlugin(env=env)
    for name, func in fake.callbacks().items():
        plugin.register_callbacks(name, func)
    plugin.start()


def _via_agent_api(fake: FakeMsrun, env: Mapping[str, str]) -> None:
    api = AgentApi(env=env)
    assert api.init_taskd_agent({"Framework": "MindSpore"}) is True
    for name, func in fake.callbacks().items():
        api.register_func(name, func)
    api.start_taskd_agent()


STARTERS = pytest.mark.parametrize("start", [_via_plugin, _via_agent_api], ids=["MSRunPlugin", "taskd_agent_api"])


@pytest.fixture
def job_env() -> dict[str, str]:
    """msrun's environment for a one-node, two-worker job whose node 0 embeds the controller."""
    return {
        "MS_SCHED_HOST": "127.0.0.1",
        "MS_SCHED_PORT": "8118",
        "MS_WORKER_NUM": "2",
        # Any free port: a one-node job needs no fixed controller port.
        "TASKD_CONTROLLER_PORT": "0",
        "TASKD_JOB_ID": "ms-contract",
        "TASKD_STOP_TIMEOUT": "5",
        "TASKD_SCHEDULER_GRACE": "5",
    }


def _exit_code(start: Starter, fake: FakeMsrun, env: Mapping[str, str]) -> Any:
    with pytest.raises(SystemExit) as exc:
        start(fake, env)
    return exc.value.code


@pytest.fixture
def driver() -> Iterator[Callable[[Callable[[], None]], None]]:
    """Runs a fault script next to the job; joined (with a deadline) at the end of the test."""
    threads: list[threading.Thread] = []

    def run(script: Callable[[], None]) -> None:
        thread = threading.Thread(target=script, daemon=True)
        thread.start()
        threads.append(thread)

    yield run
    for thread in threads:
        thread.join(timeout=60)


def _no_process_left(fake: FakeMsrun) -> None:
    assert not any(process_running(p.pid) for p in fake.everything)
    assert not any(process_running(pid) for _, pid, _ in fake.starts())


# --- registration -------------------------------------------------------------------


def test_unknown_operator_is_logged_and_ignored(caplog: pytest.LogCaptureFixture, tmp_path: Any) -> None:
    """A newer msrun may register more operators: they are logged and ignored, the known ones still count."""
    plugin = MSRunPlugin()
    plugin.register_callbacks("RESTART", lambda: 0)
    assert "'RESTART', which this TaskD does not use (it uses KILL_WORKER, START_ALL_WORKER" in caplog.text
    api = AgentApi()
    api.init_taskd_agent({"Framework": "MindSpore"})
    api.register_func("RESTART", print)
    fake = FakeMsrun(tmp_path)
    partial = {k: v for k, v in fake.callbacks().items() if k != "MONITOR"}
    for name, func in partial.items():
        plugin.register_callbacks(name, func)
    with pytest.raises(CallbackError, match="MONITOR not registered"):
        plugin.run()


def test_non_callable_is_rejected_naming_the_operator() -> None:
    """A callback that cannot be called is refused at registration, naming its operator."""
    with pytest.raises(CallbackError, match="MONITOR must be callable"):
        MSRunPlugin().register_callbacks("MONITOR", 42)  # type: ignore[arg-type]
    api = AgentApi()
    api.init_taskd_agent({"Framework": "MindSpore"})
    with pytest.raises(CallbackError, match="KILL_WORKER must be callable"):
        api.register_func("KILL_WORKER", None)  # type: ignore[arg-type]


@STARTERS
def test_start_without_every_callback_names_the_missing_ones(start: Starter, tmp_path: Any) -> None:
    """start() refuses to run before all four callbacks are registered and says which are missing."""
    fake = FakeMsrun(tmp_path)
    partial = {k: v for k, v in fake.callbacks().items() if k in ("KILL_WORKER", "MONITOR")}
    fake.callbacks = lambda: partial  # type: ignore[method-assign]
    with pytest.raises(CallbackError, match="START_ALL_WORKER, START_WORKER_LIST not registered"):
        start(fake, {})
    assert fake.everything == []


def test_agent_api_needs_init_and_serves_only_mindspore() -> None:
    """register_func before init_taskd_agent, or a PyTorch config, is a clear error (msrun then falls back)."""
    api = AgentApi()
    with pytest.raises(CallbackError, match="init_taskd_agent"):
        api.register_func("MONITOR", print)
    with pytest.raises(CallbackError, match="PyTorch"):
        api.init_taskd_agent({"Framework": "PyTorch"})


def test_module_functions_msrun_imports_exist_at_the_seed_paths() -> None:
    """msrun imports these exact names; they are the session object's methods."""
    from taskd.api.taskd_agent_api import init_taskd_agent, register_func, start_taskd_agent
    from taskd.python.framework.agent.ms_mgr.msrun_plugin import MSRunPlugin as Seed

    assert Seed is MSRunPlugin
    assert all(callable(f) for f in (init_taskd_agent, register_func, start_taskd_agent))


# --- whole runs over real children and a real embedded controller --------------------


@STARTERS
def test_job_that_finishes_ends_msrun_with_0(
    start: Starter, msrun_like: FakeMsrun, job_env: dict[str, str], driver: Callable[[Callable[[], None]], None]
) -> None:
    """Workers that exit 0 end start() with SystemExit(0); nothing is left running."""

    def finish() -> None:
        wait_until(lambda: len(msrun_like.starts()) == 2, what="both workers")
        (msrun_like.workdir / "release").touch()

    msrun_like.start_scheduler()
    driver(finish)
    assert _exit_code(start, msrun_like, job_env) == 0
    _no_process_left(msrun_like)


@STARTERS
def test_killed_worker_is_recovered_through_msruns_callbacks(
    start: Starter, msrun_like: FakeMsrun, job_env: dict[str, str], driver: Callable[[Callable[[], None]], None]
) -> None:
    """A crashed rank → one recovery cycle → START_ALL_WORKER again with counter 1 → the job ends 0."""

    def crash_then_finish() -> None:
        wait_until(lambda: len(msrun_like.starts()) == 2, what="both workers")
        victim = msrun_like.pids()[1]
        (msrun_like.workdir / "crash-1").touch()
        wait_until(lambda: not process_running(victim), what="rank 1 to crash")
        (msrun_like.workdir / "crash-1").unlink()
        wait_until(lambda: len(msrun_like.starts()) == 4, deadline=60, what="the restarted workers")
        (msrun_like.workdir / "release").touch()

    driver(crash_then_finish)
    assert _exit_code(start, msrun_like, job_env) == 0
    assert [c for c in msrun_like.calls if c[0] == "START_ALL_WORKER"] == [("START_ALL_WORKER", None)] * 2
    assert sorted(c for _, _, c in msrun_like.starts()) == ["0", "0", "1", "1"]
    _no_process_left(msrun_like)


@STARTERS
def test_recover_in_place_restarts_only_the_dead_rank(
    start: Starter, msrun_like: FakeMsrun, job_env: dict[str, str], driver: Callable[[Callable[[], None]], None]
) -> None:
    """With recover-in-place allowed and forced, START_WORKER_LIST([1]) runs and rank 0 keeps its pid."""
    pids: dict[str, dict[int, int]] = {}

    def crash_then_finish() -> None:
        wait_until(lambda: len(msrun_like.starts()) == 2, what="both workers")
        pids["before"] = msrun_like.pids()
        (msrun_like.workdir / "crash-1").touch()
        wait_until(lambda: not process_running(pids["before"][1]), what="rank 1 to crash")
        (msrun_like.workdir / "crash-1").unlink()
        wait_until(lambda: len(msrun_like.starts()) == 3, deadline=60, what="rank 1 restarted")
        pids["after"] = msrun_like.pids()
        (msrun_like.workdir / "release").touch()

    env = dict(job_env, ENABLE_RESTART_FAULT_PROCESS="on", TASKD_STRATEGIES="recover-in-place,exit")
    driver(crash_then_finish)
    assert _exit_code(start, msrun_like, env) == 0
    assert ("START_WORKER_LIST", [1]) in msrun_like.calls
    assert pids["after"][0] == pids["before"][0] and pids["after"][1] != pids["before"][1]
    _no_process_left(msrun_like)


@STARTERS
def test_repeated_faults_beyond_the_budget_give_the_job_up(
    start: Starter, msrun_like: FakeMsrun, job_env: dict[str, str], driver: Callable[[Callable[[], None]], None]
) -> None:
    """A rank that keeps crashing exhausts the cycles: msrun ends non-zero, every process is gone."""

    def keep_crashing() -> None:
        wait_until(lambda: len(msrun_like.starts()) == 2, what="both workers")
        (msrun_like.workdir / "crash-1").touch()

    msrun_like.start_scheduler()
    driver(keep_crashing)
    code = _exit_code(start, msrun_like, dict(job_env, TASKD_MAX_CYCLES="1"))
    assert code not in (0, None)
    _no_process_left(msrun_like)
    assert os.environ.get("TASKD_RESTART_COUNT") == "1"


def test_stopped_worker_is_found_through_proc_and_recovered(
    msrun_like: FakeMsrun, job_env: dict[str, str], driver: Callable[[Callable[[], None]], None]
) -> None:
    """msrun's pids are known, so a SIGSTOPped rank is a hang (its /proc state): killed, then one recovery."""
    stopped: list[int] = []

    def stop_then_finish() -> None:
        wait_until(lambda: len(msrun_like.starts()) == 2, what="both workers")
        stopped.append(msrun_like.pids()[1])
        os.kill(stopped[0], signal.SIGSTOP)
        wait_until(lambda: len(msrun_like.starts()) == 4, deadline=60, what="the restarted workers")
        (msrun_like.workdir / "release").touch()

    driver(stop_then_finish)
    assert _exit_code(_via_plugin, msrun_like, job_env) == 0
    assert [c for c in msrun_like.calls if c[0] == "START_ALL_WORKER"] == [("START_ALL_WORKER", None)] * 2
    assert not process_running(stopped[0])
    _no_process_left(msrun_like)
