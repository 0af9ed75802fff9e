"""A real etcd server for the tests: free loopback ports, a temporary data directory, TLS on demand.

``EtcdServer(data_dir).start()`` runs Debian's ``/usr/bin/etcd`` (v3 API) and
returns once it answers; ``stop()``/``start()`` take it away and bring it back
on the same ports and data (an outage), ``url(prefix)`` is a controller's
``--state``. Tests that need it skip, saying why, only when no etcd binary exists.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import grpc
import pytest

from taskd_core.rpc._gen import etcd_v3_pb2 as epb
from taskd_core.testing import free_port

#: Generous: etcd's first start writes its WAL and elects itself.
START_DEADLINE = 60.0


def etcd_binary() -> str:
    exe = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
    if exe is None:
        pytest.skip("no etcd server installed (Debian: apt-get install etcd-server; .ci/run installs it)")
    return exe


class EtcdServer:
    """One single-member etcd cluster; with ``tls`` (cert, key, CA) it requires client certificates.

    ``client`` (cert, key) is what the readiness check presents; by default the serving pair.
    ``v2`` also serves etcd's v2 API, which torch's etcd rendezvous backends use.
    """

    def __init__(
        self,
        data_dir: Path,
        tls: tuple[str, str, str] | None = None,
        client: tuple[str, str] | None = None,
        *,
        v2: bool = False,
    ) -> None:
        self.exe = etcd_binary()
        self.v2 = v2
        self.data_dir = data_dir
        self.tls = tls
        self.client = client or (tls[:2] if tls else None)
        self.port = free_port()
        self.peer_port = free_port()
        self.log = data_dir.with_suffix(".log")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, prefix: str = "") -> str:
        """A ``--state`` URL under a prefix of its own (a fresh one unless given)."""
        return f"etcd://{self.endpoint}/{prefix or 't-' + uuid.uuid4().hex[:12]}"

    def start(self) -> EtcdServer:
        scheme = "https" if self.tls else "http"
        client = f"{scheme}://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            self.exe, "--name", "default", "--data-dir", str(self.data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"default={peer}", "--log-level", "warn",
        ]
        if self.v2:
            args.append("--enable-v2")
        if self.tls:
            cert, key, ca = self.tls
            args += ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca, "--client-cert-auth"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        end = time.monotonic() + START_DEADLINE
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > end:
                self.kill()
                raise AssertionError(f"etcd did not start:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def keys(self, prefix: str) -> list[bytes]:
        """Every key under ``prefix`` (v3 API, plaintext only), as etcdctl get --prefix --keys-only would list them."""
        return list(self.items(prefix))

    def items(self, prefix: str) -> dict[bytes, bytes]:
        """Every key under ``prefix`` and its value (v3 API, plaintext only)."""
        end = bytearray(prefix.encode())
        end[-1] += 1
        with grpc.insecure_channel(self.endpoint) as channel:
            scan = channel.unary_unary(
                "/etcdserverpb.KV/Range",
                request_serializer=epb.RangeRequest.SerializeToString,
                response_deserializer=epb.RangeResponse.FromString,
            )
            answer = scan(epb.RangeRequest(key=prefix.encode(), range_end=bytes(end)), timeout=10.0)
        return {kv.key: kv.value for kv in answer.kvs}

    def _answers(self) -> bool:
        if self.tls and self.client:
            ca, (cert, key) = self.tls[2], self.client
            creds = grpc.ssl_channel_credentials(Path(ca).read_bytes(), Path(key).read_bytes(), Path(cert).read_bytes())
            channel = grpc.secure_channel(self.endpoint, creds)
        else:
            channel = grpc.insecure_channel(self.endpoint)
        with channel:
            status = channel.unary_unary(
                "/etcdserverpb.Maintenance/Status",
                request_serializer=epb.StatusRequest.SerializeToString,
                response_deserializer=epb.StatusResponse.FromString,
            )
            try:
                return bool(status(epb.StatusRequest(), timeout=1.0).leader)
            except grpc.RpcError:
                return False

    def stop(self) -> None:
        """SIGTERM and wait: the data stays, ``start()`` brings the same cluster back."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.proc = None
