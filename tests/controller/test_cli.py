"""``taskd controller`` and ``taskd status`` as a user runs them."""

from __future__ import annotations

import json

import grpc
import pytest

from taskd_core.cli import main
from tests.conftest import TEST_POLICY, RawAgent, token_file

#: What `taskd status --json` prints per job and per agent (docs/events.md).
JOB_FIELDS = {
    "job", "state", "cycle", "strategy", "faults", "strategies", "cycles_used", "max_cycles", "agents", "events",
    "outcome", "legacy", "slow_ranks", "slow_rank_bound", "slow_rank_bound_learned",
}
AGENT_FIELDS = {"agent", "role", "subscribed", "node_rank", "exit_code", "last_seen", "hang_timeouts"}


def test_status_prints_jobs_agents_cycle_and_events(controller, make_agent, capsys):
    agent = make_agent(controller.address, "job-s", "node-0", node_rank=0, rank_ids=(0, 1)).join()
    agent.fault({1: 1})
    agent.expect("stopTrain")
    assert main(["status", "--controller", controller.address, "--events", "5"]) == 0
    out = capsys.readouterr().out
    assert "job job-s" in out and "wait-stop" in out and "node-0" in out and "up" in out
    assert "1:1" in out and "transition" in out

    assert main(["status", "--controller", controller.address, "--job", "job-s", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"schema", "leader", "leader_generation", "jobs"} and data["schema"] == 1
    assert data["leader_generation"] == 0  # one controller on SQLite: no election
    (job,) = data["jobs"]
    assert set(job) == JOB_FIELDS
    assert (job["job"], job["state"], job["cycle"], job["strategy"], job["cycles_used"]) == ("job-s", "wait-stop", 1, None, 1)
    assert job["faults"] == [{"rank": 1, "fault_type": "1"}] and job["legacy"] is True
    assert job["strategies"] == [s.value for s in TEST_POLICY.strategies] and job["max_cycles"] == TEST_POLICY.max_cycles
    assert job["outcome"] == "waiting for ReportStopComplete"
    (agent_row,) = job["agents"]
    assert set(agent_row) == AGENT_FIELDS
    assert (agent_row["agent"], agent_row["node_rank"], agent_row["subscribed"], agent_row["exit_code"]) == ("node-0", 0, True, None)
    # The events are in the schema of `taskd events --json` (docs/events.md), details as objects.
    fault = next(e for e in job["events"] if e["kind"] == "fault")
    assert set(fault) == {"schema", "seq", "time", "job", "cycle", "kind", "detail"}
    assert fault["detail"]["ranks"] == {"1": "1"} and fault["job"] == "job-s"


def test_status_of_an_unknown_job_or_a_missing_controller_exits_2(controller, capsys):
    assert main(["status", "--controller", controller.address, "--job", "nope"]) == 2
    assert main(["status", "--controller", "127.0.0.1:1", "--timeout", "0.5"]) == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["--listen", "nonsense"],
        ["--listen", "127.0.0.1:99999"],
        ["--strategies", "teleport"],
        ["--strategies", ""],
    ],
)
def test_controller_rejects_bad_arguments_with_exit_2(argv, caplog):
    assert main(["controller", "--state", ":memory:", *argv]) == 2
    assert caplog.records and caplog.records[-1].levelname == "ERROR"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["controller", "--report-timeout", "0"], "--report-timeout: '0' is not a finite number of seconds > 0"),
        (["controller", "--flush-seconds", "-1"], "--flush-seconds: '-1' is not a finite number"),
        (["controller", "--max-cycles", "-1"], "--max-cycles: '-1' is not a whole number >= 0"),
        (["controller", "--cycle-window", "nan"], "--cycle-window: 'nan' is not a finite number"),
        (["controller", "--keepalive-interval", "inf"], "--keepalive-interval: 'inf' is not a finite number"),
        (["status", "--events", "99999999999"], "--events: '99999999999' is more than 2147483647"),
        (["status", "--events", "-1"], "--events: '-1' is not a whole number >= 0"),
        (["status", "--timeout", "-3"], "--timeout: '-3' is not a finite number of seconds > 0"),
    ],
)
def test_numeric_options_are_checked_with_one_line_and_no_traceback(argv, message, capsys):
    with pytest.raises(SystemExit) as ended:
        main(argv)
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err.strip().splitlines()[-1]


def test_an_unreachable_controller_is_one_line(capsys, caplog):
    assert main(["status", "--controller", "127.0.0.1:1", "--timeout", "0.5"]) == 2
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    line = record.getMessage()
    assert "\n" not in line and "controller at 127.0.0.1:1 unreachable for 0.5 s" in line


def test_controller_refuses_a_port_another_controller_holds(controller, caplog):
    assert main(["controller", "--state", ":memory:", "--listen", controller.address]) == 2
    assert "cannot bind" in caplog.records[-1].getMessage()


def test_controller_rejects_a_bad_policy_file_with_exit_2(tmp_path, caplog):
    policy = tmp_path / "policy.toml"
    policy.write_text("[defaults]\nmax_cycles = -1\n")
    assert (
        main(["controller", "--state", ":memory:", "--listen", "127.0.0.1:0", "--policy", str(policy)]) == 2
    )
    assert "max_cycles" in caplog.records[-1].getMessage()


def test_controller_daemon_stops_gracefully_on_sigterm(tmp_path, make_agent, controller_process):
    child = controller_process(tmp_path / "s.db")
    agent = make_agent(child.address, "job-t").join()
    assert child.terminate() == 0
    end = agent.stream_end()
    assert end is None or end.code() == grpc.StatusCode.UNAVAILABLE
    log = child.log.read_text()
    assert f"listening on {child.address}" in log and "stopped" in log


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--listen", "0.0.0.0:0"], "refusing plaintext on an address other hosts can reach"),
        (["--listen", "127.0.0.1:0", "--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert"),
        (["--listen", "127.0.0.1:0", "--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
        (["--listen", "127.0.0.1:0", "--tls-cert", "/no/c.pem", "--tls-key", "/no/k.pem"], "cannot read it"),
        (["--listen", "127.0.0.1:0", "--admin-token-file", "/no/token"], "--admin-token-file /no/token"),
    ],
)
def test_controller_security_settings_are_checked_with_exit_2(argv, message, caplog):
    assert main(["controller", "--state", ":memory:", *argv]) == 2
    assert message in caplog.records[-1].getMessage()


def test_controller_serves_mutual_tls_with_tokens_from_the_command_line(tmp_path, controller_process, pki):
    token_file(tmp_path / "admin", "adm1n")
    child = controller_process(
        tmp_path / "s.db",
        "--tls-cert", pki.server_cert, "--tls-key", pki.server_key, "--tls-client-ca", pki.ca,
        "--admin-token-file", str(tmp_path / "admin"),
    )
    agent = RawAgent(child.address, "cli-job", "node-0", credentials=pki.client("job-token"))
    try:
        agent.join()
        assert not agent.job().legacy
    finally:
        agent.close()
    assert child.terminate() == 0


def test_status_presents_tls_and_the_admin_token(tmp_path, controller_factory, make_agent, pki, capsys, monkeypatch):
    token_file(tmp_path / "admin", "adm1n")
    ctl = controller_factory(tls=pki.server(mutual=True), admin_token_file=str(tmp_path / "admin"))
    make_agent(ctl.address, "tls-job", "node-0", credentials=pki.client("job-token")).join()
    monkeypatch.setenv("TASKD_TLS_CERT", pki.client_cert)
    monkeypatch.setenv("TASKD_TLS_KEY", pki.client_key)
    base = ["status", "--controller", ctl.address, "--tls-ca", pki.ca]
    assert main([*base, "--admin-token-file", str(tmp_path / "admin")]) == 0
    assert "job tls-job" in capsys.readouterr().out
    assert main(base) == 0
    assert capsys.readouterr().out.strip() == "no jobs"  # no token: the job is not shown
    monkeypatch.setenv("TASKD_JOB_TOKEN", "job-token")
    assert main([*base, "--job", "tls-job"]) == 0
    monkeypatch.setenv("TASKD_JOB_TOKEN", "wrong")
    assert main([*base, "--job", "tls-job"]) == 2


def test_health_port_answers_plaintext_probes_beside_a_tls_listener(tmp_path, controller_process, pki):
    """What a Kubernetes gRPC probe sees: SERVING over plaintext, while the main port speaks only TLS."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from taskd_core.testing import free_port

    probe_port = free_port()
    child = controller_process(
        tmp_path / "s.db", "--tls-cert", pki.server_cert, "--tls-key", pki.server_key,
        "--health-port", str(probe_port),
    )
    request = health_pb2.HealthCheckRequest(service="")
    with grpc.insecure_channel(f"127.0.0.1:{probe_port}") as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(request, timeout=20)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        # Only the health service is there: the recovery service needs the TLS port.
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary("/Recover/QueryStatus")(b"", timeout=20)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert child.terminate() == 0


@pytest.mark.parametrize("port", ["-1", "65536", "http"])
def test_controller_rejects_a_bad_health_port_with_exit_2(port, capsys):
    with pytest.raises(SystemExit) as ended:
        main(["controller", "--state", ":memory:", "--listen", "127.0.0.1:0", "--health-port", port])
    assert ended.value.code == 2
    assert f"argument --health-port: {port!r} is not a TCP port (0..65535)" in capsys.readouterr().err


def test_controller_refuses_a_health_port_in_use_with_exit_2(controller, caplog):
    busy = controller.address.rpartition(":")[2]
    assert main(["controller", "--state", ":memory:", "--listen", "127.0.0.1:0", "--health-port", busy]) == 2
    assert f"--health-port {busy}: cannot bind on 127.0.0.1" in caplog.records[-1].getMessage()
