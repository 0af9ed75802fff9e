"""``taskdrun`` with torchrun's etcd command line: every node runs a controller replica, none is special.

Real ``taskdrun`` launchers (3 nodes, one worker each, no torch in the
workers) on a real etcd with the v2 API (the rendezvous) and the v3 API (the
controller's state), started exactly as torchrun would be: no TaskD option
names a controller. A node is lost as a machine dies: its whole process tree
(launcher, fork server, workers) SIGKILLed at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from pt_support import WORKERS, Launcher, kill, records

from taskd_core.authstream import stream_key, verify
from taskd_core.testing import descendants, process_running, wait_until
from tests.etcd_server import EtcdServer

pytestmark = pytest.mark.slow

IDLE = str(WORKERS / "idle.py")
NODES = 3
#: what a replica logs when it becomes the leader.
LEADS = re.compile(r"this replica \((\S+)\) leads")
LISTENS = re.compile(r"controller replica listening on (\S+) ")


def start_job(
    launch: Launcher, etcd: EtcdServer, out: Path, until: Path, job: str, *extra: str
) -> list[subprocess.Popen[bytes]]:
    common = [
        f"--nnodes={NODES}",
        "--nproc-per-node=1",
        "--rdzv-backend=etcd-v2",
        f"--rdzv-endpoint={etcd.endpoint}",
        f"--rdzv-id={job}",
        "--taskd-stop-timeout",
        "5",
        *extra,
    ]
    return [launch(*common, IDLE, str(out), "--until", str(until), log=job) for _ in range(NODES)]


def logs(root: Path, job: str) -> list[str]:
    return [(root / f"{job}.{n}.log").read_text() for n in range(NODES)]


def leader_of(root: Path, job: str, among: range | list[int] = range(NODES)) -> tuple[int, str]:
    """The node whose replica said last that it leads, and its address (newest line wins)."""
    found = [(n, m.group(1)) for n in among for m in LEADS.finditer(logs(root, job)[n])]
    assert found, "no replica leads"
    return found[-1]


def status(address: str) -> dict[str, object]:
    done = subprocess.run(
        [str(Path(sys.executable).with_name("taskd")), "status", "--controller", address, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_every_node_runs_a_replica_one_leads_and_a_killed_rank_recovers(
    launch: Launcher, etcd_v2: EtcdServer, out_dir: Path, tmp_path: Path
) -> None:
    until = tmp_path / "finish"
    nodes = start_job(launch, etcd_v2, out_dir, until, "reps")
    first = wait_until(lambda: len(records(out_dir)) == NODES and records(out_dir), "every worker", 120)
    text = logs(tmp_path, "reps")
    replicas = [LISTENS.search(t) for t in text]
    assert all(replicas), "every node runs a controller replica"
    assert sum(bool(LEADS.search(t)) for t in text) == 1
    _, leader = leader_of(tmp_path, "reps")
    # Every agent is given every replica, its own first.
    for t, own in zip(text, replicas, strict=True):
        assert own is not None
        given = re.search(r"adapter pytorch, controller (\S+) \(embedded\)", t)
        assert given is not None and given.group(1).split(",")[0] == own.group(1)
        assert len(given.group(1).split(",")) == NODES
    # Asked at a standby, the status comes from the leader and names it.
    standby = next(m.group(1) for m in replicas if m is not None and m.group(1) != leader)
    assert status(standby)["leader"] == leader

    kill(next(int(r["pid"]) for r in first if r["RANK"] == "1"))
    again = wait_until(
        lambda: len(records(out_dir)) == 2 * NODES and records(out_dir), "every worker again", 120
    )
    assert sorted(r["RANK"] for r in again if r["TASKD_RESTART_COUNT"] == "1") == ["0", "1", "2"]
    # The restart kept torch's rendezvous round (agreed on in etcd), as on c10d: no new round's polling.
    assert all("keeping its nodes and ranks" in t for t in logs(tmp_path, "reps"))
    until.touch()
    assert [node.wait(timeout=120) for node in nodes] == [0] * NODES
    # The last replica out removed the job's state: a job's state in etcd ends with the job, as in memory.
    assert etcd_v2.keys("/taskd/rdzv/reps/") == []


def test_losing_the_leaders_node_leaves_the_job_a_leader_the_other_agents_follow(
    launch: Launcher, etcd_v2: EtcdServer, out_dir: Path, tmp_path: Path
) -> None:
    until = tmp_path / "finish"
    nodes = start_job(launch, etcd_v2, out_dir, until, "lose", "--taskd-linger", "5")
    seen = wait_until(lambda: len(records(out_dir)) == NODES and records(out_dir), "every worker", 120)
    host, leader = leader_of(tmp_path, "lose")
    tree = {nodes[host].pid, *descendants(nodes[host].pid)}
    assert {int(r["pid"]) for r in seen} & tree, "the leader's node runs a worker"
    for pid in tree:  # the machine dies: everything at once
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    survivors = [n for n in range(NODES) if n != host]
    wait_until(
        lambda: any(LEADS.search(logs(tmp_path, "lose")[n]) for n in survivors),
        "a surviving replica to lead",
        60,
    )
    new_host, new_leader = leader_of(tmp_path, "lose", survivors)
    assert new_leader != leader
    # Found gone at once (its connections were reset), not once its lease ran out.
    gone = f"the leader ({leader}) is gone: nothing listens at {leader}"
    assert any(gone in logs(tmp_path, "lose")[n] for n in survivors)
    # Every surviving node's agent holds its signal stream with the new leader (an agent whose first stream
    # only formed there, its first tries having met a leader not yet reachable, never logs that it came back).
    wait_until(
        lambda: sum(bool(a["subscribed"]) for j in status(new_leader)["jobs"] for a in j["agents"]) == len(survivors),
        "the surviving nodes' agents to follow the new leader",
        60,
    )
    other = next(n for n in survivors if n != new_host)
    own = LISTENS.search(logs(tmp_path, "lose")[other])
    assert own is not None and status(own.group(1))["leader"] == new_leader
    # Nothing else on the survivors was disturbed: their workers are the ones that started.
    assert not [r for r in records(out_dir) if r["TASKD_RESTART_COUNT"] != "0"]
    assert all(process_running(int(r["pid"])) for r in seen if int(r["pid"]) not in tree)

    until.touch()
    assert [nodes[n].wait(timeout=120) for n in survivors] == [0, 0]
    wait_until(
        lambda: not [pid for pid in tree if process_running(pid)], "nothing of the lost node to be left", 30
    )


def test_etcd_briefly_unreachable_training_goes_on_and_a_recovery_waits_for_it(
    launch: Launcher, etcd_v2: EtcdServer, out_dir: Path, tmp_path: Path
) -> None:
    until = tmp_path / "finish"
    nodes = start_job(launch, etcd_v2, out_dir, until, "outage")
    first = wait_until(lambda: len(records(out_dir)) == NODES and records(out_dir), "every worker", 120)
    etcd_v2.stop()
    # Longer than the leader's lease (2 s): it stepped down, no replica leads, yet nothing stops.
    wait_until(
        lambda: sum("stopped leading" in t for t in logs(tmp_path, "outage")) == 1,
        "the leader to step down",
        30,
    )
    assert all(process_running(int(r["pid"])) for r in first)
    assert all(node.poll() is None for node in nodes)
    # A rank lost meanwhile: its recovery waits for etcd (within --taskd-report-deadline, 60 s).
    kill(next(int(r["pid"]) for r in first if r["RANK"] == "1"))
    wait_until(
        lambda: any("ReportProcessFault for job outage failed" in t for t in logs(tmp_path, "outage")),
        "the fault report to wait for a leader",
        30,
    )
    etcd_v2.start()
    again = wait_until(
        lambda: len(records(out_dir)) == 2 * NODES and records(out_dir), "every worker again", 120
    )
    assert sorted(r["RANK"] for r in again if r["TASKD_RESTART_COUNT"] == "1") == ["0", "1", "2"]
    until.touch()
    assert [node.wait(timeout=120) for node in nodes] == [0] * NODES


def test_etcd_gone_past_the_bound_ends_the_job_with_a_line_that_says_so(
    launch: Launcher, etcd_v2: EtcdServer, out_dir: Path, tmp_path: Path
) -> None:
    bound = ("--taskd-connect-timeout", "5", "--taskd-report-deadline", "5")
    nodes = start_job(launch, etcd_v2, out_dir, tmp_path / "never", "gone", *bound)
    first = wait_until(lambda: len(records(out_dir)) == NODES and records(out_dir), "every worker", 120)
    etcd_v2.stop()
    kill(next(int(r["pid"]) for r in first if r["RANK"] == "2"))
    assert [node.wait(timeout=120) for node in nodes] == [1] * NODES
    for text in logs(tmp_path, "gone"):
        assert "agent of job gone ends: failed (exit 1)" in text
        # The bound passed: one ERROR line says the controller was unreachable, and why.
        errors = [line for line in text.splitlines() if " ERROR " in line and "unreachable for 5 s" in line]
        assert any("stands by: etcd does not answer it" in line for line in errors), errors
        assert "Traceback" not in text
    wait_until(lambda: not [r for r in first if process_running(int(r["pid"]))], "no worker to be left", 30)


def test_with_the_jobs_token_and_certificates_the_replicas_serve_mutual_tls_and_sign_their_addresses(
    launch: Launcher, etcd_v2: EtcdServer, out_dir: Path, tmp_path: Path
) -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    node = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    node.cert_chain_pems[0].write_to_path(str(tmp_path / "node.pem"))
    node.private_key_pem.write_to_path(str(tmp_path / "node.key"))
    secure = {
        "TASKD_JOB_TOKEN": "s3cret",
        "TASKD_TLS_CA": str(tmp_path / "ca.pem"),
        "TASKD_TLS_CERT": str(tmp_path / "node.pem"),  # the node's certificate serves both ends
        "TASKD_TLS_KEY": str(tmp_path / "node.key"),
    }
    until = tmp_path / "finish"
    common = [
        f"--nnodes={NODES}",
        "--nproc-per-node=1",
        "--rdzv-backend=etcd-v2",
        f"--rdzv-endpoint={etcd_v2.endpoint}",
        "--rdzv-id=tls",
        "--taskd-stop-timeout",
        "5",
    ]
    nodes = [
        launch(*common, IDLE, str(out_dir), "--until", str(until), log="tls", env=secure)
        for _ in range(NODES)
    ]
    first = wait_until(lambda: len(records(out_dir)) == NODES and records(out_dir), "every worker", 120)
    text = logs(tmp_path, "tls")
    assert all(re.search(r"controller replica listening on \S+ \(mutual TLS\)", t) for t in text)
    listed = etcd_v2.items("/taskd/rdzv/tls/replicas/")
    key = stream_key("s3cret", "controller replicas")
    addresses = [verify(key, b"controller replica\0tls", v.decode()) for v in listed.values()]
    assert len(addresses) == NODES and None not in addresses, listed

    kill(next(int(r["pid"]) for r in first if r["RANK"] == "0"))
    wait_until(lambda: len(records(out_dir)) == 2 * NODES, "every worker again", 120)
    until.touch()
    assert [node.wait(timeout=120) for node in nodes] == [0] * NODES
