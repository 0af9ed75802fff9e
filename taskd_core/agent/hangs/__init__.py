"""Hang detection: the agent's side of finding a worker that stopped making progress.

- :mod:`~taskd_core.agent.hangs.watcher`: :class:`ProgressWatcher`, which watches every local
  worker three ways (its ``/proc`` state, the heartbeats and sections of
  :mod:`taskd_core.worker`, torch elastic's file timers) and keeps a hung worker's stack;
  :class:`ProgressConfig`, its settings;
- :mod:`~taskd_core.agent.hangs.steps`: how far each worker's training got (the step it
  resumed from, the last step it reached).

The worker's side (heartbeats, sections, steps) is :mod:`taskd_core.worker`, which workers import.
"""

from __future__ import annotations

from taskd_core.agent.hangs.watcher import Hang, HangSignal, ProgressConfig, ProgressWatcher

__all__ = ["Hang", "HangSignal", "ProgressConfig", "ProgressWatcher"]
