"""bench/run_all.py writes only sentences its data supports: templates for the prose, renderers for the figures.

The sample results in ``tests/bench_samples/`` are the JSON of small real runs of
the benches (``--kills 3``, ``--seconds 2``, ``--faults 4`` ...: shapes, not figures
to publish), or of a full run with its per-trial lists cut short (first_start,
mindspore, failover); section 2's is built here, since even a small recovery run
starts torch under four launchers.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SAMPLES = Path(__file__).resolve().parent / "bench_samples"
HEADINGS = [
    "# TaskD benchmarks",
    "## Machine and versions",
    "## Targets",
    "## 1. Detection: SIGKILL → `ReportProcessFault` at the controller",
    "## 2. Recovery of a SIGKILLed rank: taskdrun against torchrun",
    "## 3. Idle cost of agents and controller",
    "## 4. Cost of TLS and job tokens",
    "## 5. Cost of Prometheus metrics",
    "## 6. Hangs: detection and recovery",
    "## 7. Signals: SIGTERM → launcher gone",
    "## 8. Chaos: faults of the workers and of TaskD itself",
    "## 9. Live recovery: state transfer from a replica",
    "## 10. First start: taskdrun and `taskd run` against torchrun",
    "## 11. MindSpore under real msrun: kill → the rank stepping again, against a cold start",
    "## 12. Controller replicas on etcd: fail-over, cost against SQLite, many agents, chaos",
    "## 13. Slow ranks: steps until a straggler is named, false alarms, cost of measuring",
    "## 14. Memory snapshots of sharded training: step-time cost, steps lost, copy bandwidth",
    "## 15. A whole node lost or hung, a spare waiting (c10d)",
    "## 16. Rank 0's node lost, a spare waiting (etcd)",
    "## 17. Chaos of whole nodes: one job, many node losses in a row, spares restarted",
    "## 18. Shrinking 3 → 2 nodes (`--nnodes=2:3`), no spare waiting (c10d)",
]
#: Words that state an outcome; a template may hold them only inside a block a renderer decides.
OUTCOME_WORDS = re.compile(r"\b(met|missed|faster|slower|yes|NO|exceeded|within noise)\b")


@pytest.fixture
def run_all(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("run_all")


@pytest.fixture
def report(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("_report")


def _summary(value: float) -> dict[str, float]:
    return {"n": 3, "median": value, "p99": value, "min": value * 0.9, "max": value * 1.1}


def recovery_sample(run_all: ModuleType, torchrun_failures: int = 1) -> dict[str, Any]:
    """What ``recovery_bench.py --json`` writes, for 1x2 and 2x2 of the ddp job and every launcher."""
    bench = run_all.recovery_bench
    results: dict[str, Any] = {}
    trials: dict[str, Any] = {}
    for topo in ("1x2 ddp", "2x2 ddp"):
        results[topo], trials[topo] = {}, {}
        for i, name in enumerate(bench.LAUNCHERS):
            scale = 0.1 if name.startswith("taskdrun") else 1.0
            failed = torchrun_failures if name == "torchrun" else 0
            figures = {key: _summary(scale * (1 + i + k)) for k, (key, _) in enumerate(bench.FIGURES)}
            figures["restarts_seen"] = _summary(1.0 if name == "taskdrun-live" else 2.0)
            figures["steps_lost"] = _summary(0.0 if name == "taskdrun-live" else 5.0)
            results[topo][name] = {
                "trials": 3,
                "recovered": 3 - failed,
                "failures": ["failed: timeout"] if failed else [],
                **figures,
            }
            trials[topo][name] = [{"outcome": "recovered", "kill_lag": 0.003}] * 3
    phases = {
        "interpreter_start": _summary(0.03),
        "import_torch_profile": {"total": 2.0, "top": [{"module": "torch._C", "seconds": 0.9}]},
        "concurrent": {n: {key: _summary(0.5) for key, _, _ in bench.PHASES} for n in ("1", "2")},
    }
    return {
        "bench": "recovery",
        "config": {
            "ckpt_every": 10, "kill_step": 15, "kill_rank": -1, "step_time": 0.05, "max_restarts": 3,
            "startup_deadline": 120.0, "recovery_deadline": 30.0, "taskd_flush_seconds": 0.1,
        },
        "launchers": {n: launcher.label for n, launcher in bench.LAUNCHERS.items()},
        "results": results,
        "trials": trials,
        "phases": phases,
        "fork_server": {"window": 20.0, "cpu_percent": 0.0, "vmrss": 298_000, "pss": 123_000},
    }


def samples(run_all: ModuleType) -> dict[str, dict[str, Any]]:
    data = {path.stem: json.loads(path.read_text()) for path in SAMPLES.glob("*.json") if path.stem != "run"}
    data["recovery"] = recovery_sample(run_all)
    return data


def render_all(run_all: ModuleType, data: dict[str, Any]) -> str:
    run = json.loads((SAMPLES / "run.json").read_text())
    return run_all.render([run_all.section(part, data.get(part.step)) for part in run_all.PARTS], run)


def test_the_report_has_every_section_in_order_with_its_tables_and_targets(run_all: ModuleType) -> None:
    text = render_all(run_all, samples(run_all))
    assert [line for line in text.splitlines() if line.startswith("#")] == HEADINGS
    assert "{{" not in text and "This bench failed" not in text
    # Each bench's own table is in its section.
    for table_head in ("| agent | detection | kills |", "| figure (s) |", "| fault | injected | recovered |", "| rate | GB/s |"):
        assert table_head in text
    targets = text.split("## Targets")[1].split("## 1.")[0]
    assert "| idle agent < 1 % of one core |" in targets and "| chaos: 100 % of faults recovered | 4/4 | met |" in targets
    assert targets.strip().splitlines()[-1].startswith("| `run_all.py` under 25 min on 2 cores |")
    # Figures come from the results: the detect sample's medians, the chaos sample's fault count.
    detect = json.loads((SAMPLES / "detect.json").read_text())["results"]
    assert f"The pidfd agent's median is {detect['taskd']['median'] * 1e3:.1f} ms" in text
    assert "through 4 random faults" in text


def test_outcome_words_are_computed_from_the_results(run_all: ModuleType) -> None:
    data = samples(run_all)
    text = render_all(run_all, data)
    assert "**taskdrun recovered every trial: yes** (1x2 ddp: 3/3, 2x2 ddp: 3/3)" in text
    assert "SPEC §9 traces such failures" in text  # torchrun lost a trial in the sample

    data["recovery"] = recovery_sample(run_all, torchrun_failures=0)
    lost = copy.deepcopy(data["recovery"])
    lost["results"]["2x2 ddp"]["taskdrun"]["recovered"] = 2
    data["recovery"] = lost
    text = render_all(run_all, data)
    assert "**taskdrun recovered every trial: NO** (1x2 ddp: 3/3, 2x2 ddp: 2/3)" in text
    assert "| taskdrun recovers every trial (SPEC §9) | 1x2 ddp: 3/3, 2x2 ddp: 2/3 | missed |" in text
    assert "SPEC §9 traces such failures" not in text

    idle = data["idle"]["results"]["launchers"]
    assert "**Target missed**" not in text
    for launcher in idle.values():
        launcher["cpu_percent"] = 1.5
    assert "**Target missed** by 0.50 percentage points" in render_all(run_all, data)


def test_first_start_mindspore_and_failover_verdicts_follow_their_results(run_all: ModuleType) -> None:
    data = samples(run_all)
    text = render_all(run_all, data)
    targets = text.split("## Targets")[1].split("## 1.")[0]
    # The first_start sample: taskdrun's median ratio 0.84, torchrun's init_method from 1 of its 5 trials.
    assert (
        "| first start, taskdrun/torchrun (launch → workers done), median over the cases ≤ 1.1 | 0.84 ("
        in targets
    )
    assert "torchrun's from init_method 1/5 trials) | met |" in targets
    assert "Trials that did not count: init_method/torchrun 4 of 5 (exit code 1, 2 of 2 workers done)" in text
    assert (
        "| kill1 | 2/2 |" in text
        and "| MindSpore fork server idle CPU < 0.1 % of a core | 0.000 % over 20 s | met |" in targets
    )
    assert "| MindSpore: 100 % of kills recovered (every job and mode) | collective / fork 4/4," in targets
    assert "| 64 agents: one node's fault → stopTrain at every agent, p99 ≤ 1 s |" in targets
    assert "fault → changeStrategy on etcd ≤ 2 × SQLite (p50, same run) | 15.32 × " in targets

    slow = copy.deepcopy(data)
    slow["first_start"]["median_ratio"]["taskdrun"]["done"] = 1.3
    for cell in slow["first_start"]["cells"].values():
        cell["failures"] = []
    fork = slow["mindspore"]["runs"]["collective / fork"]
    for trial in fork["kills"]["kill-all"]:
        trial["stepped"] = fork["cold_start"]
    fork["kills"]["kill1"][1]["recovered"] = False
    slow["failover"]["chaos"]["params_equal"] = False
    slow["failover"]["scale"]["followed"] = 63
    text = render_all(run_all, slow)
    assert (
        "| first start, taskdrun/torchrun (launch → workers done), median over the cases ≤ 1.1 | 1.30 ("
        in text
    )
    assert "Trials that did not count" not in text and "Over the cases where every torchrun trial" not in text
    assert (
        "whole-node restart (both ranks killed) ≤ 0.3 × the job's cold start (medians) | collective 1.00 | missed |"
        in text
    )
    assert "| MindSpore: 100 % of kills recovered (every job and mode) | collective / fork 3/4," in text
    assert "parameters DIFFERENT | missed |" in text
    assert "(63/64 followed) | missed |" in text

    slow["failover"]["scale"] = {
        "error": "TimeoutError: the cycle over all agents did not happen within 300s"
    }
    text = render_all(run_all, slow)
    assert "| failover_bench's scale part finishes | TimeoutError: the cycle over all agents" in text
    assert "Parts that did not finish (their targets have no figure in this run): scale: TimeoutError" in text
    assert "*Scale*" not in text


def test_rank0_verdict_and_leader_note_follow_its_results(run_all: ModuleType) -> None:
    data = samples(run_all)
    rank0 = data["rank0"]
    results, trials = rank0["results"], rank0["trials"]
    taskd, peer = results["taskdrun"]["median"], results["torchrun"]["median"]
    verdict = "met" if taskd <= 3.0 and taskd / peer <= 0.1 else "missed"
    row = "| rank 0's node lost (etcd), a spare waiting: kill → every rank stepping ≤ 0.1 × torchrun and ≤ 3 s |"
    assert f"{row} {taskd:.2f} s, {taskd / peer:.3f} × torchrun | {verdict} |" in render_all(run_all, data)

    # Three taskdrun trials, the lost node leading the controller in two: 4.29 s and 4.74 s, else 1.38 s.
    slow = copy.deepcopy(data)
    template = trials["taskdrun"][0]
    slow["rank0"]["trials"]["taskdrun"] = [
        {**template, "recovered": True, "all_stepped": t, "victim_led": led}
        for t, led in ((4.29, True), (1.38, False), (4.74, True))
    ]
    slow["rank0"]["results"]["taskdrun"] = {**results["taskdrun"], "median": 4.29}
    slow["rank0"]["results"]["torchrun"] = {**results["torchrun"], "median": 22.80}
    text = render_all(run_all, slow)
    assert f"{row} 4.29 s, 0.188 × torchrun | missed |" in text
    assert "leading controller replica in 2 of 3 trial(s) (4.29, 4.74 s)" in text
    assert "In the other trial(s) (1.38 s)" in text
    slow["rank0"]["results"]["taskdrun"]["median"] = 1.38
    assert f"{row} 1.38 s, 0.061 × torchrun | met |" in render_all(run_all, slow)
    # A run whose lost node never led says nothing about the leader's case.
    for t in slow["rank0"]["trials"]["taskdrun"]:
        t["victim_led"] = False
    assert "leading controller replica in" not in render_all(run_all, slow)
    # --victim follower: the node lost is named for what it is.
    slow["rank0"]["trial"]["victim"] = "follower"
    text = render_all(run_all, slow)
    assert "every process of the node whose controller replica does not lead (torchrun: rank 0's node)" in text
    assert "| a standby replica's node lost (etcd), a spare waiting:" in text


def test_slowrank_replace_verdicts_follow_each_scripts_trials(run_all: ModuleType) -> None:
    data = samples(run_all)

    def row(data: dict[str, Any], script: str) -> str:
        start = f"| replace + a spare ({script}): from the slowdown"
        return next(line for line in render_all(run_all, data).splitlines() if line.startswith(start))

    for script in ("train_ddp.py", "train_live.py"):
        trials = [t for t in data["slowrank"]["replace"] if t["script"] == script]
        assert len(trials) > 1, "the sample has several replace trials of each script, and so a median row"
        steps = statistics.median(t["steps_to_drain"] for t in trials)
        assert f"| {script}, p50 of {len(trials)} | {steps:.0f} |" in render_all(run_all, data)
        assert row(data, script).endswith(f"| {'met' if steps <= 20 else 'missed'} |")
        assert f"{steps:.0f} steps to the drain" in row(data, script)
        # One trial that never got its pace back misses the target, whatever the medians say.
        stuck = copy.deepcopy(data)
        next(t for t in stuck["slowrank"]["replace"] if t["script"] == script).update(drain_to_healthy=None)
        assert row(stuck, script).endswith("| missed |") and "1 never back to pace" in row(stuck, script)
        late = copy.deepcopy(data)
        for t in late["slowrank"]["replace"]:
            t["steps_to_drain"] = 21
        assert row(late, script).endswith("| missed |")
    # With LiveSession a step lost misses the target; with a checkpoint restart it is only shown.
    lossy = copy.deepcopy(data)
    for t in lossy["slowrank"]["replace"]:
        t["steps_lost"] = 3
    assert row(lossy, "train_live.py").endswith("| missed |") and "steps lost 3, 3" in row(lossy, "train_live.py")
    assert row(lossy, "train_ddp.py").split("|")[-2] == row(data, "train_ddp.py").split("|")[-2]


def test_templates_state_no_outcome_outside_the_blocks_renderers_decide(report: ModuleType) -> None:
    for path in sorted(report.TEMPLATES.glob("*.md")):
        fixed = re.sub(r"\{\{#(\w+)\}\}.*?\{\{/\1\}\}", "", path.read_text(), flags=re.S)
        assert not OUTCOME_WORDS.findall(re.sub(r"\{\{\w+\}\}", "", fixed)), path.name


def test_a_field_with_no_value_fails_loudly(run_all: ModuleType, report: ModuleType) -> None:
    fields, _ = run_all.detect_fields(json.loads((SAMPLES / "detect.json").read_text()))
    assert report.fill("detect", fields).startswith("## 1. Detection")
    missing = {k: v for k, v in fields.items() if k != "taskd_p50"}
    with pytest.raises(report.TemplateError, match="template detect: field 'taskd_p50' has no value"):
        report.fill("detect", missing)
    with pytest.raises(report.TemplateError, match="field 'kills' has no value"):
        report.fill("detect", {**fields, "kills": None})
    with pytest.raises(report.TemplateError, match=r"fields \['stale'\] are given but the template names none"):
        report.fill("detect", {**fields, "stale": "1 ms"})


def test_blocks_take_flags_and_fields_take_text(report: ModuleType) -> None:
    text = "a{{#shown}} b {{x}}{{/shown}} c {{y}}"
    assert report.fill("t", {"shown": True, "x": "1", "y": "2"}, text) == "a b 1 c 2\n"
    assert report.fill("t", {"shown": False, "y": "2"}, text) == "a c 2\n"
    with pytest.raises(report.TemplateError, match="block 'shown' needs a true/false field"):
        report.fill("t", {"shown": "yes", "x": "1", "y": "2"}, text)
    with pytest.raises(report.TemplateError, match="field 'y' is a flag"):
        report.fill("t", {"shown": False, "y": True}, text)
    with pytest.raises(report.TemplateError, match="unclosed"):
        report.fill("t", {"x": "1"}, "{{#open}} {{x}}")


def test_a_bench_without_results_gets_its_heading_and_a_note(run_all: ModuleType) -> None:
    text, rows = run_all.section(run_all.PARTS[1], None)
    assert text == "## 2. Recovery of a SIGKILLed rank: taskdrun against torchrun\n\nThis bench failed in this run; see its log.\n"
    assert rows == []


def test_render_only_writes_the_report_from_kept_results(run_all: ModuleType, tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(SAMPLES, results)
    (results / "recovery.json").write_text(json.dumps(recovery_sample(run_all)))
    out = tmp_path / "benchmarks.md"
    done = subprocess.run(
        [sys.executable, str(BENCH / "run_all.py"), "--render-only", "--results", str(results), "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert out.read_text() == render_all(run_all, samples(run_all))


def test_a_quiet_machine_gets_no_claim_about_other_work(run_all: ModuleType) -> None:
    note = run_all.load_note(2, [[0.5, 0.6, 0.7], [1.2, 0.9, 0.8]], "at the start 0.50 / 0.60 / 0.70")
    assert note.startswith("**Load.** The machine has 2 cores; load average over 1 / 5 / 15 min at the start")
    assert "exceeded" not in note and "shared" not in note


def test_a_load_above_the_cores_is_reported_with_its_figure(run_all: ModuleType) -> None:
    note = run_all.load_note(2, [[0.5, 0.6, 0.7], [3.25, 2.0, 1.0]], "…")
    assert "It exceeded the core count (3.25 > 2)" in note


def test_no_fixed_sentence_about_who_shared_the_machine(run_all: ModuleType) -> None:
    for source in (Path(run_all.__file__), *sorted((BENCH / "templates").glob("*.md"))):
        text = source.read_text(encoding="utf-8")
        assert "shared with other" not in text and "this shared machine" not in text, source
