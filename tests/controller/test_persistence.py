"""State that survives the controller, on SQLite and on etcd: restarts, SIGKILL mid-cycle, damaged rows.

The store itself is tested against both backends in ``test_store.py``.
"""

from __future__ import annotations

import collections
import json
import sqlite3

import pytest

from taskd_core.controller.machine import Snapshot
from taskd_core.controller.store import JobRow, snapshot_to_dict
from taskd_core.controller.store_sqlite import SqliteStore as Store
from taskd_core.errors import ConfigError
from taskd_core.rpc import recover_pb2 as pb

JOB = "job-p"


def test_a_state_file_that_is_not_sqlite_is_a_config_error(tmp_path):
    bad = tmp_path / "state.db"
    bad.write_text("not a database" * 100)
    with pytest.raises(ConfigError, match="state file"):
        Store(str(bad)).load()


def test_a_state_file_from_before_fences_were_stored_loads_with_no_node_fenced(tmp_path):
    path = str(tmp_path / "old.db")
    old = sqlite3.connect(path)
    old.execute(
        "CREATE TABLE agents (job_id TEXT NOT NULL, agent_id TEXT NOT NULL, role TEXT NOT NULL, node_rank INTEGER,"
        " rank_ids TEXT NOT NULL, exit_code INTEGER, last_seen REAL NOT NULL, PRIMARY KEY (job_id, agent_id))"
    )
    old.execute("INSERT INTO agents VALUES (?, 'n0', 'taskd', 0, '[0, 1]', NULL, 3.0)", (JOB,))
    old.commit()
    old.close()
    store = Store(path)
    store.commit(JobRow(JOB, True, {}, snapshot_to_dict(Snapshot())), now=4.0)
    (job,) = store.load()
    assert [(a.agent_id, a.rank_ids, a.replaced_by) for a in job.agents] == [("n0", (0, 1), "")]


def test_a_restarted_controller_resumes_the_cycle_and_re_arms_its_deadline(
    controller_factory, make_agent, state_url
):
    state = state_url
    ctl = controller_factory(state=state)
    agent = make_agent(ctl.address, JOB).join()
    agent.fault()
    agent.expect("stopTrain")
    agent.stopped()
    agent.expect("globalFault")
    agent.set_report_timeout(2.0)
    agent.strategies(["recover", "dump", "exit"])
    change = agent.expect("changeStrategy", changeStrategy="recover")
    ctl.stop()
    ctl = controller_factory(state=state)
    again = make_agent(ctl.address, JOB).join()
    # The status deadline (stored as wall-clock time) passes with nobody answering: dump is next.
    sig = again.next_signal()
    if sig.signalSeq == change.signalSeq:  # re-sent before the deadline fired
        sig = again.next_signal()
    assert (sig.changeStrategy, sig.uuid, sig.signalSeq) == ("dump", change.uuid, change.signalSeq + 1)


def test_sigkill_mid_cycle_then_restart_completes_the_cycle_with_each_event_once(
    make_agent, controller_process, state_url
):
    state = state_url
    args = (
        "--report-timeout",
        "60",
        "--flush-seconds",
        "0",
        "--strategies",
        "recover,dump,exit",
        "--keepalive-interval",
        "0.5",
    )
    child = controller_process(state, *args)
    agents = [make_agent(child.address, JOB, f"n{i}").join() for i in range(2)]
    agents[0].fault({1: 1})
    for a in agents:
        a.expect("stopTrain")
        a.stopped()
    glob = [a.expect("globalFault") for a in agents][0]
    child.kill()

    # On etcd the new replica leads once the killed one's lease has run out.
    child = controller_process(state, *args).wait_serving()
    agents = [make_agent(child.address, JOB, f"n{i}").join() for i in range(2)]
    for a in agents:
        resent = a.expect("globalFault")
        assert (resent.signalSeq, resent.uuid) == (glob.signalSeq, glob.uuid)
        assert a.strategies(["recover", "exit"]).code == 0
    for a in agents:
        a.expect("changeStrategy", changeStrategy="recover", uuid=glob.uuid)
        assert a.status(0, "recover").code == 0
    view = agents[0].job(events=1000)
    assert child.terminate() == 0

    assert view.state == "idle" and view.cycle == 1
    kinds = collections.Counter(e.kind for e in view.events)
    assert kinds["job initialised"] == 1 and kinds["agent registered"] == 2 and kinds["fault"] == 1
    assert kinds["cycle started"] == 1 and kinds["cycle succeeded"] == 1
    seqs = [json.loads(e.detail)["seq"] for e in view.events if e.kind == "signal"]
    assert seqs == [1, 2, 3]
    reports = [
        (json.loads(e.detail)["step"], json.loads(e.detail)["agent"])
        for e in view.events
        if e.kind == "report"
    ]
    assert sorted(reports) == sorted(
        (step, f"n{i}") for step in ("stop", "strategies", "status") for i in range(2)
    )
    assert [e.seq for e in view.events] == sorted({e.seq for e in view.events})


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("snapshot", "{not json"),
        ("snapshot", '{"state": "no-such-state"}'),
        ("policy", '{"max_cycles": -4}'),
        ("policy", "[1, 2]"),
    ],
)
def test_a_damaged_job_row_is_set_aside_and_the_others_load(tmp_path, controller_factory, make_agent, caplog, column, value):
    """A bad row never stops the controller: its job is set aside with one line naming file and job."""
    state = tmp_path / "state.db"
    ctl = controller_factory(state=str(state))
    for job in ("good", "bad"):
        make_agent(ctl.address, job).join()
    ctl.stop()
    db = sqlite3.connect(state)
    with db:
        db.execute(f"UPDATE jobs SET {column} = ? WHERE job_id = 'bad'", (value,))
    db.close()
    ctl = controller_factory(state=str(state))
    probe = make_agent(ctl.address, "good")
    assert [j.jobId for j in probe.stub.QueryStatus(pb.StatusQuery(), timeout=30).jobs] == ["good"]
    (line,) = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert str(state) in line and "job bad " in line and "\n" not in line
    db = sqlite3.connect(state)
    assert [r[0] for r in db.execute("SELECT job_id FROM damaged_jobs")] == ["bad"]
    db.close()
    # The job's agent registers it afresh.
    make_agent(ctl.address, "bad").join()


def test_the_controller_daemon_starts_on_a_damaged_row_without_a_traceback(tmp_path, controller_process):
    state = tmp_path / "state.db"
    store = Store(str(state))
    store.commit(JobRow("ok", True, {}, snapshot_to_dict(Snapshot())), now=1.0)
    store.commit(JobRow("broken", True, {}, snapshot_to_dict(Snapshot())), now=1.0)
    store._db.execute("UPDATE jobs SET snapshot = '{\"cycle\": ' WHERE job_id = 'broken'")
    store.close()
    child = controller_process(state)
    assert child.terminate() == 0
    log = child.log.read_text()
    assert "Traceback" not in log
    (line,) = [ln for ln in log.splitlines() if "damaged" in ln]
    assert "ERROR" in line and str(state) in line and "job broken " in line
