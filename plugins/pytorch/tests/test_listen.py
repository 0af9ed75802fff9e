"""The stores TaskD starts for a job listen on the job's interface only, not on every interface."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from taskd_pytorch.bootstrap import RoundStores
from taskd_pytorch.listen import job_interface, listening_store

TIMEOUT = timedelta(seconds=30)


@pytest.fixture
def outside_address() -> str:
    """This host's address on a non-loopback interface (the one its default route leaves by)."""
    try:
        address = job_interface("192.0.2.123")  # TEST-NET-1: only the route is looked up, nothing is sent
    except OSError as exc:
        pytest.skip(f"this machine has no route off loopback: {exc}")
    if address.startswith("127."):
        pytest.skip("this machine has no non-loopback interface")
    return address


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def test_torchs_own_store_listens_on_every_interface(outside_address: str) -> None:
    """Why TaskD does not hand torch a host name: this store was asked for loopback."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    assert reachable(outside_address, store.port)


def test_a_listening_store_is_reachable_on_its_address_only(outside_address: str) -> None:
    store = listening_store("127.0.0.1", 0, TIMEOUT)
    client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=TIMEOUT)
    client.set("k", "v")
    assert store.get("k") == b"v"
    assert not reachable(outside_address, store.port)


def test_the_round_store_of_a_job_on_this_host_is_not_reachable_from_the_network(outside_address: str) -> None:
    rendezvous = listening_store("127.0.0.1", 0, TIMEOUT)
    stores = RoundStores()  # holds the round's store: it lives as long as this does
    info = stores.meet(rendezvous, 0, 0)
    assert info.master_addr == "127.0.0.1"
    assert reachable("127.0.0.1", info.master_port)
    assert not reachable(outside_address, info.master_port)


def test_a_round_store_for_other_hosts_listens_on_the_jobs_interface(outside_address: str) -> None:
    rendezvous = listening_store("127.0.0.1", 0, TIMEOUT)
    stores = RoundStores(outside_address)
    info = stores.meet(rendezvous, 0, 0)
    assert info.master_addr == outside_address
    assert reachable(outside_address, info.master_port)
    assert not reachable("127.0.0.1", info.master_port)
