"""Bad snapshot settings end the launcher with one line and exit code 2; the worker API outside taskdrun says what to do."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from taskd_core.errors import SnapshotError


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["--snapshot-copies", "99"], {}, "snapshot copies must be at most 16, not 99"),
        (["--snapshot-copies", "-1"], {}, "-1"),
        (["--snapshot-memory", "lots"], {}, "argument --snapshot-memory"),
        (["--snapshot-dir", "/etc/passwd/x"], {}, "/etc/passwd is a file, not a directory"),
        ([], {"TASKD_SNAPSHOT_COPIES": "x"}, "TASKD_SNAPSHOT_COPIES"),
    ],
)
def test_a_bad_snapshot_setting_is_one_line_and_exit_2(
    argv: list[str], env: dict[str, str], says: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "taskd_core", "run", *argv, "--nproc", "1", "--", "true"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_snapshot_writer_outside_taskdrun_says_to_run_under_it(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from taskd_pytorch.snapshot import SnapshotWriter

    monkeypatch.delenv("TASKD_SNAPSHOT_NODE_DIR", raising=False)
    monkeypatch.delenv("TASKD_PROGRESS_SOCKET", raising=False)
    with pytest.raises(SnapshotError, match="run the script under taskdrun"):
        SnapshotWriter(3)


def test_under_taskdrun_without_snapshots_the_reader_says_they_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from taskd_pytorch.snapshot import SnapshotReader

    # What a worker of `taskdrun --taskd-no-snapshots` has: its agent's socket, no keeper directory.
    monkeypatch.delenv("TASKD_SNAPSHOT_NODE_DIR", raising=False)
    monkeypatch.setenv("TASKD_PROGRESS_SOCKET", "/tmp/agent.sock")
    with pytest.raises(SnapshotError, match=r"memory snapshots are off .*--taskd-no-snapshots") as caught:
        SnapshotReader()
    assert "run the script under taskdrun" not in str(caught.value)
