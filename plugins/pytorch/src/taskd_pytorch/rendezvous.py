"""Joining torch's rendezvous so that a stop signal can end the wait, and the controller's notice board.

torch's ``next_rendezvous()`` has no way to be cancelled: it blocks until the
round completes or its join timeout (600 s by default) passes, and a signal
handler that runs meanwhile cannot make it return. :func:`run_interruptibly`
runs such a call in a daemon thread and gives up waiting when the launcher's
:class:`~taskd_core.launcher.interrupt.StopRequest` fires; the abandoned call
ends with the process, and torch's own shutdown path leaves the rendezvous
as torchrun leaves it when it is killed.

:class:`StoreBoard` is the :class:`~taskd_core.launcher.embedded.ControllerBoard`
of ``taskdrun``: the rendezvous store every node already shares, so the node
the rendezvous made rank 0 can tell the others where its embedded controller
listens, whatever backend (c10d, etcd, static) carries the rendezvous.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from torch.distributed import Store  # type: ignore[attr-defined]  # re-exported without __all__

from taskd_core.errors import ControllerUnavailableError, LauncherInterrupted
from taskd_core.launcher.interrupt import StopRequest

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Store key under which rank 0 publishes its embedded controller's ``HOST:PORT``.
CONTROLLER_KEY = "taskd/controller"
#: How often a waiting node looks at the board, and a waiting launcher at its stop request.
_POLL = 0.05


def run_interruptibly(call: Callable[[], T], stop: StopRequest, what: str) -> T:
    """``call()``'s result, or :class:`LauncherInterrupted` as soon as ``stop`` fires.

    ``call`` runs in a daemon thread; its exceptions are raised here.
    """
    outcome: list[T] = []
    failure: list[BaseException] = []
    done = threading.Event()

    def target() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # noqa: BLE001  # handed to the waiting thread, which raises it
            failure.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=target, name=f"taskd-{what.replace(' ', '-')}", daemon=True)
    thread.start()
    while not done.wait(_POLL):
        if stop.signum is not None:
            logger.warning("%s abandoned: the launcher received signal %s", what, stop.signum)
            raise LauncherInterrupted(what, stop.signum)
    if failure:
        raise failure[0]
    return outcome[0]


class StoreBoard:
    """The controller's address, published in (and read from) the job's rendezvous store.

    :param store: the store the first rendezvous round gave every node.
    :param stop: a node waiting for the address gives up when it fires.
    """

    def __init__(self, store: Store, stop: StopRequest) -> None:
        self._store = store
        self._stop = stop

    def publish(self, address: str) -> None:
        self._store.set(CONTROLLER_KEY, address)
        logger.info("published the embedded controller's address %s in the rendezvous store", address)

    def lookup(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not self._store.check([CONTROLLER_KEY]):
            if self._stop.signum is not None:
                raise LauncherInterrupted("waiting for the controller's address", self._stop.signum)
            if time.monotonic() >= deadline:
                raise ControllerUnavailableError(
                    "the rendezvous store (rank 0 never published its embedded controller)", timeout
                )
            self._stop.event.wait(_POLL)
        address = self._store.get(CONTROLLER_KEY).decode()
        logger.info("the job's controller, started by rendezvous rank 0, is at %s", address)
        return address
