"""DLRecoverManager against a real controller over loopback gRPC."""

from __future__ import annotations

import concurrent.futures
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from taskd_core.client.backoff import Backoff
from taskd_core.client.manager import DLRecoverManager
from taskd_core.client.query import QueryClient
from taskd_core.controller.runtime import Limits
from taskd_core.controller.server import STREAM_DEAD_AFTER, EmbeddedController
from taskd_core.errors import (
    ConfigError,
    ControllerUnavailableError,
    RecoveryDisabledError,
    RegistrationRefusedError,
    TaskdError,
)
from taskd_core.models import Code, FaultRank, FaultType, JobPolicy, Signal, SignalType, Strategy
from taskd_core.rpc import recover_pb2 as pb
from taskd_core.rpc import recover_pb2_grpc as pb_grpc
from taskd_core.testing import free_port, wait_until

FAST = JobPolicy(flush_seconds=0.0, report_timeout=30.0, max_cycles=3)
QUICK = Backoff(initial=0.02, cap=0.2)


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
        with pytest.raises(ControllerUnavailableError, match=r"unreachable for [\d.]+ s"):
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


def test_a_report_for_a_job_the_controller_does_not_know_joins_it_first(controller: EmbeddedController) -> None:
    """A 400 (unknown job) is answered by Init + Register and the report is sent again."""
    manager = DLRecoverManager(pb.ClientInfo(jobId="never", role="r"), controller.address, backoff=QUICK)
    try:
        assert manager.report_process_fault({0: 1}) == Code.OK
    finally:
        manager.close()


def test_a_refusal_that_joining_cannot_fix_returns_its_code(controller: EmbeddedController) -> None:
    """A report of a cycle the controller is not in is re-sent once after re-registering, then given back."""
    manager = DLRecoverManager(pb.ClientInfo(jobId="stale", role="r"), controller.address, backoff=QUICK)
    try:
        manager.rejoin()
        assert manager.report_recover_status(0, "done", {0: 1}, "recover") == Code.ORDER_MIX
    finally:
        manager.close()


def test_a_fault_report_reaches_a_controller_that_restarted_without_its_state() -> None:
    """The controller comes back empty: the refused fault is re-sent after joining again."""
    port = free_port()
    first = EmbeddedController(listen=f"127.0.0.1:{port}", defaults=FAST)
    manager = DLRecoverManager(pb.ClientInfo(jobId="lost", role="r"), first.address, backoff=QUICK)
    try:
        manager.rejoin()
        first.stop()
        with EmbeddedController(listen=f"127.0.0.1:{port}", defaults=FAST) as second:
            assert manager.report_process_fault({1: 1}) == Code.OK
            with QueryClient(second.address) as query:
                job = query.job("lost", events=50)
            assert job.cycle == 1 and job.faults == (FaultRank(1, FaultType.NORMAL),)
    finally:
        manager.close()


def test_a_report_to_a_controller_that_stays_away_ends_at_its_deadline_with_a_reason(caplog) -> None:
    manager = DLRecoverManager(
        pb.ClientInfo(jobId="gone", role="r"), f"127.0.0.1:{free_port()}", report_deadline=1.0, backoff=QUICK
    )
    try:
        assert manager.report_process_fault({0: 1}) == Code.SERVER_INNER_ERROR
        assert any("not taken: controller unreachable for 1 s" in r.getMessage() for r in caplog.records)
    finally:
        manager.close()


@pytest.mark.parametrize(("job_id", "code"), [("x" * 300, "409"), ("bad\njob", "409")])
def test_init_names_a_bad_job_id_at_once(controller: EmbeddedController, job_id: str, code: str) -> None:
    manager = DLRecoverManager(pb.ClientInfo(jobId=job_id, role="r"), controller.address, connect_deadline=120, backoff=QUICK)
    try:
        with pytest.raises(RegistrationRefusedError, match=f"refused Init \\({code}: .*fix the job id"):
            manager.init_clusterd()
    finally:
        manager.close()


def test_init_names_a_full_controller_at_once() -> None:
    with EmbeddedController(defaults=FAST, limits=Limits(max_jobs=1)) as ctl:
        first = DLRecoverManager(pb.ClientInfo(jobId="one", role="r"), ctl.address, backoff=QUICK)
        second = DLRecoverManager(
            pb.ClientInfo(jobId="two", role="r"), ctl.address, connect_deadline=120, backoff=QUICK, handler=print
        )
        try:
            first.rejoin()
            with pytest.raises(RegistrationRefusedError, match="\\(500: .*serves as many jobs"):
                second.start_subscribe("unused")
        finally:
            first.close()
            second.close()


class _Denying(pb_grpc.RecoverServicer):
    def Init(self, request: pb.ClientInfo, context: grpc.ServicerContext) -> pb.Status:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "job token does not match")


def test_init_names_a_permission_error_at_once() -> None:
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    pb_grpc.add_RecoverServicer_to_server(_Denying(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    manager = DLRecoverManager(pb.ClientInfo(jobId="j", role="r"), f"127.0.0.1:{port}", connect_deadline=120, backoff=QUICK)
    try:
        with pytest.raises(RegistrationRefusedError, match="PERMISSION_DENIED: job token does not match.*token"):
            manager.init_clusterd()
    finally:
        manager.close()
        server.stop(0)


@pytest.mark.parametrize(("outage", "survives"), [(0.75, True), (1.5, False)])
def test_an_outage_is_ridden_out_until_the_connect_deadline(tmp_path: Path, outage: float, survives: bool) -> None:
    """The stream is lost for ``outage`` x the connect deadline: within it the subscription comes back,
    beyond it start_subscribe ends saying for how long the controller was unreachable."""
    deadline = 6.0
    port = free_port()
    state = str(tmp_path / "state.db")
    ctl = EmbeddedController(listen=f"127.0.0.1:{port}", state=state, defaults=FAST)
    manager, recorder = make_manager(ctl.address, "outage", connect_deadline=deadline)
    errors: list[BaseException] = []

    def follow() -> None:
        try:
            manager.start_subscribe("unused")
        except TaskdError as exc:
            errors.append(exc)

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    try:
        wait_until(lambda: subscribed(ctl.address, "outage"), "the agent to subscribe")
        ctl.stop()
        lost = time.monotonic()
        thread.join(timeout=outage * deadline)
        if survives:
            assert thread.is_alive(), errors
            ctl = EmbeddedController(listen=f"127.0.0.1:{port}", state=state, defaults=FAST)
            wait_until(lambda: subscribed(ctl.address, "outage"), "the agent to subscribe")
            assert manager.report_process_fault({0: 1}) == Code.OK
            recorder.next(SignalType.STOP_TRAIN)
        else:
            thread.join(timeout=60)
            assert not thread.is_alive()
            (error,) = errors
            assert isinstance(error, ControllerUnavailableError) and "unreachable for 6 s" in str(error)
            assert time.monotonic() - lost >= deadline - 0.5
    finally:
        manager.close()
        thread.join(timeout=30)
        ctl.stop()


def subscribed(address: str, job_id: str, agent_id: str = "master agent") -> bool:
    """Whether ``agent_id`` of ``job_id`` holds its signal stream (False while the controller is away)."""
    try:
        with QueryClient(address) as query:
            return any(a.subscribed for a in query.job(job_id).agents if a.agent_id == agent_id)
    except TaskdError:
        return False


_FROZEN_AGENT = """
import sys
from taskd_core.client.manager import DLRecoverManager
from taskd_core.rpc import recover_pb2 as pb
manager = DLRecoverManager(pb.ClientInfo(jobId=sys.argv[2], role="taskd agent"), sys.argv[1], agent_id="node-0", handler=print)
manager.start_subscribe("unused")
"""


def test_a_frozen_agent_is_replaced_by_a_new_agent_of_its_node(controller: EmbeddedController) -> None:
    """The old agent is SIGSTOPped holding its stream; the controller declares that stream dead
    within STREAM_DEAD_AFTER and the new agent with the same id takes over (it was ~121 s)."""
    old = subprocess.Popen([sys.executable, "-c", _FROZEN_AGENT, controller.address, "frozen"])
    replacement = None
    thread = None
    try:
        wait_until(lambda: subscribed(controller.address, "frozen", "node-0"), "node-0 to subscribe")
        old.send_signal(signal.SIGSTOP)
        frozen = time.monotonic()
        replacement, recorder = make_manager(controller.address, "frozen", agent_id="node-0")
        thread = subscribe(replacement)
        assert replacement.report_process_fault({0: 1}) == Code.OK
        recorder.next(SignalType.STOP_TRAIN)  # only a live subscription gets it
        took = time.monotonic() - frozen
        # Generous for a loaded machine; the bound is STREAM_DEAD_AFTER plus one client backoff.
        assert took < 60, f"replacement took {took:.1f}s (bound {STREAM_DEAD_AFTER}s)"
    finally:
        old.kill()
        old.wait(30)
        if replacement is not None:
            replacement.close()
        if thread is not None:
            thread.join(timeout=30)


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


@pytest.fixture
def replica_pair(etcd) -> Iterator[tuple[EmbeddedController, EmbeddedController]]:
    """Two controller replicas on one etcd prefix: (the leader, the standby)."""
    state = etcd.url()
    policy = JobPolicy(flush_seconds=0.0, report_timeout=120.0, expected_agents=2)
    group = [EmbeddedController(state=state, defaults=policy) for _ in range(2)]
    try:
        (leader,) = [c for c in group if c.leading]
        yield leader, next(c for c in group if c is not leader)
    finally:
        for ctl in group:
            ctl.stop()


def test_a_manager_given_every_replica_follows_the_leader(replica_pair) -> None:
    leader, standby = replica_pair
    manager, recorder = make_manager(f"{standby.address},{leader.address}", "job-follow", agent_id="a1")
    other, _ = make_manager([leader.address, standby.address], "job-follow", agent_id="a2")
    threads = [subscribe(manager), subscribe(other)]
    try:
        assert manager.init_clusterd() and other.init_clusterd()
        assert manager.controller == leader.address
        assert manager.report_process_fault({0: 1}) == Code.OK
        assert recorder.next(SignalType.CHANGE_STRATEGY).change_strategy == "recover"
    finally:
        manager.close()
        other.close()
        for thread in threads:
            thread.join(timeout=30)


def test_a_manager_follows_the_leader_its_own_replica_names_and_moves_its_stream_there() -> None:
    """The stream held with a replica that no longer leads (hung: it would stay open) moves to the new one."""
    with (
        EmbeddedController(listen="127.0.0.1:0", state=":memory:", defaults=FAST) as old,
        EmbeddedController(listen="127.0.0.1:0", state=":memory:", defaults=FAST) as new,
    ):
        leader = [old.address]
        manager, _ = make_manager(f"{old.address},{new.address}", "job-hint", leader_hint=lambda: leader[0])
        thread = subscribe(manager)
        try:
            wait_until(lambda: subscribed(old.address, "job-hint"), "the stream with the first leader", 30)
            # A HealthCheck that timed out may have moved the client first: its stream must move all the same.
            manager._endpoints.follow(new.address)
            leader[0] = new.address
            wait_until(lambda: subscribed(new.address, "job-hint"), "the stream with the new leader", 30)
            assert manager.controller == new.address
            wait_until(lambda: not subscribed(old.address, "job-hint"), "the old stream to end", 30)
        finally:
            manager.close()
            thread.join(timeout=30)


def test_a_fail_over_mid_cycle_looks_like_an_outage(replica_pair) -> None:
    """The leader goes while an agent carries out stopTrain: its report waits and goes to the new leader.

    Each agent executes each signal once (the new leader re-sends stopTrain
    under the same number), and the cycle ends as it would have.
    """
    leader, standby = replica_pair
    addresses = f"{leader.address},{standby.address}"
    a1, rec1 = make_manager(addresses, "job-failover", agent_id="a1")
    a2, rec2 = make_manager(addresses, "job-failover", agent_id="a2")
    release = rec2.hold = threading.Event()
    threads = [subscribe(a1), subscribe(a2)]
    try:
        assert a1.init_clusterd() and a2.init_clusterd()
        assert a1.register().code == Code.OK and a2.register().code == Code.OK
        assert a1.report_process_fault({0: 1}) == Code.OK
        rec1.next(SignalType.STOP_TRAIN)
        assert rec2.busy.wait(60)
        leader.stop()
        assert standby.wait_leading(60)
        release.set()
        assert rec1.next(SignalType.CHANGE_STRATEGY).change_strategy == "recover"
        assert rec2.next(SignalType.CHANGE_STRATEGY).change_strategy == "recover"
        assert rec1.stops == 1 and rec2.stops == 1
        assert a1.controller == a2.controller == standby.address
    finally:
        release.set()
        a1.close()
        a2.close()
        for thread in threads:
            thread.join(timeout=30)


@pytest.mark.parametrize("addresses", ["", " , ", "no-port", "host:0", "a:1,b"])
def test_a_bad_controller_address_list_is_refused_at_once(addresses: str) -> None:
    with pytest.raises(ConfigError, match="HOST:PORT"):
        DLRecoverManager(pb.ClientInfo(jobId="j", role="r"), addresses)
