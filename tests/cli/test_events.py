"""``taskd events``: the journal as text or JSON lines, from a controller or a state file, followed live."""

from __future__ import annotations

import json
import threading

import pytest

from taskd_core.cli import main
from taskd_core.testing import wait_until

KEYS = {"schema", "seq", "time", "job", "cycle", "kind", "detail"}
WAIT = 20.0


def lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines()]


def test_json_lines_from_a_controller_follow_the_documented_schema(controller, make_agent, capsys):
    agent = make_agent(controller.address, "job-e", "node-0", node_rank=0, rank_ids=(0, 1)).join()
    agent.fault({1: 1})
    agent.expect("stopTrain")
    assert main(["events", "job-e", "--controller", controller.address, "--json"]) == 0
    events = lines(capsys.readouterr().out)
    assert all(set(e) == KEYS and e["schema"] == 1 and e["job"] == "job-e" for e in events)
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    fault = next(e for e in events if e["kind"] == "fault")
    assert fault["detail"] == {"agent": "node-0", "pending": False, "ranks": {"1": "1"}}
    assert any(e["kind"] == "signal" and e["detail"]["type"] == "stopTrain" for e in events)

    assert main(["events", "job-e", "--controller", controller.address, "--json", "--after", str(fault["seq"])]) == 0
    later = lines(capsys.readouterr().out)
    assert later and all(int(e["seq"]) > int(fault["seq"]) for e in later)


def test_a_state_file_reads_the_same_journal_as_text(controller_factory, make_agent, tmp_path, capsys):
    state = tmp_path / "state.db"
    ctl = controller_factory(state=str(state))
    agent = make_agent(ctl.address, "job-f", "node-0").join()
    agent.fault({0: 2})
    agent.expect("stopTrain")
    assert main(["events", "job-f", "--state", str(state)]) == 0  # while the controller runs
    text = capsys.readouterr().out
    assert "job initialised" in text and 'fault            {"agent":"node-0"' in text
    assert main(["events", "job-f", "--controller", ctl.address]) == 0
    assert capsys.readouterr().out == text


def test_follow_prints_a_fault_as_it_happens_and_ends_with_the_controller(controller_factory, make_agent, capsys):
    ctl = controller_factory()
    agent = make_agent(ctl.address, "job-live", "node-0").join()
    codes: list[int] = []
    argv = ["events", "job-live", "--controller", ctl.address, "--json", "--follow", "--interval", "0.05"]
    follower = threading.Thread(target=lambda: codes.append(main(argv)), daemon=True)
    follower.start()
    seen: list[dict[str, object]] = []

    def printed(kind: str) -> bool:
        seen.extend(lines(capsys.readouterr().out))
        return any(e["kind"] == kind for e in seen)

    wait_until(lambda: printed("agent registered"), "the follower to print the registration", WAIT)
    agent.fault({0: 1})
    wait_until(lambda: printed("fault"), "the follower to print the fault", WAIT, explain=lambda: str(seen))
    ctl.stop()
    follower.join(WAIT)
    assert codes == [0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["events", "nobody"], "not known to this controller"),
        (["events", "job-u", "--interval", "0"], "--interval"),
    ],
)
def test_bad_requests_exit_2_with_a_clear_message(controller, make_agent, caplog, argv, message):
    make_agent(controller.address, "job-u", "node-0").join()
    assert main([*argv, "--controller", controller.address]) == 2
    assert message in caplog.records[-1].getMessage()


def test_a_missing_controller_or_state_file_or_job_exits_2(tmp_path, controller_factory, caplog):
    assert main(["events", "j", "--controller", "127.0.0.1:1", "--timeout", "0.5"]) == 2
    assert "unreachable for" in caplog.records[-1].getMessage()
    assert main(["events", "j", "--state", str(tmp_path / "none.db")]) == 2
    assert "no such file" in caplog.records[-1].getMessage()
    (tmp_path / "junk.db").write_text("not a database")
    assert main(["events", "j", "--state", str(tmp_path / "junk.db")]) == 2
    assert "cannot open it as SQLite" in caplog.records[-1].getMessage()
    state = tmp_path / "state.db"
    controller_factory(state=str(state))
    assert main(["events", "j", "--state", str(state)]) == 2
    assert "not in state file" in caplog.records[-1].getMessage()
    assert main(["events", "j", "--state", "etcd://127.0.0.1:2379/taskd"]) == 2
    assert "read through its controller" in caplog.records[-1].getMessage()


def test_a_job_with_a_token_shows_its_journal_only_to_its_token(controller, make_agent, monkeypatch, caplog, capsys):
    from taskd_core.models import Credentials

    make_agent(controller.address, "job-t", "node-0", credentials=Credentials(token="secret")).join()
    monkeypatch.delenv("TASKD_JOB_TOKEN", raising=False)
    assert main(["events", "job-t", "--controller", controller.address]) == 2
    assert "permission denied" in caplog.records[-1].getMessage()
    monkeypatch.setenv("TASKD_JOB_TOKEN", "secret")
    assert main(["events", "job-t", "--controller", controller.address, "--json"]) == 0
    assert lines(capsys.readouterr().out)[0]["kind"] == "job claimed"
