"""Workers forked beside busy gRPC threads survive (msrun forks each worker with a preexec_fn)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

FORK_UNDER_LOAD = textwrap.dedent(
    """
    import os, subprocess, sys, threading
    from taskd_core.forkserver.forksafe import disable_grpc_fork_handlers
    print("disabled", disable_grpc_fork_handlers())
    from taskd_core.client.manager import DLRecoverManager
    from taskd_core.controller.server import EmbeddedController
    from taskd_core.rpc import recover_pb2 as pb

    # A signal stream, keep-alives every 10 ms and a health check loop keep gRPC threads busy.
    with EmbeddedController(keepalive_interval=0.01) as ctl:
        client = DLRecoverManager(
            pb.ClientInfo(jobId="j", role="r"), ctl.address, handler=lambda s: None, health_interval=0.001
        )
        threading.Thread(target=client.start_subscribe, daemon=True).start()
        died = 0
        for _ in range(200):
            child = subprocess.Popen([sys.executable, "-c", "pass"], preexec_fn=os.setsid, stderr=subprocess.DEVNULL)
            died += child.wait(timeout=60) != 0
        client.close()
    print("died", died)
    """
)


def test_children_forked_with_preexec_fn_beside_grpc_threads_all_start() -> None:
    """With gRPC's fork handlers on, about one fork in ten aborted in the child; TaskD turns them off."""
    out = subprocess.run([sys.executable, "-c", FORK_UNDER_LOAD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "disabled True" in out.stdout
    assert "died 0" in out.stdout, out.stdout + out.stderr[-2000:]


def test_launcher_entry_points_import_no_grpc() -> None:
    """What msrun, taskd and taskdrun import first leaves grpc unimported, so it can still be configured."""
    probe = (
        "import sys, taskd_core, taskd_core.cli, taskd_pytorch.cli, taskd.api.taskd_agent_api; "
        "import taskd.python.framework.agent.ms_mgr.msrun_plugin; print('grpc' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_too_late_is_reported() -> None:
    probe = (
        "import logging, grpc; logging.basicConfig(); "
        "from taskd_core.forkserver.forksafe import disable_grpc_fork_handlers as d; print(d())"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False"
    assert "GRPC_ENABLE_FORK_SUPPORT=false" in out.stderr
