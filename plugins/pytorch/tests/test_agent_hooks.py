"""The adapter's hooks on a real torch elastic agent, with plain python workers (no training)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest
from pt_support import JOB_TOKEN, kill, records

from taskd_core.errors import LauncherInterrupted, WorkerControlError
from taskd_core.launcher.interrupt import StopRequest
from taskd_core.models import WorkerState
from taskd_core.plugins import load_adapter
from taskd_core.testing import process_running, wait_until
from taskd_pytorch import PytorchAdapter
from taskd_pytorch.live._channel import LiveChannel


def test_restart_all_starts_every_rank_with_torchrun_environment(make_agent, out_dir: Path) -> None:
    adapter = load_adapter("pytorch", instance=PytorchAdapter(make_agent(str(out_dir))))
    assert {s.state for s in adapter.monitor().values()} == {WorkerState.NOT_STARTED}

    adapter.restart_all()

    statuses = adapter.monitor()
    assert [statuses[r].global_rank for r in (0, 1)] == [0, 1]
    assert all(s.state is WorkerState.RUNNING and process_running(s.pid) for s in statuses.values())
    seen = wait_until(lambda: len(records(out_dir)) == 2 and records(out_dir), "both workers", 30)
    assert sorted(r["LOCAL_RANK"] for r in seen) == ["0", "1"]
    assert {r["TASKD_RESTART_COUNT"] for r in seen} == {"0"}
    # Workers join the round's own agent-hosted store, never the shared rendezvous store (SPEC §9).
    assert {r["TORCHELASTIC_USE_AGENT_STORE"] for r in seen} == {"True"}


def test_stop_given_ranks_leaves_the_others_running(make_agent, out_dir: Path) -> None:
    adapter = load_adapter("pytorch", instance=PytorchAdapter(make_agent(str(out_dir), nproc=3)))
    adapter.restart_all()
    before = adapter.monitor()

    adapter.stop([1], timeout=5.0)

    after = adapter.monitor()
    assert after[1].state is WorkerState.EXITED and after[1].exit_code == -signal.SIGTERM
    assert not process_running(before[1].pid)
    assert [after[r].pid for r in (0, 2)] == [before[r].pid for r in (0, 2)]
    assert all(after[r].state is WorkerState.RUNNING for r in (0, 2))


def test_stop_escalates_to_sigkill_for_a_worker_that_ignores_sigterm(make_agent, out_dir: Path) -> None:
    adapter = load_adapter("pytorch", instance=PytorchAdapter(make_agent(str(out_dir), "--ignore-sigterm", nproc=1)))
    adapter.restart_all()
    wait_until(lambda: records(out_dir), "the worker to ignore SIGTERM", 30)

    adapter.stop(None, timeout=0.5)

    assert adapter.monitor()[0].exit_code == -signal.SIGKILL


def test_a_stopped_worker_is_continued_so_that_sigterm_ends_it_before_the_timeout(make_agent, out_dir: Path) -> None:
    adapter = load_adapter("pytorch", instance=PytorchAdapter(make_agent(str(out_dir), nproc=1)))
    adapter.restart_all()
    wait_until(lambda: records(out_dir), "the worker to start", 30)
    kill(adapter.monitor()[0].pid, signal.SIGSTOP)

    adapter.stop(None, timeout=120)

    assert adapter.monitor()[0].exit_code == -signal.SIGTERM


def test_live_recovery_is_offered_once_every_local_worker_joined_a_round(make_agent, out_dir: Path) -> None:
    agent = make_agent(str(out_dir))
    adapter = load_adapter("pytorch", instance=PytorchAdapter(agent))
    adapter.restart_all()
    first = wait_until(lambda: len(records(out_dir)) == 2 and records(out_dir), "both workers", 30)
    (path,) = {r["TASKD_LIVE_DIR"] for r in first}  # one channel per node
    channel = LiveChannel(Path(path))
    assert "recover-live" not in [s.value for s in adapter.strategies()]
    channel.mark_joined(0, 0)
    assert "recover-live" not in [s.value for s in adapter.strategies()]
    channel.mark_joined(1, 0)
    assert [s.value for s in adapter.strategies()][0] == "recover-live"

    adapter.begin_round(3)
    assert channel.current_round() == 3
    assert not adapter.await_round(3, timeout=0.2)  # nobody joined round 3
    channel.mark_joined(0, 3)
    channel.mark_joined(1, 3)
    assert adapter.await_round(3, timeout=5)
    # A worker that could not join a round (a peer lost as it formed) fails the wait at once.
    adapter.begin_round(4)
    channel.mark_joined(0, 4)
    channel.mark_failed(1, 4)
    assert not adapter.await_round(4, timeout=600)  # not its timeout: a broken wait would hang the test
    adapter.restart_all()
    assert channel.current_round() == 0 and "recover-live" not in [s.value for s in adapter.strategies()]


def test_the_workers_get_the_launchs_token_and_without_one_no_live_recovery_is_offered(
    make_agent, out_dir: Path, tmp_path: Path
) -> None:
    """The token keys the state hand-over: a launch that has none offers no hand-over nobody could authenticate."""
    keyed = make_agent(str(out_dir))
    keyed.restart_all()
    assert {r["TASKD_JOB_TOKEN"] for r in wait_until(lambda: len(records(out_dir)) == 2 and records(out_dir), "both workers", 30)} == {JOB_TOKEN}
    keyed.close()
    bare_out = tmp_path / "bare"
    bare_out.mkdir()
    adapter = load_adapter("pytorch", instance=PytorchAdapter(make_agent(str(bare_out), job_token="")))
    adapter.restart_all()
    (path,) = {r["TASKD_LIVE_DIR"] for r in wait_until(lambda: len(records(bare_out)) == 2 and records(bare_out), "both workers", 30)}
    channel = LiveChannel(Path(path))
    channel.mark_joined(0, 0)
    channel.mark_joined(1, 0)
    assert "recover-live" not in [s.value for s in adapter.strategies()]


def test_restart_list_keeps_other_pids_and_the_same_environment(make_agent, out_dir: Path) -> None:
    adapter = load_adapter("pytorch", instance=PytorchAdapter(make_agent(str(out_dir)), in_place=True))
    adapter.restart_all()
    first = wait_until(lambda: len(records(out_dir)) == 2 and records(out_dir), "both workers", 30)
    before = adapter.monitor()
    kill(before[1].pid)
    wait_until(lambda: adapter.monitor()[1].state is WorkerState.EXITED, "rank 1 to die", 10)

    adapter.restart_list([1])

    after = adapter.monitor()
    assert after[0].pid == before[0].pid
    assert after[1].pid != before[1].pid and after[1].state is WorkerState.RUNNING
    again = wait_until(lambda: len(records(out_dir)) == 3 and records(out_dir), "rank 1 again", 30)
    old, new = (next(r for r in seen if r["pid"] == pid) for seen, pid in ((first, before[1].pid), (again, after[1].pid)))
    assert {k: v for k, v in new.items() if k != "pid"} == {k: v for k, v in old.items() if k != "pid"}


def test_monitor_reports_exit_codes_and_signals(make_agent, out_dir: Path) -> None:
    adapter = load_adapter("pytorch", instance=PytorchAdapter(make_agent(str(out_dir), "--after", "0", "--exit-code", "3")))
    adapter.restart_all()

    statuses = wait_until(
        lambda: (s := adapter.monitor()) and all(x.state is WorkerState.EXITED for x in s.values()) and s, "exits", 30
    )

    assert {s.exit_code for s in statuses.values()} == {3}
    assert all(s.failed for s in statuses.values())


def test_restart_all_gives_every_round_a_fresh_worker_store(make_agent, out_dir: Path, monkeypatch) -> None:
    # Whatever the user's environment says about sharing the rendezvous store.
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    adapter = load_adapter("pytorch", instance=PytorchAdapter(make_agent(str(out_dir))))
    ports = []
    for round_no in range(3):
        adapter.restart_all()
        seen = wait_until(lambda n=round_no: len(records(out_dir)) == 2 * (n + 1) and records(out_dir), "workers", 30)
        this_round = [r for r in seen if r["TASKD_RESTART_COUNT"] == str(round_no)]
        assert len({r["MASTER_PORT"] for r in this_round}) == 1
        ports.append(this_round[0]["MASTER_PORT"])
        adapter.stop(None, timeout=5.0)
    assert len(set(ports)) == 3


def test_restart_list_of_a_rank_that_does_not_exist_is_refused(make_agent, out_dir: Path) -> None:
    adapter = load_adapter("pytorch", instance=PytorchAdapter(make_agent(str(out_dir))))
    adapter.restart_all()
    with pytest.raises(WorkerControlError, match="local ranks \\[5\\] do not exist"):
        adapter.restart_list([5])


def test_adapter_without_agent_declares_strategies_but_controls_nothing() -> None:
    adapter = load_adapter("pytorch")
    assert [s.value for s in adapter.strategies()] == ["recover", "dump", "exit"]
    assert [s.value for s in load_adapter("pytorch", instance=PytorchAdapter(in_place=True)).strategies()][0] == (
        "recover-in-place"
    )
    with pytest.raises(WorkerControlError, match="only inside taskdrun"):
        adapter.restart_all()


def test_torchs_own_run_loop_still_works_with_the_subclass(make_agent, out_dir: Path) -> None:
    from torch.distributed.elastic.agent.server.api import WorkerState as TorchState

    agent = make_agent(str(out_dir), "--after", "0", "--only-rank", "1", "--exit-code", "5")

    result = agent.run()

    assert result.state is TorchState.FAILED
    assert {rank: f.exitcode for rank, f in result.failures.items()} == {1: 5}


def test_a_stop_request_ends_a_restart_waiting_in_the_rendezvous(make_agent, out_dir: Path) -> None:
    """A restart whose rendezvous waits for a node that never comes ends when the launcher is told to stop."""
    stop = StopRequest()
    agent = make_agent(str(out_dir), nnodes=2, stop=stop)
    raised: list[LauncherInterrupted] = []

    def restart() -> None:
        try:
            agent.restart_all()
        except LauncherInterrupted as exc:
            raised.append(exc)

    waiting = threading.Thread(target=restart)
    waiting.start()
    waiting.join(timeout=1.0)
    assert waiting.is_alive()  # still in the rendezvous: the second node never joins

    stop(signal.SIGTERM)

    waiting.join(timeout=30)
    assert not waiting.is_alive()
    assert [exc.signum for exc in raised] == [signal.SIGTERM]
    assert records(out_dir) == []
