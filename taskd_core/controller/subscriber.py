"""One agent's live signal stream, as a queue the gRPC handler drains."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from taskd_core.models import Signal

logger = logging.getLogger(__name__)

#: Signals one subscriber may have unread before it counts as stuck; it is then
#: dropped and gets the latest signal again when it re-subscribes.
MAX_BACKLOG = 1000


class Subscriber:
    """Signals for one agent of one job; ``offer`` never blocks the caller."""

    def __init__(self, job_id: str, agent_id: str, max_backlog: int = MAX_BACKLOG) -> None:
        self.job_id = job_id
        self.agent_id = agent_id
        self._max_backlog = max_backlog
        # Unbounded so that the end marker always fits; the backlog cap is ours.
        self._queue: asyncio.Queue[Signal | None] = asyncio.Queue()
        self.closed = False

    def offer(self, signal: Signal) -> bool:
        """Queue a signal; False (and the stream ends) when the agent is not reading."""
        if self.closed:
            return False
        if self._queue.qsize() >= self._max_backlog:
            logger.warning(
                "job %s agent %s: %d signals unread, ending its stream",
                self.job_id,
                self.agent_id,
                self._queue.qsize(),
            )
            self.close()
            return False
        self._queue.put_nowait(signal)
        return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._queue.put_nowait(None)

    async def signals(self) -> AsyncIterator[Signal]:
        """Yield queued signals until :meth:`close`."""
        while (signal := await self._queue.get()) is not None:
            yield signal
