"""TLS, mutual TLS, tokens on the wire and the request guard, with real certificates over loopback."""

from __future__ import annotations

import os

import grpc
import pytest

from taskd_core.client.manager import DLRecoverManager
from taskd_core.controller.server import ControllerConfig, EmbeddedController
from taskd_core.errors import ConfigError, ControllerUnavailableError
from taskd_core.models import Code, Credentials
from taskd_core.rpc import recover_pb2 as pb
from taskd_core.rpc.security import (
    Caller,
    ServerTls,
    open_channel,
    parse_metadata,
    read_token_file,
    token_digest,
    token_matches,
)
from tests.conftest import RawAgent

JOB = "secure-job"


def _init(address: str, credentials: Credentials, timeout: float = 10) -> pb.Status:
    with open_channel(address, credentials) as channel:
        from taskd_core.rpc import recover_pb2_grpc

        return recover_pb2_grpc.RecoverStub(channel).Init(pb.ClientInfo(jobId=JOB, role="r"), timeout=timeout)


def test_tls_controller_serves_a_client_that_trusts_its_ca(controller_factory, pki) -> None:
    ctl = controller_factory(tls=pki.server())
    assert _init(ctl.address, pki.client(cert=False)).code == Code.OK


def test_plaintext_client_against_a_tls_controller_fails_clearly(controller_factory, pki) -> None:
    ctl = controller_factory(tls=pki.server())
    with pytest.raises(grpc.RpcError) as raw:
        _init(ctl.address, Credentials(), timeout=3)
    assert raw.value.code() == grpc.StatusCode.UNAVAILABLE
    manager = DLRecoverManager(pb.ClientInfo(jobId=JOB), ctl.address, connect_deadline=1.0, credentials=Credentials())
    try:
        with pytest.raises(ControllerUnavailableError, match=f"controller at {ctl.address} unreachable for"):
            manager.init_clusterd()
    finally:
        manager.close()


def test_client_with_another_ca_does_not_trust_the_controller(controller_factory, pki) -> None:
    ctl = controller_factory(tls=pki.server())
    with pytest.raises(grpc.RpcError) as raw:
        _init(ctl.address, Credentials(tls_ca=pki.other_ca), timeout=3)
    assert raw.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate(controller_factory, pki) -> None:
    ctl = controller_factory(tls=pki.server(mutual=True))
    assert _init(ctl.address, pki.client()).code == Code.OK
    with pytest.raises(grpc.RpcError) as raw:
        _init(ctl.address, pki.client(cert=False), timeout=3)
    assert raw.value.code() == grpc.StatusCode.UNAVAILABLE


def test_dlrecovermanager_reads_tls_and_token_from_the_environment(controller_factory, pki, monkeypatch) -> None:
    ctl = controller_factory(tls=pki.server(mutual=True), allow_legacy=False)
    monkeypatch.setenv("TASKD_TLS_CA", pki.ca)
    monkeypatch.setenv("TASKD_TLS_CERT", pki.client_cert)
    monkeypatch.setenv("TASKD_TLS_KEY", pki.client_key)
    monkeypatch.setenv("TASKD_JOB_TOKEN", "s3cret")
    with DLRecoverManager(pb.ClientInfo(jobId=JOB, role="r"), ctl.address, connect_deadline=20) as manager:
        assert manager.init_clusterd() is True
        assert manager.register().code == Code.OK


@pytest.mark.parametrize(
    ("credentials", "message"),
    [
        (Credentials(tls_cert="c.pem"), "needs both TASKD_TLS_CERT and TASKD_TLS_KEY"),
        (Credentials(tls_cert="c.pem", tls_key="k.pem"), "needs the controller's CA too"),
        (Credentials(tls_ca="/nonexistent/ca.pem"), "TLS CA file /nonexistent/ca.pem: cannot read it"),
    ],
)
def test_unusable_client_tls_settings_say_what_to_fix(credentials: Credentials, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        open_channel("127.0.0.1:1", credentials)


def test_server_tls_settings_are_checked_before_serving(tmp_path, pki) -> None:
    with pytest.raises(ConfigError, match="TLS key .*cannot read it"):
        EmbeddedController(tls=ServerTls(pki.server_cert, str(tmp_path / "missing.key")))
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    with pytest.raises(ConfigError, match="the file is empty"):
        EmbeddedController(tls=ServerTls(str(empty), pki.server_key))


def test_plaintext_beyond_loopback_needs_insecure(caplog) -> None:
    with pytest.raises(ConfigError, match="refusing plaintext .* --insecure"):
        ControllerConfig(listen="0.0.0.0:0").access()
    with caplog.at_level("WARNING"):
        rules = ControllerConfig(listen="0.0.0.0:0", insecure=True).access()
    assert [r.message for r in caplog.records if "plaintext (--insecure)" in r.message]
    assert rules.allow_legacy is False
    assert ControllerConfig(listen="127.0.0.1:0").access().allow_legacy is True
    assert ControllerConfig().listen.startswith("127.0.0.1:")


def test_tokens_are_kept_as_digests_and_compared_whole(tmp_path) -> None:
    digest = token_digest("abc")
    assert digest != "abc" and token_matches(digest, "abc")
    assert not token_matches(digest, "abd") and not token_matches(digest, "") and not token_matches("", "abc")
    path = tmp_path / "admin"
    path.write_text("  admin-token  \n")
    path.chmod(0o600)
    assert read_token_file(str(path)) == "admin-token"
    path.write_text("has space\n")
    with pytest.raises(ConfigError, match="printable ASCII without spaces"):
        read_token_file(str(path))
    for mode in (0o644, 0o640, 0o604, 0o620):  # another user, or a group member, could read it and be admin
        path.write_text("admin-token\n")
        path.chmod(mode)
        if os.geteuid() == 0:
            os.chown(path, 65534, -1)  # a group-readable file root does not own
        with pytest.raises(ConfigError, match=f"readable by other users .mode 0{mode:o}.*run chmod 600 {path}"):
            read_token_file(str(path))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file root owns")
def test_a_secret_root_mounts_for_the_pods_group_is_accepted(tmp_path) -> None:
    """Kubernetes mounts a secret owned by root, group fsGroup, mode 0440: only root chose that group."""
    path = tmp_path / "admin"
    path.write_text("admin-token\n")
    os.chown(path, 0, 65532)
    path.chmod(0o440)
    assert read_token_file(str(path)) == "admin-token"
    path.chmod(0o460)  # group may write: refused even from root
    with pytest.raises(ConfigError, match="run chmod 600"):
        read_token_file(str(path))
    assert "abc" not in repr(Credentials(token="abc")) and "abc" not in repr(Caller("abc"))


def test_metadata_parsing_accepts_bearer_only() -> None:
    assert parse_metadata([("authorization", "Bearer t0k"), ("x-taskd-launch", "L")]) == Caller("t0k", "L")
    assert parse_metadata([("other", "x")]) == Caller()
    for bad in ("Basic abc", "Bearer", "Bearer " + "x" * 513):
        with pytest.raises(Exception, match="authorization|at most 512"):
            parse_metadata([("authorization", bad)])


def test_garbage_protobuf_gets_invalid_argument_without_internal_names(controller) -> None:
    with grpc.insecure_channel(controller.address) as channel:
        for method in ("Init", "ReportProcessFault", "SubscribeProcessManageSignal"):
            call = (
                channel.unary_stream(f"/Recover/{method}")
                if method.startswith("Subscribe")
                else channel.unary_unary(f"/Recover/{method}")
            )
            with pytest.raises(grpc.RpcError) as raw:
                reply = call(b"\xff\xff\xff\xff", timeout=10)
                list(reply) if method.startswith("Subscribe") else reply
            assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            details = raw.value.details()
            assert details == "the request is not a valid protobuf message for this RPC"
    assert RawAgent(controller.address, "probe").stub.HealthCheck(pb.ClientInfo(jobId="p"), timeout=10).code == 0


def test_malformed_authorization_is_unauthenticated(controller) -> None:
    from taskd_core.rpc import recover_pb2_grpc

    with grpc.insecure_channel(controller.address) as channel:
        stub = recover_pb2_grpc.RecoverStub(channel)
        with pytest.raises(grpc.RpcError) as raw:
            stub.Init(pb.ClientInfo(jobId=JOB), metadata=[("authorization", "Basic dXNlcjpwdw==")], timeout=10)
    assert raw.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "Bearer <token>" in raw.value.details()
