"""Who leads: one replica at a time holds the state, through an etcd lease.

A replica *campaigns* by creating ``P/leader`` on a fresh lease in one
transaction that also checks the replicas' policy is still the one it
started with; the key's create revision is its *generation*. While it leads,
a keeper thread renews the lease (on a loop of its own, so a busy controller
loop cannot starve it); every write of the leader is fenced on that key's
create revision (``store_etcd.Fence``), so once the lease lapses and another
replica created the key anew, nothing the old leader sends changes anything.

A leader stops leading when:

* a renewal says the lease is gone, or renewals failed until shortly before
  the lease would end (etcd unreachable: it steps down *within* its lease);
* one of its writes finds the fence broken (another replica leads now);
* it was frozen (SIGSTOP, a paused VM) past its lease: :meth:`EtcdTerm.valid`
  compares the lease's end with the monotonic clock, so the first request
  after it thaws is refused and the keeper ends the term.

Standbys watch ``P/leader`` and campaign when it is deleted (the lease
expired or was revoked at a graceful stop); they know the leader's address
from the key, which is how they redirect clients. Beside the watch each
standby holds a TCP connection to that address
(:mod:`~taskd_core.controller.leader_probe`): once the leader's process is
gone (its connections were reset and a new one is refused), the standby
revokes the leader's lease itself and campaigns at once, instead of waiting
for the lease to run out. That is safe even were the proof wrong (a leader
alive but unreachable on that address): revoking deletes the leader key, so
the old leader's next write finds its fence broken and its next renewal
finds the lease gone; it steps down without having changed anything. The SQLite state has no
election: :class:`SoleElection` makes its one controller the leader for good.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from taskd_core.controller.etcd_client import EtcdClient, EtcdTarget, created_at, get, modified_at, put
from taskd_core.controller.leader_probe import nothing_listens
from taskd_core.controller.store import StateStore
from taskd_core.controller.store_etcd import EtcdStore, Fence, Layout
from taskd_core.errors import ConfigError, StateStoreError
from taskd_core.rpc._gen import etcd_v3_pb2 as epb

logger = logging.getLogger(__name__)

#: Seconds a standby watches the leader key before it looks again anyway.
WATCH_SLICE = 5.0
#: Renewals per lease TTL.
RENEWALS_PER_TTL = 4
#: Longest pause between two campaigns while etcd does not answer.
RETRY_CAP = 1.0


class Term(Protocol):
    """One replica's time as leader."""

    store: StateStore
    #: grows with every new leader of a state (the leader key's create revision; 0 for SQLite).
    generation: int
    #: done, with the reason, when the term is over.
    lost: asyncio.Future[str]
    #: agents that ran in the previous leader's process, found gone as this term began.
    departed: tuple[str, ...]

    def valid(self) -> bool:
        """Whether this replica may still act as leader now."""
        ...

    async def end(self) -> None:
        """Give the term up: stop writing, let another replica lead."""
        ...


class Election(Protocol):
    #: set while a campaign found another leader (or no etcd): this replica stands by.
    standing_by: asyncio.Event
    #: why the last campaign could not look at the leader key (etcd did not answer); "" when it could.
    trouble: str

    async def campaign(self) -> Term:
        """Wait until this replica leads (it may stand by for a long time)."""
        ...

    @property
    def leader(self) -> str:
        """The leading replica's address as last seen ("" unknown)."""
        ...

    async def close(self) -> None: ...


# --- SQLite: one controller, always the leader ----------------------------------------------


class SoleTerm:
    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.generation = 0
        self.lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.departed: tuple[str, ...] = ()

    def valid(self) -> bool:
        return True

    async def end(self) -> None:
        await self.store.close()


class SoleElection:
    """The one controller of a SQLite state leads from the start and never stops."""

    def __init__(self, store: StateStore, address: str) -> None:
        self._store = store
        self._address = address
        self._term: SoleTerm | None = None
        self.standing_by = asyncio.Event()
        self.trouble = ""

    async def campaign(self) -> Term:
        if self._term is not None:
            raise RuntimeError("a SQLite controller has one term; it never ends before the controller")
        self._term = SoleTerm(self._store)
        return self._term

    @property
    def leader(self) -> str:
        return self._address

    async def close(self) -> None:
        if self._term is None:
            await self._store.close()


# --- etcd --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplicaIdentity:
    """What a leader writes into the leader key (and a standby tells clients).

    ``beside``: the agent that runs in the replica's process (a launcher's own), which ends
    with it; a standby that finds the process gone tells the next term so.
    """

    address: str
    replica: str
    beside: str = ""

    def value(self) -> bytes:
        return json.dumps(
            {
                "address": self.address,
                "replica": self.replica,
                "beside": self.beside,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "since": time.time(),
            }
        ).encode()

    @staticmethod
    def of(value: bytes) -> ReplicaIdentity:
        try:
            data = json.loads(value)
            return ReplicaIdentity(str(data["address"]), str(data["replica"]), str(data.get("beside", "")))
        except (ValueError, TypeError, KeyError):
            return ReplicaIdentity("", "")


class _LeaseKeeper(threading.Thread):
    """Renews a lease from a thread and event loop of its own; tells ``lost`` when it cannot."""

    def __init__(
        self, target: EtcdTarget, lease: int, ttl: int, until: float, lost: Callable[[str], None]
    ) -> None:
        super().__init__(name=f"taskd-lease-{lease:x}", daemon=True)
        self._target = target
        self._lease = lease
        self._ttl = ttl
        #: ``time.monotonic()`` when the lease ends unless renewed (read from the controller's loop).
        self.until = until
        self._lost = lost
        self._loop = asyncio.new_event_loop()
        self._halt = asyncio.Event()

    def halt(self) -> None:
        if not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._halt.set)
            except RuntimeError:  # the loop closed meanwhile: the thread is ending anyway
                pass

    def run(self) -> None:
        try:
            self._loop.run_until_complete(self._keep())
        finally:
            self._loop.close()

    async def _keep(self) -> None:
        interval = self._ttl / RENEWALS_PER_TTL
        margin = step_down_margin(self._ttl)
        client = EtcdClient(self._target, timeout=interval)
        failing = False
        try:
            while not self._halt.is_set():
                sent = time.monotonic()
                if sent >= self.until - margin:
                    self._lost("etcd did not renew the lease in time: stepping down before it ends")
                    return
                try:
                    left = await client.keepalive(
                        self._lease, timeout=min(interval, self.until - margin - sent)
                    )
                except StateStoreError as exc:
                    # Once per outage: renewals are tried several times a second until the lease ends.
                    log = logger.debug if failing else logger.warning
                    log("%s: lease renewal failed: %s", self._target.url, exc)
                    failing, left = True, None
                if left is not None and left <= 0:
                    self._lost("the lease expired (this replica was frozen or cut off longer than its TTL)")
                    return
                if left is not None:
                    if failing:
                        logger.info("%s: the lease is renewed again", self._target.url)
                    failing = False
                    self.until = sent + left
                pause = interval if left is not None else min(interval, 0.1)
                try:
                    await asyncio.wait_for(
                        self._halt.wait(),
                        timeout=max(0.0, min(pause, self.until - margin - time.monotonic())),
                    )
                except TimeoutError:
                    pass
        finally:
            await client.close()


def step_down_margin(ttl: float) -> float:
    """How long before its lease ends a leader that could not renew it stops leading."""
    return max(0.1, ttl / 8)


class EtcdTerm:
    """A lease-held leadership: the fenced store, the keeper, and how it ends."""

    def __init__(
        self,
        client: EtcdClient,
        layout: Layout,
        lease: int,
        ttl: int,
        granted_at: float,
        generation: int,
        policy_revision: int,
        departed: tuple[str, ...] = (),
    ) -> None:
        self._client = client
        self._lease = lease
        self.generation = generation
        self.departed = departed
        self.ttl = ttl
        loop = asyncio.get_running_loop()
        self.lost: asyncio.Future[str] = loop.create_future()
        self._margin = step_down_margin(ttl)

        def lose_threadsafe(reason: str) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(self.lose, reason)

        self._keeper = _LeaseKeeper(client.target, lease, ttl, granted_at + ttl, lose_threadsafe)
        fence = Fence(
            (created_at(layout.leader, generation), modified_at(layout.policy, policy_revision)),
            lambda: self._keeper.until - self._margin,
            self.lose,
        )
        self.store: StateStore = EtcdStore(client, layout, fence)
        self._keeper.start()

    def valid(self) -> bool:
        if self.lost.done():
            return False
        if time.monotonic() >= self._keeper.until - self._margin:
            self.lose("the lease ran out before it was renewed (this replica was frozen or cut off)")
            return False
        return True

    def lose(self, reason: str) -> None:
        if not self.lost.done():
            self.lost.set_result(reason)

    async def end(self) -> None:
        self.lose("the replica stops")
        await self.store.close()  # while the lease lasts, the writes made so far still land
        self._keeper.halt()
        await asyncio.get_running_loop().run_in_executor(None, self._keeper.join, 5.0)
        # Revoking deletes the leader key at once, so a standby need not wait out the lease.
        try:
            await self._client.revoke(self._lease, timeout=1.0)
        except StateStoreError as exc:
            logger.info(
                "%s: lease not revoked (%s); it ends by itself within %d s",
                self._client.target.url,
                exc,
                self.ttl,
            )


async def _cancelled(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` (if still running) and wait until it has ended."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class EtcdElection:
    """Campaigns for the leader key of one prefix; :meth:`campaign` returns when this replica leads."""

    def __init__(
        self,
        client: EtcdClient,
        layout: Layout,
        address: str,
        *,
        ttl: int,
        policy_revision: int,
        beside: str = "",
    ) -> None:
        self._client = client
        self._layout = layout
        self._me = ReplicaIdentity(address, uuid.uuid4().hex, beside)
        self._ttl = ttl
        self._policy_revision = policy_revision
        self._leader = ReplicaIdentity("", "")
        #: the lease the leader key was last seen on (0 unknown).
        self._leader_lease = 0
        #: the leader whose process this replica found gone and whose lease it ended, until the next campaign.
        self._vacated: ReplicaIdentity | None = None
        #: revision at which the leader key was last seen (watched from the next one).
        self._seen = 0
        self.standing_by = asyncio.Event()
        self.trouble = ""

    @property
    def leader(self) -> str:
        return self._leader.address

    async def campaign(self) -> Term:
        attempt = 0
        unreachable = False
        while True:
            try:
                term = await self._try()
                self.trouble = ""
                if term is not None:
                    self.standing_by.clear()
                    return term
                self.standing_by.set()
                if unreachable:
                    logger.info("%s: etcd answers again; standing by", self._client.target.url)
                unreachable = False
                attempt = 0
                await self._await_vacancy()
            except StateStoreError as exc:
                self.standing_by.set()
                self.trouble = exc.cause or str(exc)
                if not unreachable:
                    logger.warning("%s: standing by until etcd answers: %s", self._client.target.url, exc)
                unreachable = True
                await asyncio.sleep(min(RETRY_CAP, 0.05 * 2 ** min(attempt, 10)))
                attempt += 1

    async def _try(self) -> EtcdTerm | None:
        layout = self._layout
        granted_at = time.monotonic()
        lease, ttl = await self._client.grant(self._ttl)
        answer = await self._client.txn(
            [created_at(layout.leader, 0), modified_at(layout.policy, self._policy_revision)],
            [put(layout.leader, self._me.value(), lease)],
            [get(layout.leader), get(layout.policy)],
        )
        vacated, self._vacated = self._vacated, None
        if answer.succeeded:
            self._leader = self._me
            logger.info(
                "%s: this replica (%s) leads, generation %d, lease %x (%d s)",
                self._client.target.url,
                self._me.address,
                answer.header.revision,
                lease,
                ttl,
            )
            departed = (vacated.beside,) if vacated is not None and vacated.beside else ()
            return EtcdTerm(
                self._client,
                layout,
                lease,
                ttl,
                granted_at,
                answer.header.revision,
                self._policy_revision,
                departed,
            )
        leader, policy = (r.response_range.kvs for r in answer.responses)
        await self._client.revoke(lease)
        if not policy or policy[0].mod_revision != self._policy_revision:
            by = json.loads(policy[0].value).get("by", "?") if policy else "?"
            raise ConfigError(
                f"{self._client.target.url}: the replicas' policy was replaced (by {by}) since this replica "
                "started; restart it with the new policy (the same --policy file and flags as the others)"
            )
        self._seen = answer.header.revision
        self._leader = ReplicaIdentity.of(leader[0].value) if leader else ReplicaIdentity("", "")
        self._leader_lease = leader[0].lease if leader else 0
        if self._leader.replica == self._me.replica:
            # Our own key from a campaign whose answer was lost: free it and campaign again.
            await self._client.revoke(leader[0].lease)
            return None
        return None

    async def _await_vacancy(self) -> None:
        """Watch the leader key until it is deleted (or for one slice, then look again).

        Beside the watch, :func:`~taskd_core.controller.leader_probe.nothing_listens`
        holds a connection to the leader's address: once nothing listens there, this
        standby ends the leader's lease instead of waiting for it to run out.
        """
        deadline = time.monotonic() + WATCH_SLICE
        probe: tuple[str, asyncio.Task[str]] | None = None
        watch: asyncio.Future[list[epb.Event]] | None = None
        try:
            while (left := deadline - time.monotonic()) > 0:
                probe = self._probe(probe)
                watch = asyncio.ensure_future(self._client.watch(self._layout.leader, self._seen + 1, left))
                await asyncio.wait((watch, probe[1]), return_when=asyncio.FIRST_COMPLETED)
                if not watch.done():
                    await _cancelled(watch)
                    await self._vacate(probe[1].result())
                    return
                events = watch.result()
                if not events:
                    return
                for event in events:
                    self._seen = max(self._seen, event.kv.mod_revision)
                    if event.type == epb.Event.DELETE:
                        logger.info(
                            "%s: the leader (%s) is gone; campaigning",
                            self._client.target.url,
                            self._leader.address,
                        )
                        self._leader, self._leader_lease = ReplicaIdentity("", ""), 0
                        return
                    self._leader, self._leader_lease = ReplicaIdentity.of(event.kv.value), event.kv.lease
        finally:
            for task in (watch, probe[1] if probe is not None else None):
                if task is not None:
                    await _cancelled(task)

    def _probe(self, running: tuple[str, asyncio.Task[str]] | None) -> tuple[str, asyncio.Task[str]]:
        """The probe of the leader known now (the running one while the leader is the same)."""
        address = self._leader.address if self._leader.replica != self._me.replica else ""
        if running is not None and running[0] == address:
            return running
        if running is not None:
            running[1].cancel()
        # No leader known (or only this replica's own stale key): nothing to probe, the watch decides.
        return address, asyncio.ensure_future(nothing_listens(address))

    async def _vacate(self, why: str) -> None:
        """End the lease of a leader whose process is gone, so that a standby leads now.

        Safe even were the proof wrong: every write of the old leader is fenced on
        its leader key, which the revocation deletes (see the module's docstring).
        """
        logger.warning(
            "%s: the leader (%s) is gone: %s; ending its lease %x",
            self._client.target.url,
            self._leader.address,
            why,
            self._leader_lease,
        )
        if self._leader_lease:
            await self._client.revoke(self._leader_lease)
        self._vacated = self._leader
        self._leader, self._leader_lease = ReplicaIdentity("", ""), 0

    async def close(self) -> None:
        await self._client.close()
