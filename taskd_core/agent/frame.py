"""The signal handler for a ``frame``: what the seed API's ``start_subscribe(frame)`` acts through.

The seed client (:class:`~taskd_core.client.manager.DLRecoverManager`) only
speaks the protocol; carrying out a signal on workers is the agent layer's
job. :func:`frame_handler` loads the adapter named ``frame`` (or wraps the
adapter object a user's own launcher gives) and answers with the core's
:class:`~taskd_core.agent.dispatcher.ActionDispatcher` over it, after checking
that the adapter has workers to act on: a client whose adapter cannot see any
worker would answer the first ``stopTrain`` with an error and lose the job.
"""

from __future__ import annotations

from taskd_core.agent.dispatcher import ActionDispatcher, Reporter
from taskd_core.errors import ConfigError, WorkerControlError
from taskd_core.plugins import load_adapter

_ATTACH = (
    "start the workers first, then pass them: DLRecoverManager(info, address, adapter=<object with the "
    "taskd_* hooks>), or build the adapter yourself and pass "
    "handler=ActionDispatcher(adapter, manager).handle"
)


def frame_handler(frame: str, reporter: Reporter, instance: object | None = None) -> ActionDispatcher:
    """The dispatcher for the adapter ``frame`` (``instance`` when given), reporting through ``reporter``.

    :raises AdapterNotFoundError: no adapter ``frame`` is installed.
    :raises ConfigError: the adapter has no workers to act on.
    """
    adapter = load_adapter(frame, instance=instance)
    try:
        workers = adapter.monitor()
    except WorkerControlError as exc:
        raise ConfigError(f"frame {frame!r}: the adapter cannot show its workers ({exc}); {_ATTACH}") from exc
    if not workers:
        raise ConfigError(f"frame {frame!r}: the adapter has no workers to act on; {_ATTACH}")
    return ActionDispatcher(adapter, reporter)
