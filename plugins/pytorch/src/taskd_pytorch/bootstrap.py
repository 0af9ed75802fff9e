"""Where the workers of one restart round meet: a new, empty store hosted by group rank 0's agent.

Group rank 0 is whichever node the round's rendezvous ranked first: when the
node that was rank 0 is lost, the next round's rank 0 hosts the store.

torchrun (torch 2.13, c10d rendezvous, default settings) lets workers share
the agent's rendezvous TCP store (``TORCHELASTIC_USE_AGENT_STORE=True``). That
store outlives a restart and still holds the previous round's keys, among
them the dead workers' addresses, so restarted workers connect to dead ports
or hang in ``init_process_group`` (SPEC §9: 2 recoveries in 10 trials).

Here every round gets a store of its own instead, whatever
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` says: group rank 0's agent starts a
brand-new TCP store on a free port before any worker of the round starts,
and publishes the port under a key that belongs to this round only; workers
join it as clients (``TORCHELASTIC_USE_AGENT_STORE=True``). Because the store
is already listening when the workers come up, none of them waits in the
client's connect retries, as they did when the global rank 0 worker had to
start the store itself (measured: about 0.5 s of every recovery).

The store listens on one address only (:mod:`taskd_pytorch.listen`), the
one the workers are told: loopback when the whole job runs on this host.
"""

from __future__ import annotations

import logging
from datetime import timedelta

# torch.distributed re-exports its C stores without listing them in __all__.
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]
from torch.distributed.elastic.rendezvous import RendezvousStoreInfo

from taskd_pytorch.listen import listening_store

logger = logging.getLogger(__name__)

#: Value of ``TORCHELASTIC_USE_AGENT_STORE`` in every worker: they join the round's agent-hosted store.
USE_AGENT_STORE = "True"


class RoundStores:
    """The workers' store of the current restart round (hosted only on group rank 0's agent).

    :param host: the address the store listens on and the workers of every node reach it at.
    """

    def __init__(self, host: str = "127.0.0.1", timeout: timedelta = timedelta(minutes=15)) -> None:
        self._host = host
        self._timeout = timeout
        self._store: TCPStore | None = None

    def meet(self, store: Store, group_rank: int, round_no: int) -> RendezvousStoreInfo:
        """``MASTER_ADDR``/``MASTER_PORT`` for the workers of restart round ``round_no``.

        :param store: the rendezvous store all agents of the round share.
        :param group_rank: this agent's rank in the rendezvous; rank 0 hosts the round's store.
        :param round_no: how many times the whole group has been started before;
            every agent counts the same, since the controller restarts them together.
        """
        port = None
        # Replacing the previous round's store shuts it down: its workers are gone. A node that
        # is no longer group rank 0 (the rendezvous ranked the nodes anew after a node's loss)
        # hosts none: the new rank 0 does.
        self._store = listening_store(self._host, 0, self._timeout) if group_rank == 0 else None
        if self._store is not None:
            port = self._store.port
        info = RendezvousStoreInfo.build(
            group_rank, PrefixStore(f"taskd/workers/round{round_no}/", store), self._host, server_port=port
        )
        logger.info(
            "restart round %s: workers meet at %s:%s%s",
            round_no,
            info.master_addr,
            info.master_port,
            " (this node, group rank 0, hosts the store)" if port is not None else "",
        )
        return info
