"""The MindSpore fork server's fork hooks (a hook module of ``ForkServerSettings.hooks``).

Imported by the fork server itself, so it uses the standard library and
MindSpore only (``taskd_mindspore``'s package ``__init__`` imports nothing).

:func:`before_fork` and :func:`after_fork_in_parent` are MindSpore's own
``fork_utils.prepare_before_fork`` / ``parent_at_fork``;
:func:`after_fork_in_child` calls ``fork_utils.child_at_fork`` (MindSpore resets
its thread pools and executors there). Then, for the
seconds ``communication.init()`` takes, it works around two waits of
MindSpore 2.10's cluster start that a restart otherwise pays in full:

* **a lost connect.** ``TCPComm::Connect`` marks a new connection
  "connecting" after handing its socket to the event-loop thread; over
  loopback the connect completes at once, and when that thread is woken onto
  the same core it preempts the caller, marks the connection "connected"
  first and is then overwritten: the registration with the scheduler fails and
  is retried after 0.5 s, on a busy machine again and again (15 times in a row
  measured). The process runs as ``SCHED_BATCH`` meanwhile, whose threads do
  not preempt on wake-up, so the caller finishes first;
* **a fixed 3 s sleep.** The CPU collective library looks up each peer's
  address and ``sleep(3)``\\ s when it is not published yet; the worker that
  registered last always looks first. ``init()`` holds the GIL, so no Python
  thread can help; instead the agent sends :data:`WAKE_SIGNAL` to the
  worker's main thread at :data:`WAKE_AFTER` seconds after its start, for
  which this hook installs a handler that does nothing, with ``SA_RESTART``:
  ``sleep()`` is never restarted and ends early, every call that can be
  restarted is.

``SCHED_BATCH`` also slows MindSpore's own hand-offs between threads (the
first step's compilation took up to twice as long), so it ends as soon as
the handler runs after ``init()`` returned, and for every process at the
last wake-up (the agent sets the threads back, as the handler cannot run in
a scheduler, whose ``init()`` lasts the whole job). The handler puts the
signal's default back when it runs at the last wake-up, so the script goes
on as a fresh interpreter would.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from types import FrameType

#: The signal that wakes a forked worker's main thread (default action: ignored).
WAKE_SIGNAL = signal.SIGURG
#: Seconds after a forked start at which the agent wakes its main thread. A wake-up during MindSpore's
#: address lookup spends one of the 19 tries it allows (3 s each): seven leave it 36 s for a slow peer.
WAKE_AFTER = (0.6, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0)
#: A wake-up this long after the child's start is the last one (the agent counts from a little later).
_LAST_WAKE = (WAKE_AFTER[-2] + WAKE_AFTER[-1]) / 2


def end_batch(pid: int | None = None) -> None:
    """Every ``SCHED_BATCH`` thread of ``pid`` (None: this process) back to ``SCHED_OTHER``."""
    for tid in os.listdir(f"/proc/{'self' if pid is None else pid}/task"):
        try:
            if os.sched_getscheduler(int(tid)) == os.SCHED_BATCH:
                os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            pass  # the thread (or the process) ended meanwhile


def _initialized() -> bool:
    """Whether ``mindspore.communication.init()`` returned in this process."""
    helper = sys.modules.get("mindspore.communication._comm_helper")
    return bool(getattr(getattr(helper, "GlobalComm", None), "INITED", False))


def before_fork() -> None:
    from mindspore._c_expression import fork_utils

    fork_utils.prepare_before_fork()


def after_fork_in_parent() -> None:
    from mindspore._c_expression import fork_utils

    fork_utils.parent_at_fork()


def after_fork_in_child() -> None:
    """MindSpore's child hook, and the start-up workarounds where the signal and policy are the defaults."""
    from mindspore._c_expression import fork_utils

    defaults = signal.getsignal(WAKE_SIGNAL) is signal.SIG_DFL, os.sched_getscheduler(0) == os.SCHED_OTHER
    workaround = all(defaults)
    if workaround:
        # First: threads started from now on (MindSpore's, its event loops) inherit it.
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    fork_utils.child_at_fork()
    if not workaround:
        return
    started = time.monotonic()

    def on_wake(signum: int, frame: FrameType | None) -> None:
        # A handler runs only between bytecodes: init() holds the GIL, so once it returned, or when the
        # script has not reached it yet. SCHED_BATCH slows MindSpore's own thread hand-offs (compiling).
        late = time.monotonic() - started >= _LAST_WAKE
        if late or _initialized():
            end_batch()
        if late:
            signal.signal(WAKE_SIGNAL, signal.SIG_DFL)

    signal.signal(WAKE_SIGNAL, on_wake)
    signal.siginterrupt(WAKE_SIGNAL, False)
