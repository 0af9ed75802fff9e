"""The roster of a job's controller replicas, on a real etcd: announced, signed, read, left."""

from __future__ import annotations

import grpc

from taskd_core.authstream import sign, stream_key
from taskd_core.controller.etcd_client import parse_etcd_url
from taskd_core.launcher.roster import Roster, roster_prefix
from taskd_core.rpc._gen import etcd_v3_pb2 as epb
from tests.etcd_server import EtcdServer


def put(etcd: EtcdServer, key: bytes, value: str) -> None:
    with grpc.insecure_channel(etcd.endpoint) as channel:
        call = channel.unary_unary(
            "/etcdserverpb.KV/Put",
            request_serializer=epb.PutRequest.SerializeToString,
            response_deserializer=epb.PutResponse.FromString,
        )
        call(epb.PutRequest(key=key, value=value.encode()), timeout=10.0)


def test_each_agent_reads_every_signed_replica_its_own_first_and_the_last_out_clears_the_state(
    etcd: EtcdServer,
) -> None:
    target = parse_etcd_url(etcd.url())
    prefix = target.prefix
    put(etcd, prefix.encode() + b"/jobs/j", "{}")  # some state of the job
    # Someone who can write to etcd but lacks the token lists a controller of their own; another
    # job's replica (the same token, another job) is not this job's either.
    put(etcd, roster_prefix(prefix) + b"forged", "10.6.6.6:1")
    put(
        etcd,
        roster_prefix(prefix) + b"other",
        sign(stream_key("t0k", "controller replicas"), b"x", "10.7.7.7:1"),
    )
    rosters = [Roster(target, "j", "t0k") for _ in range(3)]
    try:
        for n, roster in enumerate(rosters):
            roster.announce(f"127.0.0.1:{1000 + n}")
        for n, roster in enumerate(rosters):
            listed = roster.addresses(3, timeout=10)
            assert listed[0] == f"127.0.0.1:{1000 + n}"
            assert sorted(listed) == ["127.0.0.1:1000", "127.0.0.1:1001", "127.0.0.1:1002"]
        # Fewer than wanted at the deadline: what is there.
        assert len(rosters[0].addresses(4, timeout=0.2)) == 3
        rosters.pop().close(last_clears=prefix.encode() + b"/")
        assert len(rosters[0].addresses(2, timeout=1)) == 2
    finally:
        for roster in rosters:
            roster.close(last_clears=prefix.encode() + b"/")
    # The two unverifiable entries are not replicas: the last one out still cleared the prefix.
    assert etcd.keys(prefix + "/") == []


def test_without_a_token_addresses_are_taken_as_they_are(etcd: EtcdServer) -> None:
    target = parse_etcd_url(etcd.url())
    put(etcd, roster_prefix(target.prefix) + b"plain", "127.0.0.1:7")
    roster = Roster(target, "j", "")
    try:
        roster.announce("127.0.0.1:8")
        assert roster.addresses(2, timeout=5) == ("127.0.0.1:8", "127.0.0.1:7")
    finally:
        roster.close()
