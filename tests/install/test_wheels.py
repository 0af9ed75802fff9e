"""The three distributions as users get them: built, checked as an index would, installed without torch or MindSpore.

Everything here builds wheels or virtualenvs (tens of seconds), so it is all
``slow``; the builds and environments are shared by the whole session.
"""

from __future__ import annotations

import sys
import sysconfig
import tomllib
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from install_support import PROJECTS, ROOT, FreshVenv, checked, run

from taskd_core.testing import free_port

pytestmark = pytest.mark.slow

TORCH_HINT = "pip install 'taskd-pytorch[framework]'"
MINDSPORE_HINT = "pip install 'taskd-mindspore[framework]'"


def _version(project: Path) -> str:
    return str(tomllib.loads((project / "pyproject.toml").read_text())["project"]["version"])


def _wheel(dist: Path, name: str) -> zipfile.ZipFile:
    (path,) = dist.glob(f"{name.replace('-', '_')}-{_version(PROJECTS[name])}-*.whl")
    return zipfile.ZipFile(path)


def test_sdists_and_wheels_pass_twine_check(dist: Path) -> None:
    checked([sys.executable, "-m", "twine", "check", "--strict", *map(str, sorted(dist.iterdir()))])


@pytest.mark.parametrize("name", sorted(PROJECTS))
def test_wheel_passes_check_wheel_contents(dist: Path, name: str) -> None:
    (wheel,) = dist.glob(f"{name.replace('-', '_')}-*.whl")
    # Run in the project's directory: its [tool.check-wheel-contents] names the expected top-level packages.
    checked([sys.executable, "-m", "check_wheel_contents", str(wheel)], cwd=PROJECTS[name])


def test_core_wheel_carries_stubs_proto_types_and_entry_points(dist: Path) -> None:
    with _wheel(dist, "taskd-core") as whl:
        names = set(whl.namelist())
        assert whl.read("taskd_core/rpc/_gen/recover.proto") == (ROOT / "proto/recover.proto").read_bytes()
        entry_points = whl.read(f"taskd_core-{_version(ROOT)}.dist-info/entry_points.txt").decode()
    assert {"taskd_core/py.typed", "taskd_core/rpc/_gen/recover_pb2.py", "taskd_core/rpc/_gen/recover_pb2.pyi",
            "taskd_core/rpc/_gen/recover_pb2_grpc.py"} <= names
    # The seed document's paths, msrun's two among them, ship with the core.
    assert {"taskd/api/taskd_agent_api.py", "taskd/python/framework/agent/ms_mgr/msrun_plugin.py",
            "taskd/python/toolkit/recover_module/recover_manager.py",
            "taskd/python/toolkit/recover_module/pb/recover_pb2.py"} <= names
    assert "taskd = taskd_core.cli:main" in entry_points
    assert "process = taskd_core.launcher.process_adapter:ProcessAdapter" in entry_points


@pytest.mark.parametrize(
    ("name", "package", "lines"),
    [
        ("taskd-pytorch", "taskd_pytorch", ["taskdrun = taskd_pytorch._entry:console_main", "pytorch = taskd_pytorch.adapter:PytorchAdapter"]),
        ("taskd-mindspore", "taskd_mindspore", ["mindspore = taskd_mindspore.adapter:MSRunAdapter"]),
    ],
)
def test_adapter_wheel_carries_types_entry_points_and_the_plain_core_requirement(
    dist: Path, name: str, package: str, lines: list[str]
) -> None:
    version = _version(PROJECTS[name])
    with _wheel(dist, name) as whl:
        assert f"{package}/py.typed" in whl.namelist()
        assert not [n for n in whl.namelist() if n.startswith("taskd/")]
        entry_points = whl.read(f"{package}-{version}.dist-info/entry_points.txt").decode()
        meta = whl.read(f"{package}-{version}.dist-info/METADATA").decode()
    for line in lines:
        assert line in entry_points
    # Built from the sdist, outside the checkout: no file:// reference leaks into a published wheel.
    assert "Requires-Dist: taskd-core>=0.1.0\n" in meta
    assert "file:" not in meta


@pytest.fixture(scope="module")
def from_wheels(fresh_venv: Callable[..., FreshVenv], dist: Path) -> FreshVenv:
    return fresh_venv("from-wheels", "taskd-pytorch", "taskd-mindspore", find_links=(dist,))


def test_version_names_the_core_and_every_installed_adapter(from_wheels: FreshVenv) -> None:
    done = from_wheels.run("taskd", "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"taskd-core {_version(ROOT)}",
        f"taskd-mindspore {_version(PROJECTS['taskd-mindspore'])} (adapter mindspore)",
        f"taskd-pytorch {_version(PROJECTS['taskd-pytorch'])} (adapter pytorch)",
    ]


def test_plugins_lists_adapters_without_their_framework_as_unavailable(from_wheels: FreshVenv) -> None:
    done = from_wheels.run("taskd", "plugins")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split()[-1] for line in done.stdout.splitlines()[1:4]}
    assert rows["mindspore"] == rows["pytorch"] == "UNAVAILABLE"
    assert "recover" in rows["process"].split(",")
    assert f"pytorch (taskd_pytorch.adapter:PytorchAdapter): PyTorch (module torch) is not installed in this environment; install it with: {TORCH_HINT}" in done.stdout
    assert MINDSPORE_HINT in done.stdout
    assert "Traceback" not in done.stdout + done.stderr


@pytest.mark.parametrize("argv", [["--help"], ["--nproc-per-node=2", "train.py"]])
def test_taskdrun_without_torch_says_how_to_install_it_in_one_line(from_wheels: FreshVenv, argv: list[str]) -> None:
    done = from_wheels.run("taskdrun", *argv)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"taskdrun: PyTorch (module torch) is not installed in this environment; install it with: {TORCH_HINT}"
    ]


def test_taskd_run_works_from_the_wheels(from_wheels: FreshVenv, tmp_path: Path) -> None:
    worker = f"import os; open(os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK']), 'w').close()"
    done = from_wheels.run("taskd", "run", "--nproc", "2", "--", "python", "-c", worker)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


def test_msrun_import_paths_and_packaged_proto_work_without_mindspore(from_wheels: FreshVenv) -> None:
    done = from_wheels.python(
        "from importlib.resources import files\n"
        "from taskd.api.taskd_agent_api import init_taskd_agent\n"
        "from taskd.python.framework.agent.ms_mgr.msrun_plugin import MSRunPlugin\n"
        "from taskd.python.toolkit.recover_module.recover_manager import DLRecoverManager\n"
        "print(MSRunPlugin.__module__, callable(init_taskd_agent), DLRecoverManager.__name__)\n"
        "print(files('taskd_core.rpc._gen').joinpath('recover.proto').read_text().splitlines()[0])\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "taskd_mindspore.plugin True DLRecoverManager",
        (ROOT / "proto/recover.proto").read_text().splitlines()[0],
    ]


@pytest.fixture(scope="module")
def from_checkout(fresh_venv: Callable[..., FreshVenv], checkout: Path) -> FreshVenv:
    # Exactly the README's command from a checkout: the adapter alone, the core found in the checkout.
    return fresh_venv("from-checkout", str(checkout / "plugins/pytorch"))


def test_adapter_alone_installs_from_a_checkout_with_the_core(from_checkout: FreshVenv) -> None:
    done = from_checkout.run("taskd", "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"taskd-core {_version(ROOT)}", f"taskd-pytorch {_version(ROOT)} (adapter pytorch)"]


def test_msrun_paths_without_the_mindspore_adapter_name_the_install_command(from_checkout: FreshVenv) -> None:
    for path in ("taskd.api.taskd_agent_api", "taskd.python.framework.agent.ms_mgr.msrun_plugin"):
        # msrun catches ImportError around these imports and logs the message.
        done = from_checkout.python(f"try:\n    import {path}\nexcept ImportError as exc:\n    print(exc)\n")
        assert done.returncode == 0, done.stderr
        assert done.stdout == (
            "the TaskD mindspore adapter (taskd-mindspore) is not installed in this environment; "
            "install it with: pip install taskd-mindspore\n"
        )


def test_real_msrun_with_fault_tolerance_and_only_the_core_says_what_to_install(
    fresh_venv: Callable[..., FreshVenv], dist: Path, tmp_path: Path
) -> None:
    """msrun (MindSpore 2.10, from this environment) beside taskd-core alone: it logs the install command and runs on."""
    core = fresh_venv("core-with-mindspore", "taskd-core", find_links=(dist,))
    # MindSpore comes from this environment's site-packages; its .pth files (the editable
    # taskd-mindspore among them) are not processed there, so the adapter stays absent.
    (site,) = core.path.glob("lib/python*/site-packages")
    (site / "mindspore_from_test_env.pth").write_text(str(Path(sysconfig.get_paths()["purelib"])) + "\n")
    assert "No module named 'taskd_mindspore'" in core.python("import taskd_mindspore").stderr
    (tmp_path / "train.py").write_text("print('worker ran')\n")
    env = {**core.env, "MS_ENABLE_TFT": "{ARF:1}"}
    msrun = "import sys; from mindspore.parallel.cluster.run import main; sys.argv[0] = 'msrun'; sys.exit(main())"
    done = run([str(core.bin / "python"), "-c", msrun, "--worker_num=1", "--local_worker_num=1",
                f"--master_port={free_port()}", "--join=True", f"--log_dir={tmp_path / 'logs'}", "train.py"],
               cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    said = done.stdout + done.stderr
    assert ("Import task agent: the TaskD mindspore adapter (taskd-mindspore) is not installed in this "
            "environment; install it with: pip install taskd-mindspore") in said
    assert "Traceback" not in said
    assert "worker ran" in (tmp_path / "logs/worker_0.log").read_text()
