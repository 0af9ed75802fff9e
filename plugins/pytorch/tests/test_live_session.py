"""The live session's waiting on DDP's collectives (``_RoundWatch``), with collectives that finish when told."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch

from taskd_core.errors import ConfigError
from taskd_pytorch.live import LiveSession
from taskd_pytorch.live._session import PeerLost, _peer_failure, _RoundWatch

DEADLINE = 10.0


class FakeWork:
    """A collective that completes (or fails) when the test says so, as ``dist.Work`` reports it."""

    def __init__(self, *, completes_as_the_slice_ends: bool = False) -> None:
        self._done = threading.Event()
        self._error: Exception | None = None
        self._late = completes_as_the_slice_ends

    def finish(self, error: Exception | None = None) -> None:
        self._error = error
        self._done.set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is not None and not self._done.wait(timeout.total_seconds()):
            if self._late:
                self._done.set()  # completes between the timeout and the caller's next look
            raise RuntimeError("Operation timed out!")
        self._done.wait(DEADLINE)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()


class Rounds:
    def __init__(self) -> None:
        self.announced: int | None = None

    def __call__(self) -> int | None:
        return self.announced


@pytest.fixture
def rounds() -> Rounds:
    return Rounds()


@pytest.fixture
def watch(rounds: Rounds) -> Iterator[_RoundWatch]:
    watch = _RoundWatch(rounds, timedelta(seconds=60))
    yield watch
    watch.close()


def outcome(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    return future.wait()


def test_a_finished_collective_completes_ddps_future_with_the_bucket(watch: _RoundWatch) -> None:
    work, bucket = FakeWork(), torch.ones(3)
    future = watch.watch(work, bucket, rank=1)  # type: ignore[arg-type]
    assert not future.done()

    work.finish()

    assert outcome(future) is bucket
    assert watch.abandon("leaving") == []


def test_a_collective_that_completes_as_a_slice_runs_out_is_not_taken_for_a_timeout(
    watch: _RoundWatch,
) -> None:
    work, bucket = FakeWork(completes_as_the_slice_ends=True), torch.ones(2)

    future = watch.watch(work, bucket, rank=0)  # type: ignore[arg-type]

    assert outcome(future) is bucket


def test_a_failed_collective_fails_ddps_future_with_its_own_error(watch: _RoundWatch) -> None:
    work = FakeWork()
    future = watch.watch(work, torch.ones(1), rank=2)  # type: ignore[arg-type]

    work.finish(RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer"))

    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        outcome(future)


def test_a_new_round_fails_every_pending_collective_and_they_count_as_left(
    watch: _RoundWatch, rounds: Rounds
) -> None:
    first, second = FakeWork(), FakeWork()
    futures = [watch.watch(w, torch.ones(1), rank=1) for w in (first, second)]  # type: ignore[arg-type]

    rounds.announced = 4

    for future in futures:
        with pytest.raises(PeerLost, match="round 4 was announced") as caught:
            outcome(future)
        # DDP hands the failure to backward() as a RuntimeError naming it; the step loop knows it.
        assert _peer_failure(RuntimeError(f"Unable to cast {caught.value} to Tensor"))
    assert watch.abandon("leaving") == [first, second]
    assert watch.abandon("leaving") == []


def test_leaving_a_round_fails_what_is_still_waited_for(watch: _RoundWatch) -> None:
    work = FakeWork()
    future = watch.watch(work, torch.ones(1), rank=3)  # type: ignore[arg-type]

    assert watch.abandon("rank 3 left DDP's all-reduce: it left round 2") == [work]

    with pytest.raises(PeerLost, match="left round 2"):
        outcome(future)


def test_a_collective_past_its_deadline_fails_as_a_lost_peer(rounds: Rounds) -> None:
    watch = _RoundWatch(rounds, timedelta(milliseconds=50))
    try:
        future = watch.watch(FakeWork(), torch.ones(1), rank=0)  # type: ignore[arg-type]
        with pytest.raises(PeerLost, match="took over") as caught:
            outcome(future)
        assert _peer_failure(RuntimeError(f"Unable to cast {caught.value} to Tensor"))
    finally:
        watch.close()


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"sharded": True, "model": torch.nn.Linear(2, 2)}, "sharded=True and replicated state (model)"),
        ({"sharded": True, "snapshot_every": -1}, "snapshot_every must be a whole number of steps"),
        ({"sharded": True, "snapshot_every": 1.5}, "snapshot_every must be a whole number of steps"),
        ({"snapshot_every": 2}, "snapshot_every is for sharded state (sharded=True)"),
    ],
)
def test_a_session_is_either_replicated_or_sharded_and_says_so(kwargs: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        LiveSession(**kwargs)  # type: ignore[arg-type]
    assert says in str(caught.value)
