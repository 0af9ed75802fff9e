"""A small asyncio client of etcd's v3 gRPC API: what the controller's etcd state needs.

Ranges, transactions, leases, one watch and the member status, over
``grpc.aio`` with the messages generated from ``proto/etcd_v3.proto``.

Why not a client library
------------------------
The controller needs etcd's v3 API from its own event loop, under the
project's protobuf 7 and grpcio 1.85, with client-certificate TLS, several
endpoints and a deadline on every call. What was on offer:

* ``etcd3`` (python-etcd3) has had no release since 2020; its generated code
  predates protobuf 4 and fails to import on current protobuf.
* ``aetcd`` (its maintained asyncio fork, 1.0 in 2026) ships stubs built by
  another grpcio-tools than ours, talks to one endpoint, and would be a
  second copy of etcd's message types in protobuf's default pool (a process
  importing both clients fails); ``etcd3gw`` and its async twin go through
  etcd's JSON gateway with an HTTP stack of their own (``requests`` /
  ``aiohttp``) and base64 for every key.
* etcd's own JSON gateway (``/v3/kv/range`` ...) needs no generated code but
  the same HTTP client, and its streaming endpoints (watch, lease keep-alive)
  are chunked JSON, not messages.

Generating the messages ourselves costs one ~200-line proto file (the fields
we use, etcd's numbers) compiled by the same ``scripts/gen_proto.py`` and
grpcio-tools as ``recover.proto``: they can never drift from the installed
protobuf, there is no new dependency, and the channel (TLS, reconnect
backoff, message sizes) is configured like every other channel of TaskD.
The services are named by path below rather than generated, so the
messages live in TaskD's own proto package (see the proto's header).

Endpoints are tried in turn: a call that cannot reach one (UNAVAILABLE) goes
to the next within the same deadline, and the one that answered is tried
first next time. Deadlines are on every call; callers decide about retries.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from taskd_core.errors import ConfigError, StateStoreError, StateUnavailableError
from taskd_core.rpc._gen import etcd_v3_pb2 as epb

logger = logging.getLogger(__name__)

SCHEME = "etcd://"
#: Keys one range page asks for; pages keep every answer well under the message limit.
PAGE = 1000
#: gRPC statuses meaning "this endpoint is not reachable now": another endpoint may answer.
_RETRY_ELSEWHERE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_CHANNEL_OPTIONS = (
    # Capped like the agents' channels: after a long etcd outage every attempt is a real one.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # Each endpoint its own connection, never shared with another client in the process.
    ("grpc.use_local_subchannel_pool", 1),
)

_M = TypeVar("_M", bound=Message)
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class EtcdTls:
    """Files for TLS to etcd: the CA that signed etcd's certificate, and a client certificate."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    def credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials from the files; ConfigError naming the file that cannot be read."""
        if bool(self.cert) != bool(self.key):
            raise ConfigError(
                "--etcd-cert and --etcd-key go together: give the client certificate and its key"
            )
        blobs: dict[str, bytes | None] = {}
        for flag, path in (("--etcd-cacert", self.ca), ("--etcd-cert", self.cert), ("--etcd-key", self.key)):
            try:
                blobs[flag] = Path(path).read_bytes() if path else None
            except OSError as exc:
                raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
        return grpc.ssl_channel_credentials(
            root_certificates=blobs["--etcd-cacert"],
            private_key=blobs["--etcd-key"],
            certificate_chain=blobs["--etcd-cert"],
        )


@dataclass(frozen=True, slots=True)
class EtcdTarget:
    """Where the state lives in etcd: endpoints (``HOST:PORT``) and a key prefix (``/taskd``)."""

    endpoints: tuple[str, ...]
    prefix: str
    tls: EtcdTls | None = None

    @property
    def url(self) -> str:
        return f"{SCHEME}{','.join(self.endpoints)}{self.prefix}"


def is_etcd_url(state: str) -> bool:
    return state.startswith(SCHEME)


def parse_etcd_url(text: str, tls: EtcdTls | None = None) -> EtcdTarget:
    """``etcd://HOST:PORT[,HOST:PORT...]/PREFIX`` as a target; ConfigError saying what is wrong."""
    example = "e.g. etcd://127.0.0.1:2379/taskd or etcd://etcd-0:2379,etcd-1:2379/taskd"
    if not is_etcd_url(text):
        raise ConfigError(f"--state {text!r}: an etcd state starts with {SCHEME}; {example}")
    hosts, slash, prefix = text[len(SCHEME) :].partition("/")
    prefix = "/" + prefix.strip("/")
    if not slash or prefix == "/":
        raise ConfigError(f"--state {text!r}: give a key prefix after the endpoints; {example}")
    if not prefix.isprintable() or " " in prefix:
        raise ConfigError(f"--state {text!r}: the key prefix must be printable, without spaces")
    endpoints = tuple(e.strip() for e in hosts.split(","))
    for endpoint in endpoints:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ConfigError(f"--state {text!r}: endpoint {endpoint!r} is not HOST:PORT; {example}")
    return EtcdTarget(endpoints, prefix, tls)


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


def put(key: bytes, value: bytes, lease: int = 0) -> epb.RequestOp:
    return epb.RequestOp(request_put=epb.PutRequest(key=key, value=value, lease=lease))


def delete(key: bytes, range_end: bytes = b"") -> epb.RequestOp:
    return epb.RequestOp(request_delete_range=epb.DeleteRangeRequest(key=key, range_end=range_end))


def get(key: bytes) -> epb.RequestOp:
    return epb.RequestOp(request_range=epb.RangeRequest(key=key))


def created_at(key: bytes, revision: int) -> epb.Compare:
    """The key exists with this create revision (0: the key does not exist)."""
    return epb.Compare(result=epb.Compare.EQUAL, target=epb.Compare.CREATE, key=key, create_revision=revision)


def modified_at(key: bytes, revision: int) -> epb.Compare:
    """The key was last written at this revision."""
    return epb.Compare(result=epb.Compare.EQUAL, target=epb.Compare.MOD, key=key, mod_revision=revision)


# Method paths of etcd's services (package etcdserverpb) and their answers.
_RANGE = ("/etcdserverpb.KV/Range", epb.RangeResponse)
_TXN = ("/etcdserverpb.KV/Txn", epb.TxnResponse)
_GRANT = ("/etcdserverpb.Lease/LeaseGrant", epb.LeaseGrantResponse)
_REVOKE = ("/etcdserverpb.Lease/LeaseRevoke", epb.LeaseRevokeResponse)
_STATUS = ("/etcdserverpb.Maintenance/Status", epb.StatusResponse)
_KEEPALIVE = ("/etcdserverpb.Lease/LeaseKeepAlive", epb.LeaseKeepAliveResponse)
_WATCH = ("/etcdserverpb.Watch/Watch", epb.WatchResponse)


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


def _brief(exc: grpc.aio.AioRpcError) -> str:
    details = (exc.details() or "").splitlines()
    return f"{exc.code().name}: {details[0][:200] if details else ''}"


class EtcdClient:
    """Calls to one etcd cluster from one event loop; :meth:`close` when done."""

    def __init__(self, target: EtcdTarget, *, timeout: float = 2.0) -> None:
        self.target = target
        self.timeout = timeout
        self._credentials = target.tls.credentials() if target.tls is not None else None
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._current = 0

    # --- plumbing -------------------------------------------------------------

    def _channel(self, index: int) -> grpc.aio.Channel:
        channel = self._channels.get(index)
        if channel is None:
            endpoint = self.target.endpoints[index]
            if self._credentials is None:
                channel = grpc.aio.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
            else:
                channel = grpc.aio.secure_channel(endpoint, self._credentials, options=_CHANNEL_OPTIONS)
            self._channels[index] = channel
        return channel

    async def _each_endpoint(
        self,
        method: str,
        timeout: float | None,
        attempt: Callable[[grpc.aio.Channel, float], Awaitable[_T]],
    ) -> _T:
        """``attempt(channel, seconds)`` on each endpoint in turn until one answers.

        An unreachable endpoint fails at once and the next is tried; a frozen one
        uses only its share of the deadline. The endpoint that answered is tried
        first next time.
        """
        name = method.rpartition("/")[2]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.timeout if timeout is None else timeout)
        n = len(self.target.endpoints)
        last = ""
        for tried in range(n):
            index = (self._current + tried) % n
            share = (deadline - loop.time()) / (n - tried)
            if share <= 0:
                break
            try:
                result = await attempt(self._channel(index), share)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRY_ELSEWHERE:
                    raise StateStoreError(self.target.url, f"etcd refused {name}", _brief(exc)) from None
                last = f"{self.target.endpoints[index]}: {_brief(exc)}"
                continue
            self._current = index
            return result
        raise StateUnavailableError(self.target.url, f"no etcd endpoint answered {name}", last)

    async def _unary(self, method: tuple[str, type[_M]], request: Message, timeout: float | None) -> _M:
        path, answer = method

        async def attempt(channel: grpc.aio.Channel, seconds: float) -> _M:
            call = channel.unary_unary(
                path, request_serializer=_serialize, response_deserializer=answer.FromString
            )
            response: _M = await call(request, timeout=seconds)
            return response

        return await self._each_endpoint(path, timeout, attempt)

    async def _stream_once(
        self, method: tuple[str, type[_M]], request: Message, timeout: float | None
    ) -> _M | None:
        """One request and its answer on a bidirectional stream (None: the stream ended first)."""
        path, answer = method

        async def attempt(channel: grpc.aio.Channel, seconds: float) -> _M | None:
            call = channel.stream_stream(
                path, request_serializer=_serialize, response_deserializer=answer.FromString
            )(timeout=seconds)
            try:
                await call.write(request)
                response = await call.read()
            finally:
                call.cancel()
            return None if response is grpc.aio.EOF else response

        return await self._each_endpoint(path, timeout, attempt)

    # --- the calls ----------------------------------------------------------------

    async def range(
        self,
        key: bytes,
        range_end: bytes = b"",
        *,
        limit: int = 0,
        keys_only: bool = False,
        count_only: bool = False,
        descending: bool = False,
        timeout: float | None = None,
    ) -> epb.RangeResponse:
        request = epb.RangeRequest(
            key=key,
            range_end=range_end,
            limit=limit,
            keys_only=keys_only,
            count_only=count_only,
            sort_order=epb.RangeRequest.DESCEND if descending else epb.RangeRequest.NONE,
            sort_target=epb.RangeRequest.KEY,
        )
        return await self._unary(_RANGE, request, timeout)

    async def scan(self, prefix: bytes, *, keys_only: bool = False) -> AsyncIterator[epb.KeyValue]:
        """Every key under ``prefix`` in key order, one page at a time, all at one revision."""
        end = prefix_end(prefix)
        start, revision = prefix, 0
        while True:
            request = epb.RangeRequest(
                key=start, range_end=end, limit=PAGE, keys_only=keys_only, revision=revision
            )
            page = await self._unary(_RANGE, request, None)
            revision = revision or page.header.revision
            for kv in page.kvs:
                yield kv
            if not page.more or not page.kvs:
                return
            start = page.kvs[-1].key + b"\0"

    async def txn(
        self,
        compare: Sequence[epb.Compare],
        success: Sequence[epb.RequestOp],
        failure: Sequence[epb.RequestOp] = (),
        *,
        timeout: float | None = None,
    ) -> epb.TxnResponse:
        request = epb.TxnRequest(compare=compare, success=success, failure=failure)
        return await self._unary(_TXN, request, timeout)

    async def grant(self, ttl: int, *, timeout: float | None = None) -> tuple[int, int]:
        """A new lease: its id and the TTL etcd granted (etcd may raise a TTL to its minimum)."""
        answer = await self._unary(_GRANT, epb.LeaseGrantRequest(TTL=ttl), timeout)
        if answer.error:
            raise StateStoreError(self.target.url, "etcd refused a lease", answer.error)
        return answer.ID, answer.TTL

    async def revoke(self, lease: int, *, timeout: float | None = None) -> None:
        """End a lease now, deleting its keys; a lease already gone is no error."""
        try:
            await self._unary(_REVOKE, epb.LeaseRevokeRequest(ID=lease), timeout)
        except StateStoreError as exc:
            if "lease not found" not in exc.cause:
                raise

    async def keepalive(self, lease: int, *, timeout: float | None = None) -> int:
        """Renew a lease once; the seconds it now has left (0 or less: it expired)."""
        answer = await self._stream_once(_KEEPALIVE, epb.LeaseKeepAliveRequest(ID=lease), timeout)
        return answer.TTL if answer is not None else 0

    async def status(self, *, timeout: float | None = None) -> epb.StatusResponse:
        """The answering member's status (version, database size)."""
        return await self._unary(_STATUS, epb.StatusRequest(), timeout)

    async def watch(self, key: bytes, start_revision: int, timeout: float) -> list[epb.Event]:
        """Changes of ``key`` from ``start_revision`` on, waiting at most ``timeout`` for the first.

        Empty when nothing changed in time; the caller looks again.
        """
        request = epb.WatchRequest(
            create_request=epb.WatchCreateRequest(key=key, start_revision=start_revision)
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        path, answer = _WATCH
        call = self._channel(self._current).stream_stream(
            path, request_serializer=_serialize, response_deserializer=answer.FromString
        )()
        try:
            await call.write(request)
            while (left := deadline - loop.time()) > 0:
                response = await asyncio.wait_for(call.read(), left)
                if response is grpc.aio.EOF or response.canceled:
                    return []
                if response.events:
                    return list(response.events)
        except TimeoutError:
            return []
        except grpc.aio.AioRpcError as exc:
            # The next watch goes to another endpoint: this one may be the reason.
            self._current = (self._current + 1) % len(self.target.endpoints)
            raise StateUnavailableError(self.target.url, "the watch ended", _brief(exc)) from None
        finally:
            call.cancel()
        return []

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
