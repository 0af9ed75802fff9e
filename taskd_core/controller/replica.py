"""One controller replica: it leads and serves, or it stands by and says who leads.

:func:`open_election` turns ``--state`` into an election: a SQLite file is a
controller of its own that leads at once; ``etcd://HOSTS/PREFIX`` is checked
(reachable, TaskD's prefix of this schema, the same policy as the other
replicas) before the replica serves anything, so a bad start is one line and
exit 2. :class:`Replica` then loops: campaign, load the state into a fresh
:class:`~taskd_core.controller.runtime.Controller`, serve (health SERVING)
until the term ends, close that controller (its streams end, agents come
back to whoever leads), stand by (NOT_SERVING) and campaign again. Nothing
of a term outlives it: each leader starts from what etcd holds.

Requests reach the controller through :meth:`Replica.controller`, which
raises :class:`~taskd_core.errors.NotLeaderError` (with the leader's
address) on a standby or once the term's lease ran out; the service turns
that into gRPC UNAVAILABLE plus the address, so a client can follow.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from grpc_health.v1 import health, health_pb2

from taskd_core.controller.election import Election, EtcdElection, SoleElection, Term
from taskd_core.controller.etcd_client import EtcdClient, EtcdTls, is_etcd_url, parse_etcd_url
from taskd_core.controller.policy import PolicyBook, policy_to_dict
from taskd_core.controller.runtime import Controller, ControllerGauges
from taskd_core.controller.store import StateStore
from taskd_core.controller.store_etcd import Layout, check_prefix, claim_policy
from taskd_core.controller.store_sqlite import SqliteState
from taskd_core.errors import LeadershipLostError, NotLeaderError, StateStoreError, StateUnavailableError
from taskd_core.rpc import SERVICE_NAME

logger = logging.getLogger(__name__)


def policy_document(policies: PolicyBook) -> dict[str, Any]:
    """The policy book as the replicas compare it (JSON data, as etcd gives it back)."""
    doc = {
        "defaults": policy_to_dict(policies.defaults),
        "jobs": {job: policy_to_dict(p) for job, p in sorted(policies.jobs.items())},
    }
    loaded: dict[str, Any] = json.loads(json.dumps(doc))
    return loaded


async def open_election(
    state: str,
    address: str,
    policies: PolicyBook,
    *,
    etcd_tls: EtcdTls | None = None,
    lease_ttl: int = 2,
    replace_policy: bool = False,
    timeout: float = 5.0,
    beside: str = "",
) -> Election:
    """The election behind ``state``; checks an etcd prefix before anything serves.

    :raises StateUnavailableError: etcd did not answer within ``timeout``.
    :raises ConfigError: a malformed URL, someone else's prefix, another schema, another policy.
    """
    if not is_etcd_url(state):
        return SoleElection(SqliteState(state), address)
    target = parse_etcd_url(state, etcd_tls)
    client = EtcdClient(target, timeout=max(0.5, min(2.0, timeout)))
    layout = Layout(target.prefix)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                await client.status(timeout=max(0.1, deadline - time.monotonic()))
                break
            except StateUnavailableError as exc:
                if time.monotonic() >= deadline:
                    raise StateUnavailableError(
                        target.url, f"etcd unreachable for {timeout:g} s", exc.cause
                    ) from None
                await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        await check_prefix(client, layout)
        revision = await claim_policy(
            client, layout, policy_document(policies), address, replace=replace_policy
        )
    except BaseException:
        await client.close()
        raise
    return EtcdElection(client, layout, address, ttl=lease_ttl, policy_revision=revision, beside=beside)


class Replica:
    """Leads or stands by, on one event loop; :meth:`start`, then :meth:`stop`."""

    def __init__(
        self,
        election: Election,
        make_controller: Callable[[StateStore], Controller],
        health_servicer: health.aio.HealthServicer,
        address: str,
    ) -> None:
        self._election = election
        self._make = make_controller
        self._health = health_servicer
        self.address = address
        self._term: Term | None = None
        self._controller: Controller | None = None
        self._task: asyncio.Task[None] | None = None
        self._leading = asyncio.Event()
        #: set with the error that ends this replica for good (a policy replaced under it).
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def leading(self) -> bool:
        return self._controller is not None

    @property
    def leader(self) -> str:
        """The leading replica's address ("" unknown): this one's while it leads."""
        if self._controller is not None:
            return self.address
        # Until its next campaign looks, a replica that just stopped leading still sees itself.
        known = self._election.leader
        return "" if known == self.address else known

    @property
    def generation(self) -> int:
        return self._term.generation if self._term is not None and self._controller is not None else 0

    def controller(self) -> Controller:
        """The controller while this replica leads; :class:`NotLeaderError` otherwise."""
        term, controller = self._term, self._controller
        if controller is None or term is None or not term.valid():
            leader = self.leader if controller is None else ""
            where = f"the leader is at {leader}" if leader else "no leader is known yet; try another replica"
            trouble = self._election.trouble
            if trouble:
                # What the last look at etcd found: the leader named may have stepped down since.
                where = f"etcd does not answer it ({trouble[:160]}); {where.replace(' is at ', ' was at ')}"
            raise NotLeaderError(f"controller replica {self.address} stands by: {where}", leader=leader)
        return controller

    def gauges(self) -> ControllerGauges:
        if self._controller is None:
            return ControllerGauges({}, 0, 0, 0)
        return self._controller.gauges()

    async def start(self, timeout: float) -> None:
        """Start campaigning; returns once this replica leads or stands by (or after ``timeout``)."""
        await self._set_health(False)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="taskd-replica")
        settled: list[asyncio.Future[Any]] = [
            asyncio.ensure_future(self._leading.wait()),
            asyncio.ensure_future(self._election.standing_by.wait()),
            self.failed,
        ]
        await asyncio.wait(settled, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for waiter in settled[:2]:
            waiter.cancel()
        if self.failed.done() and not self.failed.cancelled():
            self.failed.result()  # raises what ended the replica

    async def wait_leading(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._leading.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def _set_health(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):
            await self._health.set(service, status)

    async def _run(self) -> None:
        try:
            while True:
                term = await self._election.campaign()
                self._term = term
                controller = self._make(term.store)
                try:
                    await controller.start(departed=term.departed)
                except (LeadershipLostError, StateStoreError) as exc:
                    logger.warning("replica %s could not take over: %s; standing by", self.address, exc)
                    await controller.close()
                    await term.end()
                    continue
                self._controller = controller
                self._leading.set()
                await self._set_health(True)
                reason = await term.lost
                self._controller = None
                self._leading.clear()
                await self._set_health(False)
                logger.warning("replica %s stopped leading: %s; standing by", self.address, reason)
                await controller.close()
                await term.end()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the replica cannot go on (its policy was replaced): the caller exits
            if not self.failed.done():
                self.failed.set_exception(exc)

    def end_streams(self) -> None:
        if self._controller is not None:
            self._controller.end_streams()

    async def stop(self) -> None:
        """Stop campaigning or leading: close the controller and give the lease back."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        controller, self._controller = self._controller, None
        self._leading.clear()
        if controller is not None:
            await controller.close()
        term, self._term = self._term, None
        if term is not None:
            await term.end()
        await self._election.close()
        if not self.failed.done():
            self.failed.cancel()
