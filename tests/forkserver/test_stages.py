"""What the server imports when: only what the first workers need before forking them, then what they import.

And the fork hook modules a framework uses to run its own code around each fork.
Real servers and workers; each worker reports what it finds in ``sys.modules``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from taskd_core.forkserver.client import (
    TORCH_FIRST,
    ForkedProcess,
    ForkLauncher,
    ForkServerSettings,
)
from taskd_core.testing import wait_until

WAIT = 120.0
REPORT = "import json, sys; print(json.dumps(sorted(m for m in sys.argv[1:] if m in sys.modules)))\n"


def _modules_of(launcher: ForkLauncher, argv: list[str], log: Path) -> tuple[bool, list[str]]:
    with open(log, "wb") as out:
        proc = launcher.start(argv, dict(os.environ), stdout=out)
        assert proc.wait(WAIT) == 0
    return isinstance(proc, ForkedProcess), json.loads(log.read_text())


@pytest.mark.slow
def test_a_torch_job_is_forked_once_torch_is_imported_and_what_workers_import_follows(tmp_path: Path) -> None:
    script = tmp_path / "report.py"
    # Lives long enough to report what it imported (1 s after its start).
    script.write_text(
        "import sys, time, torch\nif sys.argv[-1] == 'dynamo':\n    import torch._dynamo\n    time.sleep(3)\n"
        + REPORT
    )
    report = [sys.executable, str(script), "torch", "torch._dynamo"]
    launcher = ForkLauncher(report, ForkServerSettings(learn=True, ready_timeout=WAIT))
    try:
        server = launcher.server
        assert server is not None
        first = _modules_of(launcher, report, tmp_path / "first.log")
        assert server.preloaded == list(TORCH_FIRST)
        _modules_of(launcher, [*report, "dynamo"], tmp_path / "dynamo.log")
        wait_until(
            lambda: "torch._dynamo" in server.learned, what="torch._dynamo in the server", deadline=WAIT
        )
        later = _modules_of(launcher, report, tmp_path / "later.log")
    finally:
        launcher.close()

    assert first == (True, ["torch"]) and later == (True, ["torch", "torch._dynamo"])


def test_fork_hooks_run_around_the_servers_forks_and_not_the_workers_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "myhooks.py").write_text(
        "import os\n"
        f"DIR = {str(tmp_path)!r}\n"
        "def mark(what):\n"
        "    open(os.path.join(DIR, f'{what}-{os.getpid()}'), 'w').close()\n"
        "def before_fork():\n"
        "    mark('before')\n"
        "def after_fork_in_parent():\n"
        "    mark('parent')\n"
        "def after_fork_in_child():\n"
        "    mark('child')\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    script = tmp_path / "w.py"
    # The worker forks a child of its own: no hook may run around that one.
    script.write_text("import os, sys\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\n")
    argv = [sys.executable, str(script)]
    settings = ForkServerSettings(preload=(), learn=False, ready_timeout=WAIT, hooks=("myhooks",))
    launcher = ForkLauncher(argv, settings)
    try:
        worker = launcher.start(argv, dict(os.environ))
        assert isinstance(worker, ForkedProcess) and worker.wait(WAIT) == 0
        server = launcher.server
        assert server is not None
        marks = sorted(
            p.name for p in tmp_path.iterdir() if p.name.split("-")[0] in ("before", "parent", "child")
        )
    finally:
        launcher.close()

    assert marks == sorted([f"before-{server.pid}", f"parent-{server.pid}", f"child-{worker.pid}"])


def test_a_child_fork_hook_that_fails_ends_the_worker_with_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "badhooks.py").write_text("def after_fork_in_child():\n    raise RuntimeError('no device')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    script = tmp_path / "w.py"
    script.write_text("print('ran')")
    argv = [sys.executable, str(script)]
    launcher = ForkLauncher(
        argv, ForkServerSettings(preload=(), learn=False, ready_timeout=WAIT, hooks=("badhooks",))
    )
    try:
        with open(tmp_path / "out.log", "wb") as out:
            worker = launcher.start(argv, dict(os.environ), stdout=out, stderr=subprocess.STDOUT)
            assert isinstance(worker, ForkedProcess) and worker.wait(WAIT) == 1
    finally:
        launcher.close()

    output = (tmp_path / "out.log").read_text()
    assert "badhooks.after_fork_in_child" in output and "no device" in output and "ran" not in output


def test_a_fork_hook_that_cannot_be_imported_makes_every_worker_exec(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text("import sys; sys.exit(3)")
    argv = [sys.executable, str(script)]
    launcher = ForkLauncher(
        argv, ForkServerSettings(preload=(), learn=False, ready_timeout=WAIT, hooks=("no_such_hooks",))
    )
    try:
        worker = launcher.start(argv, dict(os.environ))
        assert isinstance(worker, subprocess.Popen) and worker.wait(WAIT) == 3
        assert launcher.server is not None and "no_such_hooks" in launcher.server.reason
    finally:
        launcher.close()
