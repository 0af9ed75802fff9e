"""The ``mindspore`` adapter's hooks, called through the core's facade, over an msrun-like manager."""

from __future__ import annotations

import os

import pytest
from ms_support import FakeMsrun

from taskd_core.errors import WorkerControlError
from taskd_core.models import Strategy, WorkerState
from taskd_core.plugins import Adapter, load_adapter
from taskd_core.testing import process_running, wait_until
from taskd_mindspore.adapter import MSRunAdapter, worker_status
from taskd_mindspore.callbacks import CallbackRegistry
from taskd_mindspore.scheduler import Scheduler, find_scheduler


def _adapter(fake: FakeMsrun, **options: object) -> Adapter:
    registry = CallbackRegistry()
    for name, func in fake.callbacks().items():
        registry.register(name, func)
    return load_adapter("mindspore", instance=MSRunAdapter(registry.complete(), **options))  # type: ignore[arg-type]


def test_never_started_ranks_are_not_started_with_global_ranks(msrun_like: FakeMsrun) -> None:
    """200 with pid None before the first start reads as NOT_STARTED, global rank from MONITOR."""
    msrun_like.node_rank = 1
    statuses = _adapter(msrun_like).monitor()
    assert {r: (s.state, s.pid, s.global_rank) for r, s in statuses.items()} == {
        0: (WorkerState.NOT_STARTED, None, 2),
        1: (WorkerState.NOT_STARTED, None, 3),
    }


def test_restart_all_starts_workers_then_restarts_them_with_a_counter(msrun_like: FakeMsrun) -> None:
    """The first restart_all starts (counter 0); the next stops leftovers and starts new pids (counter 1)."""
    adapter = _adapter(msrun_like)
    adapter.restart_all()
    first = msrun_like.pids()
    assert all(s.state is WorkerState.RUNNING for s in adapter.monitor().values())
    wait_until(lambda: len(msrun_like.starts()) == 2, what="two worker starts")
    adapter.restart_all()
    second = msrun_like.pids()
    assert set(first.values()).isdisjoint(second.values())
    assert not any(process_running(pid) for pid in first.values())
    wait_until(lambda: len(msrun_like.starts()) == 4, what="four worker starts")
    assert sorted((r, c) for r, _, c in msrun_like.starts()) == [(0, "0"), (0, "1"), (1, "0"), (1, "1")]


def test_stop_all_waits_for_pids_although_monitor_still_reports_them_running(msrun_like: FakeMsrun) -> None:
    """KILL_WORKER([-1]) leaves MONITOR stale; stop returns only once every old pid is gone."""
    adapter = _adapter(msrun_like)
    adapter.restart_all()
    pids = list(msrun_like.pids().values())
    adapter.stop(None, timeout=10.0)
    assert ("KILL_WORKER", [-1]) in msrun_like.calls
    assert not any(process_running(pid) for pid in pids)
    assert all(s.state is WorkerState.GONE for s in adapter.monitor().values())


def test_stop_and_restart_list_touch_only_the_given_rank(msrun_like: FakeMsrun) -> None:
    """stop([1]) kills rank 1's pid only; restart_list([1]) gives it a new pid, rank 0 keeps its own."""
    adapter = _adapter(msrun_like)
    adapter.restart_all()
    before = msrun_like.pids()
    adapter.stop([1], timeout=10.0)
    assert ("KILL_WORKER", [before[1]]) in msrun_like.calls
    assert not process_running(before[1]) and process_running(before[0])
    assert adapter.monitor()[1].state is WorkerState.GONE
    adapter.restart_list([1])
    after = adapter.monitor()
    assert ("START_WORKER_LIST", [1]) in msrun_like.calls
    assert after[0].pid == before[0] and after[1].pid not in (before[1], None)
    assert all(s.state is WorkerState.RUNNING for s in after.values())


def test_exit_codes_are_read_as_msrun_reports_them(msrun_like: FakeMsrun) -> None:
    """A worker that exits 0 has succeeded; one that crashed and was reaped is GONE (msrun's 300)."""
    adapter = _adapter(msrun_like)
    adapter.restart_all()
    (msrun_like.workdir / "crash-1").touch()
    wait_until(lambda: adapter.monitor()[1].state is WorkerState.GONE, what="rank 1 to be reported gone")
    (msrun_like.workdir / "release").touch()
    wait_until(lambda: adapter.monitor()[0].succeeded, what="rank 0 to exit 0")
    assert adapter.monitor()[1].failed


def test_workers_that_outlive_kill_worker_are_sigkilled_at_the_deadline(msrun_like: FakeMsrun) -> None:
    """When KILL_WORKER does nothing, stop SIGKILLs the pids itself once the timeout passed."""
    adapter = _adapter(msrun_like)
    adapter.restart_all()
    pids = list(msrun_like.pids().values())
    msrun_like.ignore_kill = True
    adapter.stop(None, timeout=0.2)
    assert not any(process_running(pid) for pid in pids)


def test_full_restart_replaces_the_scheduler_and_in_place_restart_keeps_it(msrun_like: FakeMsrun) -> None:
    """restart_all after the first start starts a new scheduler with the same command; restart_list does not."""
    original = msrun_like.start_scheduler()
    adapter = _adapter(msrun_like, scheduler=Scheduler())
    adapter.restart_all()
    adapter.stop([0], timeout=10.0)
    adapter.restart_list([0])
    current = find_scheduler(os.getpid())
    assert current is not None and current.pid == original.pid
    adapter.restart_all()
    replaced = find_scheduler(os.getpid())
    assert replaced is not None and replaced.pid != original.pid
    assert replaced.argv == current.argv and original.poll() is not None


@pytest.mark.parametrize(("in_place", "expected"), [
    (False, [Strategy.RECOVER, Strategy.DUMP, Strategy.EXIT]),
    (True, [Strategy.RECOVER_IN_PLACE, Strategy.RECOVER, Strategy.DUMP, Strategy.EXIT]),
])
def test_strategies_offer_recover_in_place_only_when_allowed(
    msrun_like: FakeMsrun, in_place: bool, expected: list[Strategy]
) -> None:
    """recover-in-place is declared only when the job allows it."""
    assert list(_adapter(msrun_like, recover_in_place=in_place).strategies()) == expected


def test_entry_point_adapter_without_msrun_says_where_it_runs() -> None:
    """The installed entry point loads, declares strategies, and explains that hooks need msrun."""
    adapter = load_adapter("mindspore")
    assert Strategy.RECOVER in adapter.strategies()
    with pytest.raises(WorkerControlError, match="runs inside msrun"):
        adapter.monitor()


def test_malformed_monitor_entries_are_rejected() -> None:
    """A MONITOR entry that is not msrun's shape is an error naming the rank, not a guess."""
    with pytest.raises(ValueError, match="local rank 3"):
        worker_status(3, {"pid": "x", "status": None, "global_rank": 3}, 3)
    assert worker_status(0, {"pid": 5, "status": -9, "global_rank": 0}, 0).exit_code == -9
