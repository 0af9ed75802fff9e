"""The seed document's import paths, driven through a recovery cycle against a real controller."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest

# Exactly as the seed document writes them.
from taskd.python.toolkit.recover_module import recover_manager
from taskd.python.toolkit.recover_module.pb import recover_pb2 as pb
from taskd.python.toolkit.recover_module.pb import recover_pb2_grpc
from taskd.python.toolkit.recover_module.recover_manager import DLRecoverManager
from taskd_core.client.query import QueryClient
from taskd_core.controller.server import EmbeddedController
from taskd_core.errors import AdapterNotFoundError, ConfigError
from taskd_core.launcher.process_adapter import ProcessAdapter
from taskd_core.launcher.spec import LaunchSpec
from taskd_core.models import Code, JobPolicy, WorkerStatus
from taskd_core.plugins import hookimpl
from taskd_core.testing import wait_until

FAST = JobPolicy(flush_seconds=0.0, report_timeout=60.0, max_cycles=3)


@pytest.fixture
def controller() -> Iterator[EmbeddedController]:
    with EmbeddedController(listen="127.0.0.1:0", state=":memory:", defaults=FAST) as ctl:
        yield ctl


@pytest.fixture
def workers() -> Iterator[ProcessAdapter]:
    """Two real sleeping workers, as a user's own launcher would have started them."""
    spec = LaunchSpec(command=(sys.executable, "-c", "import time; time.sleep(120)"), nproc=2, job_id="seed")
    adapter = ProcessAdapter(spec)
    adapter.taskd_restart_all()
    yield adapter
    adapter.taskd_stop_workers(None, 5.0)


def test_a_cycle_through_the_seed_paths(controller: EmbeddedController, workers: ProcessAdapter) -> None:
    """A fault reported through the module function restarts the attached workers; the journal shows the cycle."""
    manager = DLRecoverManager(pb.ClientInfo(jobId="seed", role="master agent"), controller.address, adapter=workers)
    thread = threading.Thread(target=manager.start_subscribe, kwargs={"frame": "process"}, daemon=True)
    before = {rank: s.pid for rank, s in workers.taskd_monitor().items()}
    try:
        assert manager.init_clusterd()
        thread.start()
        assert recover_manager.report_process_fault({1: 1}) == Code.OK
        wait_until(lambda: "cycle succeeded" in _journal_kinds(controller, "seed"), "the cycle to succeed", 60,
                   explain=lambda: f"journal: {_journal_kinds(controller, 'seed')}")
        assert "strategy chosen" in _journal_kinds(controller, "seed")
    finally:
        manager.close()
        thread.join(timeout=30)
    after = {rank: s.pid for rank, s in workers.taskd_monitor().items()}
    assert all(after[rank] != before[rank] for rank in before), (before, after)


def _journal_kinds(controller: EmbeddedController, job: str) -> list[str]:
    with QueryClient(controller.address) as query:
        return [e.kind for e in query.job(job, events=100).events]


def test_the_seed_pb_is_the_wire_stubs() -> None:
    assert recover_pb2_grpc.RecoverStub and pb.ClientInfo(jobId="j").jobId == "j"


def test_unknown_frame_is_named(controller: EmbeddedController) -> None:
    with DLRecoverManager(pb.ClientInfo(jobId="j", role="r"), controller.address) as manager:
        with pytest.raises(AdapterNotFoundError, match="'nosuchframe'.*process"):
            manager.start_subscribe(frame="nosuchframe")


def test_a_frame_without_workers_fails_at_start_subscribe(controller: EmbeddedController) -> None:
    """The installed `process` adapter, built without a launch spec, has no workers: refused before any signal."""
    with DLRecoverManager(pb.ClientInfo(jobId="j", role="r"), controller.address) as manager:
        with pytest.raises(ConfigError, match="frame 'process': the adapter cannot show its workers.*LaunchSpec.*adapter="):
            manager.start_subscribe(frame="process")


class NoWorkers:
    """An adapter a user attached before starting anything."""

    @hookimpl
    def taskd_monitor(self) -> dict[int, WorkerStatus]:
        return {}


def test_an_attached_adapter_without_workers_is_refused(controller: EmbeddedController) -> None:
    with DLRecoverManager(pb.ClientInfo(jobId="j", role="r"), controller.address, adapter=NoWorkers()) as manager:
        with pytest.raises(ConfigError, match="frame 'mine': the adapter has no workers to act on; start the workers"):
            manager.start_subscribe(frame="mine")


def test_fault_codes_reach_the_journal(controller: EmbeddedController) -> None:
    """The reference's signature: report_process_fault(fault_ranks, fault_codes); the codes are kept."""
    with DLRecoverManager(pb.ClientInfo(jobId="codes", role="r"), controller.address) as manager:
        assert manager.init_clusterd() and manager.register().code == Code.OK
        assert recover_manager.report_process_fault({2: 1}, fault_codes={2: 8001}) == Code.OK
        with QueryClient(controller.address) as query:
            events = query.job("codes", events=50).events
    faults = [e.detail for e in events if e.kind == "fault"]
    assert faults[0]["codes"] == {"2": "8001"}


@pytest.mark.parametrize(
    "bad",
    [{"a": 1}, [1, 2], {1.5: 1}, {True: 1}, {1: "x"}, {-1: 1}, "0:1"],
    ids=["rank-text", "list", "rank-float", "rank-bool", "type-text", "rank-negative", "string"],
)
def test_bad_fault_ranks_return_a_code_and_log_why(
    controller: EmbeddedController, bad: object, caplog: pytest.LogCaptureFixture
) -> None:
    """The seed's report functions answer an int: bad fault_ranks give 409 and a logged reason, never a raise."""
    with DLRecoverManager(pb.ClientInfo(jobId="bad", role="r"), controller.address) as manager:
        assert recover_manager.report_process_fault(bad) == Code.INVALID_PARAM  # type: ignore[arg-type]
        assert recover_manager.report_stop_complete(0, "x", bad) == Code.INVALID_PARAM  # type: ignore[arg-type]
        assert recover_manager.report_recover_strategy(bad, ["exit"]) == Code.INVALID_PARAM  # type: ignore[arg-type]
        assert recover_manager.report_recover_status(0, "x", bad, "recover") == Code.INVALID_PARAM  # type: ignore[arg-type]
        assert manager.report_process_fault({0: 1}, {"r": 1}) == Code.INVALID_PARAM  # type: ignore[dict-item]
    assert "ReportProcessFault for job bad not sent" in caplog.text
    assert "ReportRecoverStatus for job bad not sent" in caplog.text


def test_register_for_another_job_is_refused(controller: EmbeddedController) -> None:
    with DLRecoverManager(pb.ClientInfo(jobId="mine", role="r"), controller.address) as manager:
        assert manager.init_clusterd()
        status = manager.register(pb.ClientInfo(jobId="theirs", role="r"))
        assert status.code == Code.INVALID_PARAM
        assert "serves job 'mine', not 'theirs'" in status.info
        assert manager.register(pb.ClientInfo(jobId="mine", role="other role")).code == Code.OK
