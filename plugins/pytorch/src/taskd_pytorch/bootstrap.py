"""Where the workers of one restart round meet: a store of their own on a fresh port.

torchrun (torch 2.13, c10d rendezvous, default settings) lets workers share
the agent's rendezvous TCP store (``TORCHELASTIC_USE_AGENT_STORE=True``). That
store outlives a restart and still holds the previous round's keys, among
them the dead workers' addresses, so restarted workers connect to dead ports
or hang in ``init_process_group`` (SPEC §9: 2 recoveries in 10 trials).

Here every round gets its own meeting point instead, whatever
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` says: group rank 0 picks a free port on
its host and publishes it under a key that belongs to this round only; the
global rank 0 worker then hosts a brand-new TCP store on that port
(``TORCHELASTIC_USE_AGENT_STORE=False``), empty of any earlier round's keys.
"""

from __future__ import annotations

import logging

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.rendezvous import RendezvousStoreInfo

logger = logging.getLogger(__name__)

#: Value of ``TORCHELASTIC_USE_AGENT_STORE`` in every worker: workers never join the agents' store.
USE_AGENT_STORE = "False"


def round_store_info(store: Store, group_rank: int, round_no: int, local_addr: str | None) -> RendezvousStoreInfo:
    """``MASTER_ADDR``/``MASTER_PORT`` for the workers of restart round ``round_no``.

    :param store: the rendezvous store all agents of the round share.
    :param group_rank: this agent's rank in the rendezvous; rank 0 chooses the port.
    :param round_no: how many times the whole group has been started before;
        every agent counts the same, since the controller restarts them together.
    :param local_addr: the address workers reach group rank 0 at (``--local-addr``), else its FQDN.
    """
    info = RendezvousStoreInfo.build(group_rank, PrefixStore(f"taskd/workers/round{round_no}/", store), local_addr)
    logger.info("restart round %s: workers meet at %s:%s", round_no, info.master_addr, info.master_port)
    return info
