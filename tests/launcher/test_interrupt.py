"""SIGTERM / SIGINT forwarding of launchers."""

from __future__ import annotations

import os
import signal
import threading

from taskd_core.launcher.interrupt import StopRequest, forward_stop_signals


def test_signals_reach_stop_and_handlers_come_back() -> None:
    """Inside the block both signals call stop(signum); afterwards the previous handlers are back."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    got: list[int] = []
    with forward_stop_signals(got.append):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
    assert got == [signal.SIGTERM, signal.SIGINT]
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_other_threads_keep_the_callers_handling() -> None:
    """Off the main thread nothing is installed (Python would refuse) and the block still runs."""
    before = signal.getsignal(signal.SIGTERM)
    seen: list[object] = []

    def body() -> None:
        with forward_stop_signals(lambda signum: None):
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(timeout=30)
    assert seen == [before]


def test_a_stop_request_tells_every_listener_even_one_that_comes_late() -> None:
    request = StopRequest()
    early: list[int] = []
    request.listen(early.append)
    with forward_stop_signals(request):
        os.kill(os.getpid(), signal.SIGTERM)
    late: list[int] = []
    request.listen(late.append)
    assert request.event.is_set() and request.signum == signal.SIGTERM
    assert early == late == [signal.SIGTERM]
