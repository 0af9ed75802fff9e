"""The job's own keys in the rendezvous store (c10d, etcd-v2): what a spare needs to take a lost node's place.

torch's dynamic rendezvous numbers its rounds privately and forms a new one
only once every participant of the last one left it (a dead one after its
keep-alive expires: 15 s by default). TaskD keeps the round instead and puts
a spare in the lost node's seat (same group rank, same global ranks, same
world size), so the job needs a few facts the spare cannot learn from torch.
They live in the rendezvous store under ``taskd.<run id>/`` (:class:`JobStore`):

* ``job``: the job's command line as it matters to every node
  (:data:`Command`), written by group rank 0 once the first round formed: a
  launcher that finds it started after the job had all its nodes, so it
  stands by as a spare, and its command line must be the job's; ``nodes``: how
  many nodes that round admitted (``--nnodes=MIN:MAX``: MIN to MAX), which
  every node's controller policy counts on;
* ``controller``: the embedded controller's address (the
  :class:`~taskd_pytorch.rendezvous.StoreBoard` of every round);
* ``rounds`` and ``round<N>/``: TaskD's number of each torch round and the
  store its agents share (agreements on keeping the round, the workers'
  store port): torch's own round store is keyed by its private round number;
* ``epoch``: what the next whole-group start uses (:class:`Epoch`), written
  by every agent after each start (all write the same values): the spare
  reads it when it joins the survivors' restart, which cannot complete
  without it (they wait for its arrival in the round's agreement).

The c10d and etcd-v2 backends have such a store (torch's etcd store has no
``compare_set``: the agreements on it use ``add``, see
:mod:`taskd_pytorch.rendezvous_reuse`); the static one has no rounds and
torch's older ``etcd`` rendezvous is no dynamic one: with those a launcher
never stands by.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]  # re-exported without __all__

from taskd_core.errors import ConfigError

logger = logging.getLogger(__name__)

#: The job's command line, as the fields every node must agree on (name -> value as text).
Command = Mapping[str, str]

_JOB = "job"
_NODES = "nodes"
_EPOCH = "epoch"
_ROUNDS = "rounds"
#: Key in torch's round store under which group rank 0 tells the others TaskD's number of the round.
_ROUND_NO = "taskd/round-no"


@dataclass(frozen=True, slots=True)
class Epoch:
    """What the job's next whole-group start uses; the same on every agent of the round."""

    #: TaskD's number of the current torch round (its shared store is ``round<N>/``).
    round_no: int
    #: whole-group starts so far (the workers' ``TASKD_RESTART_COUNT`` of the next start).
    starts: int
    #: whole-group restarts since the round formed (the next agreement's number).
    restarts: int
    group_world_size: int


class JobStore:
    """TaskD's keys of one job in its c10d rendezvous store.

    :param store: the rendezvous backend's store (torch's ``c10d`` backend creates it).
    :param run_id: the job's ``--rdzv-id``.
    """

    def __init__(self, store: Store, run_id: str) -> None:
        self.store = PrefixStore(f"taskd.{run_id}/", store)

    def has_all_nodes(self) -> bool:
        """The job's first round formed before this launcher came: it stands by as a spare."""
        return bool(self.store.check([_JOB]))

    def formed(self, command: Command, nodes: int) -> None:
        """Group rank 0, once the first round formed: the job has ``nodes`` nodes started with ``command``."""
        self.store.set(_NODES, str(nodes))
        self.store.set(_JOB, json.dumps(dict(command), sort_keys=True))

    def nodes(self) -> int:
        """How many nodes the job's first round admitted."""
        return int(self.store.get(_NODES).decode())

    def check_command(self, command: Command) -> None:
        """A spare's command line must be the job's.

        :raises ConfigError: naming the first setting that differs.
        """
        job = json.loads(self.store.get(_JOB).decode())
        for name in sorted(set(job) | set(command)):
            if job.get(name) != command.get(name):
                raise ConfigError(
                    f"this taskdrun would stand by as a spare of job {command.get('--rdzv-id')}, but its "
                    f"{name} is {command.get(name)!r} where the job's is {job.get(name)!r}: start a spare "
                    "with the job's own command line"
                )

    def round_store(self, torch_round: Store, group_rank: int) -> tuple[Store, int]:
        """The store the agents of a new torch round share, and TaskD's number of that round.

        Group rank 0 numbers the round and tells the others through torch's round store.
        """
        if group_rank == 0:
            round_no = int(self.store.add(_ROUNDS, 1))
            torch_round.set(_ROUND_NO, str(round_no))
        else:
            round_no = int(torch_round.get(_ROUND_NO).decode())
        return self.round(round_no), round_no

    def round(self, round_no: int) -> Store:
        """The store of TaskD's round ``round_no``."""
        return PrefixStore(f"round{round_no}/", self.store)

    def publish(self, epoch: Epoch) -> None:
        self.store.set(_EPOCH, json.dumps(asdict(epoch)))

    def epoch(self) -> Epoch:
        """The epoch the job's agents published last (blocks until there is one)."""
        return Epoch(**json.loads(self.store.get(_EPOCH).decode()))
