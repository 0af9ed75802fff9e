"""``taskd run`` against controller replicas on etcd: the leader is killed, the job does not notice.

Two ``taskd controller`` processes share one etcd prefix; the job's launcher
is given both (``--controller A,B``). The leader is SIGKILLed while the
workers train: they keep running (same pids), the agent follows the new
leader, a worker killed afterwards is recovered by it, and the job finishes.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from taskd_core.client.query import QueryClient
from taskd_core.errors import TaskdError
from taskd_core.models import Credentials
from tests.conftest import ControllerProcess, token_file
from tests.etcd_server import EtcdServer

from .harness import Cluster, wait_until
from .test_run_processes import starts, worker

ADMIN = Credentials(token="adm1n")


def subscribed(address: str, job_id: str) -> bool:
    """Whether the job's agent holds a signal stream on the controller at ``address``."""
    try:
        with QueryClient(address, ADMIN) as controller:
            job = controller.job(job_id)
    except TaskdError:
        return False
    return bool(job.agents) and all(a.subscribed for a in job.agents)


def test_a_killed_leader_is_followed_and_a_later_fault_recovered(tmp_path: Path, cluster: Cluster, etcd: EtcdServer) -> None:
    state = etcd.url()
    token_file(tmp_path / "admin", ADMIN.token)
    args = ("--lease-ttl", "2", "--flush-seconds", "0.3", "--report-timeout", "60",
            "--strategies", "recover-in-place,recover,exit", "--admin-token-file", str(tmp_path / "admin"))
    leader = ControllerProcess(state, args, tmp_path / "ctl-a.log").wait_serving()
    standby = ControllerProcess(state, args, tmp_path / "ctl-b.log")
    try:
        run = cluster.node(
            0, 1, 2, worker(tmp_path, "wait"), "--in-place", "--controller", f"{leader.address},{standby.address}"
        )
        wait_until("both workers started", lambda: len(starts(tmp_path)) == 2, cluster)
        first = starts(tmp_path)

        leader.kill()
        standby.wait_serving()
        wait_until("the agent on the new leader", lambda: subscribed(standby.address, cluster.job_id), cluster)
        os.kill(first[1, 0], signal.SIGKILL)
        wait_until("rank 1 restarted by the new leader", lambda: (1, 1) in starts(tmp_path), cluster)
        (tmp_path / "out" / "finish").touch()
        assert run.wait() == 0, run.output()
        assert starts(tmp_path)[0, 0] == first[0, 0] and (0, 1) not in starts(tmp_path)  # rank 0 trained on

        with QueryClient(f"{leader.address},{standby.address}", ADMIN) as controller:
            kinds = [e.kind for e in controller.events(cluster.job_id).events]
        assert kinds.count("cycle started") == 1 and kinds.count("cycle succeeded") == 1
        assert "job finished" in kinds
        assert "Traceback" not in run.output()
    finally:
        for child in (leader, standby):
            if child.proc.poll() is None:
                child.kill()
