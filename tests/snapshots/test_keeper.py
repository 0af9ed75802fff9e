"""The node's keeper process: it owns the snapshot directory, serves copies to the job only, and cleans up."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from taskd_core.errors import SnapshotError, StreamError
from taskd_core.forkserver.jobscope import owner_tag
from taskd_core.snapshots.keeper import DIR_ENV, PREFIX, Keeper
from taskd_core.snapshots.peer import PeerClient
from taskd_core.snapshots.settings import SnapshotSettings
from taskd_core.snapshots.store import SnapshotStore
from taskd_core.testing import descendants, process_running, wait_gone, wait_until

TOKEN = "the job's token"


@pytest.fixture
def keeper(tmp_path: Path) -> Iterator[Keeper]:
    with Keeper(
        SnapshotSettings(directory=tmp_path), job_id="job", host="127.0.0.1", token=TOKEN, local_world_size=2
    ) as k:
        yield k


def test_a_copy_sent_to_a_keeper_is_listed_fetched_whole_and_dropped(keeper: Keeper) -> None:
    local = SnapshotStore(keeper.root.with_name("sender"))
    seal = local.write(5, 12, b"meta", [memoryview(b"x" * 300_000), memoryview(b"y" * 7)])
    client = PeerClient(TOKEN, "job", timeout=30)
    address = keeper.address()
    assert address.startswith("127.0.0.1:")
    client.put(address, seal, b"meta", [memoryview(b"x" * 300_000), memoryview(b"y" * 7)])
    assert client.inventory(address) == {5: [12]}
    # It is a file of the keeper's directory: memory no worker owns.
    assert SnapshotStore(keeper.root).steps(5) == [12]
    got = client.get(address, 5, 12)
    assert got.meta == b"meta" and bytes(got.data) == b"x" * 300_000 + b"y" * 7
    client.drop(address, 5, 11)
    assert client.inventory(address) == {}
    with pytest.raises(SnapshotError, match="not complete"):
        client.get(address, 5, 12)


def test_a_damaged_copy_at_a_keeper_is_refused_by_the_fetcher(keeper: Keeper) -> None:
    store = SnapshotStore(keeper.root)
    store.write(1, 3, b"m", [memoryview(b"z" * 1000)])
    data = store.step_dir(1, 3) / "data"
    data.write_bytes(b"Z" + data.read_bytes()[1:])
    with pytest.raises(SnapshotError, match="damaged"):
        PeerClient(TOKEN, "job", timeout=30).get(keeper.address(), 1, 3)


def test_a_process_without_the_jobs_token_gets_nothing(keeper: Keeper) -> None:
    with pytest.raises(StreamError, match="did not prove this job's key"):
        PeerClient("another token", "job", timeout=30).inventory(keeper.address())
    with pytest.raises(StreamError):
        PeerClient(TOKEN, "another job", timeout=30).inventory(keeper.address())


def test_the_workers_are_told_the_directory_and_their_budget(tmp_path: Path) -> None:
    settings = SnapshotSettings(directory=tmp_path, memory_mib=64, copies=2)
    with Keeper(settings, job_id="j", host="", token="", local_world_size=4) as k:
        env = k.worker_env()
        assert env[DIR_ENV] == str(k.root) and k.root.parent == tmp_path
        assert env["TASKD_SNAPSHOT_RANK_BUDGET"] == str(16 << 20)
        assert env["TASKD_SNAPSHOT_COPIES"] == "2"
        assert k.address() == ""  # no token: nothing listens, no peer copies
    assert not k.root.exists()


_LAUNCHER = """
import json, sys, time
from pathlib import Path
from taskd_core.snapshots.keeper import Keeper
from taskd_core.snapshots.settings import SnapshotSettings
k = Keeper(SnapshotSettings(directory=Path(sys.argv[1])), job_id="j", host="127.0.0.1", token="t", local_world_size=1)
k.address()
print(json.dumps({"root": str(k.root), "keeper": k.pid}), flush=True)
time.sleep(600)
"""


def test_the_snapshots_go_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(tmp_path)], stdout=subprocess.PIPE)
    try:
        assert launcher.stdout is not None
        started = json.loads(launcher.stdout.readline())
        root, keeper_pid = Path(started["root"]), int(started["keeper"])
        SnapshotStore(root).write(0, 1, b"m", [memoryview(b"d" * 100)])
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        wait_until(lambda: not root.exists(), "the keeper to remove the snapshots", 30)
        wait_gone([keeper_pid], "the keeper")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if "keeper_pid" in locals() and process_running(keeper_pid):
            os.kill(keeper_pid, signal.SIGKILL)


def _stale_dirs(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"{PREFIX}*"))


def test_a_whole_tree_sigkilled_leaves_its_snapshots_and_the_next_keeper_removes_them(tmp_path: Path) -> None:
    # A real launcher (taskd run) with its keeper, fork server, guard and worker, all SIGKILLed at once.
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "taskd_core",
            "run",
            "--snapshot-dir",
            str(tmp_path),
            "--nproc",
            "1",
            "--",
            "sleep",
            "600",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    tree: list[int] = []
    try:
        wait_until(lambda: len(_stale_dirs(tmp_path)) == 1, "the launcher's snapshot directory", 60)
        (stale,) = _stale_dirs(tmp_path)
        wait_until(lambda: any(_is_sleep(p) for p in descendants(launcher.pid)), "the worker", 60)
        tree = [launcher.pid, *descendants(launcher.pid)]
        for pid in tree:
            os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        wait_gone(tree, "the launcher's tree")
        assert stale.is_dir()  # nothing of the tree was left to remove it
        live = tmp_path / f"{PREFIX}{owner_tag()}-live"  # this process runs: its directory stays
        reused = tmp_path / f"{PREFIX}{os.getpid()}.1-reused"  # this pid, but a process started then: gone
        elsewhere = tmp_path / f"{PREFIX}{os.getpid()}.1.1-elsewhere"  # another pid namespace's: not judged
        for path in (live, reused, elsewhere):
            path.mkdir()
        with Keeper(
            SnapshotSettings(directory=tmp_path), job_id="j", host="", token="", local_world_size=1
        ) as k:
            assert not stale.exists() and not reused.exists()
            assert live.is_dir() and elsewhere.is_dir() and k.root.is_dir()
    finally:
        for pid in tree or [launcher.pid]:
            if process_running(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=30)


def _is_sleep(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep\0")
    except OSError:
        return False


def test_peer_copies_over_the_keepers_budget_are_refused_and_said_once(tmp_path: Path) -> None:
    # 4 MiB for the node, one peer copy per rank: 2 MiB for the other nodes' copies.
    settings = SnapshotSettings(directory=tmp_path, memory_mib=4, copies=1)
    data = [memoryview(b"p" * (600 << 10))]
    sender = SnapshotStore(tmp_path / "sender")
    client = PeerClient(TOKEN, "job", timeout=30)
    log = tmp_path / "keeper.log"
    with open(log, "wb") as err, _stderr_to(err):
        k = Keeper(settings, job_id="job", host="127.0.0.1", token=TOKEN, local_world_size=1)
    with k:
        assert k.peer_budget == 2 << 20
        address = k.address()
        for step in (1, 2, 3):  # rank 0 holds two copies at most here (the newest and the next)
            client.put(address, sender.write(0, step, b"m", data), b"m", data)
        client.put(address, sender.write(1, 1, b"m", data), b"m", data)  # 1.8 MiB held
        for step in (2, 3):
            with pytest.raises(SnapshotError, match="holds peer copies of 2 MiB at most"):
                client.put(address, sender.write(1, step, b"m", data), b"m", data)
        assert client.inventory(address) == {0: [2, 3], 1: [1]}
        client.put(address, sender.write(0, 4, b"m", data), b"m", data)  # the others go on
        assert client.inventory(address)[0] == [3, 4]
    said = log.read_text()
    assert said.count("a copy of rank 1 (0 MiB) does not fit") == 1, said


@contextlib.contextmanager
def _stderr_to(f: IO[bytes]) -> Iterator[None]:
    """The keeper inherits this process's stderr (fd 2): point it at ``f`` while one starts."""
    saved = os.dup(2)
    os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
