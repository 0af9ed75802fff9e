"""The node-local channel between taskdrun's agent and its live workers."""

from __future__ import annotations

from pathlib import Path

from taskd_pytorch.live._channel import LiveChannel


def test_a_new_channel_is_round_zero_and_nobody_opted_in() -> None:
    channel = LiveChannel.create()
    try:
        assert channel.current_round() == 0
        assert channel.joined(0) is None and not channel.opted_in([0, 1])
    finally:
        channel.remove()
    assert not channel.path.exists()


def test_rounds_and_joins_are_seen_by_the_other_side(tmp_path: Path) -> None:
    agent, worker = LiveChannel(tmp_path), LiveChannel(tmp_path)
    worker.mark_joined(0, 0)
    assert agent.opted_in([0]) and not agent.opted_in([0, 1])
    agent.begin_round(5)
    assert worker.current_round() == 5
    worker.mark_joined(1, 5)
    assert (agent.joined(0), agent.joined(1)) == (0, 5) and agent.opted_in([0, 1])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left behind


def test_reset_forgets_rounds_and_joins_for_a_whole_group_restart(tmp_path: Path) -> None:
    channel = LiveChannel(tmp_path)
    channel.begin_round(3)
    channel.mark_joined(0, 3)
    channel.reset()
    assert channel.current_round() == 0 and channel.joined(0) is None


def test_an_unreadable_file_counts_as_absent(tmp_path: Path) -> None:
    (tmp_path / "round").write_text("garbage")
    (tmp_path / "rank0.joined").write_text("")
    channel = LiveChannel(tmp_path)
    assert channel.current_round() == 0 and channel.joined(0) is None


def test_a_round_a_worker_could_not_join_is_seen_by_the_agent_and_forgotten_by_a_reset(tmp_path: Path) -> None:
    agent, worker = LiveChannel(tmp_path), LiveChannel(tmp_path)
    assert agent.failed(1) is None
    worker.mark_failed(1, 4)
    assert agent.failed(1) == 4 and agent.joined(1) is None
    agent.reset()
    assert agent.failed(1) is None
