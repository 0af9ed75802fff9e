"""Where the controller replicas of one job say they listen, in the etcd that holds the job's state.

When every node of a job runs a controller replica on one etcd prefix (``taskdrun``
with the etcd rendezvous), each node's agent must know every replica, not only
its own: the leader may be any of them, and after a node's loss another. So each
replica *announces* its address under ``P/replicas/ID`` (``P`` the state's
prefix), on a lease of its own that a thread renews: a replica whose node is
lost leaves the roster once its lease runs out, a graceful stop at once. The
agents read the roster after their own replica announced itself
(:meth:`Roster.addresses`).

With the job's token (``TASKD_JOB_TOKEN``; a job on several hosts has one) each
address is signed for this job (:func:`taskd_core.authstream.sign`), as the
other addresses a job publishes are: whoever can write to etcd but does not
hold the token cannot send the agents to a controller of their own, because an
address that does not verify is skipped. Without a token (every node on this
machine's loopback, a legacy job) addresses are taken as they are.

The roster also knows when the job's last replica goes (:meth:`Roster.close`):
that one removes the job's state from etcd, as an embedded controller's state
in memory ends with the job.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

from taskd_core.authstream import sign, stream_key, verify
from taskd_core.controller.etcd_client import EtcdClient, EtcdTarget, delete, parse_etcd_url, prefix_end, put
from taskd_core.errors import ControllerUnavailableError, StateStoreError
from taskd_core.launcher.settings import NodeSettings

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds of an announcement's lease: how long a lost node's replica stays listed.
ROSTER_TTL = 5
#: How often :meth:`Roster.addresses` looks again while fewer replicas are listed than wanted.
_POLL = 0.05
#: Purpose of the job token's key that signs the addresses (see :func:`taskd_core.authstream.stream_key`).
_PURPOSE = "controller replicas"


def roster_prefix(state_prefix: str) -> bytes:
    """Where the replicas of the state at ``state_prefix`` (``/taskd/...``) announce themselves."""
    return state_prefix.rstrip("/").encode() + b"/replicas/"


class Roster:
    """This node's announcement in the roster of one job's replicas, and the roster as read from etcd.

    :param target: the etcd cluster and the state's prefix.
    :param job_id: the job the addresses are signed for.
    :param token: the job's token; empty: addresses go unsigned and are read unchecked.
    :param ttl: seconds of the announcement's lease.
    :param timeout: seconds one call to etcd may take.
    """

    def __init__(
        self, target: EtcdTarget, job_id: str, token: str, *, ttl: int = ROSTER_TTL, timeout: float = 5.0
    ) -> None:
        self._target = target
        self._prefix = roster_prefix(target.prefix)
        self._key = stream_key(token, _PURPOSE) if token else b""
        self._context = b"controller replica\0" + job_id.encode()
        self._ttl = ttl
        self._timeout = timeout
        self._name = self._prefix + uuid.uuid4().hex.encode()
        self._address = ""
        self._lease = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="taskd-roster", daemon=True)
        self._thread.start()
        self._client: EtcdClient = self._call(self._make_client())
        self._keeper: concurrent.futures.Future[None] | None = None

    async def _make_client(self) -> EtcdClient:
        # Made on the roster's loop: grpc.aio channels belong to the loop that opens them.
        return EtcdClient(self._target, timeout=self._timeout)

    def _call(self, coroutine: Coroutine[Any, Any, T], wait: float | None = None) -> T:
        done = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return done.result(self._timeout * 2 if wait is None else wait)
        except concurrent.futures.TimeoutError:
            done.cancel()
            raise StateStoreError(self._target.url, "etcd did not answer the roster in time") from None

    # --- this replica's announcement ----------------------------------------------------

    def announce(self, address: str) -> None:
        """List ``address`` as one of the job's replicas until :meth:`close` (or this process ends).

        :raises StateStoreError: etcd did not take it.
        """
        self._address = address
        self._call(self._put())
        self._keeper = asyncio.run_coroutine_threadsafe(self._keep(), self._loop)
        logger.info("%s: announced this node's controller replica %s", self._target.url, address)

    def _value(self) -> bytes:
        return (sign(self._key, self._context, self._address) if self._key else self._address).encode()

    async def _put(self) -> None:
        lease, _ = await self._client.grant(self._ttl)
        await self._client.txn([], [put(self._name, self._value(), lease)])
        self._lease = lease

    async def _keep(self) -> None:
        """Renew the lease; announce again on a new one when etcd let it lapse (an outage)."""
        told = False
        while True:
            await asyncio.sleep(self._ttl / 4)
            try:
                if await self._client.keepalive(self._lease) <= 0:
                    logger.info("%s: the roster's lease lapsed; announcing again", self._target.url)
                    await self._put()
                told = False
            except StateStoreError as exc:
                if not told:
                    logger.warning("%s: cannot renew this replica's roster entry: %s", self._target.url, exc)
                told = True

    # --- the roster ---------------------------------------------------------------------

    def addresses(self, want: int, timeout: float) -> tuple[str, ...]:
        """The listed replicas: this node's first, then the others; waits up to ``timeout`` for ``want``.

        Fewer than ``want`` at the deadline are logged and returned: the agents
        still follow the leader that a listed replica names.

        :raises StateStoreError: etcd did not answer.
        """
        deadline = time.monotonic() + timeout
        while True:
            found = self._call(self._read())
            others = sorted(a for a in found if a != self._address)
            listed = ((self._address,) if self._address else ()) + tuple(others)
            if len(listed) >= want:
                return listed
            if time.monotonic() >= deadline:
                logger.warning(
                    "%s: %s of the job's %s controller replicas announced themselves within %.1fs: %s",
                    self._target.url,
                    len(listed),
                    want,
                    timeout,
                    ", ".join(listed) or "none",
                )
                return listed
            time.sleep(_POLL)

    async def _read(self) -> set[str]:
        answer = await self._client.range(self._prefix, prefix_end(self._prefix))
        found = set()
        for kv in answer.kvs:
            text = kv.value.decode("utf-8", "replace")
            address = verify(self._key, self._context, text) if self._key else text
            if address is None:
                logger.warning(
                    "skipped a controller replica address the job's token did not sign: %r", text[:99]
                )
                continue
            found.add(address)
        return found

    # --- the end ------------------------------------------------------------------------

    def close(self, *, last_clears: bytes = b"") -> None:
        """Leave the roster; the last replica to leave deletes every key under ``last_clears``.

        Two replicas that leave together may both find the roster empty and both
        delete: deleting twice is harmless. A failure is logged, never raised:
        the job has ended by then.
        """
        try:
            if self._keeper is not None:
                self._keeper.cancel()
            if self._lease:
                self._call(self._client.revoke(self._lease))
            if last_clears and not self._call(self._read()):
                self._call(self._client.txn([], [delete(last_clears, prefix_end(last_clears))]))
                logger.info("%s: the job's last replica removed its state", self._target.url)
        except StateStoreError as exc:
            logger.warning("%s: leaving the roster: %s", self._target.url, exc)
        finally:
            self._call(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
            self._loop.close()


def replica_addresses(settings: NodeSettings, timeout: float) -> str:
    """The job's announced replicas, comma-separated, for a launcher that runs none yet (a spare).

    Waits up to ``timeout`` for at least one.

    :raises ControllerUnavailableError: none announced itself in time.
    :raises StateStoreError: etcd did not answer.
    """
    target = parse_etcd_url(settings.controller_state, settings.etcd_tls)
    roster = Roster(target, settings.job_id, settings.agent.credentials.token)
    try:
        listed = roster.addresses(1, timeout)
    finally:
        roster.close()
    if not listed:
        raise ControllerUnavailableError(
            f"{target.url} (no controller replica of the job announced itself)", timeout
        )
    return ",".join(listed)
