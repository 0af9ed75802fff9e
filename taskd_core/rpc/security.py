"""Control-plane security in one place: TLS for both sides, job tokens and the gRPC interceptors.

Client side, :func:`open_channel` turns :class:`~taskd_core.models.Credentials`
into a channel: TLS (mutual with a client certificate) when a CA is given,
and every call carrying ``authorization: Bearer <token>`` and the launch
identity as metadata. Every client (``DLRecoverManager``, ``taskd status``,
the launchers' agents) opens its channel here.

Server side, :class:`ServerTls` makes the server's credentials,
:class:`RequestGuard` refuses malformed requests before they reach the
service (an unreadable protobuf gets ``INVALID_ARGUMENT``, a malformed
``authorization`` header ``UNAUTHENTICATED``) and :func:`caller_of` gives the
service what a caller presented. Tokens are compared as SHA-256 digests in
constant time; the controller stores only digests.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import ssl
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from taskd_core.errors import ConfigError, ProtocolError
from taskd_core.models import Credentials
from taskd_core.values import check_secret

logger = logging.getLogger(__name__)

#: Metadata keys (gRPC wants them lower case).
AUTHORIZATION = "authorization"
LAUNCH = "x-taskd-launch"

_GARBAGE_TEXT = "the request is not a valid protobuf message for this RPC"


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"{what} {path}: cannot read it ({exc.strerror}); check the path and permissions"
        ) from None
    if not data.strip():
        raise ConfigError(f"{what} {path}: the file is empty")
    return data


# --- tokens -----------------------------------------------------------------------------


def token_digest(token: str) -> str:
    """What the controller keeps of a token."""
    return hashlib.sha256(token.encode()).hexdigest()


def token_matches(digest: str, token: str) -> bool:
    """Whether ``token`` is the one ``digest`` was made from (constant time)."""
    return bool(digest and token) and hmac.compare_digest(digest, token_digest(token))


def read_token_file(path: str, what: str = "token file") -> str:
    """A token from the first line of a file; :class:`ConfigError` for an unusable one.

    A file other users may read is refused: whoever reads the admin token is admin. Group read
    is allowed only on a file root owns (the rule PostgreSQL applies to its key file): that is how
    Kubernetes mounts a secret for a pod's ``fsGroup``, and only root could have chosen the group.
    """
    try:
        st = os.stat(path)
        mode, owner = st.st_mode, st.st_uid
    except OSError:
        mode, owner = 0, 0  # _read says what is wrong with the path
    if mode & 0o027 or (owner != 0 and mode & 0o070):
        raise ConfigError(
            f"{what} {path}: readable by other users (mode {stat.S_IMODE(mode):04o}); "
            f"whoever reads it holds the token: run chmod 600 {path}"
        )
    token = _read(path, what).decode(errors="replace").strip().splitlines()[0].strip()
    check_secret(token, what)
    return token


# --- client side ----------------------------------------------------------------------------


def call_metadata(credentials: Credentials) -> tuple[tuple[str, str], ...]:
    """The metadata every call of a client carries; :class:`ConfigError` for a token gRPC cannot send."""
    pairs: list[tuple[str, str]] = []
    if credentials.token:
        check_secret(credentials.token, "the job token")
        pairs.append((AUTHORIZATION, f"Bearer {credentials.token}"))
    if credentials.launch:
        pairs.append((LAUNCH, credentials.launch))
    return tuple(pairs)


def channel_credentials(credentials: Credentials) -> grpc.ChannelCredentials | None:
    """TLS credentials for a client, or None for plaintext; :class:`ConfigError` for unusable files."""
    if bool(credentials.tls_cert) != bool(credentials.tls_key):
        raise ConfigError(
            "mutual TLS needs both TASKD_TLS_CERT and TASKD_TLS_KEY (the client's certificate and key)"
        )
    if not credentials.tls_ca:
        if credentials.tls_cert:
            raise ConfigError(
                "a client certificate (TASKD_TLS_CERT) needs the controller's CA too: set TASKD_TLS_CA"
            )
        return None
    cert = _read(credentials.tls_cert, "TLS client certificate") if credentials.tls_cert else None
    key = _read(credentials.tls_key, "TLS client key") if credentials.tls_key else None
    return grpc.ssl_channel_credentials(_read(credentials.tls_ca, "TLS CA file"), key, cert)


def open_channel(
    address: str, credentials: Credentials, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A channel to the controller at ``address`` presenting ``credentials`` on every call."""
    tls = channel_credentials(credentials)
    channel = (
        grpc.secure_channel(address, tls, options=options)
        if tls is not None
        else grpc.insecure_channel(address, options=options)
    )
    metadata = call_metadata(credentials)
    return grpc.intercept_channel(channel, _WithMetadata(metadata)) if metadata else channel


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):  # type: ignore[misc]
    method: str
    timeout: float | None
    metadata: tuple[tuple[str, str], ...]
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class _WithMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Adds the caller's metadata to every unary and server-streaming call."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            tuple(details.metadata or ()) + self._metadata,
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        return continuation(self._details(details), request)


# --- server side ----------------------------------------------------------------------------


def _loads(load: Callable[[], object], problem: str) -> None:
    """Run one of :mod:`ssl`'s loaders; its error becomes :class:`ConfigError` ``problem``."""
    try:
        load()
    except ssl.SSLError:
        raise ConfigError(problem) from None


@dataclass(frozen=True, slots=True)
class ServerTls:
    """The controller's certificate and key; ``client_ca`` set requires client certificates from it."""

    cert: str
    key: str
    client_ca: str = ""

    def credentials(self) -> grpc.ServerCredentials:
        """The server's gRPC credentials; :class:`ConfigError` for files that are no usable PEM."""
        pair = (_read(self.key, "TLS key"), _read(self.cert, "TLS certificate"))
        roots = _read(self.client_ca, "TLS client CA") if self.client_ca else None
        # gRPC itself would only fail at bind time, with a message about the port.
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        _loads(
            lambda: context.load_verify_locations(cafile=self.cert),
            f"TLS certificate {self.cert}: no PEM certificate in it; check --tls-cert",
        )
        _loads(
            lambda: context.load_cert_chain(self.cert, self.key, password=lambda: b""),
            f"TLS key {self.key}: not the unencrypted PEM private key of {self.cert}; check --tls-key",
        )
        if self.client_ca:
            _loads(
                lambda: context.load_verify_locations(cafile=self.client_ca),
                f"TLS client CA {self.client_ca}: no PEM certificate in it; check --tls-client-ca",
            )
        return grpc.ssl_server_credentials(
            [pair], root_certificates=roots, require_client_auth=roots is not None
        )


@dataclass(frozen=True, slots=True)
class Caller:
    """What a request presented: the bearer token and the launch identity (empty when absent)."""

    token: str = field(default="", repr=False)
    launch: str = ""
    #: the host the request came from (its address, "" when unknown): whose quota a request without
    #: a known token counts against.
    peer: str = ""


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``, ``unix:/path``)."""
    scheme, _, rest = peer.partition(":")
    if scheme in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0].strip("[]")
    return scheme if not rest else f"{scheme}:{rest}"


def parse_metadata(pairs: Iterable[tuple[str, str | bytes]]) -> Caller:
    """The :class:`Caller` of a request's metadata; :class:`ProtocolError` for malformed values."""
    token = launch = ""
    for key, value in pairs:
        if key not in (AUTHORIZATION, LAUNCH):
            continue
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        if key == AUTHORIZATION:
            scheme, _, token = text.partition(" ")
            if scheme.lower() != "bearer" or not token:
                raise ProtocolError("authorization metadata must be 'Bearer <token>'", field=AUTHORIZATION)
        else:
            launch = text
    for value, name in ((token, "the job token"), (launch, LAUNCH)):
        try:
            check_secret(value, name)
        except ConfigError as exc:
            raise ProtocolError(str(exc), field=name) from None
    return Caller(token, launch)


def caller_of(context: grpc.aio.ServicerContext) -> Caller:
    """What the caller of an RPC presented (the :class:`RequestGuard` has refused malformed metadata)."""
    caller = parse_metadata(context.invocation_metadata() or ())
    return Caller(caller.token, caller.launch, peer_host(context.peer() or ""))


_GARBAGE = object()


class RequestGuard(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses what the service must never see: unreadable protobuf and malformed credentials.

    Applies to the methods of one service (``/<service>/``); others pass untouched.
    """

    def __init__(self, service: str) -> None:
        self._prefix = f"/{service}/"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefix):
            return handler
        refusal: tuple[grpc.StatusCode, str] | None = None
        try:
            parse_metadata(details.invocation_metadata or ())
        except ProtocolError as exc:
            refusal = (grpc.StatusCode.UNAUTHENTICATED, str(exc))
        return _guarded(handler, refusal)


def _guarded(
    handler: grpc.RpcMethodHandler, refusal: tuple[grpc.StatusCode, str] | None
) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer

    def safe_parse(data: bytes) -> Any:
        try:
            return parse(data)
        except (DecodeError, ValueError):  # the caller's garbage, never our error
            return _GARBAGE

    async def check(request: Any, context: grpc.aio.ServicerContext) -> None:
        if refusal is not None:
            await context.abort(*refusal)
        if request is _GARBAGE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _GARBAGE_TEXT)

    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def unary_call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(request, context)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_call, request_deserializer=safe_parse, response_serializer=handler.response_serializer
        )
    if handler.unary_stream is not None:
        stream = handler.unary_stream

        async def stream_call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await check(request, context)
            # aclosing: a cancelled call closes the service's generator at once, running its cleanup.
            async with contextlib.aclosing(stream(request, context)) as items:
                async for item in items:
                    yield item

        return grpc.unary_stream_rpc_method_handler(
            stream_call, request_deserializer=safe_parse, response_serializer=handler.response_serializer
        )
    return handler
