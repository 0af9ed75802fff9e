"""The launcher's side of a node's snapshot keeper: the directory workers write, and the process that owns it.

:class:`Keeper` makes the node's snapshot directory (on the tmpfs
``/dev/shm``, so its files are memory no worker owns: they survive the
worker's SIGKILL) and starts the keeper process
(:mod:`taskd_core.snapshots._serve`) whose stdin is a pipe from the launcher.
The keeper serves the directory to the other nodes' ranks (their peer copies
arrive there; a rank that lost its node fetches its copies back), and removes
it when that pipe ends: when the launcher closes it at the job's end, and when
the kernel closes it because the launcher died, however it died (the
lifeline's pattern, :mod:`taskd_core.forkserver.lifeline`); what a node's
whole process tree SIGKILLed at once leaves, the next keeper on the machine
removes (:func:`sweep`).

The workers learn where the directory is from :meth:`Keeper.worker_env`
(``TASKD_SNAPSHOT_*``, read by ``taskd_pytorch.snapshot``), and where the
keeper listens from the directory's ``address`` file: nothing waits for the
keeper to start.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from taskd_core.forkserver.jobscope import abandoned, owner_tag
from taskd_core.snapshots.settings import SnapshotSettings
from taskd_core.snapshots.store import SnapshotStore

logger = logging.getLogger(__name__)

#: The node's snapshot directory, in every worker.
DIR_ENV = "TASKD_SNAPSHOT_NODE_DIR"
#: Bytes each worker's own snapshots may take (its two newest, and as much again per peer copy).
BUDGET_ENV = "TASKD_SNAPSHOT_RANK_BUDGET"
#: Peer copies each worker sends.
COPIES_ENV = "TASKD_SNAPSHOT_COPIES"
#: The job id, the keepers' authentication context.
JOB_ENV = "TASKD_SNAPSHOT_JOB"
#: The snapshot directories' names: this prefix, the launcher's owner tag, ``-`` and a random part.
PREFIX = "taskd-snapshots-"
#: Seconds to wait for the keeper's address.
START_TIMEOUT = 30.0


def sweep(directory: Path) -> list[Path]:
    """Remove the snapshot directories in ``directory`` whose launcher is gone; returns them.

    A keeper removes its directory when its launcher ends, however that ends; a node's whole
    process tree SIGKILLed at once (the keeper with it) leaves the directory, memory that
    nothing frees. Each is named after its launcher (:func:`~taskd_core.forkserver.jobscope.owner_tag`,
    as the job cgroups are), so the next keeper on the machine finds and removes it.
    """
    gone = abandoned(directory, PREFIX)
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def default_memory(directory: Path) -> int:
    """Half of the free space of ``directory``'s file system, in bytes."""
    try:
        stat = os.statvfs(directory)
    except OSError:
        return 0
    return stat.f_bavail * stat.f_frsize // 2


class Keeper:
    """One node's snapshot directory and keeper process; use as a context manager, or :meth:`close`.

    :param host: where the keeper listens for the other nodes (``""``: no peer copies).
    :param token: the job's token, which keys the keepers' wire (empty: no peer copies).
    :param local_world_size: the node's workers, who share its memory budget.
    """

    def __init__(
        self,
        settings: SnapshotSettings,
        *,
        job_id: str,
        host: str,
        token: str,
        local_world_size: int,
    ) -> None:
        self.settings = settings
        self.job_id = job_id
        settings.directory.mkdir(parents=True, exist_ok=True)
        swept = sweep(settings.directory)
        if swept:
            logger.info("removed the snapshots of launchers that are gone: %s", ", ".join(map(str, swept)))
        self.root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{owner_tag()}-", dir=settings.directory))
        memory = settings.memory_mib << 20 if settings.memory_mib is not None else default_memory(self.root)
        self.rank_budget = memory // max(1, local_world_size)
        # The share of the node's memory that the ring's symmetry leaves to the other nodes' copies.
        self.peer_budget = memory * settings.copies // (1 + settings.copies)
        env = {k: v for k, v in os.environ.items() if k != "TASKD_JOB_TOKEN"}
        if token:
            env["TASKD_JOB_TOKEN"] = token
        listen = host if host and token else "-"
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "taskd_core.snapshots._serve",
                str(self.root),
                listen,
                job_id,
                str(self.peer_budget),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env=env,
            # Outside the launcher's session: a terminal's signals are the launcher's to handle.
            start_new_session=True,
        )
        self._pipe: IO[bytes] | None = self._process.stdin
        self._listens = listen != "-"
        if not token:
            logger.info("memory snapshots stay on their node: without TASKD_JOB_TOKEN no peer copy is sent")

    @property
    def pid(self) -> int:
        return self._process.pid

    def address(self, timeout: float = START_TIMEOUT) -> str:
        """Where the keeper listens, once it does; empty without a listener or after ``timeout``."""
        if self._listens:
            deadline = time.monotonic() + timeout
            while not (found := SnapshotStore(self.root).keeper()) and time.monotonic() < deadline:
                if self._process.poll() is not None:
                    break
                time.sleep(0.01)
            return found
        return ""

    def worker_env(self) -> dict[str, str]:
        """What each worker is told about its node's snapshots."""
        return {
            DIR_ENV: str(self.root),
            BUDGET_ENV: str(self.rank_budget),
            COPIES_ENV: str(self.settings.copies),
            JOB_ENV: self.job_id,
        }

    def close(self) -> None:
        """End the keeper; it removes the node's snapshots (the job is over here)."""
        if self._pipe is not None:
            try:
                self._pipe.close()
            except OSError:
                pass
            self._pipe = None
        try:
            self._process.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
