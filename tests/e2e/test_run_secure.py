"""``taskd run`` with TLS, mutual TLS and job tokens, end to end: one fault, one recovery, exit 0."""

from __future__ import annotations

import json
import sqlite3
import sys
import textwrap
from pathlib import Path

import pytest

from .harness import Cluster, TaskdRun, wait_until

#: argv: OUT. Rank 0's first start exits 1; every other start finishes after a short while.
WORKER = textwrap.dedent(
    """
    import os, pathlib, sys, time
    out = pathlib.Path(sys.argv[1])
    (out / f"start-{os.environ['RANK']}-{os.environ['TASKD_RESTART_COUNT']}").touch()
    if os.environ["RANK"] == "0" and os.environ["TASKD_RESTART_COUNT"] == "0":
        time.sleep(0.3)
        sys.exit(1)
    time.sleep(1.0)
    """
)


def _command(tmp_path: Path) -> list[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    (tmp_path / "out").mkdir(exist_ok=True)
    return ["--", sys.executable, str(script), str(tmp_path / "out")]


def _journal(state: Path, job_id: str) -> list[tuple[str, dict[str, object]]]:
    db = sqlite3.connect(state)
    try:
        rows = db.execute("SELECT kind, detail FROM events WHERE job_id = ? ORDER BY seq", (job_id,))
        return [(kind, json.loads(detail)) for kind, detail in rows]
    finally:
        db.close()


def _recovered_with_token(state: Path, job_id: str) -> None:
    journal = _journal(state, job_id)
    kinds = [kind for kind, _ in journal]
    assert "cycle succeeded" in kinds and "job finished" in kinds, kinds
    claims = [detail for kind, detail in journal if kind == "job claimed"]
    assert claims and claims[0]["legacy"] is False


def test_tls_controller_and_taskd_run_with_a_token(tmp_path, cluster: Cluster, controller_process, pki, monkeypatch):
    state = tmp_path / "ctl.db"
    ctl = controller_process(state, "--tls-cert", pki.server_cert, "--tls-key", pki.server_key, "--flush-seconds", "0.3")
    monkeypatch.setenv("TASKD_JOB_TOKEN", "e2e-job-token")
    run = TaskdRun(
        ["--nproc", "2", "--controller", ctl.address, "--tls-ca", pki.ca, "--job-id", cluster.job_id, *_command(tmp_path)],
        tmp_path / "run.log",
    )
    cluster.runs.append(run)
    assert run.wait() == 0, run.output()
    _recovered_with_token(state, cluster.job_id)


def test_mutual_tls_embedded_controller(tmp_path, cluster: Cluster, pki, monkeypatch):
    """With TASKD_TLS_CERT/KEY the embedded controller serves mutual TLS; the generated token binds the job."""
    monkeypatch.setenv("TASKD_TLS_CA", pki.ca)
    monkeypatch.setenv("TASKD_TLS_CERT", pki.server_cert)  # the node's certificate serves both ends
    monkeypatch.setenv("TASKD_TLS_KEY", pki.server_key)
    monkeypatch.delenv("TASKD_JOB_TOKEN", raising=False)
    state = tmp_path / "embedded.db"
    run = TaskdRun(
        ["--nproc", "2", "--controller-state", str(state), "--job-id", cluster.job_id, "--flush-seconds", "0.3",
         *_command(tmp_path)],
        tmp_path / "run.log",
    )
    cluster.runs.append(run)
    assert run.wait() == 0, run.output()
    assert "mutual TLS" in run.output()
    _recovered_with_token(state, cluster.job_id)


def test_plaintext_taskd_run_against_a_tls_controller_fails_clearly(tmp_path, cluster: Cluster, controller_process, pki):
    ctl = controller_process(tmp_path / "ctl.db", "--tls-cert", pki.server_cert, "--tls-key", pki.server_key)
    run = TaskdRun(
        ["--nproc", "1", "--controller", ctl.address, "--connect-timeout", "2", "--job-id", cluster.job_id,
         *_command(tmp_path)],
        tmp_path / "run.log",
    )
    cluster.runs.append(run)
    assert run.wait() != 0
    out = run.output()
    assert f"controller at {ctl.address} unreachable for" in out and "TASKD_TLS_CA names its CA" in out
    assert "Traceback" not in out


def test_second_live_launch_with_the_same_job_id_is_refused(tmp_path, cluster: Cluster, controller_process, pki, monkeypatch):
    ctl = controller_process(tmp_path / "ctl.db")
    monkeypatch.setenv("TASKD_JOB_TOKEN", "shared-token")
    (tmp_path / "out").mkdir()
    hold = ["--", sys.executable, "-c", "import time; time.sleep(120)"]
    argv = ["--nproc", "1", "--controller", ctl.address, "--job-id", cluster.job_id]
    first = TaskdRun([*argv, *hold], tmp_path / "first.log")
    cluster.runs.append(first)
    wait_until("first launch registered", lambda: _registered(tmp_path, cluster), cluster)
    second = TaskdRun([*argv, *hold], tmp_path / "second.log")
    cluster.runs.append(second)
    assert second.wait() != 0
    out = second.output()
    assert "in use by another live launch" in out and "Traceback" not in out
    assert first.proc.poll() is None  # the first launch is unaffected


def _registered(tmp_path: Path, cluster: Cluster) -> bool:
    state = tmp_path / "ctl.db"
    return state.exists() and "agent registered" in [k for k, _ in _journal(state, cluster.job_id)]


@pytest.mark.parametrize("extra", [[], ["--controller", "192.0.2.1:8899"]])
def test_several_nodes_beyond_loopback_need_a_shared_token(tmp_path, extra, monkeypatch):
    """No traffic: the launch is refused while its settings are built."""
    from taskd_core.cli import main

    monkeypatch.delenv("TASKD_JOB_TOKEN", raising=False)
    argv = ["run", "--nnodes", "2", "--node-rank", "1", "--master-addr", "192.0.2.1", "--insecure", *extra,
            "--", "true"]
    assert main(argv) == 2


def test_node0_refuses_a_plaintext_embedded_controller_beyond_loopback(monkeypatch, caplog):
    """No traffic: the embedded controller refuses to start before it binds; --insecure is the way out."""
    from taskd_core.cli import main

    monkeypatch.setenv("TASKD_JOB_TOKEN", "shared")
    argv = ["run", "--nnodes", "2", "--node-rank", "0", "--master-addr", "192.0.2.1", "--", "true"]
    assert main(argv) == 2
    assert "refusing plaintext on an address other hosts can reach" in caplog.records[-1].getMessage()
