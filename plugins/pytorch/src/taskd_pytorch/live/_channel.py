"""The local channel between a node's agent and its live workers: a directory of small files.

The agent (``taskdrun``) creates the directory and passes it to every worker
as ``TASKD_LIVE_DIR``. Two kinds of file live in it, each written atomically
(a temporary file renamed over the old one), so a reader never sees half a
number:

* ``round`` — written by the agent: the live recovery round the node's
  workers must be in. A new round tells running workers to leave their
  process group (even one blocked on a stopped peer) and meet the others in
  the new one; a worker started later joins it directly, except a
  replacement the agent started before announcing the next round: its
  rank's ``joined`` file names the current round (a process of its rank was
  in it), so it waits for the next.
* ``rank<local_rank>.joined`` — written by each worker: the last round it
  joined and holds the job's state in. Its existence also tells the agent
  that the worker uses the live API, so the node can offer ``recover-live``.
* ``rank<local_rank>.failed`` — written by a worker: the last round that broke
  under it (a peer was lost as the round formed, during the state's hand-over,
  or later). The agent then reports that round failed at once instead of
  waiting for its live timeout; a replacement of that rank waits for the next round.

Files, not a socket: both sides only need "the latest number", reading one is
a few microseconds, and nothing has to be listening when the other side
starts or dies. This module imports nothing heavy: the agent uses it too.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from taskd_core.scratch import scratch_dir

#: Environment variable naming the channel directory in every worker.
LIVE_DIR_ENV = "TASKD_LIVE_DIR"
#: Environment variable holding the job's token, which keys the state hand-over.
JOB_TOKEN_ENV = "TASKD_JOB_TOKEN"
_ROUND = "round"


class LiveChannel:
    """One node's channel directory (see the module docstring for its files)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls) -> LiveChannel:
        """A new, empty channel directory (the agent's side)."""
        return cls(scratch_dir("live"))

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    # --- the agent's side ------------------------------------------------------

    def begin_round(self, round_no: int) -> None:
        self._write(_ROUND, round_no)

    def reset(self) -> None:
        """Forget every round: the whole group starts afresh (round 0, every worker loads its checkpoint)."""
        for entry in self.path.iterdir():
            entry.unlink(missing_ok=True)

    def joined(self, local_rank: int) -> int | None:
        """The last round ``local_rank`` joined, or None if it never used the live API."""
        return self._read(_joined(local_rank))

    def failed(self, local_rank: int) -> int | None:
        """The last round that broke under ``local_rank``, or None."""
        return self._read(_failed(local_rank))

    def opted_in(self, local_ranks: Iterable[int]) -> bool:
        """Every given worker has joined a round at least once, so it survives a peer's loss."""
        ranks = list(local_ranks)
        return bool(ranks) and all(self.joined(rank) is not None for rank in ranks)

    # --- the worker's side -----------------------------------------------------

    def current_round(self) -> int:
        return self._read(_ROUND) or 0

    def mark_joined(self, local_rank: int, round_no: int) -> None:
        self._write(_joined(local_rank), round_no)

    def mark_failed(self, local_rank: int, round_no: int) -> None:
        self._write(_failed(local_rank), round_no)

    # --- files -------------------------------------------------------------------

    def _write(self, name: str, value: int) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=f".{name}.")
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(str(value))
        os.replace(tmp, self.path / name)

    def _read(self, name: str) -> int | None:
        try:
            text = (self.path / name).read_text(encoding="ascii")
        except FileNotFoundError:
            return None
        return int(text) if text.strip().isdigit() else None


def _joined(local_rank: int) -> str:
    return f"rank{local_rank}.joined"


def _failed(local_rank: int) -> str:
    return f"rank{local_rank}.failed"
