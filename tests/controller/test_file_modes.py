"""Files holding secrets are the owner's alone: the state file and its WAL 0600, token files checked."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from taskd_core.controller.machine import JournalEntry
from taskd_core.controller.store import Commit, JobRow
from taskd_core.controller.store_sqlite import SqliteState


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_state_file_and_its_wal_are_created_0600_whatever_the_umask(tmp_path) -> None:
    state = tmp_path / "state.db"
    old = os.umask(0o022)
    try:

        async def write() -> None:
            store = SqliteState(str(state))
            await store.write(Commit(JobRow("j", True, {}, {}), (JournalEntry("hang", 0, {"stacks": "..."}),), now=1.0))
            assert {p.name: _mode(p) for p in tmp_path.iterdir()} == {
                "state.db": 0o600, "state.db-wal": 0o600, "state.db-shm": 0o600,
            }
            await store.close()

        asyncio.run(write())
    finally:
        os.umask(old)
    assert _mode(state) == 0o600


def test_a_state_file_other_users_could_read_is_made_private(tmp_path) -> None:
    state = tmp_path / "state.db"
    state.touch(mode=0o644)
    state.chmod(0o644)

    async def open_it() -> None:
        await SqliteState(str(state)).close()

    asyncio.run(open_it())
    assert _mode(state) == 0o600


def test_another_user_reads_neither_the_state_nor_its_wal(tmp_path_factory) -> None:
    """The attack of the campaign: another local user read a job's journal (hang evidence, secrets) from state.db."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv(1) to act as another user")
    shared = Path(tempfile.mkdtemp(prefix="taskd-modes-", dir="/tmp"))  # a directory every user may enter
    try:
        shared.chmod(0o755)
        state = shared / "state.db"

        async def write() -> None:
            store = SqliteState(str(state))
            await store.write(Commit(JobRow("j", True, {}, {}), (JournalEntry("hang", 0, {"stacks": "s3cr3t"}),), now=1.0))
            for name in ("state.db", "state.db-wal"):
                other = subprocess.run(
                    ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat", str(shared / name)],
                    capture_output=True, timeout=30,
                )
                assert other.returncode != 0 and b"Permission denied" in other.stderr, (name, other)
            await store.close()

        asyncio.run(write())
    finally:
        shutil.rmtree(shared)
