"""Whole-group restarts that keep the last rendezvous round when every node of it restarts.

torch's dynamic rendezvous (``c10d``) forms a new round for every restart:
each agent leaves the round, then joins the next one and, while it waits for
the others, polls the shared state once a second (``_Action.SYNC`` sleeps 1 s).
On two nodes the first agent to join paid about 1 s of every recovery, though
the round it formed had the same nodes, ranks and world size as the last.

When the controller orders a whole-group restart, every node of the job
restarts together, so that round can be kept: same group ranks, world size
and rendezvous store; the workers still get a fresh store of their own
(:mod:`taskd_pytorch.bootstrap`, keyed by the restart count). Every agent of
the round must take the same path, or the ones that keep the round and the
ones in a new round wait for each other until a timeout. They agree in the
round's store, whose keys belong to that round only:

* each agent adds itself to the restart's arrival counter;
* the last to arrive proposes *keep* if no node waits to join the rendezvous
  (a replaced node joins the next round), else *new round*;
* an agent that sees a node waiting, or waits longer than ``wait`` for the
  decision (an agent of the round is gone), proposes *new round*;
* a proposal is a ``compare_set`` on one key, so the first one wins and every
  agent, late ones included, reads the same decision. torch's etcd store
  (``etcd-v2``) has no ``compare_set``: there the first agent whose ``add`` to
  the proposers' counter returns 1 writes the decision, the others only read
  it (should that agent die before it writes, the others take a new round at
  their deadline).

A new round is exactly what torch does, so every fallback is today's path.
Other rendezvous backends (static: no rounds to save; torch's older ``etcd``
rendezvous, which is no ``DynamicRendezvousHandler``) always take it.
"""

from __future__ import annotations

import logging
import time
from enum import Enum

from torch.distributed import Store  # type: ignore[attr-defined]  # re-exported without __all__
from torch.distributed.elastic.rendezvous import RendezvousHandler
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from taskd_core.errors import LauncherInterrupted
from taskd_core.launcher.interrupt import StopRequest

logger = logging.getLogger(__name__)

#: The rendezvous backend whose rounds are kept (its store has ``compare_set``).
REUSABLE_BACKEND = "c10d"
#: torch's etcd backend of the dynamic rendezvous: its rounds are kept too, agreed on with ``add``.
ETCD_BACKEND = "etcd-v2"
#: How often an agent looks for the decision, and how often whether a node waits to join.
_POLL = 0.005
_WAITING_POLL = 0.5


class Regroup(str, Enum):
    """What a whole-group restart does about the rendezvous."""

    KEEP = "keep"
    NEW_ROUND = "new-round"


class RoundReuse:
    """One agent's side of the agreement on keeping the rendezvous round at each whole-group restart.

    :param handler: the job's rendezvous handler.
    :param wait: how long an agent waits for the others of the round before it proposes a new round.
    """

    def __init__(self, handler: RendezvousHandler, wait: float = 60.0) -> None:
        self._handler = handler
        self._wait = wait
        backend = handler.get_backend() if isinstance(handler, DynamicRendezvousHandler) else ""
        self._enabled = backend in (REUSABLE_BACKEND, ETCD_BACKEND)
        self._atomic = backend == REUSABLE_BACKEND
        #: whole-group restarts since the current round formed (the same count on every agent of it).
        self._restarts = 0

    def formed(self) -> None:
        """A new rendezvous round formed: its store has no agreement keys yet."""
        self._restarts = 0

    @property
    def restarts(self) -> int:
        """Whole-group restarts since the round formed: the number of the next agreement."""
        return self._restarts

    def resume(self, restarts: int) -> None:
        """Join a round the other agents have restarted ``restarts`` times already (a spare taking a seat)."""
        self._restarts = restarts

    def decide(self, store: Store | None, group_world_size: int | None, stop: StopRequest) -> Regroup:
        """Agree with the other agents of the round whether the next start keeps it.

        :param store: the round's store (None before the first round: a new round, then).
        :param group_world_size: how many agents formed the round.
        :param stop: a stop request ends the wait with :class:`LauncherInterrupted`.
        """
        if not self._enabled or store is None or group_world_size is None:
            return Regroup.NEW_ROUND
        prefix = f"taskd/regroup/{self._restarts}/"
        self._restarts += 1
        decision = prefix + "decision"
        if store.add(prefix + "arrived", 1) >= group_world_size:
            waiting = self._handler.num_nodes_waiting()
            self._propose(store, decision, Regroup.NEW_ROUND if waiting else Regroup.KEEP)
        deadline = time.monotonic() + self._wait
        look_again = time.monotonic()
        while not store.check([decision]):
            if stop.signum is not None:
                raise LauncherInterrupted("agreeing on the next rendezvous round", stop.signum)
            now = time.monotonic()
            if now >= deadline:
                logger.warning("the other agents of the round did not restart within %ss", self._wait)
                self._propose(store, decision, Regroup.NEW_ROUND)
                if not store.check([decision]):  # the agent that won the proposal died before writing it
                    return Regroup.NEW_ROUND
            elif now >= look_again:
                look_again = now + _WAITING_POLL
                if self._handler.num_nodes_waiting():
                    self._propose(store, decision, Regroup.NEW_ROUND)
            time.sleep(_POLL)
        agreed = Regroup(store.get(decision).decode())
        logger.info(
            "whole-group restart %s of the rendezvous round: %s",
            self._restarts,
            "keeping its nodes and ranks" if agreed is Regroup.KEEP else "a new round",
        )
        return agreed

    def _propose(self, store: Store, key: str, proposal: Regroup) -> None:
        if self._atomic:
            store.compare_set(key, "", proposal.value)
        elif store.add(key + "/proposers", 1) == 1:
            store.set(key, proposal.value)
