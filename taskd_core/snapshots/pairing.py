"""Which ranks hold a copy of whose snapshot: a ring over the nodes, so no node holds only its own copies.

Ranks sit on nodes in blocks of ``local_world_size`` (as torch elastic assigns
them). Copy ``k`` (1-based) of rank ``r`` on node ``n`` goes to the rank with the
same local rank on node ``(n + k) mod nodes``: every node sends its copies to
the next ``copies`` nodes and holds those of the previous ``copies``, so losing
one node loses no shard while ``copies >= 1``, and losing ``copies + 1``
adjacent nodes loses some (those go back to disk).
"""

from __future__ import annotations


def holders(rank: int, local_world_size: int, world_size: int, copies: int) -> list[int]:
    """The ranks, each on another node, to which ``rank`` sends its copies (at most ``nodes - 1``)."""
    if local_world_size <= 0 or world_size % local_world_size:
        return []
    nodes = world_size // local_world_size
    node, local = divmod(rank, local_world_size)
    return [((node + k) % nodes) * local_world_size + local for k in range(1, min(copies, nodes - 1) + 1)]
