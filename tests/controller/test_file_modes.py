"""Files holding secrets are the owner's alone: the state file and its WAL 0600, token files checked."""

from __future__ import annotations

import asyncio
import os
import stat

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
