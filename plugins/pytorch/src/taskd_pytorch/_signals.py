"""Keeping the launcher's signal handlers in charge while torch starts workers.

``PContext.start()`` installs, on the main thread, handlers that raise
``SignalException`` for SIGTERM, SIGINT, SIGHUP and SIGQUIT. Under TaskD the
launcher's handlers (which ask the node agent to shut down) must stay the ones
that run, so they are put back right after every start. On any other thread
torch installs nothing and warns that workers could be orphaned; under TaskD
that is not so (the launcher's main thread handles the signals), so that one
warning is left out while workers start.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from torch.distributed.elastic.multiprocessing import SignalException

logger = logging.getLogger(__name__)

#: The logger of ``PContext.start()``.
_TORCH_LOGGER = "torch.distributed.elastic.multiprocessing.api"

#: torch's default for ``TORCHELASTIC_SIGNALS_TO_HANDLE``.
_TORCH_DEFAULT = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def _signals_torch_handles() -> list[signal.Signals]:
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", _TORCH_DEFAULT).split(",")
    return [getattr(signal, name.strip()) for name in names if hasattr(signal, name.strip())]


def _no_orphan_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(
        "Failed to register signal handlers since torchelastic is running"
    )


@contextmanager
def keep_signal_handlers() -> Iterator[None]:
    """Restore the current handlers of torch's signals when the block ends.

    A signal that torch's handler caught inside the block (as
    ``SignalException``) is delivered again to the restored handler, so a
    shutdown request is never lost; the block then fails with ``RuntimeError``.
    """
    if threading.current_thread() is not threading.main_thread():
        torch_log = logging.getLogger(_TORCH_LOGGER)
        torch_log.addFilter(_no_orphan_warning)
        try:
            yield
        finally:
            torch_log.removeFilter(_no_orphan_warning)
        return
    saved = {sig: signal.getsignal(sig) for sig in _signals_torch_handles()}
    caught: SignalException | None = None
    try:
        yield
    except SignalException as exc:
        caught = exc
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    if caught is not None:
        logger.warning("%s arrived while workers were starting; passing it on", caught.sigval.name)
        signal.raise_signal(caught.sigval)
        raise RuntimeError(f"worker start interrupted by {caught.sigval.name}") from caught
