"""Loading adapters by name: isolation, clear errors, the typed facade."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from plugin_support import GOOD, make_dist

from taskd_core.errors import AdapterNotFoundError, PluginLoadError, WorkerControlError
from taskd_core.plugins import hookimpl, list_adapters, load_adapter


def test_adapter_from_a_real_entry_point(dist_path: Path) -> None:
    """A class entry point is instantiated and its hooks answer through the facade."""
    make_dist(dist_path, "tdtest_good", GOOD, "goodframe = tdtest_good:Adapter")
    adapter = load_adapter("goodframe")
    assert [s.value for s in adapter.strategies()] == ["recover", "exit"]
    assert adapter.monitor()[0].global_rank == 4
    listed = {a.name: a for a in list_adapters()}
    assert listed["goodframe"].distribution == "tdtest_good 1.2.3"
    assert listed["goodframe"].strategies == ("recover", "exit")


def test_missing_adapter_names_what_is_installed(dist_path: Path) -> None:
    make_dist(dist_path, "tdtest_other", GOOD, "otherframe = tdtest_other:Adapter")
    with pytest.raises(AdapterNotFoundError, match="'nosuchframe'.*otherframe") as info:
        load_adapter("nosuchframe")
    assert info.value.plugin == "nosuchframe"


def test_broken_import_names_plugin_distribution_and_cause(dist_path: Path) -> None:
    make_dist(dist_path, "tdtest_broken", "import no_such_module_xyz\n", "brokenframe = tdtest_broken:Adapter")
    make_dist(dist_path, "tdtest_fine", GOOD, "fineframe = tdtest_fine:Adapter")
    with pytest.raises(PluginLoadError, match="'brokenframe'.*tdtest_broken 1.2.3.*no_such_module_xyz"):
        load_adapter("brokenframe")
    # One broken distribution does not hide the others.
    listed = {a.name: a for a in list_adapters()}
    assert "no_such_module_xyz" in listed["brokenframe"].error
    assert listed["fineframe"].error == ""


def test_hookimpl_with_unknown_argument_is_a_load_error() -> None:
    class Wrong:
        @hookimpl
        def taskd_stop_workers(self, ranks: Sequence[int], timeout: float) -> bool:
            return True

    with pytest.raises(PluginLoadError, match="ranks"):
        load_adapter("wrong", instance=Wrong())


def test_hook_failure_becomes_worker_control_error() -> None:
    class Failing:
        @hookimpl
        def taskd_restart_list(self, local_ranks: Sequence[int]) -> bool:
            raise OSError("no such command")

    adapter = load_adapter("failing", instance=Failing())
    with pytest.raises(WorkerControlError, match=r"'failing' could not restart workers for local ranks \[1\]: OSError"):
        adapter.restart_list([1])
    with pytest.raises(WorkerControlError, match="no implementation of taskd_restart_all"):
        adapter.restart_all()


def test_monitor_result_is_checked() -> None:
    class BadMonitor:
        @hookimpl
        def taskd_monitor(self) -> Mapping[int, object]:
            return {0: {"pid": 1, "status": None}}

    with pytest.raises(WorkerControlError, match="WorkerStatus"):
        load_adapter("bad", instance=BadMonitor()).monitor()


def test_builtin_process_adapter_is_listed() -> None:
    names = {a.name for a in list_adapters()}
    assert "process" in names
