"""``taskd run`` refuses bad input with exit code 2; ``taskd plugins`` lists adapters, broken ones included."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from taskd_core.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "0", "--", "true"], "argument --nproc/--nproc-per-node: must be at least 1, not 0"),
        (["--nnodes", "0", "--", "true"], "argument --nnodes: must be at least 1"),
        (["--node-rank", "-1", "--", "true"], "argument --node-rank: must not be negative"),
        (["--controller", "nohost", "--", "true"], "is not HOST:PORT"),
        (["--controller", "host:99999", "--", "true"], "not a TCP port"),
        (["--controller", "bad host!:80", "--", "true"], "neither an IP address nor a host name"),
        (["--dump-signal", "SIGNOPE", "--", "true"], "unknown signal 'SIGNOPE'"),
        (["--stop-timeout", "-1", "--", "true"], "must be a finite number of seconds"),
    ],
)
def test_run_rejects_bad_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Malformed single values are argparse errors: usage, the reason, exit 2."""
    with pytest.raises(SystemExit) as excinfo:
        main(["run", *argv])
    assert excinfo.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no command to launch"),
        (["--"], "no command to launch"),
        (["--nnodes", "2", "--node-rank", "2", "--", "true"], "node rank 2 is outside 0..1"),
        (["--master-addr", "not a host", "--", "true"], "master address"),
        (["--master-port", "0", "--", "true"], "master port: 0 is not a TCP port"),
        (["--strategies", "recover,teleport", "--", "true"], "teleport"),
        (["--nnodes", "2", "--node-rank", "1", "--controller-port", "0", "--", "true"], "controller port"),
    ],
)
def test_run_rejects_inconsistent_input(argv: list[str], message: str, caplog: pytest.LogCaptureFixture) -> None:
    """Combinations that cannot work end with a clear logged message and exit 2, before any worker starts."""
    assert main(["run", *argv]) == 2
    assert message in caplog.text


def test_dump_signal_accepts_names_and_numbers() -> None:
    parser = build_parser()
    for text in ("USR2", "sigusr2", "SIGUSR2", "12"):
        assert parser.parse_args(["run", "--dump-signal", text, "--", "x"]).dump_signal.name == "SIGUSR2"


BROKEN = "import a_module_that_does_not_exist\n"
GOOD = textwrap.dedent(
    """
    from taskd_core.launcher.process_adapter import ProcessAdapter as Adapter
    """
)


def lay_out_dist(root: Path, name: str, source: str, entry: str) -> None:
    """An unpacked distribution: a module plus ``<name>.dist-info`` with METADATA and entry_points.txt."""
    (root / f"{name}.py").write_text(source)
    info = root / f"{name}-0.4.2.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.4.2\n")
    info.joinpath("entry_points.txt").write_text(f"[taskd]\n{entry}\n")


def test_plugins_lists_adapters_and_broken_ones(tmp_path: Path) -> None:
    """`python -m taskd_core plugins` shows each adapter's distribution and strategies, and why a broken one failed."""
    lay_out_dist(tmp_path, "tdcli_good", GOOD, "goodframe = tdcli_good:Adapter")
    lay_out_dist(tmp_path, "tdcli_broken", BROKEN, "brokenframe = tdcli_broken:Adapter")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    result = subprocess.run(
        [sys.executable, "-m", "taskd_core", "plugins"], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.split() == ["goodframe", "tdcli_good", "0.4.2", "recover,dump,exit"] for line in lines)
    assert any(line.split() == ["brokenframe", "tdcli_broken", "0.4.2", "BROKEN"] for line in lines)
    assert "No module named 'a_module_that_does_not_exist'" in result.stdout


def test_plugins_lists_builtin_process_adapter(capsys: pytest.CaptureFixture[str]) -> None:
    """With taskd-core installed, its built-in `process` adapter is listed with its version."""
    try:
        version = metadata.version("taskd-core")
    except metadata.PackageNotFoundError:
        pytest.skip("taskd-core is not installed in this environment (run scripts/env.sh)")
    assert main(["plugins"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["process", "taskd-core", version, "recover,dump,exit"] in rows
