"""Fixtures for the pytorch adapter: real torch elastic agents driving plain python workers."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pt_support import JOB_TOKEN, WORKERS, Launcher, events, finish, run_job

from taskd_core.launcher.interrupt import StopRequest
from tests.etcd_server import EtcdServer


@pytest.fixture
def make_agent(tmp_path: Path) -> Iterator[Callable[..., object]]:
    """Build ``TaskdElasticAgent`` s on a one-node c10d rendezvous; every worker is stopped at teardown."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from taskd_pytorch.elastic import TaskdElasticAgent

    made: list[TaskdElasticAgent] = []

    def make(
        *worker_args: str, nproc: int = 2, script: str = "idle.py", nnodes: int = 1, stop: StopRequest | None = None,
        job_token: str = JOB_TOKEN,
    ) -> TaskdElasticAgent:
        handler = get_rendezvous_handler(
            RendezvousParameters(
                backend="c10d", endpoint="127.0.0.1:0", run_id=uuid.uuid4().hex, min_nodes=nnodes, max_nodes=nnodes
            )
        )
        spec = WorkerSpec(
            role="trainer",
            local_world_size=nproc,
            rdzv_handler=handler,
            entrypoint=sys.executable,
            args=("-u", str(WORKERS / script), *worker_args),
            local_addr="127.0.0.1",
        )
        agent = TaskdElasticAgent(
            spec, DefaultLogsSpecs(log_dir=str(tmp_path / "logs")), stop_timeout=5.0, stop=stop, job_token=job_token
        )
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.close()
        agent.get_worker_group().spec.rdzv_handler.shutdown()


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path)
    yield launcher
    launcher.cleanup()


@pytest.fixture(scope="session")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """Final parameters of ``examples/train_ddp.py`` run without faults (2 nodes x 2 workers)."""
    launcher = Launcher(tmp_path_factory.mktemp("fault_free"))
    try:
        nodes, progress, result = run_job(launcher, launcher.root / "job")
        done = finish(nodes, result)
        assert {e["restart"] for e in events(progress)} == {0}
        yield done
    finally:
        launcher.cleanup()


@pytest.fixture
def etcd_v2(tmp_path: Path) -> Iterator[EtcdServer]:
    """A real etcd server that also serves the v2 API, on free loopback ports (``stop()``/``start()``: an outage).

    Skips the test when etcd (Debian's ``etcd-server``, which ``.ci/run``
    installs) or torch's client library ``python-etcd`` is missing.
    """
    pytest.importorskip("etcd", reason="python-etcd, torch's etcd-v2 client, is not installed")
    server = EtcdServer(tmp_path / "etcd", v2=True).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_server(etcd_v2: EtcdServer) -> str:
    """``HOST:PORT`` of :func:`etcd_v2`, for ``--rdzv-endpoint``."""
    return etcd_v2.endpoint
