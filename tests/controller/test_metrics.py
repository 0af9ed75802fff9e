"""The controller's /metrics: counters follow the journal, live gauges, RPC codes, bad ports, the dashboard."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from taskd_core.cli import main
from taskd_core.controller.machine import JournalEntry
from taskd_core.controller.metrics import ControllerMetrics
from taskd_core.controller.server import EmbeddedController
from taskd_core.errors import ConfigError
from taskd_core.models import JobPolicy, Strategy

ROOT = Path(__file__).resolve().parents[2]
POLICY = JobPolicy(strategies=tuple(Strategy), report_timeout=10.0, flush_seconds=0.0, max_cycles=5)
WAIT = 20.0


@pytest.fixture
def metered() -> Iterator[EmbeddedController]:
    ctl = EmbeddedController(defaults=POLICY, keepalive_interval=0.5, metrics_port=0)
    yield ctl
    ctl.stop()


def scrape(port: int | None) -> dict[str, float]:
    assert port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def exported_names(metrics: ControllerMetrics) -> set[str]:
    """Every sample name the registry can export (counters as *_total, histograms as *_bucket...)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    return {
        family.name + suffix
        for family in metrics.registry.collect()
        for suffix in suffixes.get(family.type, ("",))
    }


def test_a_recovery_cycle_moves_the_counters_as_the_journal_says(metered, make_agent):
    agent = make_agent(metered.address, "job-m", "node-0", node_rank=0, rank_ids=(0, 1)).join()
    assert agent.fault({1: 1, 0: 2}).code == 0
    agent.expect("stopTrain")
    assert agent.stopped().code == 0
    agent.expect("globalFault")
    assert agent.strategies(["recover", "exit"]).code == 0
    agent.expect("changeStrategy", changeStrategy="recover")
    assert agent.status(1, "recover").code == 0  # recover fails: exit, killMaster
    agent.expect("changeStrategy", changeStrategy="exit")
    agent.expect("killMaster")
    assert agent.fault({0: 1}).code == 401  # a given-up job takes no faults

    m = scrape(metered.metrics_port)
    assert m["taskd_faults_total{fault_type=normal}"] == 1
    assert m["taskd_faults_total{fault_type=network}"] == 1
    assert m["taskd_recovery_cycles_started_total{}"] == 1
    assert m["taskd_strategy_decisions_total{strategy=recover}"] == 1
    assert m["taskd_strategy_decisions_total{strategy=exit}"] == 1
    assert m["taskd_escalations_total{strategy=recover}"] == 1
    assert m["taskd_recovery_cycles_total{outcome=given-up,strategy=exit}"] == 1
    assert m["taskd_recovery_cycle_duration_seconds_count{outcome=given-up}"] == 1
    assert m["taskd_fault_to_strategy_seconds_count{}"] == 1
    assert m["taskd_jobs_given_up_total{}"] == 1
    assert m["taskd_signals_sent_total{type=changeStrategy}"] == 2
    assert m["taskd_rpc_requests_total{code=0,method=ReportProcessFault}"] == 1
    assert m["taskd_rpc_requests_total{code=401,method=ReportProcessFault}"] == 1
    assert m["taskd_jobs{state=given-up}"] == 1 and m["taskd_jobs{state=idle}"] == 0
    assert m["taskd_agents_registered{}"] == 1 and m["taskd_agents_connected{}"] == 1
    assert m["taskd_journal_entries{}"] == len(agent.job(events=1000).events)
    assert m["taskd_journal_entries_written_total{}"] == m["taskd_journal_entries{}"]


def test_a_refused_signal_stream_is_counted_with_its_grpc_status(metered, make_agent):
    agent = make_agent(metered.address, "job-unknown", "node-0")
    agent.subscribe()
    assert agent.stream_end() is not None
    key = "taskd_rpc_requests_total{code=NOT_FOUND,method=SubscribeProcessManageSignal}"
    end = time.monotonic() + WAIT
    while key not in (m := scrape(metered.metrics_port)):
        assert time.monotonic() < end, f"{key} not in /metrics within {WAIT}s"
        time.sleep(0.05)
    assert m[key] == 1
    assert m["taskd_rpc_duration_seconds_count{method=SubscribeProcessManageSignal}"] == 1


def test_worker_events_feed_kill_to_restart_resumed_and_steps_lost():
    metrics = ControllerMetrics()

    def journal(kind: str, **detail: object) -> None:
        metrics.journalled("j", [JournalEntry(kind, 1, detail)], now=100.0)

    journal("worker started", rank=3, pid=10, at=1.0)
    journal("worker resumed", rank=3, pid=10, at=1.5, step=0)  # a first start loses nothing
    journal("fault", ranks={"3": "1"}, pending=False)
    journal("cycle started", faults={"3": "1"})
    journal("worker exited", rank=3, pid=10, at=10.0, exit_code=-9, step=57)
    journal("worker exited", rank=4, pid=11, at=10.5, exit_code=-15, step=56)
    journal("worker started", rank=3, pid=12, at=10.25)
    journal("worker resumed", rank=3, pid=12, at=11.0, step=50)
    value = metrics.registry.get_sample_value
    assert value("taskd_kill_to_restart_seconds_sum") == pytest.approx(0.25)
    assert value("taskd_kill_to_resumed_seconds_sum") == pytest.approx(1.0)
    assert value("taskd_steps_lost_total") == 7
    # Ranks of one job redo the same steps: a cycle costs the most any rank lost, not their sum.
    journal("worker resumed", rank=4, pid=13, at=11.0, step=50)
    assert value("taskd_steps_lost_total") == 7
    assert value("taskd_kill_to_resumed_seconds_count") == 1  # only the faulty rank's
    assert value("taskd_worker_exits_total", {"outcome": "failed"}) == 1
    assert value("taskd_worker_exits_total", {"outcome": "stopped"}) == 1
    assert value("taskd_worker_starts_total") == 2
    # A live recovery: the replacement resumes where the lost rank was, nothing is lost.
    journal("fault", ranks={"3": "1"}, pending=False)
    journal("cycle started", faults={"3": "1"})
    journal("worker exited", rank=3, pid=12, at=20.0, exit_code=-9, step=80)
    journal("worker started", rank=3, pid=14, at=20.5)
    journal("worker resumed", rank=3, pid=14, at=21.0, step=80)
    assert value("taskd_steps_lost_total") == 7
    assert value("taskd_kill_to_resumed_seconds_count") == 2


def test_metrics_are_off_unless_asked_for(controller):
    assert controller.metrics_port is None


def test_a_taken_metrics_port_is_a_clear_error(metered):
    with pytest.raises(ConfigError, match="cannot bind"):
        EmbeddedController(metrics_port=metered.metrics_port)


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
@pytest.mark.parametrize("command", [["controller", "--state", ":memory:"], ["run", "--nproc", "1"]])
def test_taskd_controller_and_run_reject_a_bad_metrics_port(command, port, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--metrics-port", port, "--", "true"])
    assert exit_info.value.code == 2
    assert "--metrics-port" in capsys.readouterr().err


def test_taskd_controller_refuses_a_metrics_port_in_use(caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["controller", "--state", ":memory:", "--listen", "127.0.0.1:0", "--metrics-port", str(port)]
        assert main(argv) == 2
    assert f"--metrics-port {port}: cannot bind on 127.0.0.1 (the port is in use" in caplog.records[-1].getMessage()


def test_the_grafana_dashboard_and_the_docs_name_only_exported_metrics():
    names = exported_names(ControllerMetrics()) | {
        "taskd_jobs",
        "taskd_agents_registered",
        "taskd_agents_connected",
        "taskd_journal_entries",
        "taskd_slow_ranks",
        "taskd_state_writes_held",
        "taskd_state_write_failures_total",
    }
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "taskd-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\b((?:taskd|process)_[a-z_]+)", expr)}
    assert used and used <= names, sorted(used - names)
    assert any("taskd_kill_to_restart_seconds_bucket" in e for e in exprs)

    table = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(taskd_[a-z_]+)`", table, re.MULTILINE))
    ours = {n for n in names if n.startswith("taskd_")}
    # Histograms are documented by their base name; everything else by its exported name.
    assert documented == {re.sub(r"_(bucket|count|sum)$", "", n) for n in ours}


def test_a_tls_controller_serves_metrics_over_https_only(pki):
    import ssl
    import urllib.error

    ctl = EmbeddedController(tls=pki.server(), metrics_port=0)
    try:
        url = f"https://127.0.0.1:{ctl.metrics_port}/metrics"
        context = ssl.create_default_context(cafile=pki.ca)
        with urllib.request.urlopen(url, timeout=10, context=context) as reply:
            assert b"taskd_jobs" in reply.read()
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url.replace("https", "http"), timeout=10).read()
    finally:
        ctl.stop()


def test_an_idle_connection_does_not_block_an_https_scrape(pki):
    """One client that connects and says nothing (or many) must not hold the TLS handshake of every scrape."""
    import socket
    import ssl

    ctl = EmbeddedController(tls=pki.server(), metrics_port=0)
    idle = [socket.create_connection(("127.0.0.1", ctl.metrics_port), timeout=10)]
    try:
        url = f"https://127.0.0.1:{ctl.metrics_port}/metrics"
        context = ssl.create_default_context(cafile=pki.ca)
        with urllib.request.urlopen(url, timeout=10, context=context) as reply:
            assert b"taskd_jobs" in reply.read()
        # Past the cap, a connection is closed at once instead of holding a thread.
        from taskd_core.controller.metrics import METRICS_CONNECTIONS

        idle += [socket.create_connection(("127.0.0.1", ctl.metrics_port), timeout=10) for _ in range(METRICS_CONNECTIONS)]
        assert idle[-1].recv(1) == b""
    finally:
        for sock in idle:
            sock.close()
        ctl.stop()

