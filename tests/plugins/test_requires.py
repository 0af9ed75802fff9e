"""An adapter whose framework, or whose distribution, is missing: one line saying what to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from plugin_support import GOOD, make_dist

from taskd_core.errors import FrameworkMissingError, PluginError
from taskd_core.plugins import (
    adapter_distributions,
    adapter_module,
    list_adapters,
    load_adapter,
    require_module,
)

NEEDS_FRAMEWORK = """
from taskd_core.plugins import require_module

class Adapter:
    def __init__(self):
        require_module("needyframe", "no_such_framework_xyz", "Needy (module no_such_framework_xyz)",
                       "pip install needy")
"""


def test_require_module_passes_for_installed_and_names_the_install_command_otherwise() -> None:
    require_module("x", "json", "JSON", "nothing")
    with pytest.raises(FrameworkMissingError) as info:
        require_module("needyframe", "no_such_framework_xyz", "Needy", "pip install needy")
    assert str(info.value) == "Needy is not installed in this environment; install it with: pip install needy"
    # msrun catches ImportError around TaskD's imports; the core's hierarchy still holds.
    assert isinstance(info.value, ImportError) and isinstance(info.value, PluginError)
    assert (info.value.plugin, info.value.install) == ("needyframe", "pip install needy")


def test_adapter_module_names_the_missing_distribution_but_keeps_other_import_errors(dist_path: Path) -> None:
    with pytest.raises(FrameworkMissingError, match=r"\(tdtest-absent\) is not installed.*pip install tdtest-absent$"):
        adapter_module("absent", "tdtest_absent.plugin", "tdtest-absent")
    (dist_path / "tdtest_inner.py").write_text("import no_such_dependency_xyz\n")
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        adapter_module("inner", "tdtest_inner", "tdtest-inner")


def test_adapter_without_its_framework_is_listed_unavailable_and_not_broken(dist_path: Path) -> None:
    make_dist(dist_path, "tdtest_needy", NEEDS_FRAMEWORK, "needyframe = tdtest_needy:Adapter")
    make_dist(dist_path, "tdtest_good", GOOD, "goodframe = tdtest_good:Adapter")
    listed = {a.name: a for a in list_adapters()}
    assert listed["needyframe"].unavailable.endswith("install it with: pip install needy")
    assert listed["needyframe"].error == ""
    assert listed["goodframe"].unavailable == ""
    with pytest.raises(FrameworkMissingError, match="pip install needy"):
        load_adapter("needyframe")
    assert adapter_distributions()["tdtest_needy 1.2.3"] == ("needyframe",)


def test_cli_plugins_and_version_show_it(dist_path: Path) -> None:
    make_dist(dist_path, "tdtest_needy", NEEDS_FRAMEWORK, "needyframe = tdtest_needy:Adapter")
    env_path = f"import sys; sys.path.insert(0, {str(dist_path)!r}); from taskd_core.cli import main; sys.exit(main())"
    listed = subprocess.run([sys.executable, "-c", env_path, "plugins"], capture_output=True, text=True, timeout=60,
                            check=False)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith("needyframe "))
    assert row.split() == ["needyframe", "tdtest_needy", "1.2.3", "UNAVAILABLE"]
    assert ("needyframe (tdtest_needy:Adapter): Needy (module no_such_framework_xyz) is not installed in this "
            "environment; install it with: pip install needy") in listed.stdout
    version = subprocess.run([sys.executable, "-c", env_path, "--version"], capture_output=True, text=True,
                             timeout=60, check=False)
    assert version.returncode == 0, version.stderr
    lines = version.stdout.splitlines()
    assert lines[0].startswith("taskd-core ")
    assert "tdtest_needy 1.2.3 (adapter needyframe)" in lines
    assert "Traceback" not in listed.stderr + version.stderr
