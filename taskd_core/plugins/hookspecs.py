"""Hook specifications: the plugin author's reference.

A framework adapter implements these five hooks for the workers of *one node*
and nothing else; an adapter that offers live recovery (``"recover-live"``)
also implements the two hooks of the last section. When to call them — which controller action stops which
ranks, when to restart, when to report — is decided once, in the core
(:mod:`taskd_core.agent.dispatcher`), never in an adapter.

Ranks passed to and returned from these hooks are **local** ranks
(``0 .. local_world_size - 1``); :class:`~taskd_core.models.WorkerStatus`
carries the matching global rank. Every hook is ``firstresult``: the agent
loads exactly one adapter per run, and a hook answers by returning a value
other than ``None``. Raise any exception to report failure; the core wraps it
in :class:`~taskd_core.errors.WorkerControlError` naming your adapter.

Hooks are called from the agent's control thread, one at a time; they may
block, but must honour the ``timeout`` they are given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from taskd_core.models import WorkerStatus
from taskd_core.plugins._markers import hookspec

# --- what the adapter can do -------------------------------------------------


@hookspec(firstresult=True)
def taskd_strategies() -> Sequence[str] | None:
    """Recovery strategies this adapter can carry out for its job.

    Called when the controller asks the job for its strategies (``on_global_rank``).
    Return values of :class:`~taskd_core.models.Strategy`: ``"recover"``
    (restart every local worker), ``"recover-in-place"`` (restart only the
    faulty ranks while the others keep running: claim it only when healthy
    workers survive a peer's restart), ``"recover-live"`` (replace the faulty
    ranks while the others keep running and hand them the job's state: claim it
    only when every local worker uses a live-recovery API and the adapter
    implements :func:`taskd_begin_round` and :func:`taskd_await_round`),
    ``"dump"`` (workers can save on the dump signal) and ``"exit"``. ``"retry"`` needs in-process step retry,
    which only a framework runtime can do.

    :returns: the strategies; stops at the first non-None result.
    """


# --- worker control ------------------------------------------------------------


@hookspec(firstresult=True)
def taskd_stop_workers(local_ranks: Sequence[int] | None, timeout: float) -> bool | None:
    """Stop the given local workers, or every local worker when ``local_ranks`` is None.

    Return only when the processes are really gone (reaped or vanished), or
    raise. Escalate on your own: ask nicely first (SIGTERM), then force
    (SIGKILL) once ``timeout`` seconds have passed since the call started.

    :param local_ranks: local ranks to stop; ``None`` means all.
    :param timeout: seconds before polite stopping turns into killing.
    :returns: ``True`` when done.
    """


@hookspec(firstresult=True)
def taskd_restart_all() -> bool | None:
    """Start every local worker afresh (stopping leftovers first).

    Also used for the job's first start. Workers must see a restart counter
    that grows with every call (``TASKD_RESTART_COUNT``), so training code
    can tell a restart from a first start.

    :returns: ``True`` once the workers have been started.
    """


@hookspec(firstresult=True)
def taskd_restart_list(local_ranks: Sequence[int]) -> bool | None:
    """Start only the given local workers, with the same rank and environment as before.

    The other workers keep running untouched. The given workers have already
    been stopped by :func:`taskd_stop_workers`.

    :param local_ranks: local ranks to start again.
    :returns: ``True`` once they have been started.
    """


@hookspec(firstresult=True)
def taskd_monitor() -> Mapping[int, WorkerStatus] | None:
    """Status of every local worker, keyed by local rank.

    Must be cheap: the agent calls it whenever a worker's pid becomes
    readable through ``pidfd`` (i.e. the moment a worker dies) and after
    every action. Report workers that were never started as
    ``WorkerState.NOT_STARTED``.

    :returns: ``{local_rank: WorkerStatus}``.
    """


@hookspec(firstresult=True)
def taskd_resize(node_rank: int, nodes: int) -> bool | None:
    """The nodes change with the next :func:`taskd_restart_all`: this node is ``node_rank`` of ``nodes``.

    Called (only for jobs that may shrink or grow, ``taskdrun --nnodes=MIN:MAX``)
    when the controller dropped a lost node, or took a spare as a new node, and
    the nodes restart together with the new world: the workers the next restart starts get this node's new
    ranks, contiguous (node rank × local world size + local rank), and the new
    world size. An adapter that cannot do this leaves the hook out: the
    restart then fails and the controller moves down its ladder.

    :returns: ``True`` once the next restart will use the new layout.
    """


# --- live recovery (only adapters that offer "recover-live") ---------------------


@hookspec(firstresult=True)
def taskd_begin_round(round_no: int) -> bool | None:
    """Tell every local worker that live recovery round ``round_no`` begins.

    Running workers leave their broken process group and wait to meet the
    others in the new round; workers started from now on join it. Every agent
    of the job is called with the same number (the controller's cycle), before
    the faulty ranks are started again with :func:`taskd_restart_list`. Must
    not block.

    :param round_no: the new round, larger than every earlier one of the job.
    :returns: ``True`` once the workers can see the new round.
    """


@hookspec(firstresult=True)
def taskd_await_round(round_no: int, timeout: float) -> bool | None:
    """Wait until every local worker has joined round ``round_no`` and holds the job's state.

    :param round_no: the round announced by :func:`taskd_begin_round`.
    :param timeout: seconds to wait at most.
    :returns: ``True`` when every local worker joined in time, ``False`` when
        one did not (it died, or the deadline passed): the core then reports
        the strategy as failed and the controller falls back to a full restart.
    """
