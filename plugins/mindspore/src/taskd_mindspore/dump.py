"""The ``dump`` strategy for a MindSpore script: save the last words at the next step boundary, exit 0.

When the controller chooses ``dump`` (a policy such as ``TASKD_STRATEGIES=dump,exit``,
or the ladder's rung after ``recover``), every running worker's agent sends it
the dump signal (SIGUSR1) and gives it ``TASKD_DUMP_GRACE`` seconds (30) to end;
a worker that ended with 0 counts as saved. The signal only sets a flag: the
script saves where its state is consistent, between two steps, and returns.

A loop of your own::

    from taskd_mindspore.dump import DumpRequest

    dump = DumpRequest()                      # installs the SIGUSR1 handler
    for step in range(start, steps):
        train_step(x, y)
        if dump.requested:
            ms.save_checkpoint(net, ckpt)     # the last words
            break
    return 0

``Model.train``: ``model.train(epochs, data, callbacks=[dump_callback(save)])``
where ``save(cb_params)`` writes the checkpoint; the callback stops training
at the end of the step in which the signal came (``run_context.request_stop()``).

A worker blocked in a collective with a dead peer sees the flag only once that
collective returns (MindSpore's CPU collectives give up after 30 s); its
parameters are still those of its last completed step, so it can save them then.
Nothing here imports MindSpore but :func:`dump_callback`, or any part of
TaskD but the standard library.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

#: The signal TaskD's agents send for ``dump`` (``DispatchConfig.dump_signal``).
DUMP_SIGNAL = signal.SIGUSR1


class DumpRequest:
    """Whether TaskD asked this process to save and end; installs the handler for ``signum``.

    Must be created in the main thread (Python's signal handlers live there).
    """

    def __init__(self, signum: signal.Signals = DUMP_SIGNAL) -> None:
        self.signum = signum
        self._requested = False
        signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._requested = True

    @property
    def requested(self) -> bool:
        """True once the dump signal came."""
        return self._requested


def dump_callback(save: Callable[[Any], object], request: DumpRequest | None = None) -> Any:
    """A ``mindspore.train.Callback``: once a dump is asked for, ``save(cb_params)`` and stop training.

    :param save: writes the last words from ``run_context.original_args()``
        (``cb_params.train_network``, ``cb_params.cur_step_num``, ...).
    :param request: the flag to watch (default: a new :class:`DumpRequest`).
    """
    from mindspore.train import Callback

    flag = request or DumpRequest()

    class _DumpCallback(Callback):  # type: ignore[misc]
        def on_train_step_end(self, run_context: Any) -> None:
            if flag.requested:
                save(run_context.original_args())
                run_context.request_stop()

    return _DumpCallback()
