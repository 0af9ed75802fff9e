"""The node agent: one per node, inside the launcher process.

It starts the node's workers through the adapter, learns of a worker's death
the moment it happens (pidfds, no polling interval), reports it to the
controller with the worker's *global* rank, and lets the controller's
signals drive the :class:`~taskd_core.agent.dispatcher.ActionDispatcher`.
It returns an :class:`AgentOutcome`; the launcher turns it into an exit code.

Each pass of the supervision loop monitors the node (the other threads'
notices, then one look at the workers), decides whether that ends the run (the
ordered checks of :mod:`taskd_core.agent.decision`), reports what it found,
and waits for the next change: the shape of torch elastic's ``_invoke_run``.

Threads: :meth:`NodeAgent.run` is the supervision loop; the client's signal
stream runs in a second thread. Both call hooks under one lock, which no
report holds: a report may retry an unreachable controller for a minute, and
the agent keeps watching its workers (and obeying SIGTERM) meanwhile. Fault
reports go out, in order, from a third thread for the same reason.
"""

from __future__ import annotations

import functools
import logging
import signal as signals
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from taskd_core.agent.config import AgentConfig
from taskd_core.agent.crashloop import CrashLoop
from taskd_core.agent.decision import AgentOutcome, Ending, Events, Look, Notices, Outcome, View, decide
from taskd_core.agent.dispatcher import ActionDispatcher
from taskd_core.agent.hangs import Hang, ProgressWatcher
from taskd_core.agent.hangs.work import MAX_SAMPLES
from taskd_core.agent.lifecycle import WorkerLedger
from taskd_core.agent.pidwatch import PidWatch
from taskd_core.client.manager import DLRecoverManager
from taskd_core.errors import ConfigError, RecoveryDisabledError, TaskdError, WorkerControlError
from taskd_core.models import (
    Code,
    FaultType,
    RankWork,
    Resize,
    Signal,
    WorkerEvent,
    WorkerState,
    WorkerStatus,
)
from taskd_core.plugins.registry import Adapter

__all__ = ["AgentOutcome", "NodeAgent", "Outcome"]

logger = logging.getLogger(__name__)

#: Upper bound on one wait for a worker event. Deaths end the wait through
#: pidfds and every state change (a handled signal, shutdown) wakes it, so
#: this only bounds how stale the loop's view can get; each wake-up costs a
#: MONITOR call, which an idle agent should not spend every second.
_WAIT_CAP = 5.0
#: Seconds the last report (this agent ends) may retry an unreachable controller.
_FINAL_REPORT_DEADLINE = 5.0


@dataclass(frozen=True, slots=True)
class _Held:
    """A failed worker whose report the restart backoff holds back."""

    local_rank: int
    #: the cycle that started it (see ``startedCycle`` in the proto).
    started_cycle: int


class NodeAgent:
    """Supervises one node's workers for the controller at ``config.controller``."""

    def __init__(
        self, config: AgentConfig, adapter: Adapter, leader_hint: Callable[[], str] | None = None
    ) -> None:
        self.config = config
        self.adapter = adapter
        self._lock = threading.RLock()
        self._watch = PidWatch()
        self._fault_reports = ThreadPoolExecutor(1, thread_name_prefix=f"taskd-faults-{config.job_id}")
        # Set by other threads; each pass of the loop reads them as one Notices (with the dispatcher's).
        self._shutdown_signal: int | None = None
        #: why the signal stream ended for good, when the controller could not be reached any more.
        self._controller_lost: str | None = None
        #: why the agent must end the job itself: a fault report the controller did not take.
        self._unreported: str | None = None
        #: (local rank, pid) of workers whose end is not a fault: stopped on purpose or already reported.
        self._settled: set[tuple[int, int | None]] = set()
        self._progress = (
            ProgressWatcher(config.progress, self._watch.wake, on_events=self._watch.wake)
            if config.progress.enabled
            else None
        )
        self._ledger = WorkerLedger(last_step=self._progress.last_step) if self._progress else WorkerLedger()
        self._crashloop = CrashLoop(config.restart_backoff)
        #: global ranks whose fault report the restart backoff holds back, and until when.
        self._held: dict[int, _Held] = {}
        #: worker events not reported yet: they wait while fault reports are held back.
        self._unsent: list[WorkerEvent] = []
        #: workers' work per step not reported yet (for the controller's slow-rank detection).
        self._work: list[RankWork] = []
        self._report_at = 0.0
        if not config.controller:
            raise ConfigError(f"the agent of job {config.job_id} needs a controller address")
        self.client = DLRecoverManager.for_job(
            config.job_id,
            config.controller,
            role=config.role,
            agent_id=config.identity,
            node_rank=config.node_rank,
            credentials=config.credentials,
            handler=self._handle_signal,
            connect_deadline=config.connect_timeout,
            # A fault found during an outage must wait as long as the outage is ridden out.
            report_deadline=max(config.report_deadline, config.connect_timeout),
            health_interval=config.health_interval,
            health_note=self._progress.describe if self._progress is not None else None,
            leader_hint=leader_hint,
        )
        self.dispatcher = ActionDispatcher(
            adapter,
            self.client,
            config.dispatch,
            on_stopping=self._settle,
            lock=self._lock,
            send=self._in_order,
            on_resize=self._resize,
        )

    # --- control from other threads --------------------------------------------------

    def shutdown(self, signum: int = signals.SIGTERM) -> None:
        """Stop every worker and end :meth:`run` (safe from a signal handler).

        A start-up still trying to reach the controller gives up at once
        instead of after the connect deadline; the last report gets one try.
        """
        self._shutdown_signal = signum
        self.client.abandon_retries()
        self._watch.wake()

    def _handle_signal(self, signal: Signal) -> None:
        self.dispatcher.handle(signal)
        self._watch.wake()

    def _settle(self, statuses: Iterable[WorkerStatus]) -> None:
        chosen = list(statuses)
        self._ledger.stopping(chosen)
        self._settled.update((s.local_rank, s.pid) for s in chosen)

    # --- the run -----------------------------------------------------------------------------

    def run(self) -> AgentOutcome:
        """Run the node's workers to the end; never raises for worker failures."""
        subscriber: threading.Thread | None = None
        try:
            recovery = self._rejoin()
            self._start_workers()
            if recovery:
                subscriber = self._start_subscriber()
            else:
                logger.warning(
                    "process recovery is off for job %s: a failed worker ends the job", self.config.job_id
                )
            outcome = self._supervise(recovery)
        except TaskdError as exc:
            outcome = self._cut_short(exc)
        finally:
            self._close(subscriber)
        logger.info(
            "agent of job %s ends: %s (exit %s) %s",
            self.config.job_id,
            outcome.kind.value,
            outcome.exit_code,
            outcome.reason,
        )
        return outcome

    def _rejoin(self) -> bool:
        """Register with the controller; whether it recovers this job."""
        try:
            self.client.rejoin()
        except RecoveryDisabledError:
            return False
        return True

    def _start_workers(self) -> None:
        if self._progress is not None:
            # Before the first start: workers inherit where to report their progress.
            self._progress.start()
        with self._lock:
            self.adapter.restart_all()
            self.client.rank_ids = tuple(sorted(s.global_rank for s in self.adapter.monitor().values()))

    def _resize(self, resize: Resize) -> None:
        """This node's place once the job shrank or grew: the adapter's next restart and the agent's identity
        use it.

        The controller numbered the ranks the same way (``membership.shrunk_layout``): a node keeps
        its number of ranks, and its global ranks follow its new node rank.
        """
        client = self.client
        try:
            node_rank = resize.node_rank(client.node_rank)
        except ValueError as exc:
            raise WorkerControlError(self.adapter.name, "change the job's nodes", str(exc)) from None
        self.adapter.resize(node_rank, resize.nodes)
        size = len(client.rank_ids)
        logger.warning(
            "job %s has %s nodes now: node %s is node %s",
            self.config.job_id,
            resize.nodes,
            client.node_rank,
            node_rank,
        )
        client.node_rank, client.rank_ids = node_rank, tuple(range(node_rank * size, (node_rank + 1) * size))

    def _start_subscriber(self) -> threading.Thread:
        subscriber = threading.Thread(
            target=self._subscribe, name=f"taskd-signals-{self.config.job_id}", daemon=True
        )
        subscriber.start()
        return subscriber

    def _cut_short(self, exc: TaskdError) -> AgentOutcome:
        """The outcome of a run an error ended (its workers are stopped)."""
        self._stop_all()
        signum = self._shutdown_signal
        if signum is not None:
            # A stop signal cut the start short (the launcher abandoned a rendezvous, say): not a failure.
            logger.warning("agent of job %s stopped while starting: %s", self.config.job_id, exc)
            return AgentOutcome(Outcome.INTERRUPTED, 128 + signum, f"signal {signum}")
        logger.error("agent of job %s failed: %s", self.config.job_id, exc)
        return AgentOutcome(Outcome.FAILED, 1, str(exc))

    def _close(self, subscriber: threading.Thread | None) -> None:
        with self._lock:
            self.dispatcher.closed.set()
        self.client.close()
        # close() ends any retry; a report still queued has nobody left to hear it.
        self._fault_reports.shutdown(wait=True, cancel_futures=True)
        if subscriber is not None:
            subscriber.join(timeout=10.0)
        if self._progress is not None:
            self._progress.close()
        self._watch.close()

    def _subscribe(self) -> None:
        try:
            self.client.start_subscribe(self.adapter.name)
        except TaskdError as exc:
            logger.error("lost the controller for good: %s", exc)
            self._controller_lost = str(exc)
            self._watch.wake()

    def _stop_all(self) -> None:
        # A signal waiting for the lock (a restart, say) must not start workers
        # after this: close() stops them and shuts the dispatcher for good.
        try:
            self.dispatcher.close()
        except TaskdError:
            logger.exception("stopping workers failed")

    # --- the supervision loop: monitor -> decide -> report -> wait ---------------------------

    def _supervise(self, recovery: bool) -> AgentOutcome:
        """Watch and report until :func:`~taskd_core.agent.decision.decide` finds the run's end."""
        while True:
            view = self._monitor(recovery)
            ending = decide(view)
            if ending is not None:
                return self._end(ending, view.look)
            if self._report(view.look):
                continue  # workers were stopped, or a recovery may start: look again before waiting
            self._wait(view.look)

    def _monitor(self, recovery: bool) -> View:
        """The notices the other threads left, then one look at the workers."""
        notices = Notices(
            stop_signal=self._shutdown_signal,
            controller_lost=self._controller_lost,
            given_up=self.dispatcher.give_up_reason if self.dispatcher.given_up.is_set() else None,
            unreported=self._unreported,
            ending=self.dispatcher.ending.is_set(),
        )
        with self._lock:
            resync = self.dispatcher.refused.is_set()
            self.dispatcher.refused.clear()
            if resync:
                self.dispatcher.drop_early()
            statuses = self.adapter.monitor()
            started = self.dispatcher.started_cycles()
            changes = self._worker_events(statuses)
        now = time.monotonic()
        self._crashloop.seen(statuses.values(), now)
        if recovery:
            self._unsent.extend(changes)
            self._take_work()
        look = Look(now, statuses, started, self._failures(statuses, resync), resync, self._hung(statuses))
        return View(recovery, notices, look)

    def _failures(self, statuses: Mapping[int, WorkerStatus], resync: bool) -> tuple[WorkerStatus, ...]:
        """The failed workers not stopped on purpose nor reported yet; all stopped ones on a ``resync``."""
        if resync:
            # The controller lost the cycle these workers were stopped for: report them again.
            return tuple(
                s for s in statuses.values() if s.state is not WorkerState.RUNNING and not s.succeeded
            )
        return tuple(s for s in statuses.values() if s.failed and (s.local_rank, s.pid) not in self._settled)

    def _hung(self, statuses: Mapping[int, WorkerStatus]) -> tuple[Hang, ...]:
        """The hangs declared since the last look whose worker still runs and is not being stopped."""
        hangs = self._progress.take_hangs() if self._progress is not None else []
        live = {(s.local_rank, s.pid) for s in statuses.values() if s.state is WorkerState.RUNNING}
        return tuple(h for h in hangs if (h.local_rank, h.pid) in live - self._settled)

    def _end(self, ending: Ending, look: Look) -> AgentOutcome:
        """Leave the workers and the controller as ``ending`` says; its outcome."""
        self._log_failed(ending.failed)
        if ending.kill:
            self._stop_hung(ending.kill, look.statuses, None)
        if ending.stop:
            self._stop_all()
        if ending.events is Events.FLUSHED:
            self._report_changes()
        elif ending.events is Events.QUEUED:
            self._queue_events()
        if ending.farewell is not None:
            self._final_report(ending.outcome.exit_code, ending.farewell)
        return ending.outcome

    def _report(self, look: Look) -> bool:
        """Report what ``look`` found; whether anything was (then the node is looked at again at once).

        In order: new failures (held back by the restart backoff, or due), the
        worker events queued behind them, replacements started early, hangs.
        """
        if look.failed:
            self._hold(look)
        reported = bool(self._held) and look.at >= self._report_at
        if reported:
            self._report_held(look.started)
        if not self._held:
            # Queued behind the fault report (one the restart backoff holds back included): the
            # journal keeps the order, a fault before its worker's end; the recovery never waits.
            self._queue_events()
            if look.failed:
                # Reported at once, not held back by the restart backoff: a live node starts
                # the replacements while the controller decides (after the report, not before).
                self.dispatcher.start_early(look.failed)
        if look.hung:
            self._stop_hung(look.hung, look.statuses, look.started)
        return bool(look.failed or reported or look.hung)

    def _wait(self, look: Look) -> None:
        """Until a worker ends, another thread has news, a held report is due, or the wait cap."""
        running = [s for s in look.statuses.values() if s.state is WorkerState.RUNNING and s.pid]
        if self._progress is not None:
            self._progress.track({s.pid: (s.local_rank, s.global_rank) for s in running if s.pid})
        if self._watch.watch(s.pid for s in running if s.pid):
            return  # one ended before it could be watched: look again now
        self._watch.wait(min(_WAIT_CAP, self._report_at - look.at) if self._held else _WAIT_CAP)

    def _queue_events(self) -> None:
        """Send the worker events not reported yet from the report thread, behind the reports queued there."""
        if self._unsent or self._work:
            self._fault_reports.submit(self.client.report_worker_events, self._unsent, self._work)
            self._unsent, self._work = [], []

    def _take_work(self) -> None:
        """Keep the work samples the watcher gathered; the newest count when they pile up."""
        if self._progress is not None:
            self._work.extend(self._progress.take_work())
            del self._work[:-MAX_SAMPLES]

    def _log_failed(self, failed: Iterable[WorkerStatus]) -> None:
        for s in failed:
            logger.warning(
                "rank %s (local %s, pid %s) failed with exit code %s",
                s.global_rank,
                s.local_rank,
                s.pid,
                s.exit_code,
            )

    def _hold(self, look: Look) -> None:
        """Take the look's failures as faults: reported once the restart backoff lets them be."""
        failed = list(look.failed)
        self._settle(failed)
        self._log_failed(failed)
        delay = 0.0 if look.resync else self._crashloop.failed(failed, look.at)
        if delay > 0:
            logger.warning(
                "ranks %s failed within %.0f s of their start, %d times in a row: restarting in %.1f s "
                "(restart backoff, at most %.0f s)",
                sorted(s.global_rank for s in failed),
                self.config.restart_backoff.healthy_after,
                self._crashloop.streak,
                delay,
                self.config.restart_backoff.cap,
            )
        self._report_at = max(self._report_at, look.at + delay) if self._held else look.at + delay
        self._held.update(
            {s.global_rank: _Held(s.local_rank, look.started.get(s.local_rank, 0)) for s in failed}
        )

    def _report_held(self, started: Mapping[int, int]) -> None:
        """Report the held ranks, but not those a recovery restarted while the backoff held them."""
        held, self._held = self._held, {}
        # A peer's failed collective, held back, must not start a cycle of its own once the
        # cycle of the rank that killed it has replaced it: the controller would restart the
        # fresh workers again.
        replaced = sorted(rank for rank, h in held.items() if started.get(h.local_rank, 0) > h.started_cycle)
        if replaced:
            logger.info("ranks %s were restarted by a recovery while held back: not reported", replaced)
        due = {rank: h for rank, h in held.items() if rank not in replaced}
        if due:
            self._send_fault(
                sorted(due),
                {rank: int(FaultType.NORMAL.value) for rank in due},
                started_cycle=max(h.started_cycle for h in due.values()),
            )

    def _send_fault(
        self, ranks: list[int], faults: Mapping[int, int], *, started_cycle: int, detail: str = ""
    ) -> None:
        """Report faults from the report thread; one the controller does not take ends the job (see below)."""
        report = self._fault_reports.submit(
            functools.partial(
                self.client.report_process_fault, faults, detail=detail, started_cycle=started_cycle
            )
        )
        report.add_done_callback(functools.partial(self._fault_report_done, ranks=ranks))

    def _in_order(self, report: Callable[[], int]) -> int:
        """Send an action's report behind the fault reports queued before it."""
        try:
            queued = self._fault_reports.submit(report)
        except RuntimeError:  # the agent is ending and its report thread is gone
            return report()
        return queued.result()

    def _fault_report_done(self, report: Future[int], ranks: list[int]) -> None:
        """A fault report the controller did not take ends the job here, loudly, instead of a silent hang."""
        if report.cancelled():
            return
        exc = report.exception()
        code = Code.SERVER_INNER_ERROR if exc is not None else report.result()
        if code == Code.OK:
            return
        if exc is not None:
            logger.error("reporting failed workers to the controller failed: %s", exc, exc_info=exc)
        self._unreported = (
            f"the controller did not take the fault report of ranks {ranks} (code {code}); "
            "without it the job cannot be recovered"
        )
        logger.error("job %s ends here: %s", self.config.job_id, self._unreported)
        self._watch.wake()

    def _report_changes(self) -> None:
        with self._lock:
            changes = [*self._unsent, *self._worker_events(self.adapter.monitor())]
            self._take_work()
            work, self._unsent, self._work = self._work, [], []
        self.client.report_worker_events(changes, work)

    def _worker_events(self, statuses: Mapping[int, WorkerStatus]) -> list[WorkerEvent]:
        """Worker events since the last look: reported steps, then starts and ends."""
        seen = self._ledger.update(statuses)
        # Taken after the ledger, whose look at an ended worker's last step reads every datagram
        # it sent: its `resumed` goes before its `exited`. New workers have reported nothing yet.
        reported = self._progress.take_worker_events() if self._progress is not None else []
        return [*reported, *seen]

    def _stop_hung(
        self, hung: Sequence[Hang], statuses: Mapping[int, WorkerStatus], started: Mapping[int, int] | None
    ) -> None:
        """Report hung workers (their stacks are taken), then kill them, unless something stops them already.

        ``started``: the cycle that started each local rank, or None when there
        is no recovery to report to. The report goes first, so its RPC and the
        controller's flush window run while the rank is killed; the lock keeps
        the controller's stopTrain from reaching the rank before this kill.
        Killed at once, not through the ladder's polite stop: a stopped or stuck
        process ignores SIGTERM, and its peers' collectives fail only once it is gone.
        """
        stopped = [h for h in hung if (h.local_rank, h.pid) not in self._settled]
        if not stopped:
            return
        with self._lock:
            self._settle(statuses[h.local_rank] for h in stopped)
            if started is not None:
                self._send_fault(
                    sorted(h.global_rank for h in stopped),
                    {h.global_rank: int(FaultType.HANG.value) for h in stopped},
                    detail="\n".join(h.evidence() for h in stopped),
                    started_cycle=max(started.get(h.local_rank, 0) for h in stopped),
                )
            try:
                self.adapter.stop([h.local_rank for h in stopped], 0.0)
            except TaskdError:
                logger.exception("stopping hung workers failed")
        for hang in stopped:
            logger.warning("%s: reported as a hang and stopped", hang.reason)

    def _final_report(self, code: int, msg: str) -> None:
        # Reports still queued (the last workers' exits) reach the journal before the agent's end does.
        try:
            self._fault_reports.submit(lambda: None).result(timeout=_FINAL_REPORT_DEADLINE)
        except (TimeoutError, RuntimeError):
            logger.warning("earlier reports to the controller are still pending as this agent ends")
        try:
            # Short deadline: a launcher that is told to stop must not hang on a controller that is gone.
            self.client.report_agent_exit(code, msg, deadline=_FINAL_REPORT_DEADLINE)
        except Exception:  # the outcome stands even if the controller cannot hear it
            logger.exception("could not tell the controller that this agent ends")
