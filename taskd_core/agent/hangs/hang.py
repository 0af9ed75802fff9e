"""What a declared hang is: which signal showed it, the timeout that applied, the stack.

:class:`Hang` is what the watcher hands the agent, which reports it to the
controller (:meth:`Hang.evidence` goes into the journal) and kills the worker.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: Longest stack text kept for the journal; a deep stack of many threads is cut, not dropped.
MAX_STACK = 32_000


class HangSignal(str, enum.Enum):
    """What showed that a worker stopped making progress."""

    STOPPED = "stopped"
    DISK_SLEEP = "uninterruptible-sleep"
    HEARTBEAT = "heartbeat"
    SECTION = "section"
    TIMER = "timer"


@dataclass(frozen=True, slots=True)
class Hang:
    """One worker declared hung, with the evidence for the journal."""

    pid: int
    local_rank: int
    global_rank: int
    signal: HangSignal
    #: what stopped: the section or timer scope, the /proc state, or ``heartbeat``.
    name: str
    #: seconds without progress when declared, and the timeout that applied.
    waited: float
    timeout: float
    learned: bool
    stack: str
    #: seconds taking the stack took.
    stack_seconds: float = 0.0

    @property
    def reason(self) -> str:
        how = "learned" if self.learned else "configured"
        return (
            f"rank {self.global_rank} (pid {self.pid}) hung: {self.signal.value} {self.name!r}, "
            f"no progress for {self.waited:.1f}s (timeout {self.timeout:.1f}s, {how})"
        )

    def evidence(self) -> str:
        """The reason and the stack, cut to fit one journal entry."""
        text = f"{self.reason}\nstack taken in {self.stack_seconds:.2f}s\n{self.stack}"
        return text if len(text) <= MAX_STACK else text[: MAX_STACK - 20] + "\n... (cut)\n"
