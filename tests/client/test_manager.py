"""DLRecoverManager against a real controller over loopback gRPC."""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from taskd_core.client.backoff import Backoff
from taskd_core.client.manager import DLRecoverManager
from taskd_core.controller.server import EmbeddedController
from taskd_core.errors import ConfigError, ControllerUnavailableError, RecoveryDisabledError, TaskdError
from taskd_core.models import Code, JobPolicy, Signal, SignalType, Strategy
from taskd_core.rpc import recover_pb2 as pb

FAST = JobPolicy(flush_seconds=0.0, report_timeout=30.0, max_cycles=3)
QUICK = Backoff(initial=0.02, cap=0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def controller() -> Iterator[EmbeddedController]:
    with EmbeddedController(listen="127.0.0.1:0", state=":memory:", defaults=FAST) as ctl:
        yield ctl


class Recorder:
    """A signal handler that answers like an agent whose actions all succeed."""

    def __init__(self, manager: DLRecoverManager, strategies: tuple[str, ...] = ("recover", "exit")) -> None:
        self.manager = manager
        self.strategies = strategies
        self.signals: queue.Queue[Signal] = queue.Queue()
        self.stops = 0
        #: when set, answering stopTrain waits for this event (a slow agent).
        self.hold: threading.Event | None = None
        self.busy = threading.Event()

    def __call__(self, signal: Signal) -> None:
        self.stops += signal.signal_type == SignalType.STOP_TRAIN
        if signal.signal_type == SignalType.STOP_TRAIN and self.hold is not None:
            self.busy.set()
            self.hold.wait(120)
        faults = {f.rank: int(f.fault_type.value) for f in signal.fault_ranks}
        if signal.signal_type == SignalType.STOP_TRAIN:
            self.manager.report_stop_complete(0, "stopped", faults)
        elif signal.signal_type == SignalType.GLOBAL_FAULT:
            self.manager.report_recover_strategy(faults, list(self.strategies))
        elif signal.signal_type == SignalType.CHANGE_STRATEGY and signal.change_strategy != Strategy.EXIT:
            self.manager.report_recover_status(0, "done", faults, signal.change_strategy)
        self.signals.put(signal)

    def next(self, kind: str) -> Signal:
        while True:
            signal = self.signals.get(timeout=60)
            if signal.signal_type == kind:
                return signal


def subscribe(manager: DLRecoverManager) -> threading.Thread:
    thread = threading.Thread(target=manager.start_subscribe, kwargs={"frame": "unused"}, daemon=True)
    thread.start()
    return thread


def make_manager(address: str, job: str, **kwargs: object) -> tuple[DLRecoverManager, Recorder]:
    recorders: list[Recorder] = []
    manager = DLRecoverManager(
        pb.ClientInfo(jobId=job, role="master agent"),
        address,
        handler=lambda signal: recorders[0](signal),
        backoff=QUICK,
        **kwargs,  # type: ignore[arg-type]
    )
    recorders.append(Recorder(manager))
    return manager, recorders[0]


def test_full_recover_cycle_through_the_seed_api(controller: EmbeddedController) -> None:
    """Fault report → stop → strategies → recover → status, then close() ends the subscription."""
    manager, recorder = make_manager(controller.address, "job-a")
    thread = subscribe(manager)
    try:
        assert manager.report_process_fault({1: 1}) == Code.OK
        stop = recorder.next(SignalType.STOP_TRAIN)
        assert [f.rank for f in stop.fault_ranks] == [1]
        change = recorder.next(SignalType.CHANGE_STRATEGY)
        assert change.change_strategy == "recover" and change.uuid == stop.uuid
    finally:
        manager.close()
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_kill_master_ends_the_subscription(controller: EmbeddedController) -> None:
    """A job whose only strategy is exit is given up: start_subscribe returns and .killed is set."""
    manager, recorder = make_manager(controller.address, "job-kill")
    recorder.strategies = ("exit",)
    thread = subscribe(manager)
    try:
        manager.report_process_fault({0: 1})
        thread.join(timeout=60)
        assert not thread.is_alive()
        assert manager.killed
    finally:
        manager.close()


def test_init_answers_false_when_recovery_is_off() -> None:
    with EmbeddedController(listen="127.0.0.1:0", state=":memory:", defaults=JobPolicy(recovery_enabled=False)) as ctl:
        manager = DLRecoverManager(pb.ClientInfo(jobId="off", role="r"), ctl.address, handler=print, backoff=QUICK)
        try:
            assert manager.init_clusterd() is False
            with pytest.raises(RecoveryDisabledError, match="'off'"):
                manager.start_subscribe("unused")
        finally:
            manager.close()


def test_init_gives_up_at_its_deadline() -> None:
    manager = DLRecoverManager(
        pb.ClientInfo(jobId="j", role="r"), f"127.0.0.1:{free_port()}", connect_deadline=0.5, rpc_timeout=0.2, backoff=QUICK
    )
    try:
        with pytest.raises(ControllerUnavailableError, match="did not answer"):
            manager.init_clusterd()
    finally:
        manager.close()


def test_report_outside_a_cycle_gets_a_clear_code(controller: EmbeddedController) -> None:
    manager = DLRecoverManager(pb.ClientInfo(jobId="idle", role="r"), controller.address, backoff=QUICK)
    try:
        assert manager.init_clusterd()
        assert manager.register().code == Code.OK
        assert manager.report_stop_complete(0, "x", {0: 1}) == Code.ORDER_MIX
    finally:
        manager.close()


def test_report_for_unregistered_job_after_retry(controller: EmbeddedController) -> None:
    """Re-register-and-retry-once cannot help a job that was never initialised: 408/400 comes back."""
    manager = DLRecoverManager(pb.ClientInfo(jobId="never", role="r"), controller.address, backoff=QUICK)
    try:
        assert manager.report_process_fault({0: 1}) == Code.UNREGISTERED
    finally:
        manager.close()


def test_resubscription_after_controller_restart_does_not_repeat_a_signal(tmp_path: Path) -> None:
    """Mid-cycle the controller restarts on its state file; each agent executes each signal once.

    Agent a1 has executed and answered ``stopTrain`` when the controller goes
    down, agent a2 is still busy with it. After the restart both re-subscribe
    and get the cycle's latest signal again: a1 skips it (same sequence
    number), a2's answer completes the wait, and the cycle goes on.
    """
    port = free_port()
    address = f"127.0.0.1:{port}"
    state = str(tmp_path / "state.db")
    policy = JobPolicy(flush_seconds=0.0, report_timeout=120.0, expected_agents=2)
    ctl = EmbeddedController(listen=address, state=state, defaults=policy)
    a1, rec1 = make_manager(address, "job-restart", agent_id="a1")
    a2, rec2 = make_manager(address, "job-restart", agent_id="a2")
    release = rec2.hold = threading.Event()
    threads = [subscribe(a1), subscribe(a2)]
    try:
        assert a1.init_clusterd() and a2.init_clusterd()
        # Registered before the fault, so both are members of its cycle whatever their threads do.
        assert a1.register().code == Code.OK and a2.register().code == Code.OK
        assert a1.report_process_fault({0: 1}) == Code.OK
        rec1.next(SignalType.STOP_TRAIN)
        assert rec2.busy.wait(60)
        ctl.stop()
        ctl = EmbeddedController(listen=address, state=state, defaults=policy)
        release.set()
        assert rec1.next(SignalType.CHANGE_STRATEGY).change_strategy == "recover"
        assert rec2.next(SignalType.CHANGE_STRATEGY).change_strategy == "recover"
        assert rec1.stops == 1 and rec2.stops == 1
    finally:
        release.set()
        a1.close()
        a2.close()
        for thread in threads:
            thread.join(timeout=30)
        ctl.stop()


def test_the_client_alone_needs_a_handler(controller: EmbeddedController) -> None:
    """The core client does not know the agent: without a handler it says how to get one."""
    manager = DLRecoverManager(pb.ClientInfo(jobId="j", role="r"), controller.address, backoff=QUICK)
    try:
        with pytest.raises(ConfigError, match="no signal handler for frame 'pytorch'.*recover_manager"):
            manager.start_subscribe(frame="pytorch")
    finally:
        manager.close()


def test_module_functions_need_an_open_manager() -> None:
    from taskd.python.toolkit.recover_module import recover_manager

    with pytest.raises(TaskdError, match="no DLRecoverManager is open"):
        recover_manager.report_process_fault({0: 1})
