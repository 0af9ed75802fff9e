"""Where this worker's snapshots go: its node's directory and keeper, its budget, its peers."""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from taskd_core.errors import SnapshotError
from taskd_core.snapshots.keeper import BUDGET_ENV, COPIES_ENV, DIR_ENV, JOB_ENV
from taskd_core.snapshots.pairing import holders
from taskd_core.snapshots.peer import PeerClient
from taskd_core.snapshots.store import SnapshotStore
from taskd_core.worker import SOCKET_ENV

#: Key prefix under which each rank publishes its node keeper's address in the workers' store.
_KEY = "taskd/snapshot/keeper/"
#: Seconds to wait for a peer's keeper address or a keeper's answer.
PEER_TIMEOUT = 60.0


@dataclass(frozen=True, slots=True)
class Place:
    """This worker's rank, its node's snapshot store and keeper, and what it may use."""

    rank: int
    world_size: int
    local_world_size: int
    store: SnapshotStore
    budget: int
    copies: int
    job_id: str
    token: str
    master: tuple[str, int] | None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Place:
        """:raises SnapshotError: outside taskdrun (no snapshot directory for this worker)."""
        env = os.environ if env is None else env
        root = env.get(DIR_ENV, "")
        if not root:
            if env.get(SOCKET_ENV):
                # A taskdrun worker (its agent's progress socket) without a keeper: turned off.
                raise SnapshotError(
                    "memory snapshots are off for this job (taskdrun --taskd-no-snapshots: no node keeper); "
                    "checkpoints go to disk only"
                )
            raise SnapshotError(
                f"memory snapshots need a node keeper: run the script under taskdrun (no {DIR_ENV} here), "
                "or save to disk with dcp.FileSystemWriter instead"
            )
        world = int(env.get("WORLD_SIZE", "1"))
        master = None
        if env.get("MASTER_ADDR") and env.get("MASTER_PORT", "").isdigit():
            master = (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
        return cls(
            rank=int(env.get("RANK", "0")),
            world_size=world,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
            store=SnapshotStore(Path(root)),
            budget=int(env.get(BUDGET_ENV, "0")),
            copies=int(env.get(COPIES_ENV, "0")),
            job_id=env.get(JOB_ENV, ""),
            token=env.get("TASKD_JOB_TOKEN", ""),
            master=master,
        )

    @property
    def keeper(self) -> str:
        """``HOST:PORT`` of this node's keeper; empty: no peer copies (none listens, or not yet)."""
        return self.store.keeper()

    def holders(self) -> list[int]:
        """The ranks on other nodes to whose keepers this rank's copies go (none without a keeper)."""
        if not self.keeper or not self.token:
            return []
        return holders(self.rank, self.local_world_size, self.world_size, self.copies)

    def client(self) -> PeerClient:
        return PeerClient(self.token, self.job_id, timeout=PEER_TIMEOUT)

    def peer_keepers(self, ranks: list[int]) -> dict[int, str]:
        """The keeper addresses of ``ranks``' nodes, as each published it in the workers' store.

        Publishes this rank's own first. A rank that does not publish within
        :data:`PEER_TIMEOUT` (gone, or without a keeper) is left out.
        """
        if self.master is None:
            return {}
        store = dist.TCPStore(  # type: ignore[attr-defined]  # re-exported without __all__
            self.master[0],
            self.master[1],
            is_master=False,
            timeout=datetime.timedelta(seconds=PEER_TIMEOUT),
        )
        store.set(_KEY + str(self.rank), self.keeper)
        out = {}
        for rank in ranks:
            try:
                store.wait([_KEY + str(rank)], datetime.timedelta(seconds=PEER_TIMEOUT))
            except (RuntimeError, dist.DistStoreError):
                continue
            address = store.get(_KEY + str(rank)).decode()
            if address:
                out[rank] = address
        return out
