"""The fork server with real processes: a forked worker is indistinguishable from an exec'd one.

Every test starts a real server (``taskd_core/forkserver/_server.py``
run by this interpreter) and real workers; the ``launchers`` fixture closes
every server, which SIGKILLs what is left of its workers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from taskd_core.forkserver.client import (
    ForkedProcess,
    ForkLauncher,
    ForkServerSettings,
    PythonCommand,
    start_worker,
)
from taskd_core.testing import process_running, wait_until

#: Generous ceiling of every wait (two loaded cores).
WAIT = 60.0

#: Reports what a script can see of how it was started, then ends the way argv[1] says.
FIDELITY = textwrap.dedent(
    """
    import atexit, json, os, signal, sys, threading
    atexit.register(lambda: print("atexit ran", flush=True))
    print(json.dumps({
        "argv": sys.argv, "orig_argv": sys.orig_argv, "name": __name__, "file": __file__,
        "spec": getattr(__spec__, "name", None), "path0": sys.path[0], "cwd": os.getcwd(),
        "env": {k: v for k, v in os.environ.items() if k.startswith("FID_")}, "environ_n": len(os.environ),
        "signals": {s.name: str(signal.getsignal(s)) for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)},
        "mask": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "own_session": os.getsid(0) == os.getpid(), "own_group": os.getpgid(0) == os.getpid(),
        "stdout": [sys.stdout.line_buffering, sys.stdout.write_through, sys.stdout.encoding],
        "stderr": [sys.stderr.line_buffering, sys.stderr.write_through],
        "stdin": os.read(0, 10).decode(), "threads": threading.active_count(),
        "comm": open("/proc/self/comm").read().strip(),
    }), flush=True)
    how = sys.argv[1]
    if how == "exit3":
        sys.exit(3)
    if how == "raise":
        raise ValueError("uncaught")
    if how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    if how == "message":
        sys.exit("a message")
    """
)

NO_PRELOAD = ForkServerSettings(preload=(), learn=False, ready_timeout=WAIT)


@pytest.fixture
def launchers() -> Iterator[Callable[..., ForkLauncher]]:
    made: list[ForkLauncher] = []

    def make(command: list[str], settings: ForkServerSettings = NO_PRELOAD, **kw: object) -> ForkLauncher:
        launcher = ForkLauncher(command, settings, **kw)  # type: ignore[arg-type]
        made.append(launcher)
        return launcher

    yield make
    for launcher in made:
        launcher.close()


def run_both(launcher: ForkLauncher, argv: list[str], cwd: Path, log: Path) -> list[tuple[int, str, bool]]:
    """Run ``argv`` forked and exec'd with the same environment; (exit code, output, forked) of each."""
    results = []
    env = {**os.environ, "FID_RANK": "3"}
    for way in (launcher, None):
        out = log.with_suffix(f".{'fork' if way else 'exec'}.log")
        with open(out, "wb") as f:
            proc = start_worker(way, argv, env, str(cwd), subprocess.DEVNULL, f, subprocess.STDOUT)
            code = proc.wait(WAIT)
        results.append((code, out.read_text(), isinstance(proc, ForkedProcess)))
    return results


@pytest.mark.parametrize("how", ["ok", "exit3", "raise", "sigterm", "message"])
@pytest.mark.parametrize("flags", [["-u"], []])
def test_forked_script_sees_and_ends_exactly_as_an_execd_one(
    tmp_path: Path, launchers: Callable[..., ForkLauncher], how: str, flags: list[str]
) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "fidelity.py").write_text(FIDELITY)
    argv = [sys.executable, *flags, "pkg/fidelity.py", how]
    launcher = launchers(argv, cwd=str(tmp_path))

    (forked, execd) = run_both(launcher, argv, tmp_path, tmp_path / how)

    assert forked[2] and not execd[2]
    assert forked[:2] == execd[:2]
    report = json.loads(forked[1].splitlines()[0])
    assert report["argv"] == ["pkg/fidelity.py", how] and report["name"] == "__main__"
    assert report["path0"] == str(tmp_path / "pkg") and report["env"] == {"FID_RANK": "3"}
    assert report["own_session"] and report["own_group"] and report["threads"] == 1
    assert forked[0] == {"ok": 0, "exit3": 3, "raise": 1, "sigterm": -signal.SIGTERM, "message": 1}[how]


def test_forked_module_is_run_as_python_m_runs_it(
    tmp_path: Path, launchers: Callable[..., ForkLauncher]
) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "fidelity.py").write_text(FIDELITY)
    argv = [sys.executable, "-u", "-m", "pkg.fidelity", "raise"]
    launcher = launchers(argv, cwd=str(tmp_path))

    forked, execd = run_both(launcher, argv, tmp_path, tmp_path / "module")

    assert forked[2] and forked[:2] == execd[:2]
    assert json.loads(forked[1].splitlines()[0])["argv"] == [str(tmp_path / "pkg" / "fidelity.py"), "raise"]


@pytest.mark.parametrize(
    "argv",
    [
        ["bash", "-c", "true"],
        [sys.executable, "-c", "pass"],
        [sys.executable, "-i", "x.py"],
        [sys.executable, "missing.py"],
        [sys.executable, "-m"],
        [sys.executable, "-W"],
        [sys.executable],
        ["/no/such/python", "x.py"],
    ],
)
def test_commands_only_the_interpreter_can_run_faithfully_are_not_forked(
    tmp_path: Path, argv: list[str]
) -> None:
    (tmp_path / "x.py").write_text("")
    assert PythonCommand.parse(argv, str(tmp_path), os.environ.get("PATH")) is None


def test_a_worker_with_other_interpreter_flags_or_startup_env_is_started_by_exec(
    tmp_path: Path, launchers: Callable[..., ForkLauncher]
) -> None:
    script = tmp_path / "w.py"
    script.write_text("import sys; sys.exit(5)")
    launcher = launchers([sys.executable, str(script)])
    assert isinstance(launcher.start([sys.executable, str(script)], dict(os.environ)), ForkedProcess)

    other_flags = launcher.start([sys.executable, "-B", str(script)], dict(os.environ))
    other_env = launcher.start([sys.executable, str(script)], {**os.environ, "PYTHONHASHSEED": "7"})
    not_python = launcher.start(["bash", "-c", "exit 5"], dict(os.environ))

    for proc in (other_flags, other_env, not_python):
        assert isinstance(proc, subprocess.Popen)
        assert proc.wait(WAIT) == 5


def test_killed_fork_server_takes_its_workers_and_is_replaced(
    tmp_path: Path, launchers: Callable[..., ForkLauncher]
) -> None:
    script = tmp_path / "sleep.py"
    script.write_text("import time; time.sleep(120)")
    argv = [sys.executable, str(script)]
    launcher = launchers(argv)
    worker = launcher.start(argv, dict(os.environ))
    assert isinstance(worker, ForkedProcess)
    first = launcher.server
    assert first is not None

    os.kill(first.pid, signal.SIGKILL)

    assert worker.wait(WAIT) == -signal.SIGKILL  # PR_SET_PDEATHSIG: the worker died with its server
    # A new server is started the moment the old one is seen dead, and serves once it has preloaded.
    second = wait_until(lambda: launcher.server is not first and launcher.server, "a new fork server")
    assert second.wait_ready(WAIT)
    again = launcher.start(argv, dict(os.environ))
    assert isinstance(again, ForkedProcess) and again.server is second


def test_workers_start_by_exec_while_the_server_still_preloads(
    tmp_path: Path, launchers: Callable[..., ForkLauncher], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "slow.py").write_text("import time; time.sleep(120)")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    script = tmp_path / "w.py"
    script.write_text("import sys; sys.exit(6)")
    argv = [sys.executable, str(script)]
    launcher = launchers(argv, ForkServerSettings(preload=("slow",), learn=False, ready_timeout=0.0))

    worker = launcher.start(argv, dict(os.environ))

    assert isinstance(worker, subprocess.Popen) and worker.wait(WAIT) == 6


def test_closing_the_launcher_kills_forked_workers_and_their_groups(
    tmp_path: Path, launchers: Callable[..., ForkLauncher]
) -> None:
    script = tmp_path / "parent.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(child.pid))\n"
        "time.sleep(120)\n"
    )
    argv = [sys.executable, str(script)]
    launcher = launchers(argv)
    worker = launcher.start(argv, dict(os.environ))
    grandchild = int(
        wait_until(lambda: (tmp_path / "child.pid").exists() and (tmp_path / "child.pid").read_text())
    )

    launcher.close()

    assert worker.wait(WAIT) == -signal.SIGKILL
    wait_until(lambda: not process_running(grandchild), what="the worker's child to be killed with its group")


def test_launcher_sigkilled_leaves_no_worker_or_server(tmp_path: Path) -> None:
    """``taskd run`` SIGKILLed: its fork server and every forked worker end without it."""
    script = tmp_path / "w.py"
    script.write_text(
        f"import os, time; open({str(tmp_path)!r} + f'/w{{os.getpid()}}', 'w'); time.sleep(120)"
    )
    run = subprocess.Popen(
        [Path(sys.executable).with_name("taskd"), "run", "--nproc", "2", "--", sys.executable, str(script)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        pids = wait_until(lambda: len(list(tmp_path.glob("w[0-9]*"))) == 2 and list(tmp_path.glob("w[0-9]*")))
        workers = [int(p.name[1:]) for p in pids]
        servers = {_ppid(pid) for pid in workers}
        assert run.pid not in servers  # forked by the server, not started by the launcher
        os.kill(run.pid, signal.SIGKILL)
        run.wait(WAIT)
        wait_until(
            lambda: not any(process_running(pid) for pid in [*workers, *servers]),
            what="workers and server to end",
        )
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(WAIT)


def test_server_refuses_to_serve_after_a_device_context_appeared(
    tmp_path: Path, launchers: Callable[..., ForkLauncher], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("class cuda:\n    is_initialized = staticmethod(lambda: True)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    script = tmp_path / "w.py"
    script.write_text("import sys; sys.exit(4)")
    argv = [sys.executable, str(script)]
    launcher = launchers(argv, ForkServerSettings(preload=("torch",), learn=False, ready_timeout=WAIT))

    worker = launcher.start(argv, dict(os.environ))

    assert isinstance(worker, subprocess.Popen) and worker.wait(WAIT) == 4
    assert launcher.server is not None and "CUDA" in launcher.server.reason


def test_server_learns_the_installed_modules_workers_import(
    tmp_path: Path, launchers: Callable[..., ForkLauncher]
) -> None:
    script = tmp_path / "w.py"
    script.write_text("import time, xml.dom.minidom; time.sleep(120)")
    argv = [sys.executable, str(script)]
    launcher = launchers(argv, ForkServerSettings(preload=(), learn=True, ready_timeout=WAIT))
    worker = launcher.start(argv, dict(os.environ))
    server = launcher.server
    assert isinstance(worker, ForkedProcess) and server is not None

    wait_until(lambda: "xml.dom.minidom" in server.learned, what="the server to import what the worker did")
    assert (
        "w" not in server.learned and "__main__" not in server.learned
    )  # the job's own code is never preloaded


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.slow
def test_forked_workers_do_not_share_unseeded_random_streams(
    tmp_path: Path, launchers: Callable[..., ForkLauncher]
) -> None:
    """torch's and numpy's global generators are reseeded in each child, as in fresh processes; seeding still rules."""
    script = tmp_path / "draw.py"
    script.write_text(
        "import json, random, sys, numpy, torch\n"
        "if sys.argv[1] == 'seeded':\n"
        "    torch.manual_seed(1); numpy.random.seed(1); random.seed(1)\n"
        "print(json.dumps([torch.rand(1).item(), float(numpy.random.rand()), random.random()]))\n"
    )
    launcher = launchers(
        [sys.executable, str(script)],
        ForkServerSettings(preload=("torch", "numpy.random"), learn=False, ready_timeout=300),
    )
    draws: dict[str, list[list[float]]] = {"free": [], "seeded": []}
    for mode, runs in draws.items():
        for i in range(2):
            out = tmp_path / f"{mode}{i}.log"
            with open(out, "wb") as f:
                proc = launcher.start([sys.executable, str(script), mode], dict(os.environ), stdout=f)
                assert isinstance(proc, ForkedProcess) and proc.wait(WAIT) == 0
            runs.append(json.loads(out.read_text()))

    free, seeded = draws["free"], draws["seeded"]
    assert all(a != b for a, b in zip(free[0], free[1], strict=True))
    assert seeded[0] == seeded[1]
