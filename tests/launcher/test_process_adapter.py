"""The ``process`` adapter's hooks, called through the registry's typed facade on real child processes."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from taskd_core.errors import ConfigError, WorkerControlError
from taskd_core.launcher import LaunchSpec, ProcessAdapter
from taskd_core.models import Strategy, WorkerState, WorkerStatus
from taskd_core.plugins import Adapter, load_adapter
from taskd_core.testing import process_running, wait_for_file, wait_until

#: Dumps the rank variables to <dir>/<local rank>.<restart>.json, then sleeps or exits as told by argv.
WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
            "MASTER_PORT", "TASKD_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "TASKD_JOB_ID", "EXTRA"]
    env = {k: os.environ.get(k) for k in keys}
    env["pid"] = os.getpid()
    out = os.path.join(sys.argv[1], f"{env['LOCAL_RANK']}.{env['TASKD_RESTART_COUNT']}.json")
    with open(out + ".tmp", "w") as f:
        json.dump(env, f)
    os.replace(out + ".tmp", out)
    codes = {int(r): int(c) for r, c in (x.split("=") for x in sys.argv[2].split(",") if x)}
    code = codes.get(int(env["LOCAL_RANK"]))
    if code is None:
        time.sleep(120)
    sys.exit(code)
    """
)


def make_spec(tmp_path: Path, exits: str = "", **kw: object) -> LaunchSpec:
    fields: dict[str, object] = dict(
        command=(sys.executable, "-c", WORKER, str(tmp_path), exits),
        nproc=2,
        nnodes=3,
        node_rank=1,
        master_addr="10.1.2.3",
        master_port=4242,
        job_id="job-7",
        log_dir=tmp_path / "logs",
        env={"EXTRA": "x", "RANK": "overridden"},
        stop_timeout=5.0,
    )
    fields.update(kw)
    return LaunchSpec(**fields)  # type: ignore[arg-type]


@pytest.fixture
def adapters() -> Iterator[list[Adapter]]:
    """Adapters a test creates; every worker they started is stopped (SIGKILL at once) afterwards."""
    made: list[Adapter] = []
    yield made
    for adapter in made:
        adapter.stop(None, 0)


def start(adapters: list[Adapter], spec: LaunchSpec) -> Adapter:
    adapter = load_adapter("process", instance=ProcessAdapter(spec))
    adapters.append(adapter)
    return adapter


def read_env(tmp_path: Path, local_rank: int, restart: int) -> dict[str, object]:
    return json.loads(wait_for_file(tmp_path / f"{local_rank}.{restart}.json"))


def wait_exited(adapter: Adapter, local_rank: int, deadline: float = 60.0) -> int | None:
    """Exit code of ``local_rank`` once the monitor reports it EXITED (the test fails after ``deadline``)."""

    def exited() -> WorkerStatus | None:
        status = adapter.monitor()[local_rank]
        return status if status.state is WorkerState.EXITED else None

    return wait_until(exited, f"local rank {local_rank} to exit", deadline).exit_code


def test_restart_all_sets_rank_environment(tmp_path: Path, adapters: list[Adapter]) -> None:
    """Workers see torchrun's variables (global rank = node_rank * nproc + local) and the restart counters."""
    adapter = start(adapters, make_spec(tmp_path))
    assert {s.state for s in adapter.monitor().values()} == {WorkerState.NOT_STARTED}
    adapter.restart_all()
    env = read_env(tmp_path, 1, 0)
    assert env == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "6",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "NODE_RANK": "1",
        "MASTER_ADDR": "10.1.2.3",
        "MASTER_PORT": "4242",
        "TASKD_RESTART_COUNT": "0",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TASKD_JOB_ID": "job-7",
        "EXTRA": "x",
        "pid": env["pid"],
    }
    statuses = adapter.monitor()
    assert [(s.local_rank, s.global_rank, s.state) for s in statuses.values()] == [
        (0, 2, WorkerState.RUNNING),
        (1, 3, WorkerState.RUNNING),
    ]
    assert statuses[1].pid == env["pid"]
    assert (tmp_path / "logs" / "rank3" / "restart0.log").exists()


def test_restart_all_grows_counter_and_replaces_every_worker(tmp_path: Path, adapters: list[Adapter]) -> None:
    """restart_all stops leftovers and starts everyone again with the next restart count."""
    adapter = start(adapters, make_spec(tmp_path))
    adapter.restart_all()
    first = {r: read_env(tmp_path, r, 0)["pid"] for r in (0, 1)}
    adapter.restart_all()
    second = {r: read_env(tmp_path, r, 1) for r in (0, 1)}
    assert {r: e["TORCHELASTIC_RESTART_COUNT"] for r, e in second.items()} == {0: "1", 1: "1"}
    assert not any(process_running(pid) for pid in first.values())  # type: ignore[arg-type]
    assert {s.pid for s in adapter.monitor().values()} == {e["pid"] for e in second.values()}
    assert (tmp_path / "logs" / "rank2" / "restart1.log").exists()


def test_restart_list_keeps_other_workers(tmp_path: Path, adapters: list[Adapter]) -> None:
    """Stopping and restarting one rank gives it a new pid and count; the other keeps its pid and count."""
    adapter = start(adapters, make_spec(tmp_path, independent_workers=True))
    adapter.restart_all()
    before = {r: read_env(tmp_path, r, 0)["pid"] for r in (0, 1)}
    adapter.stop([1], timeout=5)
    assert adapter.monitor()[1].exit_code == -signal.SIGTERM
    adapter.restart_list([1])
    again = read_env(tmp_path, 1, 1)
    statuses = adapter.monitor()
    assert statuses[0].pid == before[0] and statuses[0].state is WorkerState.RUNNING
    assert statuses[1].pid == again["pid"] != before[1]
    assert again["TASKD_RESTART_COUNT"] == "1"
    adapter.restart_all()
    assert read_env(tmp_path, 0, 2)["TASKD_RESTART_COUNT"] == "2"


def test_monitor_reports_exit_codes(tmp_path: Path, adapters: list[Adapter]) -> None:
    """Exit codes are reported as they are (0, 7) and a signal death as its negative number."""
    adapter = start(adapters, make_spec(tmp_path, exits="0=7", nproc=3))
    adapter.restart_all()
    assert wait_exited(adapter, 0) == 7
    pid = read_env(tmp_path, 2, 0)["pid"]
    os.kill(pid, signal.SIGKILL)  # type: ignore[arg-type]
    assert wait_exited(adapter, 2) == -signal.SIGKILL
    statuses = adapter.monitor()
    assert statuses[0].failed and statuses[2].failed
    assert statuses[1].state is WorkerState.RUNNING


def test_successful_worker_is_reported_succeeded(tmp_path: Path, adapters: list[Adapter]) -> None:
    adapter = start(adapters, make_spec(tmp_path, exits="0=0,1=0"))
    adapter.restart_all()
    assert wait_exited(adapter, 0) == 0 and wait_exited(adapter, 1) == 0
    assert all(s.succeeded for s in adapter.monitor().values())


@pytest.mark.parametrize(
    ("independent", "expected"),
    [
        (False, (Strategy.RECOVER, Strategy.DUMP, Strategy.EXIT)),
        (True, (Strategy.RECOVER_IN_PLACE, Strategy.RECOVER, Strategy.DUMP, Strategy.EXIT)),
    ],
)
def test_strategies_offer_in_place_only_for_independent_workers(
    tmp_path: Path, independent: bool, expected: tuple[Strategy, ...]
) -> None:
    adapter = load_adapter(
        "process", instance=ProcessAdapter(make_spec(tmp_path, independent_workers=independent))
    )
    assert adapter.strategies() == expected


def test_adapter_without_spec_declares_strategies_but_controls_nothing() -> None:
    """ProcessAdapter() is what `taskd plugins` instantiates: strategies work, control hooks fail clearly."""
    adapter = load_adapter("process", instance=ProcessAdapter())
    assert Strategy.RECOVER in adapter.strategies()
    with pytest.raises(WorkerControlError, match="without a LaunchSpec"):
        adapter.restart_all()


def test_out_of_range_rank_is_refused(tmp_path: Path, adapters: list[Adapter]) -> None:
    adapter = start(adapters, make_spec(tmp_path))
    with pytest.raises(WorkerControlError, match=r"local ranks \[5\] are outside 0..1"):
        adapter.restart_list([5])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"command": ()}, "no command"),
        ({"nproc": 0}, "nproc must be at least 1"),
        ({"node_rank": 3}, "node rank 3 is outside 0..2"),
        ({"master_addr": "bad host!"}, "neither an IP address nor a host name"),
        ({"master_port": 70000}, "not a TCP port"),
    ],
)
def test_launch_spec_validates(tmp_path: Path, change: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_spec(tmp_path, **change)
