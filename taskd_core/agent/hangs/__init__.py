"""Hang detection: the agent's side of finding a worker that stopped making progress.

- :mod:`~taskd_core.agent.hangs.watcher`: :class:`ProgressWatcher`, which watches every local
  worker three ways and keeps a hung worker's stack, from these parts:

  - :mod:`~taskd_core.agent.hangs.config`: :class:`ProgressConfig`, its bounds, and the
    timeouts it learns from the job;
  - :mod:`~taskd_core.agent.hangs.procstat`: what ``/proc`` says of a worker (stopped, in
    uninterruptible sleep, busy);
  - :mod:`~taskd_core.agent.hangs.inbox`: where workers' heartbeats and sections
    (:mod:`taskd_core.worker`) and torch elastic's file timers arrive, and how workers learn
    where that is;
  - :mod:`~taskd_core.agent.hangs.stacks`: a hung worker's Python stack (py-spy, faulthandler);
  - :mod:`~taskd_core.agent.hangs.hang`: :class:`Hang`, what the agent is handed;
- :mod:`~taskd_core.agent.hangs.steps`: how far each worker's training got (the step it
  resumed from, the last step it reached).

The worker's side (heartbeats, sections, steps) is :mod:`taskd_core.worker`, which workers import.
"""

from __future__ import annotations

from taskd_core.agent.hangs.config import ProgressConfig
from taskd_core.agent.hangs.hang import Hang, HangSignal
from taskd_core.agent.hangs.watcher import ProgressWatcher

__all__ = ["Hang", "HangSignal", "ProgressConfig", "ProgressWatcher"]
