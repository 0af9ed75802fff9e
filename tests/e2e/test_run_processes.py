"""``taskd run`` end to end with plain Python workers: finish, give-up, in-place, signals, adapters."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from taskd_core import testing

from .harness import DEADLINE, REPO, Cluster, job_processes, wait_until, worker_command

#: argv: OUT MODE. Records each start as OUT/start-<rank>-<restart>-<pid>, then
#: "finish": exits 0; "crash": exits 1; "orphan": starts a long-lived child and exits 0;
#: "family": starts a long-lived child and waits; "wait": runs until OUT/finish appears.
WORKER = textwrap.dedent(
    """
    import os, pathlib, sys, time
    out, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
    (out / f"start-{os.environ['RANK']}-{os.environ['TASKD_RESTART_COUNT']}-{os.getpid()}").touch()
    if mode == "crash":
        time.sleep(0.3)
        sys.exit(1)
    if mode in ("orphan", "family"):  # a long-lived child; "orphan" then exits 0, "family" waits
        import subprocess
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(200)"])
        if mode == "orphan":
            sys.exit(0)
    deadline = time.monotonic() + (0.5 if mode == "finish" else 200)
    while time.monotonic() < deadline and not (out / "finish").exists():
        time.sleep(0.05)
    """
)


def worker(tmp_path: Path, mode: str) -> list[str]:
    return worker_command(tmp_path, WORKER, mode)


def starts(tmp_path: Path) -> dict[tuple[int, int], int]:
    """{(global rank, restart count): pid} of every worker start so far."""
    out = {}
    for path in (tmp_path / "out").glob("start-*"):
        _, rank, restart, pid = path.name.split("-")
        out[int(rank), int(restart)] = int(pid)
    return out


def kinds(cluster: Cluster) -> list[str]:
    return [kind for kind, _ in cluster.journal()]


def test_all_workers_finish(tmp_path: Path, cluster: Cluster) -> None:
    """2 nodes x 2 workers exit 0: both agents exit 0 and the controller records the job finished."""
    command = worker(tmp_path, "finish")
    for node in (0, 1):
        cluster.node(node, 2, 2, command)
    assert cluster.wait_all() == [0, 0], cluster.diagnostics()
    assert set(starts(tmp_path)) == {(r, 0) for r in range(4)}
    assert "job finished" in kinds(cluster)
    assert job_processes(cluster.job_id) == []


def test_two_nodes_on_a_loopback_alias_finish(tmp_path: Path, cluster: Cluster) -> None:
    """--master-addr 127.0.0.2 (Linux routes all of 127/8 to lo): node 0's controller listens where node 1 dials."""
    cluster.master_addr = "127.0.0.2"
    command = worker(tmp_path, "finish")
    for node in (0, 1):
        cluster.node(node, 2, 1, command)
    assert cluster.wait_all() == [0, 0], cluster.diagnostics()
    assert set(starts(tmp_path)) == {(0, 0), (1, 0)}
    assert "job finished" in kinds(cluster)
    node0 = cluster.runs[0].output()
    assert f"embedded controller listening on 127.0.0.2:{cluster.controller_port} (plaintext)" in node0
    assert f"controller 127.0.0.2:{cluster.controller_port} (embedded)" in node0
    assert job_processes(cluster.job_id) == []


def test_children_left_by_finished_workers_are_stopped(tmp_path: Path, cluster: Cluster) -> None:
    """Workers that exit 0 but leave children running: `taskd run` exits 0 and leaves no process behind."""
    run = cluster.node(0, 1, 2, worker(tmp_path, "orphan"))
    assert run.wait() == 0, run.output()
    assert job_processes(cluster.job_id) == []


def test_repeated_faults_give_the_job_up(tmp_path: Path, cluster: Cluster) -> None:
    """Workers crashing after every restart exhaust --max-cycles: every agent exits non-zero, nothing left."""
    command = worker(tmp_path, "crash")
    for node in (0, 1):
        cluster.node(node, 2, 2, command, "--max-cycles", "2", "--strategies", "recover,exit")
    codes = cluster.wait_all()
    assert all(code != 0 for code in codes), cluster.diagnostics()
    journal = kinds(cluster)
    assert "job given up" in journal
    assert journal.count("cycle succeeded") <= 2
    assert max(restart for _, restart in starts(tmp_path)) <= 2
    assert job_processes(cluster.job_id) == []


def test_in_place_restarts_only_the_faulty_rank(tmp_path: Path, cluster: Cluster) -> None:
    """With --in-place, a SIGKILLed worker gets a new pid; every other worker keeps its own."""
    command = worker(tmp_path, "wait")
    for node in (0, 1):
        cluster.node(node, 2, 2, command, "--in-place")
    wait_until("all four workers started", lambda: len(starts(tmp_path)) == 4, cluster)
    first = starts(tmp_path)
    os.kill(first[3, 0], signal.SIGKILL)
    wait_until("rank 3 restarted", lambda: (3, 1) in starts(tmp_path), cluster)
    after = starts(tmp_path)
    assert set(after) == {(0, 0), (1, 0), (2, 0), (3, 0), (3, 1)}
    assert after[3, 1] != first[3, 0]
    assert sorted(job_processes(cluster.job_id, fork_servers=False)) == sorted(
        [first[0, 0], first[1, 0], first[2, 0], after[3, 1]]
    )
    (tmp_path / "out" / "finish").touch()
    assert cluster.wait_all() == [0, 0], cluster.diagnostics()
    journal = cluster.journal()
    assert ("strategy chosen", "recover-in-place") in [(k, d.get("strategy")) for k, d in journal]
    assert "job finished" in [k for k, _ in journal]


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_every_worker(tmp_path: Path, cluster: Cluster, sig: signal.Signals, code: int) -> None:
    """SIGTERM / SIGINT to `taskd run` stop every worker; it exits 143 / 130."""
    run = cluster.node(0, 1, 2, worker(tmp_path, "wait"))
    wait_until("both workers started", lambda: len(starts(tmp_path)) == 2, cluster)
    run.proc.send_signal(sig)
    assert run.wait() == code, run.output()
    assert job_processes(cluster.job_id) == []


def test_sigkill_of_taskd_run_takes_every_worker_and_their_children(tmp_path: Path, cluster: Cluster) -> None:
    """A SIGKILLed launcher runs no cleanup: its lifeline guard kills the workers' process groups."""
    run = cluster.node(0, 1, 2, worker(tmp_path, "family"))
    # 2 workers + their 2 children (the node's fork server, when it already serves, comes on top)
    wait_until(
        "workers and children", lambda: len(job_processes(cluster.job_id, fork_servers=False)) == 4, cluster
    )
    run.proc.kill()
    run.wait()
    # Well under 1 s when measured; the deadline is only a ceiling for a loaded machine.
    testing.wait_until(
        lambda: not job_processes(cluster.job_id),
        "the guard to end every job process",
        30.0,
        explain=lambda: f"left: {job_processes(cluster.job_id)}",
    )


#: A distribution whose adapter is the process adapter with a fixed command; it marks each hook call.
TRACING_ADAPTER = textwrap.dedent(
    """
    import os, sys
    from taskd_core.launcher import LaunchSpec, ProcessAdapter
    from taskd_core.plugins import hookimpl

    class Adapter(ProcessAdapter):
        def __init__(self):
            super().__init__(LaunchSpec(command=(sys.executable, "-c", "pass"), nproc=2, job_id="entry"))

        @hookimpl
        def taskd_restart_all(self):
            with open(os.environ["TRACE_FILE"], "a") as f:
                f.write("restart_all\\n")
            return super().taskd_restart_all()
    """
)

#: Runs a node agent with the adapter named by argv[1], loaded through its entry point.
AGENT_SCRIPT = textwrap.dedent(
    """
    import sys
    from taskd_core.agent.config import AgentConfig
    from taskd_core.agent.node_agent import NodeAgent
    from taskd_core.controller.server import EmbeddedController
    from taskd_core.errors import PluginError
    from taskd_core.plugins import load_adapter

    try:
        adapter = load_adapter(sys.argv[1])
    except PluginError as exc:
        print(f"{type(exc).__name__}: {exc}")
        sys.exit(2)
    with EmbeddedController() as ctl:
        outcome = NodeAgent(AgentConfig(job_id="entry", controller=ctl.address), adapter).run()
    print(f"outcome {outcome.kind.value} {outcome.exit_code}")
    sys.exit(outcome.exit_code)
    """
)


def lay_out_dist(root: Path, name: str, source: str, entry: str) -> None:
    """An unpacked distribution on a path entry: module, METADATA and entry_points.txt (group ``taskd``)."""
    (root / f"{name}.py").write_text(source)
    info = root / f"{name}-2.0.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 2.0\n")
    info.joinpath("entry_points.txt").write_text(f"[taskd]\n{entry}\n")


def run_with_dists(dists: Path, args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in a child whose path holds the distributions laid out in ``dists``."""
    return subprocess.run(
        [sys.executable, *args],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(dists), str(REPO)]), **env},
        cwd=dists,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )


@pytest.mark.parametrize(
    ("frame", "code", "expected"),
    [
        ("tracing", 0, "outcome succeeded 0"),
        (
            "brokenframe",
            2,
            "PluginLoadError: TaskD adapter 'brokenframe' from distribution tdent_broken 2.0 failed"
            " to load: ModuleNotFoundError: No module named 'no_such_framework'",
        ),
        ("nosuchframe", 2, "AdapterNotFoundError: no TaskD adapter named 'nosuchframe' is installed"),
    ],
)
def test_agent_uses_adapter_from_entry_point(tmp_path: Path, frame: str, code: int, expected: str) -> None:
    """The agent drives an adapter found through a real entry point; missing or broken ones fail clearly."""
    lay_out_dist(tmp_path, "tdent_tracing", TRACING_ADAPTER, "tracing = tdent_tracing:Adapter")
    lay_out_dist(tmp_path, "tdent_broken", "import no_such_framework\n", "brokenframe = tdent_broken:Adapter")
    trace = tmp_path / "trace.txt"
    result = run_with_dists(tmp_path, ["-c", AGENT_SCRIPT, frame], TRACE_FILE=str(trace))
    assert result.returncode == code, result.stdout + result.stderr
    assert expected in result.stdout
    if frame == "tracing":
        assert trace.read_text() == "restart_all\n"


def test_plugins_lists_adapters_and_broken_ones(tmp_path: Path) -> None:
    """`python -m taskd_core plugins` shows adapters' distributions and strategies, and why one is broken."""
    lay_out_dist(
        tmp_path,
        "tdent_good",
        "from taskd_core.launcher import ProcessAdapter as Adapter\n",
        "goodframe = tdent_good:Adapter",
    )
    lay_out_dist(tmp_path, "tdent_broken", "import no_such_framework\n", "brokenframe = tdent_broken:Adapter")
    result = run_with_dists(tmp_path, ["-m", "taskd_core", "plugins"])
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert ["goodframe", "tdent_good", "2.0", "recover,dump,exit"] in rows
    assert ["brokenframe", "tdent_broken", "2.0", "BROKEN"] in rows
    assert "No module named 'no_such_framework'" in result.stdout
