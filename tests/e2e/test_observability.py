"""A real recovery under ``taskd run`` as operators see it: /metrics, ``taskd events --follow``, ``taskd timeline``.

The job: 2 plain-Python workers that step until a ``finish`` file appears,
checkpoint every 10 steps and tell their agent where they resumed and how far
they got (:mod:`taskd_core.worker`); rank 1 kills itself (SIGKILL) 5 steps
past a checkpoint once the test drops a ``crash`` file, so the follower is
provably live before the fault happens.
"""

from __future__ import annotations

import json
import os
import queue
import sqlite3
import struct
import subprocess
import sys
import textwrap
import threading
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from taskd_core.testing import free_port

from .harness import DEADLINE, REPO, Cluster, wait_until

WORKER = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    from taskd_core import worker
    out = pathlib.Path(sys.argv[1])
    ckpt = out / f"ckpt-{os.environ['RANK']}"
    step = int(ckpt.read_text()) if ckpt.exists() else 0
    worker.resumed(step)
    end = time.monotonic() + 200
    while time.monotonic() < end and not (out / "finish").exists():
        crash = os.environ["RANK"] == "1" and (out / "crash").exists() and not (out / "crashed").exists()
        if crash and step % 10 == 5:
            (out / "crashed").touch()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)
        step += 1
        worker.step(step)
        if step % 10 == 0:
            tmp = out / f"tmp-{os.environ['RANK']}"  # one per rank: a shared one is replaced away under the other
            tmp.write_text(str(step))
            os.replace(tmp, ckpt)
    """
)


def taskd(*argv: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "taskd_core", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )


def scrape(port: int) -> dict[str, float]:
    """Every sample of the exposition, parsed by prometheus_client's own parser: {'name{k=v,...}': value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def test_recovery_in_metrics_events_and_timeline(
    tmp_path: Path, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The launcher and the readers share the job's token (one-node launches otherwise make up a secret one).
    monkeypatch.setenv("TASKD_JOB_TOKEN", "observability-test-token")
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    metrics_port = free_port()
    address = f"127.0.0.1:{cluster.controller_port}"
    run = cluster.node(0, 1, 2, [sys.executable, str(script), str(out)], "--metrics-port", str(metrics_port))
    follower: subprocess.Popen[str] | None = None
    try:
        wait_until("workers journalled", lambda: cluster.state.exists() and _started(cluster) >= 2, cluster)
        follower = taskd("events", cluster.job_id, "--follow", "--json", "--controller", address, "--interval", "0.1")
        lines: queue.Queue[dict[str, object]] = queue.Queue()
        threading.Thread(target=_pump, args=(follower, lines), daemon=True).start()
        seen: list[dict[str, object]] = []

        def follower_saw(kind: str) -> bool:
            while not lines.empty():
                seen.append(lines.get())
            return any(e["kind"] == kind for e in seen)

        wait_until("the follower prints the journal so far", lambda: follower_saw("worker started"), cluster)
        (out / "crash").touch()
        # The job still runs (its workers wait for `finish`): the follower sees the fault live.
        wait_until("the follower sees the fault", lambda: follower_saw("fault"), cluster)
        wait_until("the follower sees the recovery", lambda: follower_saw("cycle succeeded"), cluster)
        wait_until("rank 1 restarted", lambda: _started(cluster) >= 4, cluster)
        first = seen[0]
        assert first["schema"] == 1 and first["job"] == cluster.job_id and first["seq"] == 1
        assert set(first) == {"schema", "seq", "time", "job", "cycle", "kind", "detail"}
        fault = next(e for e in seen if e["kind"] == "fault")
        assert fault["detail"] == {"agent": "node-0", "pending": False, "ranks": {"1": "1"}}

        # Within one scrape, /metrics says what the journal says.
        journal = cluster.journal()
        kinds = Counter(kind for kind, _ in journal)
        m = scrape(metrics_port)
        assert m["taskd_faults_total{fault_type=normal}"] == 1
        assert m["taskd_recovery_cycles_started_total{}"] == kinds["cycle started"] == 1
        assert m["taskd_recovery_cycles_total{outcome=recovered,strategy=recover}"] == kinds["cycle succeeded"] == 1
        assert m["taskd_recovery_cycle_duration_seconds_count{outcome=recovered}"] == 1
        assert m["taskd_fault_to_strategy_seconds_count{}"] == 1
        assert m["taskd_kill_to_restart_seconds_count{}"] == 1
        assert m["taskd_strategy_decisions_total{strategy=recover}"] == kinds["strategy chosen"]
        assert m["taskd_worker_starts_total{}"] == kinds["worker started"] == 4
        assert m["taskd_worker_exits_total{outcome=failed}"] == 1
        signals = Counter(str(d["type"]) for kind, d in journal if kind == "signal")
        for signal_type, count in signals.items():
            assert m[f"taskd_signals_sent_total{{type={signal_type}}}"] == count
        assert m["taskd_rpc_requests_total{code=0,method=ReportProcessFault}"] == 1
        assert m["taskd_rpc_requests_total{code=0,method=ReportRecoverStatus}"] == 1
        assert m["taskd_jobs{state=idle}"] == 1 and m["taskd_jobs{state=wait-stop}"] == 0
        assert m["taskd_agents_connected{}"] == 1
        assert m["taskd_journal_entries{}"] >= len(journal)
        assert m["process_resident_memory_bytes{}"] > 0
        # Steps lost: per rank, the last step its first worker reached minus the step its second
        # resumed from; the cycle costs the most any rank lost. Rank 1 died 5 steps past a checkpoint
        # (its agent may know a step less: steps within 0.1 s of the last report wait for the next).
        wait_until("the restarted workers resumed", lambda: _count(cluster, "worker resumed") >= 4, cluster)
        journal = cluster.journal()
        lost = {
            rank: _steps(journal, "worker exited", rank)[0] - _steps(journal, "worker resumed", rank)[1]
            for rank in (0, 1)
        }
        assert 0 < lost[1] <= 5, lost
        m = scrape(metrics_port)
        assert m["taskd_steps_lost_total{}"] == max(0, *lost.values())
        assert m["taskd_kill_to_resumed_seconds_count{}"] == 1  # the faulty rank's
        assert m["taskd_kill_to_resumed_seconds_sum{}"] > 0

        # The timeline of the live controller, and of its state file, once the job is over.
        picture = tmp_path / "live.png"
        drawn = taskd("timeline", cluster.job_id, "--controller", address, "--out", str(picture))
        assert drawn.wait(timeout=DEADLINE) == 0, drawn.stderr.read() if drawn.stderr else ""
        width, height = png_size(picture)
        assert width >= 1000 and height >= 400

        (out / "finish").touch()
        assert run.wait() == 0, cluster.diagnostics()
        # The embedded controller ended with its job: the follower ends by itself, exit 0.
        assert follower.wait(timeout=DEADLINE) == 0
        svg = tmp_path / "after.svg"
        drawn = taskd("timeline", cluster.job_id, "--state", str(cluster.state), "--out", str(svg))
        assert drawn.wait(timeout=DEADLINE) == 0
        text = svg.read_text()
        assert text.lstrip().startswith("<?xml") and "rank 0" in text and "rank 1" in text
        assert "resumed after" in text and "cycle 1: recover, recovered" in text and "finished" in text
        assert f"{lost[1]} step{'s' * (lost[1] != 1)} lost" in text
    finally:
        if follower is not None and follower.poll() is None:
            follower.kill()
            follower.wait(timeout=60)


def _started(cluster: Cluster) -> int:
    return _count(cluster, "worker started")


def _count(cluster: Cluster, kind: str) -> int:
    try:
        return sum(1 for k, _ in cluster.journal() if k == kind)
    except sqlite3.Error:  # the state file is being created
        return 0


def _steps(journal: list[tuple[str, dict[str, object]]], kind: str, rank: int) -> list[int]:
    return [int(str(d["step"])) for k, d in journal if k == kind and d["rank"] == rank]


def _pump(proc: subprocess.Popen[str], lines: queue.Queue[dict[str, object]]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put(json.loads(line))


def test_timeline_of_64_ranks(tmp_path: Path, cluster: Cluster) -> None:
    """64 workers (``sh``, cheap), rank 37 SIGKILLs itself once: a legible picture with 64 lanes."""
    flag = tmp_path / "crashed"
    body = f'if [ "$RANK" = 37 ] && [ ! -e {flag} ]; then touch {flag}; sleep 1; kill -9 $$; fi; sleep 4'
    run = cluster.node(0, 1, 64, ["sh", "-c", body])
    assert run.wait() == 0, cluster.diagnostics()
    picture = tmp_path / "64.png"
    drawn = taskd("timeline", cluster.job_id, "--state", str(cluster.state), "--out", str(picture))
    assert drawn.wait(timeout=DEADLINE) == 0, drawn.stderr.read() if drawn.stderr else ""
    width, height = png_size(picture)
    assert width >= 1000 and height >= 64 * 15  # at least 15 pixels per lane
    svg = tmp_path / "64.svg"
    drawn = taskd("timeline", cluster.job_id, "--state", str(cluster.state), "--out", str(svg))
    assert drawn.wait(timeout=DEADLINE) == 0
    text = svg.read_text()
    assert "64 ranks, 1 recovery cycle" in text and "rank 0" in text and "rank 60" in text
    assert text.count("restarted after") == 1
