"""Attacks on a live round's state hand-over by another user of the host, against a real ``taskdrun`` job.

The attacker runs as a user of its own (created for the test, removed after),
with nothing but what any user has: the job's store port (ports are public)
and the wire protocol. (It is started as root, since the interpreter lives
where only root can read, and drops to that user before it opens a socket.)
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pt_support import EXAMPLES, TRAIN_ARGS, WORKERS, Launcher, events

from taskd_core.testing import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def other_user() -> Iterator[tuple[int, int]]:
    """(uid, gid) of a user created for the test; skips where the machine cannot make one."""
    if os.geteuid() != 0:
        pytest.skip("creating a second user for the attacker needs root")
    name = f"taskdatk{secrets.token_hex(3)}"
    made = subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        capture_output=True, text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"useradd failed: {made.stderr.strip()}")
    try:
        import pwd

        entry = pwd.getpwnam(name)
        yield entry.pw_uid, entry.pw_gid
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def store_port(log: Path) -> str:
    """The port of the workers' store, from the launcher's log (any user can list listening ports)."""
    found = re.search(r"restart round 0: workers meet at \S+:(\d+)", log.read_text())
    return found.group(1) if found else ""


def start_pids(progress: Path) -> dict[int, int]:
    return {int(e["rank"]): int(e["pid"]) for e in events(progress) if e["event"] == "start"}


def test_another_user_cannot_poison_a_replacement_through_the_store(
    launch: Launcher, tmp_path: Path, other_user: tuple[int, int]
) -> None:
    """The attacker pre-sets the round's address to its relay, relays the replica's signed skeleton
    and forges the payload (zeros, whose checksum it recomputes). The replacement never connects to
    it (the address is not signed with the job's key) and gets the genuine state from the replica."""
    work = tmp_path / "job"
    work.mkdir()
    progress = work / "progress.jsonl"
    node = launch(
        "--nproc-per-node=2", str(EXAMPLES / "train_live.py"), "--ckpt-dir", str(work / "ckpt"),
        "--progress", str(progress), "--result", str(work / "result.json"), *TRAIN_ARGS, "--steps", "100",
        log="attacked", env={"TASKD_JOB_TOKEN": "s3cret"},  # token or no token: the finding held with one
    )
    port = str(wait_until(lambda: store_port(tmp_path / "attacked.0.log"), "the workers' store", 180))
    uid, gid = other_user
    attacker = subprocess.Popen(
        # First live round (cycle 1) of the first start (restart 0).
        [sys.executable, str(WORKERS / "hand_over_attacker.py"), f"{uid}:{gid}", port,
         "taskd/live/0/1//state-transfer", "45"],  # a PrefixStore joins its prefix and a key with "/"
        stdout=subprocess.PIPE, text=True, cwd="/", env={"PATH": os.environ["PATH"]},
    )
    try:
        assert attacker.stdout is not None
        assert attacker.stdout.readline().strip() == "ready"
        wait_until(lambda: len(start_pids(progress)) == 2 and any(e["event"] == "step" for e in events(progress)), "both ranks to train", 180)
        os.kill(start_pids(progress)[0], signal.SIGKILL)  # rank 0's replacement takes the state from rank 1
        report = json.loads(attacker.stdout.readline())
        assert node.wait(timeout=300) == 0
    finally:
        if attacker.poll() is None:
            attacker.kill()
        attacker.wait(timeout=30)

    assert report["genuine_seen"]  # the attacker did see the real address, and the round went on
    assert not report["forged_ack"] and not report["receiver_connected"]
    log = events(progress)
    assert {e["restart"] for e in log} == {0}  # recovered live: the genuine state reached the replacement
    assert json.loads((work / "result.json").read_text())["steps"] == 100
