"""Turning SIGTERM / SIGINT into an orderly stop of a launcher's workers.

Every launcher (``taskd run``, ``msrun`` through ``MSRunPlugin``, ``taskdrun``)
needs the same thing: while its agent runs, SIGTERM and SIGINT must stop the
workers and end the agent (exit 143 / 130), not kill the launcher and orphan
the workers. Handlers can only be installed from the main thread (torch
elastic checks the same); elsewhere the caller keeps its own signal handling.

A launcher that has work to do before its agent exists (``taskdrun`` joins
its rendezvous first) installs the handlers once, around everything, with a
:class:`StopRequest`: whatever is running when the signal comes (the
rendezvous, then the agent) listens to it and ends.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

logger = logging.getLogger(__name__)

#: The signals that mean "stop the job" to a launcher.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """The stop signal a launcher received, if any, passed on to every listener.

    Call it with a signal number (it is the ``stop`` of :func:`forward_stop_signals`);
    a listener added after the signal came is told at once, so a signal that
    arrives between two phases of a launcher is never lost.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        #: set once a stop signal came; blocking phases wait on it.
        self.event = threading.Event()
        self._listeners: list[Callable[[int], None]] = []

    def __call__(self, signum: int) -> None:
        self.signum = signum
        self.event.set()
        for listener in list(self._listeners):
            listener(signum)

    def listen(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(signum)`` on the stop signal (now, if it came already); it must be signal-safe."""
        self._listeners.append(listener)
        if self.signum is not None:
            listener(self.signum)


@contextlib.contextmanager
def forward_stop_signals(
    stop: Callable[[int], None], who: str = "launcher", signals: tuple[signal.Signals, ...] = STOP_SIGNALS
) -> Iterator[None]:
    """Route ``signals`` (SIGTERM, SIGINT) to ``stop(signum)`` while the block runs, then restore.

    :param stop: called in the main thread with the signal number; it must be
        safe there (for example ``NodeAgent.shutdown``, which only sets a flag).
    :param who: how the log line names the receiver.
    :param signals: the signals to forward.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: FrameType | None) -> None:
        logger.warning("%s received %s: stopping every worker", who, signal.Signals(signum).name)
        stop(signum)

    previous = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
