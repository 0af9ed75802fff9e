"""The four callbacks msrun hands to TaskD, checked when they are registered.

msrun 2.10 (``mindspore/utils/utils.py: RSCPluginHandle.register_callback``)
registers exactly these operators, as bound methods of its
``_ProcessManager``:

==================== ======================================= =======================================
operator             msrun's method                          call and result
==================== ======================================= =======================================
``KILL_WORKER``      ``kill_workers(pids)``                  pids to SIGKILL (their process groups);
                                                             ``-1`` in the list = every worker; 0
``START_ALL_WORKER`` ``start_all_workers()``                 SIGKILLs leftovers, starts all; 0/1
``START_WORKER_LIST````start_worker_list(local_ranks)``      starts the given local ranks (a list!)
``MONITOR``          ``monitor_rank_status(local_ranks)``    ``[-1]`` = all; ``{local_rank: {"pid",
                                                             "status", "global_rank", ...}}``
==================== ======================================= =======================================
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from taskd_core.errors import ConfigError

logger = logging.getLogger(__name__)

#: ``KILL_WORKER`` / ``MONITOR`` argument meaning "every local worker".
ALL_WORKERS = -1

KillWorker = Callable[[list[int]], Any]
StartAllWorker = Callable[[], Any]
StartWorkerList = Callable[[list[int]], Any]
Monitor = Callable[[list[int]], Mapping[int, Mapping[str, Any]]]


class Operator(str, enum.Enum):
    """Names msrun registers its callbacks under (the reference's constants)."""

    KILL_WORKER = "KILL_WORKER"
    START_ALL_WORKER = "START_ALL_WORKER"
    START_WORKER_LIST = "START_WORKER_LIST"
    MONITOR = "MONITOR"


_ACCEPTED = ", ".join(op.value for op in Operator)


class CallbackError(ConfigError, ValueError):
    """A callback registration that cannot work (unknown operator, not callable, missing).

    Also a :class:`ValueError`, so a launcher that guards registration with
    ``except ValueError`` (as msrun's generic ``except Exception`` does) sees it.
    """


@dataclass(frozen=True, slots=True)
class MsrunCallbacks:
    """The complete set of msrun's callbacks; the adapter drives workers only through these."""

    kill_worker: KillWorker
    start_all_worker: StartAllWorker
    start_worker_list: StartWorkerList
    monitor: Monitor


class CallbackRegistry:
    """Collects ``register_callbacks(operator, func)`` calls; the last registration of an operator wins."""

    def __init__(self) -> None:
        self._funcs: dict[Operator, Callable[..., Any]] = {}

    def register(self, operator: str, func: Callable[..., Any]) -> None:
        """Record ``func`` for ``operator``; raises :class:`CallbackError` for a non-callable.

        An operator this version does not know is logged and ignored: a newer
        msrun may register more, and raising would make it run without TaskD.
        """
        try:
            op = Operator(operator)
        except ValueError:
            logger.warning(
                "msrun registered callback operator %r, which this TaskD does not use (it uses %s); ignored",
                operator,
                _ACCEPTED,
            )
            return
        if not callable(func):
            raise CallbackError(f"callback for {op.value} must be callable, got {type(func).__name__}")
        if op in self._funcs:
            logger.info("callback %s registered again; the new one replaces the old", op.value)
        self._funcs[op] = func

    def missing(self) -> Sequence[Operator]:
        return [op for op in Operator if op not in self._funcs]

    def complete(self) -> MsrunCallbacks:
        """All four callbacks; raises :class:`CallbackError` naming those never registered."""
        missing = self.missing()
        if missing:
            raise CallbackError(
                "cannot start: msrun callback(s) "
                + ", ".join(op.value for op in missing)
                + " not registered; register all of "
                + _ACCEPTED
                + " with register_callbacks(operator, func) first"
            )
        return MsrunCallbacks(
            kill_worker=self._funcs[Operator.KILL_WORKER],
            start_all_worker=self._funcs[Operator.START_ALL_WORKER],
            start_worker_list=self._funcs[Operator.START_WORKER_LIST],
            monitor=self._funcs[Operator.MONITOR],
        )
