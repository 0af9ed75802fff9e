"""The recovery state machine's transition table, without I/O or gRPC."""

from __future__ import annotations

import json
import re

import pytest

from taskd_core.controller.machine import (
    _TABLE,
    _TARGETS,
    AgentExited,
    AgentInfo,
    AgentLost,
    DeadlinePassed,
    FaultReported,
    JobMachine,
    State,
    StatusReported,
    StopReported,
    StrategiesReported,
)
from taskd_core.controller.store import snapshot_from_dict, snapshot_to_dict
from taskd_core.errors import IllegalTransition
from taskd_core.models import SPARE_ROLE, Code, FaultRank, FaultType, JobPolicy, Strategy

NOW = 1_000.0
ALL = tuple(Strategy)


def machine(*agents: str, **policy) -> JobMachine:
    table = {a: AgentInfo(a) for a in agents or ("a",)}
    return JobMachine(
        "job", JobPolicy(**{"strategies": ALL, "flush_seconds": 0, "report_timeout": 5, **policy}), table
    )


def fault(m: JobMachine, *faults: tuple[int, str], agent: str = "a"):
    ranks = tuple(FaultRank(r, FaultType(t)) for r, t in faults or ((0, "1"),))
    return m.handle(FaultReported(agent, ranks), NOW)


def to_decision(m: JobMachine, strategies=("recover", "dump", "exit"), faults=((0, "1"),)):
    """Run the machine to its first changeStrategy; return that reaction."""
    fault(m, *faults)
    for agent in m.snap.members:
        m.handle(StopReported(agent, 0), NOW)
    reaction = None
    for agent in m.snap.members:
        reaction = m.handle(StrategiesReported(agent, tuple(strategies)), NOW)
    return reaction


def kinds(reaction) -> list[str]:
    return [s.signal_type for s in reaction.signals]


def test_every_state_has_a_rule_for_agent_exit_and_no_rule_is_for_a_missing_handler():
    assert all((state, AgentExited) in _TABLE for state in State)
    assert all(callable(handler) for handler in _TABLE.values())


def test_a_fault_starts_a_cycle_with_stop_train():
    m = machine()
    r = fault(m, (3, "1"))
    assert r.reply.code == Code.OK and r.persist
    (stop,) = r.signals
    assert (stop.signal_type, stop.actions, stop.seq, stop.cycle) == ("stopTrain", ("stop_train",), 1, 1)
    assert re.fullmatch(r"[0-9a-f]+-[0-9a-f]{32}", stop.uuid)
    assert m.state is State.WAIT_STOP and m.snap.deadline == NOW + 5
    assert [j.kind for j in r.journal][:2] == ["fault", "cycle started"]


def test_the_flush_window_collects_faults_and_stale_deadlines_are_ignored():
    m = machine(flush_seconds=1)
    fault(m, (1, "0"))
    assert m.state is State.FLUSHING and m.snap.deadline == NOW + 1
    fault(m, (1, "1"), (2, "0"))
    fault(m, (1, "0"))  # a normal fault stays normal
    assert m.snap.faults == {1: FaultType.NORMAL, 2: FaultType.ON_CHIP_MEMORY}
    assert not m.handle(DeadlinePassed(m.snap.step - 1), NOW).signals
    r = m.handle(DeadlinePassed(m.snap.step), NOW + 1)
    assert kinds(r) == ["stopTrain"] and len(r.signals[0].fault_ranks) == 2


def test_reports_that_do_not_fit_get_order_mix_naming_the_expectation():
    m = machine("a", "b")
    r = m.handle(StopReported("a", 0), NOW)
    assert r.reply.code == Code.ORDER_MIX and "no recovery cycle" in r.reply.info and not r.persist
    fault(m)
    r = m.handle(StatusReported("a", 0, "recover"), NOW)
    assert r.reply.code == Code.ORDER_MIX and "expects ReportStopComplete" in r.reply.info
    r = m.handle(StopReported("a", 0, uuid="0-old"), NOW)
    assert r.reply.code == Code.ORDER_MIX and "stale uuid" in r.reply.info
    r = m.handle(StopReported("late", 0), NOW)
    assert r.reply.code == Code.ORDER_MIX and "not part of the cycle" in r.reply.info
    assert m.handle(StopReported("a", 0), NOW).reply.code == Code.OK
    repeat = m.handle(StopReported("a", 0), NOW)
    assert repeat.reply.code == Code.OK and "repeated" in repeat.reply.info and not repeat.signals


def test_waits_end_only_when_every_agent_answered():
    m = machine("a", "b")
    fault(m)
    assert not m.handle(StopReported("a", 0), NOW).signals
    r = m.handle(StopReported("b", 0), NOW)
    assert kinds(r) == ["globalFault"] and m.state is State.WAIT_STRATEGIES


def test_expected_agents_keep_a_wait_open_until_its_deadline():
    m = machine("a", expected_agents=2)
    fault(m)
    assert not m.handle(StopReported("a", 0), NOW).signals
    r = m.handle(DeadlinePassed(m.snap.step), NOW + 5)
    assert kinds(r) == ["changeStrategy", "killMaster"] and m.state is State.GIVEN_UP


@pytest.mark.parametrize(
    ("faults", "reported", "policy", "wire"),
    [
        (((0, "0"),), ("retry", "recover"), ALL, ("retry", "", ("change_strategy",))),
        (((0, "2"), (1, "2")), ("retry",), ALL, ("retry", "", ("change_strategy",))),
        (
            ((0, "1"),),
            ("recover-in-place", "recover"),
            ALL,
            ("recover", "recover-in-place", ("change_strategy", "fault_nodes_restart")),
        ),
        (
            ((0, "1"),),
            ("retry", "recover-in-place", "recover"),
            ("recover", "exit"),
            ("recover", "", ("change_strategy",)),
        ),
        (((0, "0"), (1, "2")), ("retry", "recover"), ALL, ("recover", "", ("change_strategy",))),
        (((0, "1"),), ("dump", "recover"), ("dump", "exit"), ("dump", "", ("change_strategy",))),
        (
            ((0, "1"),),
            ("recover-live", "recover-in-place", "recover"),
            ALL,
            ("recover", "recover-live", ("change_strategy", "fault_nodes_restart")),
        ),
        (((0, "1"),), ("recover-live", "recover"), ("recover", "exit"), ("recover", "", ("change_strategy",))),
    ],
)
def test_strategy_choice_follows_the_ladder(faults, reported, policy, wire):
    m = machine(strategies=policy)
    r = to_decision(m, reported, faults)
    (change,) = r.signals
    assert (change.change_strategy, change.extra_params, change.actions) == wire
    assert m.state is State.WAIT_STATUS


def test_success_returns_to_idle_and_clears_the_cycle():
    m = machine()
    to_decision(m)
    r = m.handle(StatusReported("a", 0, "recover"), NOW)
    assert m.state is State.IDLE and m.snap.uuid == "" and m.snap.last_signal is None and not r.signals
    assert "cycle succeeded" in [j.kind for j in r.journal]


def test_recover_in_place_results_may_name_either_strategy():
    m = machine()
    to_decision(m, ("recover-in-place", "exit"))
    assert m.handle(StatusReported("a", 0, "dump"), NOW).reply.code == Code.ORDER_MIX
    assert m.handle(StatusReported("a", 0, "recover"), NOW).reply.code == Code.OK
    assert m.state is State.IDLE


def test_a_failed_live_recovery_falls_back_to_a_full_restart_in_the_same_cycle():
    m = machine("a", "b")
    to_decision(m, ("recover-live", "recover", "exit"))
    assert m.snap.strategy == "recover-live"
    assert m.handle(StatusReported("a", 0, "recover"), NOW).reply.code == Code.OK  # either name, like in-place
    r = m.handle(StatusReported("b", Code.RECOVERABLE_RETRY_ERROR, "recover-live"), NOW)
    (change,) = r.signals
    assert (change.change_strategy, change.extra_params, change.cycle) == ("recover", "", 1)
    assert m.snap.tried == ["recover-live", "recover"] and m.state is State.WAIT_STATUS


def test_the_default_policy_offers_live_recovery_first_to_jobs_that_report_it():
    m = JobMachine("job", JobPolicy(flush_seconds=0), {"a": AgentInfo("a")})
    (change,) = to_decision(m, ("recover-live", "recover", "dump", "exit")).signals
    assert (change.change_strategy, change.extra_params) == ("recover", "recover-live")
    m = JobMachine("job", JobPolicy(flush_seconds=0), {"a": AgentInfo("a")})
    (change,) = to_decision(m, ("recover", "dump", "exit")).signals
    assert (change.change_strategy, change.extra_params) == ("recover", "")


def test_failures_walk_down_the_ladder_to_kill_master():
    m = machine()
    to_decision(m, ("retry", "recover-in-place", "recover", "dump", "exit"), ((0, "0"),))
    assert m.snap.strategy == "retry"
    steps = []
    for strategy in ("retry", "recover-in-place", "recover"):
        r = m.handle(StatusReported("a", Code.CLIENT_ERROR, strategy), NOW)
        steps.append((r.signals[0].change_strategy, r.signals[0].extra_params))
    assert steps == [("recover", "recover-in-place"), ("recover", ""), ("dump", "")]
    r = m.handle(StatusReported("a", 0, "dump"), NOW)
    assert [(s.signal_type, s.change_strategy, s.extra_params) for s in r.signals] == [
        ("changeStrategy", "exit", "dump_exit"),
        ("killMaster", "", "dump done, job exits"),
    ]
    assert m.state is State.GIVEN_UP and m.snap.tried == ["retry", "recover-in-place", "recover", "dump"]


def test_status_deadline_counts_silent_agents_as_failed():
    m = machine("a", "b")
    to_decision(m)
    m.handle(StatusReported("a", 0, "recover"), NOW)
    r = m.handle(DeadlinePassed(m.snap.step), NOW + 5)
    assert r.signals[0].change_strategy == "dump"
    deadline = next(j for j in r.journal if j.kind == "deadline")
    assert deadline.detail["silent"] == ["b"]


def test_a_silent_strategy_report_leaves_only_exit():
    m = machine("a", "b")
    fault(m)
    m.handle(StopReported("a", 0), NOW)
    m.handle(StopReported("b", 0), NOW)
    m.handle(StrategiesReported("a", ("recover",)), NOW)
    r = m.handle(DeadlinePassed(m.snap.step), NOW + 5)
    assert kinds(r) == ["changeStrategy", "killMaster"] and r.signals[0].change_strategy == "exit"


@pytest.mark.parametrize("code", [Code.PROCESS_NOT_READY, Code.CLIENT_ERROR])
def test_a_failed_stop_gives_up(code):
    m = machine()
    fault(m)
    r = m.handle(StopReported("a", code), NOW)
    assert kinds(r) == ["changeStrategy", "killMaster"] and m.state is State.GIVEN_UP


def test_the_cycle_budget_gives_up_on_the_next_fault():
    m = machine(max_cycles=1)
    to_decision(m)
    m.handle(StatusReported("a", 0, "recover"), NOW)
    r = fault(m)
    assert kinds(r) == ["killMaster"] and m.state is State.GIVEN_UP and "budget" in m.snap.outcome
    assert fault(m).reply.code == Code.ORDER_MIX


def test_faults_during_wait_status_start_the_next_cycle_after_success():
    m = machine()
    to_decision(m)
    assert fault(m, (7, "1")).reply.code == Code.OK
    assert m.snap.pending == {7: FaultType.NORMAL}
    r = m.handle(StatusReported("a", 0, "recover"), NOW)
    assert kinds(r) == ["stopTrain"] and r.signals[0].cycle == 2 and m.snap.faults == {7: FaultType.NORMAL}


def covered_fault(m: JobMachine, *ranks: int, started: int | None):
    faults = tuple(FaultRank(r, FaultType.NORMAL) for r in ranks)
    return m.handle(FaultReported("a", faults, started_cycle=started), NOW)


def test_a_late_fault_of_workers_the_cycle_restarts_anyway_does_not_start_another():
    m = machine()
    to_decision(m)  # cycle 1 decided recover: every worker restarts
    r = covered_fault(m, 1, 2, started=0)
    assert r.reply.code == Code.OK and "covered by cycle 1" in r.reply.info
    assert m.snap.pending == {} and r.journal[0].detail["covered"] == 1
    r = m.handle(StatusReported("a", 0, "recover"), NOW)
    assert m.state is State.IDLE and r.signals == ()


@pytest.mark.parametrize("started", [1, None])
def test_a_fault_of_workers_this_cycle_started_or_of_unknown_start_waits_for_the_next_cycle(started):
    m = machine()
    to_decision(m)
    covered_fault(m, 1, started=started)
    assert m.snap.pending == {1: FaultType.NORMAL}


def test_recover_in_place_covers_only_the_ranks_it_restarts():
    m = machine()
    to_decision(m, strategies=("recover-in-place", "recover"), faults=((3, "1"),))
    assert m.snap.strategy == "recover-in-place"
    r = covered_fault(m, 3, 1, started=0)
    assert r.journal[0].detail["ranks"] == {"3": "1"} and m.snap.pending == {1: FaultType.NORMAL}


def test_faults_during_the_stop_wait_join_the_cycle():
    m = machine()
    fault(m, (1, "1"))
    fault(m, (2, "1"))
    r = m.handle(StopReported("a", 0), NOW)
    assert [f.rank for f in r.signals[0].fault_ranks] == [1, 2]


def test_fault_nodes_come_from_the_agents_rank_lists():
    m = machine("a", "b")
    m.agents["a"].node_rank, m.agents["a"].rank_ids = 0, (0, 1)  # type: ignore[index]
    m.agents["b"].node_rank, m.agents["b"].rank_ids = 1, (2, 3)  # type: ignore[index]
    fault(m, (2, "1"))
    m.handle(StopReported("a", 0), NOW)
    (glob,) = m.handle(StopReported("b", 0), NOW).signals
    assert glob.actions == ("on_global_rank", "fault_nodes_exit") and glob.node_rank_ids == ("1",)


def test_every_agent_exiting_zero_finishes_an_idle_job():
    m = machine("a", "b")
    for name in ("a", "b"):
        m.agents[name].exit_code = 0  # type: ignore[index]
        r = m.handle(AgentExited(name, 0), NOW)
    assert m.state is State.FINISHED and r.journal[-1].kind == "job finished"


def test_signal_sequence_is_job_wide_and_the_snapshot_round_trips_through_json():
    m = machine()
    to_decision(m)
    data = json.loads(json.dumps(snapshot_to_dict(m.snap)))
    copy = snapshot_from_dict(data)
    assert copy == m.snap and copy.last_signal.seq == 3


def _diagram_edges() -> set[tuple[State, State]]:
    """The ``A --label--> B`` lines of the module docstring; ``A / B`` lists several states."""
    import taskd_core.controller.machine as module

    edges = set()
    for line in (module.__doc__ or "").splitlines():
        found = re.match(r"\s+([A-Z_ /]+?) --.*?--> ([A-Z_ /]+?)(\s{2,}\(.*)?$", line)
        if found:
            for source in found.group(1).split("/"):
                for target in found.group(2).split("/"):
                    edges.add((State[source.strip()], State[target.strip()]))
    return edges


def test_the_module_diagram_shows_exactly_the_declared_transitions():
    declared = {(source, target) for (source, _), targets in _TARGETS.items() for target in targets}
    assert _diagram_edges() == declared
    assert set(_TARGETS) <= set(_TABLE)


def test_an_undeclared_transition_is_refused(monkeypatch):
    """A handler that would enter a state its table row does not declare raises instead of corrupting the job."""
    monkeypatch.setitem(_TARGETS, (State.IDLE, FaultReported), frozenset({State.FLUSHING}))
    m = machine(flush_seconds=0)
    with pytest.raises(IllegalTransition, match="FaultReported in idle may not lead to wait-stop"):
        fault(m)


def _one_cycle(m: JobMachine, now: float):
    """A fault at ``now`` recovered by recover; the fault's reaction."""
    r = m.handle(FaultReported("a", (FaultRank(0, FaultType("1")),)), now)
    if m.state is State.GIVEN_UP:
        return r
    m.handle(StopReported("a", 0), now)
    m.handle(StrategiesReported("a", ("recover", "exit")), now)
    m.handle(StatusReported("a", 0, "recover"), now)
    assert m.state is State.IDLE
    return r


def test_the_cycle_budget_counts_within_its_window():
    m = machine(max_cycles=2, cycle_window=100)
    _one_cycle(m, NOW)
    _one_cycle(m, NOW + 50)
    # The first cycle left the window: a third fault 101 s later is recovered, not fatal.
    _one_cycle(m, NOW + 101)
    assert m.snap.cycle == 3 and len(m.snap.cycle_starts) == 2
    r = _one_cycle(m, NOW + 140)
    assert kinds(r) == ["killMaster"] and m.state is State.GIVEN_UP
    reason = m.snap.outcome
    assert "2 cycles within the last 100 s" in reason and "budget 2 per 100 s" in reason
    assert r.signals[0].extra_params == reason  # the agents learn why
    assert snapshot_from_dict(json.loads(json.dumps(snapshot_to_dict(m.snap)))).cycle_starts == m.snap.cycle_starts


def test_a_zero_cycle_window_counts_over_the_jobs_life():
    m = machine(max_cycles=1, cycle_window=0)
    _one_cycle(m, NOW)
    r = _one_cycle(m, NOW + 10**6)
    assert kinds(r) == ["killMaster"] and "1 of 1 cycles over the job's life" in m.snap.outcome


def test_a_node_replaced_during_a_live_round_starts_the_next_cycle_with_the_spare():
    """The round in flight holds the lost node's ranks (its state hand-over may be under way): it cannot
    form, so a new cycle's round takes the spare in, instead of waiting for reports that cannot succeed."""
    m = machine("a", "b", "spare")
    for name, node, ranks in (("a", 0, (0, 1)), ("b", 1, (2, 3))):
        m.agents[name].node_rank, m.agents[name].rank_ids = node, ranks  # type: ignore[index]
    m.agents["spare"].role, m.agents["spare"].last_seen = SPARE_ROLE, NOW  # type: ignore[index]
    to_decision(m, strategies=("recover-live", "recover", "dump", "exit"), faults=((3, "1"),))
    assert (m.state, m.snap.strategy, m.snap.cycle) == (State.WAIT_STATUS, "recover-live", 1)
    old = m.snap.uuid
    r = m.handle(AgentLost("b", "its signal stream ended"), NOW)
    assert (m.state, m.snap.cycle, m.snap.members) == (State.WAIT_STOP, 2, ["a", "spare"])
    (stop,) = r.signals
    assert stop.signal_type == "stopTrain" and [f.rank for f in stop.fault_ranks] == [2, 3]
    assert [e.kind for e in r.journal if e.kind in ("node replaced", "strategy failed")] == [
        "node replaced",
        "strategy failed",
    ]
    # The survivor's answer to the broken round belongs to the cycle left behind.
    late = m.handle(StatusReported("a", int(Code.RECOVERABLE_RETRY_ERROR), "recover-live", old), NOW)
    assert late.reply.code == Code.ORDER_MIX and m.state is State.WAIT_STOP


def test_a_node_replaced_during_a_whole_restart_joins_it_in_the_cycle_in_flight():
    m = machine("a", "b", "spare")
    for name, node, ranks in (("a", 0, (0, 1)), ("b", 1, (2, 3))):
        m.agents[name].node_rank, m.agents[name].rank_ids = node, ranks  # type: ignore[index]
    m.agents["spare"].role, m.agents["spare"].last_seen = SPARE_ROLE, NOW  # type: ignore[index]
    to_decision(m, faults=((3, "1"),))
    r = m.handle(AgentLost("b"), NOW)
    assert (m.state, m.snap.cycle, m.snap.members) == (State.WAIT_STATUS, 1, ["a", "spare"]) and not r.signals
