"""The ``mindspore`` TaskD adapter: the core's worker hooks carried out through msrun's own callbacks.

msrun keeps owning the worker processes (it starts them, with its own
environment, logs and process groups); this adapter only translates:

=====================  ==============================================================
hook                   msrun callbacks
=====================  ==============================================================
stop(ranks | all)      ``KILL_WORKER(pids)`` or ``KILL_WORKER([-1])``, then wait until
                       the pids are really gone; SIGKILL leftovers at the deadline
restart-all            stop leftovers, replace the scheduler (not on the first start,
                       see :mod:`taskd_mindspore.scheduler`), ``START_ALL_WORKER()``
restart-list(ranks)    ``START_WORKER_LIST(ranks)`` (the scheduler stays)
monitor                ``MONITOR([-1])``, statuses translated as below
=====================  ==============================================================

``MONITOR`` statuses: ``None`` running; ``200`` never started (pid may be
None); ``300`` the pid vanished (msrun reports this for every reaped worker
that did not exit 0, so a SIGKILL shows up as 300, not -9); any other int the
exit code. Right after ``KILL_WORKER([-1])`` msrun still reports the old pids
as running (its SIGKILL has not landed yet), which is why stopping waits on the
pids themselves (pidfds) instead of trusting ``MONITOR``.

msrun's ``KILL_WORKER`` sends SIGKILL to each worker's process group at once;
there is no polite phase to configure, so ``timeout`` only bounds the wait.
The restart counter reaches the workers through the environment msrun passes
on: ``TASKD_RESTART_COUNT`` is set in this (msrun's) process before each
``START_ALL_WORKER``.
"""

from __future__ import annotations

import logging
import os
import signal as signals
from collections.abc import Mapping, Sequence
from typing import Any

from taskd_core.agent.config import STOP_TIMEOUT
from taskd_core.agent.pidwatch import wait_gone
from taskd_core.errors import ConfigError
from taskd_core.models import Strategy, WorkerState, WorkerStatus
from taskd_core.plugins import hookimpl, require_module
from taskd_mindspore.callbacks import ALL_WORKERS, MsrunCallbacks
from taskd_mindspore.scheduler import Scheduler

logger = logging.getLogger(__name__)

#: msrun's MONITOR status codes (the reference's constants).
STATUS_NOT_STARTED = 200
STATUS_PID_GONE = 300
#: Environment variable carrying the restart counter to the workers.
RESTART_COUNT_ENV = "TASKD_RESTART_COUNT"
#: Seconds SIGKILLed leftovers get to vanish before stopping counts as failed.
_KILL_GRACE = 5.0
#: The command that installs MindSpore (and so msrun) in the version this adapter is tested with.
INSTALL_MINDSPORE = "pip install 'taskd-mindspore[framework]'"


def worker_status(local_rank: int, raw: Mapping[str, Any], default_global_rank: int) -> WorkerStatus:
    """One entry of msrun's ``MONITOR`` result as a :class:`WorkerStatus`."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"MONITOR entry for local rank {local_rank} is {raw!r}, not a dict")
    pid = raw.get("pid")
    status = raw.get("status")
    global_rank = raw.get("global_rank", default_global_rank)
    if (pid is not None and not isinstance(pid, int)) or not isinstance(global_rank, int):
        raise ValueError(
            f"MONITOR entry for local rank {local_rank} has a bad pid or global_rank: {dict(raw)!r}"
        )
    if status == STATUS_NOT_STARTED or (status is None and pid is None):
        return WorkerStatus(local_rank, global_rank, WorkerState.NOT_STARTED, pid)
    if status is None:
        return WorkerStatus(local_rank, global_rank, WorkerState.RUNNING, pid)
    if status == STATUS_PID_GONE:
        return WorkerStatus(local_rank, global_rank, WorkerState.GONE, pid)
    if not isinstance(status, int):
        raise ValueError(f"MONITOR status for local rank {local_rank} is {status!r}, not None or an int")
    return WorkerStatus(local_rank, global_rank, WorkerState.EXITED, pid, status)


def _kill_leftover(pid: int) -> None:
    # msrun starts each worker in a session of its own: its group holds the worker's children too.
    try:
        if os.getpgid(pid) == pid:
            logger.warning("worker pid %s outlived KILL_WORKER: SIGKILL to its process group", pid)
            os.killpg(pid, signals.SIGKILL)
        else:
            logger.warning("worker pid %s outlived KILL_WORKER: SIGKILL", pid)
            os.kill(pid, signals.SIGKILL)
    except ProcessLookupError:
        logger.info("worker pid %s vanished before SIGKILL", pid)


class MSRunAdapter:
    """TaskD hooks over msrun's callbacks, for the workers of the node this msrun runs.

    :param callbacks: msrun's four callbacks; without them (the entry point
        instantiated by ``taskd plugins``) the adapter can only declare strategies.
    :param recover_in_place: whether a faulty rank may be restarted alone.
    :param scheduler: msrun's scheduler, replaced on every restart of all
        workers; None on nodes without one or where it must be left alone.
    :param rank_offset: global rank of local rank 0, used only when MONITOR
        omits ``global_rank``.
    :param stop_timeout: deadline of the stop that precedes a restart of all workers.
    """

    def __init__(
        self,
        callbacks: MsrunCallbacks | None = None,
        *,
        recover_in_place: bool = False,
        scheduler: Scheduler | None = None,
        rank_offset: int = 0,
        stop_timeout: float = STOP_TIMEOUT,
    ) -> None:
        require_module(
            "mindspore", "mindspore", "MindSpore (module mindspore, which provides msrun)", INSTALL_MINDSPORE
        )
        self._callbacks = callbacks
        self.recover_in_place = recover_in_place
        self.scheduler = scheduler
        self.rank_offset = rank_offset
        self.stop_timeout = stop_timeout
        #: calls of restart_all so far; the first one is the job's start.
        self.starts = 0

    @property
    def callbacks(self) -> MsrunCallbacks:
        if self._callbacks is None:
            raise ConfigError(
                "the mindspore adapter has no msrun callbacks: it runs inside msrun "
                "(set MS_ENABLE_TFT='{ARF:1}' and start the job with msrun)"
            )
        return self._callbacks

    def statuses(self) -> dict[int, WorkerStatus]:
        raw = self.callbacks.monitor([ALL_WORKERS])
        if not isinstance(raw, Mapping):
            raise ValueError(f"MONITOR returned {raw!r}, not a dict of local ranks")
        return {int(r): worker_status(int(r), v, self.rank_offset + int(r)) for r, v in raw.items()}

    @hookimpl
    def taskd_strategies(self) -> Sequence[str]:
        found = [Strategy.RECOVER, Strategy.DUMP, Strategy.EXIT]
        if self.recover_in_place:
            found.insert(0, Strategy.RECOVER_IN_PLACE)
        return [s.value for s in found]

    @hookimpl
    def taskd_stop_workers(self, local_ranks: Sequence[int] | None, timeout: float) -> bool:
        statuses = self.statuses()
        chosen = (
            statuses.values() if local_ranks is None else [statuses[r] for r in local_ranks if r in statuses]
        )
        pids = [s.pid for s in chosen if s.pid is not None and s.state is WorkerState.RUNNING]
        if local_ranks is None:
            # [-1] also makes msrun forget its worker list and stop its log tailers.
            self.callbacks.kill_worker([ALL_WORKERS])
        elif pids:
            self.callbacks.kill_worker(list(pids))
        left = wait_gone(pids, timeout)
        if left:
            for pid in sorted(left):
                _kill_leftover(pid)
            left = wait_gone(left, _KILL_GRACE)
            if left:
                raise RuntimeError(f"worker pids {sorted(left)} survived SIGKILL")
        # msrun's MONITOR polls its Popen objects: this reaps the killed workers, leaving no zombie.
        self.callbacks.monitor([ALL_WORKERS])
        return True

    @hookimpl
    def taskd_restart_all(self) -> bool:
        if self.starts:
            self.taskd_stop_workers(None, self.stop_timeout)
            if self.scheduler is not None:
                self.scheduler.restart(self.stop_timeout)
        os.environ[RESTART_COUNT_ENV] = str(self.starts)
        self.starts += 1
        logger.info("starting every local worker through msrun (restart %s)", self.starts - 1)
        self.callbacks.start_all_worker()
        return True

    @hookimpl
    def taskd_restart_list(self, local_ranks: Sequence[int]) -> bool:
        logger.info("restarting local ranks %s through msrun", list(local_ranks))
        # msrun's start_worker_list insists on a list.
        self.callbacks.start_worker_list(list(local_ranks))
        return True

    @hookimpl
    def taskd_monitor(self) -> Mapping[int, WorkerStatus]:
        return self.statuses()
