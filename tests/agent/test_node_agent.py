"""The node agent with the built-in process adapter, real workers and a real controller."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from taskd_core.agent.config import AgentConfig, DispatchConfig, RestartBackoff
from taskd_core.agent.node_agent import AgentOutcome, NodeAgent, Outcome
from taskd_core.client.query import QueryClient
from taskd_core.controller.server import EmbeddedController
from taskd_core.errors import ConfigError, TaskdError
from taskd_core.launcher.process_adapter import ProcessAdapter
from taskd_core.launcher.spec import LaunchSpec
from taskd_core.models import JobPolicy, JobStatus, Strategy
from taskd_core.plugins import load_adapter
from taskd_core.rpc import recover_pb2 as pb
from taskd_core.testing import free_port, wait_until

WORKER = """
import os, pathlib, signal, sys, time
rank, restart = os.environ["RANK"], os.environ["TASKD_RESTART_COUNT"]
out = pathlib.Path(sys.argv[1])
def dump(signum, frame):
    (out / f"dumped-{rank}").touch()
    sys.exit(0)
signal.signal(signal.SIGUSR1, dump)  # before the start is announced: a dump may follow at once
(out / f"start-{rank}-{restart}-{os.getpid()}").write_text(repr(time.monotonic()))
deadline = time.monotonic() + 120
while not (out / "finish").exists() and time.monotonic() < deadline:
    if (out / f"kill-{rank}-{restart}").exists():  # the test asks this start to fail
        (out / f"died-{rank}-{restart}").touch()
        sys.exit(1)
    time.sleep(0.02)
"""


class Job:
    """One node's workers under a NodeAgent, run in a background thread."""

    def __init__(
        self,
        tmp: Path,
        controller: Any,  # EmbeddedController or a controller process: anything with .address
        *,
        nproc: int = 2,
        independent: bool = False,
        nnodes: int = 1,
        node_rank: int = 0,
        **config: Any,
    ) -> None:
        self.out = tmp / "out"
        self.out.mkdir(parents=True)
        script = tmp / "worker.py"
        script.write_text(WORKER)
        spec = LaunchSpec(
            command=(sys.executable, str(script), str(self.out)), nproc=nproc, job_id="job",
            independent_workers=independent, log_dir=tmp / "logs", stop_timeout=5.0,
            nnodes=nnodes, node_rank=node_rank,
        )
        self.agent = NodeAgent(
            AgentConfig(
                job_id="job",
                node_rank=node_rank,
                controller=controller.address,
                dispatch=DispatchConfig(stop_timeout=5.0, dump_grace=10.0),
                **config,
            ),
            load_adapter("process", instance=ProcessAdapter(spec)),
        )
        self._pool = ThreadPoolExecutor(1)
        self.result: Future[AgentOutcome] = self._pool.submit(self.agent.run)

    def starts(self) -> dict[tuple[int, int], int]:
        """{(rank, restart): pid} of every worker start so far."""
        out = {}
        for path in self.out.glob("start-*"):
            _, rank, restart, pid = path.name.split("-")
            out[int(rank), int(restart)] = int(pid)
        return out

    def wait_starts(self, count: int) -> dict[tuple[int, int], int]:
        wait_until(lambda: len(self.starts()) >= count, f"{count} worker starts (so far {self.starts()})", 60, unless=self.ended)
        return self.starts()

    def ended(self) -> str:
        """Why waiting on this job is pointless: its agent ended (empty while it runs)."""
        return f"the agent ended: {self.result.result()}" if self.result.done() else ""

    def finish(self) -> AgentOutcome:
        (self.out / "finish").touch()
        return self.result.result(timeout=120)

    def close(self) -> None:
        if not self.result.done():
            self.agent.shutdown(signal.SIGTERM)
        self.result.result(timeout=120)
        self._pool.shutdown()


@pytest.fixture
def make_job(tmp_path: Path) -> Iterator:
    made: list[tuple[Job, EmbeddedController]] = []

    def make(policy: JobPolicy, **kwargs: object) -> tuple[Job, EmbeddedController]:
        controller = EmbeddedController(listen="127.0.0.1:0", state=":memory:", defaults=policy)
        job = Job(tmp_path, controller, **kwargs)  # type: ignore[arg-type]
        made.append((job, controller))
        return job, controller

    yield make
    for job, controller in made:
        job.close()
        controller.stop()


def job_view(controller: EmbeddedController) -> JobStatus:
    with QueryClient(controller.address, timeout=10) as query:
        return query.job("job", events=100)


def assert_gone(pids: object) -> None:
    for pid in pids:  # type: ignore[attr-defined]
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


FAST = dict(flush_seconds=0.0, report_timeout=30.0)


def test_all_workers_finish(make_job) -> None:  # type: ignore[no-untyped-def]
    job, controller = make_job(JobPolicy(**FAST))
    pids = job.wait_starts(2)
    outcome = job.finish()
    assert (outcome.kind, outcome.exit_code) == (Outcome.SUCCEEDED, 0)
    assert job_view(controller).state == "finished"
    assert_gone(pids.values())


def test_killed_worker_recovers_every_rank(make_job) -> None:  # type: ignore[no-untyped-def]
    job, controller = make_job(JobPolicy(**FAST))
    first = job.wait_starts(2)
    os.kill(first[1, 0], signal.SIGKILL)
    after = job.wait_starts(4)
    assert set(after) == {(0, 0), (1, 0), (0, 1), (1, 1)}
    assert job.finish().exit_code == 0
    view = job_view(controller)
    assert view.cycles_used == 1
    chosen = [e.detail["strategy"] for e in view.events if e.kind == "strategy chosen"]
    assert chosen == ["recover"]


def test_in_place_restarts_only_the_dead_rank(make_job) -> None:  # type: ignore[no-untyped-def]
    job, _ = make_job(JobPolicy(**FAST), nproc=3, independent=True)
    first = job.wait_starts(3)
    os.kill(first[2, 0], signal.SIGKILL)
    after = job.wait_starts(4)
    assert after[2, 1] != first[2, 0]
    assert after[0, 0] == first[0, 0] and after[1, 0] == first[1, 0]
    for pid in (first[0, 0], first[1, 0]):
        os.kill(pid, 0)  # the healthy workers were never restarted
    assert job.finish().exit_code == 0


def test_budget_exhausted_gives_the_job_up(make_job) -> None:  # type: ignore[no-untyped-def]
    job, controller = make_job(JobPolicy(max_cycles=1, **FAST))
    first = job.wait_starts(2)
    os.kill(first[0, 0], signal.SIGKILL)
    second = job.wait_starts(4)
    os.kill(second[0, 1], signal.SIGKILL)
    outcome = job.result.result(timeout=120)
    assert (outcome.kind, outcome.exit_code) == (Outcome.GIVEN_UP, 1)
    assert_gone(second.values())
    assert job_view(controller).state == "given-up"


def test_dump_policy_saves_then_exits(make_job) -> None:  # type: ignore[no-untyped-def]
    job, _ = make_job(JobPolicy(strategies=(Strategy.DUMP, Strategy.EXIT), **FAST))
    first = job.wait_starts(2)
    os.kill(first[1, 0], signal.SIGKILL)
    outcome = job.result.result(timeout=120)
    assert outcome.kind is Outcome.GIVEN_UP
    assert (job.out / "dumped-0").exists()
    assert_gone(first.values())


def test_sigterm_to_the_agent_stops_every_worker(make_job) -> None:  # type: ignore[no-untyped-def]
    job, _ = make_job(JobPolicy(**FAST))
    pids = job.wait_starts(2)
    threading.Timer(0.01, job.agent.shutdown, args=(signal.SIGTERM,)).start()
    outcome = job.result.result(timeout=120)
    assert (outcome.kind, outcome.exit_code) == (Outcome.INTERRUPTED, 143)
    assert_gone(pids.values())


def test_a_closed_dispatcher_starts_no_worker(tmp_path: Path) -> None:
    """Once the agent has stopped its workers for good, a restart signal that was waiting is not carried out."""
    from taskd_core.agent.dispatcher import ActionDispatcher
    from taskd_core.models import FaultRank, Signal

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    (tmp_path / "out").mkdir()
    spec = LaunchSpec(command=(sys.executable, str(script), str(tmp_path / "out")), nproc=2, stop_timeout=5.0)
    adapter = load_adapter("process", instance=ProcessAdapter(spec))
    reports: list[tuple[str, ...]] = []

    class Reporter:
        def report_stop_complete(self, code: int, msg: str, fault_ranks: object) -> int:
            reports.append(("stop", str(code)))
            return 0

        def report_recover_strategy(self, fault_ranks: object, strategy_list: object) -> int:
            reports.append(("strategies",))
            return 0

        def report_recover_status(self, code: int, msg: str, fault_ranks: object, strategy: str) -> int:
            reports.append(("status", strategy))
            return 0

    dispatcher = ActionDispatcher(adapter, Reporter())
    adapter.restart_all()
    first = {s.pid for s in adapter.monitor().values()}
    dispatcher.close()
    dispatcher.handle(Signal("changeStrategy", actions=("change_strategy",), change_strategy="recover",
                             fault_ranks=(FaultRank(0),)))
    after = adapter.monitor()
    assert {s.pid for s in after.values()} == first
    assert all(s.state.value == "exited" for s in after.values())
    assert reports == []
    assert_gone(first)


def test_final_report_to_a_vanished_controller_gives_up_at_its_deadline() -> None:
    from taskd_core.client.manager import DLRecoverManager
    from taskd_core.models import Code

    with EmbeddedController() as controller:
        address = controller.address
    manager = DLRecoverManager(pb.ClientInfo(jobId="job", role="r"), address, rpc_timeout=0.2)
    try:
        assert manager.report_agent_exit(143, "interrupted", deadline=0.5) == Code.SERVER_INNER_ERROR
    finally:
        manager.close()


def test_agent_obeys_sigterm_while_a_fault_report_retries(make_job, caplog) -> None:  # type: ignore[no-untyped-def]
    """The controller is gone when a worker dies: the report may retry for 10 minutes, but the agent
    keeps watching, so SIGTERM still stops every worker and ends it at once."""
    job, controller = make_job(JobPolicy(**FAST), report_deadline=600.0)
    pids = job.wait_starts(2)
    controller.stop()
    os.kill(pids[1, 0], signal.SIGKILL)
    wait_until(lambda: "ReportProcessFault for job job failed" in caplog.text, "the fault report to retry", 60,
               explain=lambda: caplog.text)
    job.agent.shutdown(signal.SIGTERM)
    outcome = job.result.result(timeout=120)
    assert (outcome.kind, outcome.exit_code) == (Outcome.INTERRUPTED, 128 + signal.SIGTERM)
    assert_gone(pids.values())


NO_BACKOFF = RestartBackoff(initial=0.0)
CONTROLLER_FLAGS = ("--flush-seconds", "0", "--report-timeout", "30", "--max-cycles", "3")


def test_faults_during_outages_are_recovered_by_controllers_restarted_empty(tmp_path: Path, controller_process) -> None:
    """10 times: the controller is SIGKILLed, a worker dies meanwhile, a controller with an EMPTY state
    takes its port. The refused fault is re-sent after joining again and every time the job recovers."""
    port = free_port()
    listen = ("--listen", f"127.0.0.1:{port}")
    memory = Path(":memory:")
    ctl = controller_process(memory, *listen, *CONTROLLER_FLAGS)
    job = Job(tmp_path, ctl, connect_timeout=120, restart_backoff=NO_BACKOFF)
    try:
        for k in range(10):
            job.wait_starts(2 * (k + 1))
            ctl.kill()
            (job.out / f"kill-1-{k}").touch()
            wait_until((job.out / f"died-1-{k}").exists, f"rank 1 to die in outage {k}", 120, unless=job.ended)
            ctl = controller_process(memory, *listen, *CONTROLLER_FLAGS)
        job.wait_starts(22)
        outcome = job.finish()
        assert outcome.kind is Outcome.SUCCEEDED and outcome.exit_code == 0
    finally:
        job.close()


@pytest.mark.parametrize(("outage", "survives"), [(0.75, True), (1.5, False)])
def test_an_outage_is_ridden_out_for_the_connect_timeout(tmp_path: Path, outage: float, survives: bool) -> None:
    """The controller is away for ``outage`` x the connect timeout (the 45 s of a 60 s timeout, scaled):
    the job trains on and finishes; longer, the agent ends it saying the controller was unreachable.
    (In-process controllers: a new one binds in milliseconds, so the outage is what the test says.)"""
    timeout = 8.0
    port = free_port()
    state = str(tmp_path / "state.db")
    policy = JobPolicy(**FAST)
    ctl = EmbeddedController(listen=f"127.0.0.1:{port}", state=state, defaults=policy)
    job = Job(tmp_path, ctl, connect_timeout=timeout)
    try:
        first = job.wait_starts(2)
        wait_until(lambda: _subscribed(ctl.address), "the agent to subscribe", 120, unless=job.ended)
        ctl.stop()
        time.sleep(outage * timeout)
        if survives:
            ctl = EmbeddedController(listen=f"127.0.0.1:{port}", state=state, defaults=policy)
            wait_until(lambda: _subscribed(ctl.address), "the agent to subscribe again", 120, unless=job.ended)
            outcome = job.finish()
            assert outcome.kind is Outcome.SUCCEEDED and job.starts() == first  # trained through it
        else:
            outcome = job.result.result(timeout=120)
            assert outcome.kind is Outcome.FAILED and outcome.exit_code == 1
            assert "unreachable for 8 s" in outcome.reason and "gave the job up" not in outcome.reason
            assert_gone(first.values())
    finally:
        job.close()
        ctl.stop()


def _subscribed(address: str) -> bool:
    try:
        with QueryClient(address) as query:
            return any(a.subscribed for a in query.job("job").agents)
    except TaskdError:  # not there (yet), or the job is not registered again yet
        return False


def test_a_crash_looping_worker_is_restarted_with_growing_delays_then_given_up(make_job) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 dies right after every start: restarts are spaced by the backoff (none, 0.4, 0.8, 0.8 s)
    and the 5th failure finds the budget (4 per hour) spent; the agent says so."""
    backoff = RestartBackoff(initial=0.4, cap=0.8, healthy_after=60.0)
    job, _ = make_job(
        JobPolicy(max_cycles=4, cycle_window=3600, **FAST), independent=True, restart_backoff=backoff
    )
    for restart in range(6):
        (job.out / f"kill-1-{restart}").touch()
    outcome = job.result.result(timeout=120)
    assert outcome.kind is Outcome.GIVEN_UP and outcome.exit_code == 1
    assert "4 cycles within the last 3600 s, budget 4 per 3600 s" in outcome.reason
    starts = sorted(
        (int(p.name.split("-")[2]), float(p.read_text())) for p in job.out.glob("start-1-*")
    )
    assert [restart for restart, _ in starts] == [0, 1, 2, 3, 4]
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(starts)]
    # Lower bounds only: a loaded machine makes gaps longer, never shorter.
    for gap, delay in zip(gaps, [backoff.delay(n) for n in (1, 2, 3, 4)], strict=True):
        assert gap >= delay, (gaps, delay)


def test_a_failure_held_back_by_the_backoff_is_dropped_once_another_recovery_restarted_it(tmp_path: Path) -> None:
    """Two nodes. Node 1's rank fails again soon after a restart, so its backoff holds the report 3 s;
    meanwhile node 0's rank fails and its cycle restarts every rank. The held failure was of a worker
    that cycle replaced: reporting it would start a third cycle that restarts the fresh workers again."""
    controller = EmbeddedController(
        listen="127.0.0.1:0", state=":memory:",
        defaults=JobPolicy(strategies=(Strategy.RECOVER, Strategy.EXIT), expected_agents=2, **FAST),
    )
    held = RestartBackoff(initial=3.0, healthy_after=60.0)
    jobs = [
        Job(tmp_path / "n0", controller, nproc=1, nnodes=2, node_rank=0, restart_backoff=RestartBackoff(initial=0.0)),
        Job(tmp_path / "n1", controller, nproc=1, nnodes=2, node_rank=1, restart_backoff=held),
    ]
    try:
        n0, n1 = jobs
        n0.wait_starts(1), n1.wait_starts(1)
        (n1.out / "kill-1-0").touch()  # cycle 1, reported at once (the first failure)
        n0.wait_starts(2), n1.wait_starts(2)
        (n1.out / "kill-1-1").touch()  # failed again within 60 s of its start: held 3 s
        wait_until((n1.out / "died-1-1").exists, "rank 1 to die", 60)
        (n0.out / "kill-0-1").touch()  # cycle 2 restarts both, node 1's held rank too
        n0.wait_starts(3), n1.wait_starts(3)
        time.sleep(held.initial + 2.0)  # past the hold: the held failure would have started cycle 3
        assert sorted(n0.starts()) == [(0, 0), (0, 1), (0, 2)] and sorted(n1.starts()) == [(1, 0), (1, 1), (1, 2)]
        assert job_view(controller).cycle == 2
        for job in jobs:
            (job.out / "finish").touch()
        assert [job.result.result(timeout=120).kind for job in jobs] == [Outcome.SUCCEEDED] * 2
    finally:
        for job in jobs:
            job.close()
        controller.stop()


def test_restart_backoff_delays() -> None:
    backoff = RestartBackoff(initial=1.0, cap=5.0)
    assert [backoff.delay(n) for n in range(1, 7)] == [0.0, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert RestartBackoff(initial=0.0).delay(9) == 0.0
    with pytest.raises(ConfigError, match="restart backoff cap must be"):
        RestartBackoff(cap=-1.0)
