"""The node agent: one per node, inside the launcher process.

It starts the node's workers through the adapter, learns of a worker's death
the moment it happens (pidfds, no polling interval), reports it to the
controller with the worker's *global* rank, and lets the controller's
signals drive the :class:`~taskd_core.agent.dispatcher.ActionDispatcher`.
It returns an :class:`AgentOutcome`; the launcher turns it into an exit code.

Threads: :meth:`NodeAgent.run` is the supervision loop; the client's signal
stream runs in a second thread. Both call hooks under one lock, which no
report holds: a report may retry an unreachable controller for a minute, and
the agent keeps watching its workers (and obeying SIGTERM) meanwhile. Fault
reports go out, in order, from a third thread for the same reason.
"""

from __future__ import annotations

import enum
import functools
import logging
import signal as signals
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from taskd_core.agent.config import AgentConfig
from taskd_core.agent.crashloop import CrashLoop
from taskd_core.agent.dispatcher import ActionDispatcher
from taskd_core.agent.hangs.watcher import Hang, ProgressWatcher
from taskd_core.agent.lifecycle import WorkerLedger
from taskd_core.agent.pidwatch import PidWatch
from taskd_core.client.manager import DLRecoverManager
from taskd_core.errors import ConfigError, RecoveryDisabledError, TaskdError
from taskd_core.models import Code, FaultType, Signal, WorkerEvent, WorkerState, WorkerStatus
from taskd_core.plugins.registry import Adapter

logger = logging.getLogger(__name__)

#: Upper bound on one wait for a worker event. Deaths end the wait through
#: pidfds and every state change (a handled signal, shutdown) wakes it, so
#: this only bounds how stale the loop's view can get; each wake-up costs a
#: MONITOR call, which an idle agent should not spend every second.
_WAIT_CAP = 5.0
#: Seconds the last report (this agent ends) may retry an unreachable controller.
_FINAL_REPORT_DEADLINE = 5.0


class Outcome(str, enum.Enum):
    SUCCEEDED = "succeeded"
    GIVEN_UP = "given-up"
    INTERRUPTED = "interrupted"
    #: recovery was impossible here (controller unreachable, recovery off and a worker failed).
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class AgentOutcome:
    """How the agent's run ended, and the exit code a launcher should use."""

    kind: Outcome
    exit_code: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class _Held:
    """A failed worker whose report the restart backoff holds back."""

    local_rank: int
    #: the cycle that started it (see ``startedCycle`` in the proto).
    started_cycle: int


class NodeAgent:
    """Supervises one node's workers for the controller at ``config.controller``."""

    def __init__(self, config: AgentConfig, adapter: Adapter) -> None:
        self.config = config
        self.adapter = adapter
        self._lock = threading.RLock()
        self._watch = PidWatch()
        self._fault_reports = ThreadPoolExecutor(1, thread_name_prefix=f"taskd-faults-{config.job_id}")
        self._shutdown_signal: int | None = None
        #: why the signal stream ended for good, when the controller could not be reached any more.
        self._controller_lost: str | None = None
        #: (local rank, pid) of workers whose end is not a fault: stopped on purpose or already reported.
        self._settled: set[tuple[int, int | None]] = set()
        self._progress = (
            ProgressWatcher(config.progress, self._watch.wake, on_events=self._watch.wake)
            if config.progress.enabled
            else None
        )
        self._ledger = WorkerLedger(last_step=self._progress.last_step) if self._progress else WorkerLedger()
        #: why the agent must end the job itself: a fault report the controller did not take.
        self._unreported: str | None = None
        self._crashloop = CrashLoop(config.restart_backoff)
        #: global ranks whose fault report the restart backoff holds back, and until when.
        self._held: dict[int, _Held] = {}
        #: worker events not reported yet: they wait while fault reports are held back.
        self._unsent: list[WorkerEvent] = []
        self._report_at = 0.0
        if not config.controller:
            raise ConfigError(f"the agent of job {config.job_id} needs a controller address")
        self.client = DLRecoverManager.for_job(
            config.job_id,
            config.controller,
            role=config.role,
            agent_id=config.agent_id or f"node-{config.node_rank}",
            node_rank=config.node_rank,
            credentials=config.credentials,
            handler=self._handle_signal,
            connect_deadline=config.connect_timeout,
            # A fault found during an outage must wait as long as the outage is ridden out.
            report_deadline=max(config.report_deadline, config.connect_timeout),
            health_interval=config.health_interval,
            health_note=self._progress.describe if self._progress is not None else None,
        )
        self.dispatcher = ActionDispatcher(
            adapter,
            self.client,
            config.dispatch,
            on_stopping=self._settle,
            lock=self._lock,
            send=self._in_order,
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

    # --- the supervision loop -------------------------------------------------------------

    def run(self) -> AgentOutcome:
        """Run the node's workers to the end; never raises for worker failures."""
        subscriber: threading.Thread | None = None
        try:
            try:
                self.client.rejoin()
                recovery = True
            except RecoveryDisabledError:
                recovery = False
            if self._progress is not None:
                # Before the first start: workers inherit where to report their progress.
                self._progress.start()
            with self._lock:
                self.adapter.restart_all()
                self.client.rank_ids = tuple(sorted(s.global_rank for s in self.adapter.monitor().values()))
            if recovery:
                subscriber = threading.Thread(
                    target=self._subscribe, name=f"taskd-signals-{self.config.job_id}", daemon=True
                )
                subscriber.start()
            else:
                logger.warning(
                    "process recovery is off for job %s: a failed worker ends the job", self.config.job_id
                )
            outcome = self._supervise(recovery)
        except TaskdError as exc:
            self._stop_all()
            if self._shutdown_signal is not None:
                # A stop signal cut the start short (the launcher abandoned a rendezvous, say): not a failure.
                signum = self._shutdown_signal
                logger.warning("agent of job %s stopped while starting: %s", self.config.job_id, exc)
                outcome = AgentOutcome(Outcome.INTERRUPTED, 128 + signum, f"signal {signum}")
            else:
                logger.error("agent of job %s failed: %s", self.config.job_id, exc)
                outcome = AgentOutcome(Outcome.FAILED, 1, str(exc))
        finally:
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
        logger.info(
            "agent of job %s ends: %s (exit %s) %s",
            self.config.job_id,
            outcome.kind.value,
            outcome.exit_code,
            outcome.reason,
        )
        return outcome

    def _subscribe(self) -> None:
        try:
            self.client.start_subscribe(self.adapter.name)
        except TaskdError as exc:
            logger.error("lost the controller for good: %s", exc)
            self._controller_lost = str(exc)
            self.dispatcher.given_up.set()
            self._watch.wake()

    def _stop_all(self) -> None:
        # A signal waiting for the lock (a restart, say) must not start workers
        # after this: close() stops them and shuts the dispatcher for good.
        try:
            self.dispatcher.close()
        except TaskdError:
            logger.exception("stopping workers failed")

    def _supervise(self, recovery: bool) -> AgentOutcome:
        while True:
            if self._shutdown_signal is not None:
                signum = self._shutdown_signal
                self._stop_all()
                if recovery:
                    self._report_changes()
                self._final_report(128 + signum, f"agent interrupted by signal {signum}")
                return AgentOutcome(Outcome.INTERRUPTED, 128 + signum, f"signal {signum}")
            if self.dispatcher.given_up.is_set():
                if self._controller_lost is not None:
                    self._stop_all()
                    return AgentOutcome(
                        Outcome.FAILED,
                        1,
                        f"the job's controller is gone ({self._controller_lost}); when the node hosting it "
                        "was lost, the job cannot recover: start it again",
                    )
                self._report_changes()
                reason = f"the controller gave the job up: {self.dispatcher.give_up_reason}"
                self._final_report(1, reason)
                return AgentOutcome(Outcome.GIVEN_UP, 1, reason)
            if self._unreported is not None:
                return self._end_failed(self._unreported)
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
            failed = [s for s in statuses.values() if s.failed and (s.local_rank, s.pid) not in self._settled]
            if resync:
                # The controller lost the cycle these workers were stopped for: report them again.
                failed = [
                    s for s in statuses.values() if s.state is not WorkerState.RUNNING and not s.succeeded
                ]
            if failed:
                self._settle(failed)
                for s in failed:
                    logger.warning(
                        "rank %s (local %s, pid %s) failed with exit code %s",
                        s.global_rank,
                        s.local_rank,
                        s.pid,
                        s.exit_code,
                    )
                if not recovery:
                    self._stop_all()
                    return AgentOutcome(Outcome.FAILED, 1, f"ranks {[s.global_rank for s in failed]} failed")
                delay = 0.0 if resync else self._crashloop.failed(failed, now)
                self._hold(failed, started, delay, now)
            reported = bool(self._held) and now >= self._report_at
            if reported:
                self._report_held(started)
            if recovery:
                self._unsent.extend(changes)
            if self._unsent and not self._held:
                # Queued behind the fault report (one the restart backoff holds back included): the
                # journal keeps the order, a fault before its worker's end; the recovery never waits.
                self._fault_reports.submit(self.client.report_worker_events, self._unsent)
                self._unsent = []
            if failed and recovery and not self._held:
                # Reported at once, not held back by the restart backoff: a live node starts
                # the replacements while the controller decides (after the report, not before).
                self.dispatcher.start_early(failed)
            if failed or reported:
                continue
            hangs = self._progress.take_hangs() if self._progress is not None else []
            if hangs:
                stopped = self._stop_hung(hangs, statuses, started if recovery else None)
                if stopped and not recovery:
                    self._stop_all()
                    return AgentOutcome(Outcome.FAILED, 1, stopped[0].reason)
                continue
            # After dump or exit the workers may end with 0, but the job is
            # being given up: wait for killMaster instead of claiming success.
            if (
                statuses
                and all(s.succeeded for s in statuses.values())
                and not self.dispatcher.ending.is_set()
            ):
                self._final_report(0, "every worker exited 0")
                return AgentOutcome(Outcome.SUCCEEDED, 0)
            running = [s for s in statuses.values() if s.state is WorkerState.RUNNING and s.pid]
            if self._progress is not None:
                self._progress.track({s.pid: (s.local_rank, s.global_rank) for s in running if s.pid})
            if self._watch.watch(s.pid for s in running if s.pid):
                continue
            self._watch.wait(min(_WAIT_CAP, self._report_at - now) if self._held else _WAIT_CAP)

    def _hold(
        self, failed: list[WorkerStatus], started: Mapping[int, int], delay: float, now: float
    ) -> None:
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
        self._report_at = max(self._report_at, now + delay) if self._held else now + delay
        self._held.update({s.global_rank: _Held(s.local_rank, started.get(s.local_rank, 0)) for s in failed})

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
        self._watch.wake()

    def _end_failed(self, reason: str) -> AgentOutcome:
        logger.error("job %s ends here: %s", self.config.job_id, reason)
        self._stop_all()
        self._final_report(1, reason)
        return AgentOutcome(Outcome.FAILED, 1, reason)

    def _report_changes(self) -> None:
        with self._lock:
            changes = [*self._unsent, *self._worker_events(self.adapter.monitor())]
            self._unsent = []
        self.client.report_worker_events(changes)

    def _worker_events(self, statuses: Mapping[int, WorkerStatus]) -> list[WorkerEvent]:
        """Worker events since the last look: reported steps, then starts and ends."""
        seen = self._ledger.update(statuses)
        # Taken after the ledger, whose look at an ended worker's last step reads every datagram
        # it sent: its `resumed` goes before its `exited`. New workers have reported nothing yet.
        reported = self._progress.take_worker_events() if self._progress is not None else []
        return [*reported, *seen]

    def _stop_hung(
        self, hangs: list[Hang], statuses: Mapping[int, WorkerStatus], started: Mapping[int, int] | None
    ) -> list[Hang]:
        """Report the hung workers that still run (their stacks are taken), then kill them; those hangs.

        ``started``: the cycle that started each local rank, or None when there
        is no recovery to report to. The report goes first, so its RPC and the
        controller's flush window run while the rank is killed; the lock keeps
        the controller's stopTrain from reaching the rank before this kill.
        Killed at once, not through the ladder's polite stop: a stopped or stuck
        process ignores SIGTERM, and its peers' collectives fail only once it is gone.
        """
        live = {(s.local_rank, s.pid): s for s in statuses.values() if s.state is WorkerState.RUNNING}
        stopped = [
            h for h in hangs if (h.local_rank, h.pid) in live and (h.local_rank, h.pid) not in self._settled
        ]
        if not stopped:
            return []
        with self._lock:
            self._settle(live[(h.local_rank, h.pid)] for h in stopped)
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
        return stopped

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
