"""Real DDP training (torch 2.13 CPU, gloo) on 2 nodes x 2 workers under ``taskdrun``, with faults.

The job is ``examples/train_ddp.py``: deterministic, checkpointing atomically
and resuming on every start, so a recovered run must end with exactly the
parameters of a fault-free one.
"""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path

import pytest
from pt_support import FORMS, STEPS, events, finish, kill, run_job

from taskd_core.testing import process_running, wait_until

pytestmark = pytest.mark.slow


def pids_of_round(progress: Path, restart: int) -> dict[int, int]:
    return {int(e["rank"]): int(e["pid"]) for e in events(progress) if e["event"] == "start" and e["restart"] == restart}


@pytest.mark.parametrize("form", FORMS)
def test_sigkills_of_rank_3_then_rank_0_recover_and_match_a_fault_free_run(
    form: str, launch, tmp_path: Path, fault_free: dict[str, object]
) -> None:
    """torchrun's command line with only the program name changed (no TaskD option) recovers every fault."""
    nodes, progress, result = run_job(launch, tmp_path / f"killed-{form}", form=form)
    # Rank 0 (the host of the workers' store) included.
    victims = (3, 0)
    for restart, victim in enumerate(victims):
        wait_until(
            lambda n=restart: len(pids_of_round(progress, n)) == 4
            and any(e["event"] == "step" and e["restart"] == n and int(e["step"]) >= 6 * n + 5
                    for e in events(progress)),
            f"round {restart} to train", 120,
        )
        kill(pids_of_round(progress, restart)[victim], signal.SIGKILL)

    final = finish(nodes, result)

    for restart in range(1, len(victims) + 1):
        before, after = pids_of_round(progress, restart - 1), pids_of_round(progress, restart)
        assert sorted(after) == [0, 1, 2, 3]
        assert not set(before.values()) & set(after.values())  # every rank restarted, once per fault
        resumed = {int(e["step"]) for e in events(progress) if e["event"] == "resumed" and e["restart"] == restart}
        assert len(resumed) == 1 and min(resumed) > 0  # every rank resumed from the same checkpoint
    assert {e["restart"] for e in events(progress)} == set(range(len(victims) + 1))
    assert final["steps"] == STEPS
    assert final["sha256"] == fault_free["sha256"]
    assert not [pid for r in range(len(victims) + 1) for pid in pids_of_round(progress, r).values() if process_running(pid)]
    # Exactly one controller served the job, on the node the rendezvous made rank 0.
    logs = [p.read_text() for p in tmp_path.glob(f"killed-{form}*.log")]
    assert sum("embedded controller listening" in log for log in logs) == 1
    # c10d: every restart kept the rendezvous round, ranks included (the hash above); static has no rounds to keep.
    kept = [log.count("keeping its nodes and ranks") for log in logs]
    assert kept == ([len(victims)] * 2 if form == "c10d" else [0, 0])


def test_a_rank_that_raises_is_recovered_like_a_killed_one(launch, tmp_path: Path, fault_free: dict[str, object]) -> None:
    nodes, progress, result = run_job(launch, tmp_path / "raised", "--fail-at-step", "7", "--fail-rank", "2")

    final = finish(nodes, result)

    assert {e["restart"] for e in events(progress)} == {0, 1}
    assert len(pids_of_round(progress, 1)) == 4
    assert [int(e["step"]) for e in events(progress) if e["event"] == "resumed"] == [6] * 4
    assert final["sha256"] == fault_free["sha256"]


def test_torch_file_timer_overrun_is_a_hang_with_its_stack(launch, tmp_path: Path, fault_free: dict[str, object]) -> None:
    """The script arms torch's own FileTimerClient (TORCHELASTIC_TIMER_FILE, served by taskdrun as by torchrun);
    rank 3 overruns it spinning: its stack is taken, it is reported as hung, and the job recovers."""
    nodes, progress, result = run_job(
        launch, tmp_path / "timer", "--no-heartbeat", "--timer", "3", "--hang-at-step", "12", "--hang-rank", "3"
    )

    final = finish(nodes, result)

    assert {e["restart"] for e in events(progress)} == {0, 1}
    assert final["sha256"] == fault_free["sha256"]
    node1 = next(launch.root.glob("timer1.*.log")).read_text(errors="replace")
    assert "hung: timer 'step'" in node1 and "spin_forever (train_ddp.py:" in node1


def parent(pid: int) -> tuple[int, str]:
    """Parent pid of ``pid`` and the parent's name (``taskd-forksrv`` for a fork server)."""
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return ppid, Path(f"/proc/{ppid}/comm").read_text().strip()


def test_a_sigkilled_fork_server_is_recovered_by_exec_then_replaced(
    launch, tmp_path: Path, fault_free: dict[str, object]
) -> None:
    """Workers are forked by each node's fork server; SIGKILLing one takes its node's ranks along, the recovery
    starts them by exec, and a later restart is forked by the server started in its place."""
    # No hang detection: the job is paused (SIGSTOP) once below, which it would rightly take for a hang.
    nodes, progress, result = run_job(
        launch, tmp_path / "forkserver", max_cycles=8, taskd=("--taskd-no-hang-detection",)
    )
    logs = lambda: [p.read_text(errors="replace") for p in tmp_path.glob("forkserver*.log")]  # noqa: E731

    def training(after: int) -> tuple[int, dict[int, int]]:
        """The newest restart round after ``after`` in which every rank stepped twice, and its pids."""

        def newest() -> tuple[int, dict[int, int]] | None:
            log = events(progress)
            rounds = [int(e["restart"]) for e in log if int(e["restart"]) > after]
            if not rounds:
                return None
            r = max(rounds)
            steps = Counter(int(e["rank"]) for e in log if e["event"] == "step" and e["restart"] == r)
            pids = pids_of_round(progress, r)
            return (r, pids) if len(steps) == 4 and min(steps.values()) >= 2 and len(pids) == 4 else None

        return wait_until(newest, f"a round after {after} to train", 120)  # type: ignore[return-value]

    first, pids = training(-1)
    forked = [parent(pid) for pid in pids.values()]
    kill(pids[3], signal.SIGKILL)
    second, pids = training(first)
    forked += [parent(pid) for pid in pids.values()]
    server = parent(pids[0])[0]
    kill(server, signal.SIGKILL)  # ranks 0 and 1's server: both die with it
    third, pids = training(second)
    # The server's replacement must be ready before the next restart, which it then forks; the job is paused
    # meanwhile so that it cannot end first on a loaded machine.
    for pid in pids.values():
        kill(pid, signal.SIGSTOP)
    wait_until(lambda: sum(log.count("ready after") for log in logs()) == 3, "a new fork server to preload", 300)
    for pid in pids.values():
        kill(pid, signal.SIGCONT)
    kill(pids[0], signal.SIGKILL)
    _, pids = training(third)
    last = [parent(pid) for pid in pids.values()]

    final = finish(nodes, result)

    assert final["sha256"] == fault_free["sha256"]
    assert all(name == "taskd-forksrv" for _, name in forked + last)
    servers = {ppid for ppid, _ in forked + last}
    assert server in servers and len(servers) == 3  # the two first servers and the replacement
    # Right after the server died, its node started the next workers by exec: the new one was still preloading.
    node = next(log for log in logs() if f"fork server {server} died" in log)
    after_death = node[node.index(f"fork server {server} died") :]
    assert "started default local rank 0" in after_death.split("forked default local rank 0")[0]
    assert not [pid for pid in servers if process_running(pid)]
    assert not [pid for r in range(third + 2) for pid in pids_of_round(progress, r).values() if process_running(pid)]


def test_a_ddp_job_with_torch_optim_ends_on_every_rank(launch, tmp_path: Path) -> None:
    """Forked (warm) workers of a ``DistributedDataParallel`` job reach their teardown fast: without the
    example's pause after its last step, one in three such runs kept a rank alive for ever (torch 2.13
    frees the process group while a gloo thread waits for the GIL; docs/warm-restarts.md). Two runs."""
    for run in range(2):
        nodes, progress, result = run_job(launch, tmp_path / f"sgd{run}", "--optimizer", "sgd")
        assert finish(nodes, result)["steps"] == STEPS
        assert len([e for e in events(progress) if e["event"] == "done"]) == 4
