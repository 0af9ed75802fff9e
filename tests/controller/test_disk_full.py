"""A full disk under the controller: it goes on deciding from memory, says so once, and catches up.

The controller runs as a child process in a private mount namespace whose
state directory is a 2 MiB tmpfs; the test fills it (entering that
namespace) in the middle of a job, runs a whole recovery cycle, then frees it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from taskd_core.controller.store_sqlite import SqliteStore
from taskd_core.models import Credentials
from taskd_core.rpc import recover_pb2 as pb
from taskd_core.testing import wait_until
from tests.conftest import ROOT, WAIT
from tests.controller.test_metrics import scrape

TOKEN = "disk-token"


@pytest.fixture
def small_disk_controller(tmp_path: Path):
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("nsenter")):
        pytest.skip("needs root, unshare(1) and nsenter(1) for a private tmpfs")
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    port_file, log = tmp_path / "port", tmp_path / "controller.log"
    command = [
        sys.executable, "-m", "taskd_core", "controller", "--listen", "127.0.0.1:0",
        "--state", str(state_dir / "state.db"), "--port-file", str(port_file), "--metrics-port", "0",
    ]
    script = f"mount -t tmpfs -o size=2m none {state_dir} && exec {' '.join(command)}"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        address = wait_until(
            lambda: port_file.exists() and port_file.read_text().strip(), "the controller's port file", WAIT,
            unless=lambda: proc.poll() is not None and f"controller exited:\n{log.read_text()}",
        )
        metrics = wait_until(lambda: re.search(r"metrics on http://[^:]+:(\d+)/", log.read_text()), "metrics", WAIT)

        def inside(shell: str) -> None:
            subprocess.run(["nsenter", "--target", str(proc.pid), "--mount", "sh", "-c", shell], timeout=60)

        yield address, int(metrics.group(1)), log, inside, state_dir
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(WAIT)


def test_a_full_disk_neither_ends_the_job_nor_half_writes_a_transition(
    tmp_path, small_disk_controller, make_agent
) -> None:
    address, metrics_port, log, inside, state_dir = small_disk_controller
    agent = make_agent(address, "job", "node-0", rank_ids=(0, 1), credentials=Credentials(token=TOKEN)).join()
    inside(f"cat /dev/zero > {state_dir}/fill 2>/dev/null")
    agent.recover(1)  # every report answered 0, not 599: the controller decides from memory
    agent.recover(2)
    gauges = scrape(metrics_port)
    assert gauges["taskd_state_writes_held{}"] > 0 and gauges["taskd_state_write_failures_total{}"] > 0
    errors = [line for line in log.read_text().splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "the disk is full" in errors[0], errors
    inside(f"rm -f {state_dir}/fill")
    wait_until(lambda: scrape(metrics_port)["taskd_state_writes_held{}"] == 0, "the held writes to be written", WAIT)
    page = agent.stub.QueryEvents(pb.EventQuery(jobId="job", afterSeq=0, limit=1000), timeout=10)
    kinds = Counter(e.kind for e in page.events)
    seqs = [e.seq for e in page.events]
    assert seqs == sorted(set(seqs))
    # Each transition's entries are there once: none lost, none written twice by a retry.
    assert (kinds["fault"], kinds["cycle started"], kinds["cycle succeeded"], kinds["job claimed"]) == (2, 2, 2, 1)
    assert "writes resumed" in log.read_text()
    # The file holds what the controller holds: a restart would resume at cycle 2, idle.
    copy = tmp_path / "copy"
    copy.mkdir()
    inside(f"cp {state_dir}/state.db {state_dir}/state.db-wal {copy}/")
    (stored,) = SqliteStore(str(copy / "state.db")).load()
    assert (stored.row.snapshot["cycle"], stored.row.snapshot["state"]) == (2, "idle")
