"""The controller's addresses as a client sees them: one, or several replicas of which one leads.

``--controller A,B,C`` (and ``TASKD_CONTROLLER``, and ``DLRecoverManager``'s
``server_addr``) may name every replica. :class:`Endpoints` keeps one channel
per address and a *current* one; after a failed call it moves on:

* to the address a standby named (gRPC ``UNAVAILABLE`` with the leader in the
  trailing metadata :data:`~taskd_core.rpc.LEADER_METADATA`): at once;
* to the next address, when the current one did not answer (``UNAVAILABLE``
  or ``DEADLINE_EXCEEDED`` without a leader named).

With one address nothing moves, exactly as before replicas existed. Calls
may come from several threads; a failure reported for an address that is no
longer current moves nothing (another thread has moved already).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc

from taskd_core.errors import ConfigError
from taskd_core.models import Credentials
from taskd_core.rpc import LEADER_METADATA
from taskd_core.rpc import recover_pb2_grpc as pb_grpc
from taskd_core.rpc.security import open_channel

logger = logging.getLogger(__name__)

#: Statuses after which another replica may answer.
_TRY_ANOTHER = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def controller_addresses(value: str | Sequence[str], what: str = "controller address") -> tuple[str, ...]:
    """``"A,B,C"`` (or a sequence of them) as addresses; ConfigError for an empty or malformed one."""
    items = value.split(",") if isinstance(value, str) else [p for v in value for p in v.split(",")]
    addresses = tuple(dict.fromkeys(item.strip() for item in items if item.strip()))
    if not addresses:
        raise ConfigError(f"{what}: no address given; expected HOST:PORT[,HOST:PORT...]")
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ConfigError(f"{what} {address!r}: expected HOST:PORT (several: comma-separated)")
    return addresses


def _trailing(exc: grpc.RpcError) -> dict[str, str]:
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return {str(key): str(value) for key, value in trailing or ()}


def leader_of(exc: grpc.RpcError) -> str:
    """The leader a standby replica named in its refusal ("" when none, or not known to it)."""
    return _trailing(exc).get(LEADER_METADATA, "")


def from_standby(exc: grpc.RpcError) -> bool:
    """Whether a standby replica refused (it always says whom it knows as leader, if only "")."""
    return LEADER_METADATA in _trailing(exc)


class Endpoints:
    """Channels to a controller's replicas and which one is current; thread-safe."""

    def __init__(
        self, addresses: Sequence[str], credentials: Credentials, options: Sequence[tuple[str, Any]] = ()
    ) -> None:
        self.addresses = list(addresses)
        self._credentials = credentials
        self._options = tuple(options)
        self._current = self.addresses[0]
        self._channels: dict[str, grpc.Channel] = {}
        #: ``time.monotonic()`` of each address's last failure.
        self._failed_at: dict[str, float] = {}
        self._lock = threading.Lock()

    @property
    def several(self) -> bool:
        return len(self.addresses) > 1

    @property
    def current(self) -> str:
        return self._current

    def __str__(self) -> str:
        return ",".join(self.addresses)

    def pick(self) -> tuple[str, pb_grpc.RecoverStub]:
        """The current address and a stub on its channel."""
        with self._lock:
            address = self._current
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = open_channel(address, self._credentials, self._options)
        return address, pb_grpc.RecoverStub(channel)

    def follow(self, leader: str) -> bool:
        """Make ``leader`` current, as a replica beside this client learned it leads; False when it is not
        one of the addresses."""
        with self._lock:
            if leader not in self.addresses:
                return False
            moved, self._current = leader != self._current, leader
        if moved:
            logger.info("following controller %s, which leads now", leader)
        return True

    def failed(self, exc: grpc.RpcError, address: str) -> bool:
        """A call to ``address`` failed with ``exc``: move on if another replica may answer; True if moved."""
        leader = leader_of(exc)
        with self._lock:
            self._failed_at[address] = time.monotonic()
            if address != self._current:
                return True
            if leader and leader != address:
                if leader not in self.addresses:
                    self.addresses.append(leader)
                self._current = leader
            elif exc.code() in _TRY_ANOTHER and len(self.addresses) > 1:
                self._current = self.addresses[(self.addresses.index(address) + 1) % len(self.addresses)]
            else:
                return False
            moved_to = self._current
        logger.info("controller %s did not serve (%s); trying %s", address, exc.code(), moved_to)
        return True

    def pace(self, interval: float) -> float:
        """Seconds until the current address may be tried again, at most once per ``interval``."""
        with self._lock:
            since = time.monotonic() - self._failed_at.get(self._current, -interval)
        return max(0.0, interval - since)

    def call(self, method: str, request: Any, timeout: float) -> Any:
        """One unary call (``method`` of the Recover stub) that tries each replica once and the leader
        a standby names; the last :class:`grpc.RpcError` when none answers."""
        error: grpc.RpcError | None = None
        for _ in range(len(self.addresses) + 1):
            address, stub = self.pick()
            try:
                return getattr(stub, method)(request, timeout=timeout)
            except grpc.RpcError as exc:
                error = exc
                if not self.failed(exc, address):
                    break
        assert error is not None
        raise error

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
