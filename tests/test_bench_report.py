"""bench/run_all.py writes only sentences its data supports."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def run_all(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("run_all")


def test_a_quiet_machine_gets_no_claim_about_other_work(run_all: ModuleType) -> None:
    note = run_all.load_note(2, [[0.5, 0.6, 0.7], [1.2, 0.9, 0.8]], "at the start 0.50 / 0.60 / 0.70")
    assert note.startswith("**Load.** The machine has 2 cores; load average over 1 / 5 / 15 min at the start")
    assert "exceeded" not in note and "shared" not in note


def test_a_load_above_the_cores_is_reported_with_its_figure(run_all: ModuleType) -> None:
    note = run_all.load_note(2, [[0.5, 0.6, 0.7], [3.25, 2.0, 1.0]], "…")
    assert "It exceeded the core count (3.25 > 2)" in note


def test_no_fixed_sentence_about_who_shared_the_machine(run_all: ModuleType) -> None:
    source = Path(run_all.__file__).read_text(encoding="utf-8")
    assert "shared with other" not in source and "this shared machine" not in source
