"""A true network partition: one ``taskdrun`` node in a network namespace of its own, its link cut.

Two network namespaces this test makes (``ip netns``, iproute2; root only),
joined by a veth pair: the *hub* holds a real etcd, node A and the spare; the
*island* holds node B, every process of it running on when its end of the link
goes down (no process is signalled: its sockets stay open, its packets are
dropped). The controller must declare B lost after ``--taskd-node-lost-timeout``
seconds without a HealthCheck and give its seat to the spare; once the link is
up again, B must learn it was replaced and end (exit 1) without training or
steering: the job ends with the parameters of a run without faults. The
addresses exist only inside those two namespaces; both are deleted at the end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pt_support import STEPS, TRAIN_ARGS, Launcher, events, example

from taskd_core.testing import descendants, free_port, process_running, wait_until
from tests.etcd_server import etcd_binary

pytestmark = pytest.mark.slow

WAIT = 120.0
#: The veth pair's subnet; its two addresses are only ever configured inside this test's namespaces.
SUBNET = "10.231.22"
LOST_TIMEOUT = "3"


@dataclass(frozen=True, slots=True)
class Network:
    """Two namespaces and the link between them."""

    hub: str
    island: str
    link: str

    def inside(self, ns: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", ns)

    def island_link(self, state: str) -> None:
        _ip("-n", self.island, "link", "set", f"{self.link}b", state)


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)


@pytest.fixture
def network() -> Iterator[Network]:
    """The hub and the island, ``SUBNET.1`` and ``SUBNET.2`` on a veth pair; skips where namespaces cannot be made."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's ip is not installed")
    tag = f"tdp{os.getpid() % 100000}"
    net = Network(f"{tag}-hub", f"{tag}-island", tag)
    made: list[str] = []
    try:
        for ns in (net.hub, net.island):
            added = _ip("netns", "add", ns)
            if added.returncode != 0:
                pytest.skip(f"ip netns add is not allowed here: {added.stderr.strip()}")
            made.append(ns)
        steps = [
            ("link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b"),
            ("link", "set", f"{tag}a", "netns", net.hub),
            ("link", "set", f"{tag}b", "netns", net.island),
        ]
        for ns, end, host in ((net.hub, "a", 1), (net.island, "b", 2)):
            steps += [
                ("-n", ns, "addr", "add", f"{SUBNET}.{host}/24", "dev", f"{tag}{end}"),
                ("-n", ns, "link", "set", f"{tag}{end}", "up"),
                ("-n", ns, "link", "set", "lo", "up"),
            ]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"ip {' '.join(step)} failed here: {done.stderr.strip()}")
        yield net
    finally:
        for ns in made:
            _ip("netns", "delete", ns)


@pytest.fixture
def hub_etcd(network: Network, tmp_path: Path) -> Iterator[str]:
    """A real etcd (v2 API too, for torch's rendezvous) in the hub; its ``HOST:PORT``."""
    pytest.importorskip("etcd", reason="python-etcd, torch's etcd-v2 client, is not installed")
    port, peer = free_port(), free_port()
    client, peer_url = f"http://{SUBNET}.1:{port}", f"http://127.0.0.1:{peer}"
    with open(tmp_path / "etcd.log", "wb") as log:
        proc = subprocess.Popen(
            [
                *network.inside(network.hub),
                etcd_binary(),
                "--enable-v2",
                "--data-dir",
                str(tmp_path / "etcd"),
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                peer_url,
                "--initial-advertise-peer-urls",
                peer_url,
                "--initial-cluster",
                f"default={peer_url}",
                "--log-level",
                "warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    probe = f"import socket; socket.create_connection(('{SUBNET}.1', {port}), timeout=1)"
    try:
        wait_until(
            lambda: subprocess.run(
                [*network.inside(network.hub), sys.executable, "-c", probe], capture_output=True, check=False
            ).returncode
            == 0,
            "etcd to serve in the hub",
            60,
            interval=0.2,
        )
        yield f"{SUBNET}.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_node_cut_off_by_a_partition_is_replaced_and_fenced_when_the_link_comes_back(
    launch: Launcher, network: Network, hub_etcd: str, tmp_path: Path, fault_free: dict[str, Any]
) -> None:
    work = tmp_path / "partition"
    example_argv, progress, result = example("train_ddp.py", work)
    argv = [
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=etcd-v2",
        f"--rdzv-endpoint={hub_etcd}",
        "--rdzv-id=partition",
        "--taskd-node-lost-timeout",
        LOST_TIMEOUT,
        "--taskd-insecure",  # plaintext replicas on the veth addresses (TLS is docs/security.md's, not this test's)
        *example_argv,
        *TRAIN_ARGS,
        "--step-time",
        "1.0",  # the same math as the fault-free run's, slower: the spare stands by before the job ends
    ]
    env = {"TASKD_JOB_TOKEN": "partition-test-job-token"}

    def start(ns: str, host: int, log: str) -> subprocess.Popen[bytes]:
        # gloo finds its address by the host name (loopback here) unless told its interface, as on real hosts.
        nic = {**env, "GLOO_SOCKET_IFNAME": f"{network.link}{'a' if host == 1 else 'b'}"}
        return launch(f"--local-addr={SUBNET}.{host}", *argv, log=log, env=nic, prefix=network.inside(ns))

    node_a, node_b = start(network.hub, 1, "hub"), start(network.island, 2, "island")
    logs = {"a": tmp_path / "hub.0.log", "b": tmp_path / "island.1.log", "spare": tmp_path / "spare.2.log"}

    def text(name: str) -> str:
        return logs[name].read_text(errors="replace")

    def ended() -> str:
        codes = {name: p.poll() for name, p in (("A", node_a), ("B", node_b))}
        return ", ".join(f"node {n} ended with {c}" for n, c in codes.items() if c is not None)

    wait_until(lambda: "2 workers of" in text("a") + text("b"), "the first round", WAIT, unless=ended)
    spare = start(network.hub, 1, "spare")
    wait_until(lambda: "standing by as spare" in text("spare"), "the spare to stand by", WAIT)
    wait_until(
        lambda: {e["rank"] for e in events(progress) if e["event"] == "step"} == {0, 1, 2, 3},
        "every rank to train",
        WAIT,
    )
    island_tree = {node_b.pid, *descendants(node_b.pid)}
    island_ranks = {
        e["rank"] for e in events(progress) if e["event"] == "start" and int(e["pid"]) in island_tree
    }
    assert len(island_ranks) == 2
    before = len(events(progress))

    network.island_link("down")
    try:
        wait_until(lambda: "takes the place of lost node" in text("spare"), "the spare to take B's seat", WAIT)
        # Found by its silence, while every process of it still ran: a partition, not a death.
        assert all(process_running(p) for p in island_tree)
        # Declared lost by the leading replica: by its silent HealthChecks, or, when the island held the leading
        # replica (as under load in one CI run), by the new leader when B never subscribed to it.
        assert re.search(r"\(node rank 1\) lost: (no HealthCheck for|its signal stream ended)", text("a") + text("spare"))
        wait_until(
            lambda: {e["rank"] for e in events(progress)[before:] if e["event"] == "step"} == {0, 1, 2, 3},
            "every rank to step again, B's on the spare",
            WAIT,
        )
    finally:
        network.island_link("up")
    healed = len(events(progress))

    assert node_b.wait(timeout=WAIT) == 1, text("b")[-3000:]
    assert "was declared lost and spare" in text("b")
    assert node_a.wait(timeout=WAIT) == 0, text("a")[-3000:]
    assert spare.wait(timeout=WAIT) == 0, text("spare")[-3000:]
    after = events(progress)[before:]
    spare_workers = {int(e["pid"]) for e in after if e["rank"] in island_ranks and e["event"] == "start"}
    assert spare_workers and not spare_workers & island_tree
    # B's old workers never stepped once the link was back (they could not: their peers were new).
    assert not [e for e in events(progress)[healed:] if int(e["pid"]) in island_tree and e["event"] == "step"]
    final = json.loads(result.read_text())
    assert final["steps"] == STEPS and final["sha256"] == fault_free["sha256"]
    everyone = {int(e["pid"]) for e in events(progress)} | island_tree
    wait_until(lambda: not [p for p in everyone if process_running(p)], "no process of the job to be left", 60)
