"""Which agents are a job's nodes and which stand by, and the one decision about a lost node.

A job's *nodes* are the agents that run its ranks; a *spare* is an agent that
registered with :data:`~taskd_core.models.SPARE_ROLE` (a launcher started with
the job's own command line once the job had all its nodes) and runs nothing.
When a node is lost (its signal stream closed, or no HealthCheck came for the
policy's ``node_lost_timeout``), :func:`decide_node_loss` is the only place
that says what happens to the job:

* ``REPLACE``: a spare that was heard from recently takes the node's place:
  its node rank and ranks, its seat in the recovery cycle; the lost agent is
  *fenced* (:attr:`AgentInfo.replaced_by`): the controller refuses what it
  sends from then on, with :attr:`~taskd_core.models.Code.NODE_REPLACED`;
* ``SHRINK``: no spare is ready and the job has more nodes than the policy's
  ``min_nodes`` (``taskdrun --nnodes=MIN:MAX``): the node is dropped, the
  others are numbered again contiguously (:func:`shrunk_layout`) and restart
  together with the new world size (a ``recover`` carrying a
  :class:`~taskd_core.models.Resize`); the lost agent is fenced as for ``REPLACE``;
* ``WAIT``: no spare is ready, the job cannot shrink, and the policy's ``spare_wait`` keeps the
  node's place open that long: a spare that registers meanwhile takes it;
* ``GIVE_UP``: no spare is ready (nor came in time); the cycle goes on without
  the node, whose absence leaves only dump or exit (the machine's ``departed``
  rule): the job ends, naming the node.

Everything that replaces a node goes through this decision and
:meth:`~taskd_core.controller.machine.JobMachine.handle` of an
:class:`~taskd_core.controller.machine.AgentLost` event, whatever found the
loss (a closed stream, a hung machine, a slow node a policy gives up on): the
runtime's :meth:`~taskd_core.controller.runtime.Controller.node_lost` is the
call. Free of I/O, like the machine.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from taskd_core.models import SPARE_ROLE, JobPolicy

if TYPE_CHECKING:
    from taskd_core.controller.machine import AgentInfo


#: What fences a node the job dropped when it shrank (its :attr:`AgentInfo.replaced_by`, no spare's name).
SHRUNK = "(the job shrank)"


class NodeLossKind(str, enum.Enum):
    """What the controller does about a lost node."""

    REPLACE = "replace"
    SHRINK = "shrink"
    WAIT = "wait"
    GIVE_UP = "give-up"


@dataclass(frozen=True, slots=True)
class NodeLossDecision:
    """The decision about one lost node, with what the journal says about it."""

    kind: NodeLossKind
    lost: str
    #: the spare that takes the node's place (``REPLACE`` only).
    spare: str = ""
    reason: str = ""


def is_spare(info: AgentInfo) -> bool:
    """A spare still standing by: no node rank given to it yet, not ended."""
    return info.role == SPARE_ROLE and info.node_rank is None and info.exit_code is None


def is_node(info: AgentInfo) -> bool:
    """One of the job's nodes now: no spare standing by (a promoted one is), no node a spare replaced."""
    standing_by = info.role == SPARE_ROLE and info.node_rank is None
    return not standing_by and not info.replaced_by


def ready_spares(agents: Mapping[str, AgentInfo], now: float, fresh: float) -> list[str]:
    """Spares heard from within ``fresh`` seconds, in the order they are used (by name)."""
    return sorted(a for a, info in agents.items() if is_spare(info) and now - info.last_seen <= fresh)


def live_nodes(agents: Mapping[str, AgentInfo]) -> list[str]:
    """The job's nodes that have not ended, in node rank order."""
    nodes = [a for a, info in agents.items() if is_node(info) and info.exit_code is None]
    return sorted(nodes, key=lambda a: (agents[a].node_rank is None, agents[a].node_rank or 0, a))


def shrunk_layout(lost: str, agents: Mapping[str, AgentInfo]) -> dict[str, tuple[int, tuple[int, ...]]]:
    """The nodes left once ``lost`` is dropped: agent -> (new node rank, new global ranks).

    The survivors keep their order; node ranks and global ranks close up
    contiguously, each node keeping its number of ranks (torch numbers a
    round's workers the same way: by group rank, then local rank).
    """
    layout: dict[str, tuple[int, tuple[int, ...]]] = {}
    first = 0
    for node_rank, agent in enumerate(a for a in live_nodes(agents) if a != lost):
        size = len(agents[agent].rank_ids)
        layout[agent] = (node_rank, tuple(range(first, first + size)))
        first += size
    return layout


def can_shrink(agents: Mapping[str, AgentInfo], policy: JobPolicy) -> bool:
    """The job has a node more than the policy's ``min_nodes``: losing one shrinks it."""
    return bool(policy.min_nodes) and len(live_nodes(agents)) > policy.min_nodes


def growing_spare(agents: Mapping[str, AgentInfo], now: float, policy: JobPolicy) -> str | None:
    """The ready spare that joins the job as a new node while it has fewer than the policy's ``max_nodes``."""
    if not policy.max_nodes or len(live_nodes(agents)) >= policy.max_nodes:
        return None
    spares = ready_spares(agents, now, policy.node_lost_timeout)
    return spares[0] if spares else None


def grown_layout(agents: Mapping[str, AgentInfo]) -> tuple[int, tuple[int, ...]]:
    """The node rank and global ranks of a node that joins after the job's nodes (each has as many ranks)."""
    nodes = live_nodes(agents)
    size = len(agents[nodes[0]].rank_ids) if nodes else 0
    return len(nodes), tuple(range(len(nodes) * size, (len(nodes) + 1) * size))


def decide_node_loss(
    lost: str, agents: Mapping[str, AgentInfo], now: float, policy: JobPolicy, waited: float = 0.0
) -> NodeLossDecision:
    """Node ``lost`` is gone: replace it by a ready spare, shrink the job, wait for a spare, or give up.

    A spare counts as ready when it was heard from within the policy's
    ``node_lost_timeout`` (a spare sends a HealthCheck every second).
    ``waited``: seconds the node's place has waited for a spare already.
    """
    spares = ready_spares(agents, now, policy.node_lost_timeout)
    if spares:
        return NodeLossDecision(NodeLossKind.REPLACE, lost, spares[0], "a spare stands by")
    left = len([a for a in live_nodes(agents) if a != lost])
    if can_shrink(agents, policy):
        return NodeLossDecision(
            NodeLossKind.SHRINK,
            lost,
            reason=f"no spare stands by: the job shrinks to {left} nodes (at least {policy.min_nodes})",
        )
    at_least = f" and the job is at its fewest nodes ({policy.min_nodes})" if policy.min_nodes else ""
    if waited < policy.spare_wait:
        return NodeLossDecision(
            NodeLossKind.WAIT,
            lost,
            reason=f"no spare stands by{at_least}: waiting up to {policy.spare_wait:g}s for one",
        )
    if policy.spare_wait > 0:
        return NodeLossDecision(
            NodeLossKind.GIVE_UP, lost, reason=f"no spare came within {policy.spare_wait:g}s{at_least}"
        )
    return NodeLossDecision(NodeLossKind.GIVE_UP, lost, reason=f"no spare stands by{at_least}")
