"""``taskd timeline``: what the picture is built from, and the errors a user can run into."""

from __future__ import annotations

from pathlib import Path

import pytest

from taskd_core.cli import main
from taskd_core.cli.recovery_view import PHASES, build
from taskd_core.models import JournalEvent

T0 = 1_000.0


def journal() -> list[JournalEvent]:
    """A recorded recovery of 2 ranks: rank 1 killed at +2.0 after 23 steps, restarted by `recover`,
    resumed from step 20 at +3.0, its first step done at +3.4."""
    rows: list[tuple[float, int, str, dict[str, object]]] = [
        (0.00, 0, "job initialised", {"role": "taskd agent"}),
        (0.01, 0, "worker started", {"rank": 0, "local_rank": 0, "pid": 10, "at": T0 + 0.01}),
        (0.01, 0, "worker started", {"rank": 1, "local_rank": 1, "pid": 11, "at": T0 + 0.01}),
        (2.01, 0, "fault", {"agent": "node-0", "pending": False, "ranks": {"1": "1"}}),
        (2.02, 0, "worker exited", {"rank": 1, "local_rank": 1, "pid": 11, "at": T0 + 2.0, "exit_code": -9,
                                    "step": 23}),
        (2.11, 1, "cycle started", {"faults": {"1": "1"}, "members": ["node-0"], "uuid": "u"}),
        (2.11, 1, "signal", {"type": "stopTrain", "strategy": ""}),
        (2.15, 1, "transition", {"source": "wait-stop", "target": "wait-strategies"}),
        (2.15, 1, "signal", {"type": "globalFault", "strategy": ""}),
        (2.20, 1, "strategy chosen", {"strategy": "recover", "after": "", "reported": ["recover"]}),
        (2.20, 1, "signal", {"type": "changeStrategy", "strategy": "recover"}),
        (2.60, 1, "cycle succeeded", {"strategy": "recover", "uuid": "u"}),
        (2.61, 1, "worker exited", {"rank": 0, "local_rank": 0, "pid": 10, "at": T0 + 2.25}),
        (2.61, 1, "worker started", {"rank": 0, "local_rank": 0, "pid": 20, "at": T0 + 2.5}),
        (2.61, 1, "worker started", {"rank": 1, "local_rank": 1, "pid": 21, "at": T0 + 2.5}),
        (3.01, 1, "worker resumed", {"rank": 1, "local_rank": 1, "pid": 21, "at": T0 + 3.0, "step": 20}),
        (3.41, 1, "worker stepping", {"rank": 1, "local_rank": 1, "pid": 21, "at": T0 + 3.4, "step": 21}),
        (9.00, 1, "job finished", {"agents": ["node-0"]}),
    ]
    return [JournalEvent(i + 1, T0 + t, "j", c, kind, d) for i, (t, c, kind, d) in enumerate(rows)]


def test_the_view_has_incarnations_faults_phases_and_time_lost():
    view = build("j", journal())
    assert view.ranks == (0, 1) and view.outcome == "finished" and view.duration == pytest.approx(9.0)
    assert [(r.rank, r.pid, r.end is None) for r in view.incarnations] == [
        (0, 10, False), (0, 20, True), (1, 11, False), (1, 21, True)
    ]
    (fault,) = view.faults
    assert (fault.rank, fault.exit_code) == (1, -9)
    assert fault.time == pytest.approx(2.0) and fault.lost == pytest.approx(1.0)  # resumed, not just restarted
    assert (fault.back, fault.steps_lost, fault.stepping) == ("resumed", 3, pytest.approx(1.4))
    assert [p.name for p in view.phases] == list(PHASES)
    bounds = [t for p in view.phases for t in (p.start, p.end)]
    assert bounds == pytest.approx(
        [2.0, 2.01, 2.01, 2.15, 2.15, 2.20, 2.20, 2.60, 2.60, 3.0, 3.0, 3.4]
    )
    (cycle,) = view.cycles
    assert (cycle.strategy, cycle.outcome) == ("recover", "recovered")
    assert [s.signal_type for s in view.signals] == ["stopTrain", "globalFault", "changeStrategy"]


def test_an_empty_journal_is_an_empty_view():
    assert build("j", []).ranks == ()


@pytest.mark.parametrize(("name", "message"), [("t.jpg", "must end in .png or .svg"), ("no/dir/t.png", "does not exist")])
def test_a_bad_out_file_is_refused_before_anything_is_read(tmp_path, caplog, name, message):
    assert main(["timeline", "j", "--controller", "127.0.0.1:1", "--out", str(tmp_path / name)]) == 2
    assert message in caplog.records[-1].getMessage()


def test_an_unknown_job_or_one_without_worker_events_exits_2(controller, make_agent, tmp_path, caplog):
    out = tmp_path / "t.png"
    assert main(["timeline", "nobody", "--controller", controller.address, "--out", str(out)]) == 2
    assert "not known" in caplog.records[-1].getMessage()
    make_agent(controller.address, "legacy", "node-0").join()  # a raw agent reports no worker events
    assert main(["timeline", "legacy", "--controller", controller.address, "--out", str(out)]) == 2
    assert "no worker events" in caplog.records[-1].getMessage()
    assert not out.exists()


def test_without_matplotlib_the_command_says_how_to_get_it(monkeypatch, tmp_path, caplog):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
        if name.split(".")[0] == "matplotlib":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    from taskd_core.cli.timeline import draw

    with pytest.raises(Exception, match=r"pip install 'taskd-core\[timeline\]'"):
        draw(build("j", journal()), tmp_path / "t.svg")


def test_a_picture_of_the_recorded_recovery(tmp_path: Path):
    from taskd_core.cli.timeline import draw

    out = tmp_path / "t.svg"
    draw(build("j", journal()), out)
    text = out.read_text()
    assert "rank 0" in text and "rank 1" in text and "pid 21" in text
    assert "fault (exit -9, resumed after 1.00 s, 3 steps lost)" in text
    assert "cycle 1: recover, recovered in 0.59 s" in text


def test_a_slow_rank_is_marked_on_its_lane(tmp_path: Path):
    from taskd_core.cli.timeline import draw

    # A slow node: both its ranks in one event, each marked on its own lane.
    evidence = [{"rank": 0, "pid": 20, "ratio": 1.9}, {"rank": 1, "pid": 21, "ratio": 2.04}]
    found = {"ranks": [0, 1], "step": 57, "evidence": evidence}
    events = [*journal()[:-1], JournalEvent(99, T0 + 6.0, "j", 1, "slow-rank", found), journal()[-1]]
    view = build("j", events)
    assert [(m.rank, m.step, m.ratio) for m in view.slow] == [(0, 57, 1.9), (1, 57, 2.04)]
    assert view.slow[1].time == pytest.approx(6.0)
    out = tmp_path / "t.svg"
    draw(view, out)
    assert "slow (2.0x its peers' work, step 57)" in out.read_text()
