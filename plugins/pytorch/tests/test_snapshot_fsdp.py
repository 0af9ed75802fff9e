"""Memory snapshots of real FSDP2 and ZeRO jobs under ``taskdrun`` (4 ranks, gloo): what a fault costs.

Each job is ``examples/train_fsdp.py`` snapshotting every step with
``dcp.async_save(storage_writer=SnapshotWriter(step))`` and checkpointing to
disk every 4 steps; the final parameters are compared with a fault-free run's.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pt_support import Launcher, events, example, last_step, one_node_job, restores, workers
from pt_support import finish_one as finish

from taskd_core.testing import descendants, free_port, wait_until

pytestmark = pytest.mark.slow

STEPS = 16
#: 2 x 1024² weights: each rank's snapshot is a few MiB, so a kill lands in a copy often.
ARGS = ("--steps", str(STEPS), "--ckpt-every", "4", "--width", "1024", "--layers", "2", "--step-time", "0.05")


def start(
    launch: Launcher, work: Path, *extra: str, taskd: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    return one_node_job(launch, work, "train_fsdp.py", *ARGS, *extra, taskd=taskd)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The final parameter hashes of fault-free runs, FSDP2 and ZeRO."""
    launcher = Launcher(tmp_path_factory.mktemp("reference"))
    try:
        out = {}
        for variant, extra in (("fsdp", ()), ("zero", ("--zero",))):
            node, _, result = start(launcher, launcher.root / variant, *extra)
            out[variant] = finish(node, result)["sha256"]
        yield out
    finally:
        launcher.cleanup()


@pytest.mark.parametrize("variant", ["fsdp", "zero"])
def test_a_sigkilled_rank_restores_from_memory_and_loses_at_most_one_step(
    launch: Launcher, tmp_path: Path, reference: dict[str, str], variant: str
) -> None:
    extra = ("--zero",) if variant == "zero" else ()
    node, progress, result = start(
        launch, tmp_path / variant, "--fail-at-step", "10", "--fail-rank", "2", "--fail-mode", "kill", *extra
    )
    done = finish(node, result)
    back = restores(progress)
    assert sorted(back) == [0, 1, 2, 3]
    # Killed as step 10 began (10 steps done); the disk checkpoint is at step 8.
    assert {source for source, _ in back.values()} == {"memory"}, back
    assert {step for _, step in back.values()} <= {9, 10}
    assert done["steps"] == STEPS and done["sha256"] == reference[variant]


def test_every_worker_killed_at_a_random_moment_of_a_copy_restores_every_shard_from_memory(
    launch: Launcher, tmp_path: Path, reference: dict[str, str]
) -> None:
    node, progress, result = start(launch, tmp_path / "all")
    wait_until(
        lambda: last_step(progress) >= 4 and len(workers(node, progress)) == 4,
        "every rank to train 4 steps",
        120,
    )
    # The snapshot of a step is copied while the next one computes: any moment is in or near a copy.
    pause = random.Random().uniform(0.0, 0.5)
    print(f"killing every worker {pause:.3f}s later")
    time.sleep(pause)
    seen = last_step(progress)
    for pid in workers(node, progress).values():
        os.kill(pid, signal.SIGKILL)
    done = finish(node, result)
    back = restores(progress)
    assert {source for source, _ in back.values()} == {"memory"} and sorted(back) == [0, 1, 2, 3], back
    (step,) = {step for _, step in back.values()}
    assert seen - 1 <= step <= seen + 1, (seen, back)  # a step may end between the look and the kill
    assert done["sha256"] == reference["fsdp"]


def test_a_damaged_copy_is_refused_by_its_checksum_and_the_disk_checkpoint_is_used(
    launch: Launcher, tmp_path: Path, reference: dict[str, str]
) -> None:
    node, progress, result = start(launch, tmp_path / "damaged", taskd=("--taskd-no-hang-detection",))
    wait_until(
        lambda: last_step(progress) >= 6 and len(workers(node, progress)) == 4,
        "every rank to train 6 steps",
        120,
    )
    pids = workers(node, progress)
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)  # frozen: no copy completes or begins while rank 1's are damaged
    (root,) = [r for r in Path("/dev/shm").glob("taskd-snapshots-*") if str(r) in _keeper_roots(node)]
    steps = sorted(d for d in (root / "rank1").iterdir() if (d / "done").exists())
    assert steps, "rank 1 has complete snapshots"
    newest = steps[-1] / "data"
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    newest.write_bytes(raw)
    for older in steps[:-1]:
        data = older / "data"
        data.write_bytes(data.read_bytes()[:-8])
    for pid in pids.values():
        os.kill(pid, signal.SIGKILL)
    done = finish(node, result)
    back = restores(progress)
    assert {source for source, _ in back.values()} == {"disk"}, back
    log = (tmp_path / "damaged.0.log").read_text()
    assert "is damaged: its data does not match its checksum" in log
    assert done["sha256"] == reference["fsdp"]


def _keeper_roots(node: subprocess.Popen[bytes]) -> str:
    """The command lines of ``node``'s processes (its keeper names its directory)."""
    out = []
    for pid in descendants(node.pid):
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return "\n".join(out)


def test_a_snapshot_over_the_memory_limit_warns_once_and_the_job_goes_on_from_disk(
    launch: Launcher, tmp_path: Path, reference: dict[str, str]
) -> None:
    node, progress, result = start(
        launch,
        tmp_path / "limit",
        "--fail-at-step",
        "10",
        "--fail-rank",
        "1",
        "--fail-mode",
        "kill",
        taskd=("--taskd-snapshot-memory", "1"),
    )
    done = finish(node, result)
    back = restores(progress)
    assert back == {rank: ("disk", 8) for rank in range(4)}
    log = (tmp_path / "limit.0.log").read_text()
    # One warning per rank and life (two lives), however many steps.
    assert log.count("rank 1: a memory snapshot of") == 2, log[-4000:]
    assert "over this rank's budget of 0 MiB" in log
    assert done["sha256"] == reference["fsdp"]


def test_on_two_nodes_a_damaged_local_copy_is_replaced_by_the_peer_copy_on_the_other_node(
    launch: Launcher, tmp_path: Path, reference: dict[str, str]
) -> None:
    """2 taskdrun nodes x 2 ranks: every snapshot also goes to the same local rank on the other node."""
    work = tmp_path / "peer"
    example_argv, progress, result = example("train_fsdp.py", work)
    rdzv = [
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-id=peer",
        "--taskd-no-hang-detection",
    ]
    job = [
        *example_argv,
        *ARGS,
    ]
    nodes = [launch(*rdzv, *job, log=f"peer{n}", env={"TASKD_JOB_TOKEN": "s3cret"}) for n in (0, 1)]
    wait_until(lambda: last_step(progress) >= 4, "every rank to train 4 steps", 120)
    # Frozen at a random moment: copies (own and peer) may be in flight, and stay half-done.
    time.sleep(random.Random().uniform(0.0, 0.5))
    pids = {e["rank"]: e["pid"] for e in events(progress) if e["event"] == "start"}
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)
    on_node = {n: {r for r, pid in pids.items() if pid in descendants(nodes[n].pid)} for n in (0, 1)}
    holder = next(n for n in (0, 1) if 2 in on_node[n])
    (root,) = [
        r for r in Path("/dev/shm").glob("taskd-snapshots-*") if str(r) in _keeper_roots(nodes[holder])
    ]
    damaged = sorted(d for d in (root / "rank2").iterdir() if (d / "done").exists())
    assert damaged, "rank 2 has complete snapshots on its node"
    for step_dir in damaged:
        data = step_dir / "data"
        raw = bytearray(data.read_bytes())
        raw[0] ^= 0x01
        data.write_bytes(raw)
    for pid in pids.values():
        os.kill(pid, signal.SIGKILL)
    assert [node.wait(timeout=240) for node in nodes] == [0, 0]
    back = restores(progress)
    assert back[2][0] == "peer", back
    assert {back[r][0] for r in (0, 1, 3)} == {"memory"}, back
    assert len({step for _, step in back.values()}) == 1
    assert json.loads(result.read_text())["sha256"] == reference["fsdp"]


def test_a_lost_node_is_replaced_by_a_spare_whose_ranks_restore_from_the_peer_copies(
    launch: Launcher, tmp_path: Path, reference: dict[str, str]
) -> None:
    """2 taskdrun nodes x 2 ranks and a hot spare; the node without the controller loses its whole tree."""
    work = tmp_path / "spare"
    example_argv, progress, result = example("train_fsdp.py", work)
    argv = [
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-id=spare",
        *example_argv,
        *ARGS,
        "--step-time",
        "1.5",
    ]  # the sleep stands for compute: it changes no parameter
    token = {"TASKD_JOB_TOKEN": "s3cret"}
    logs = [launch.root / f"spare{n}.{n}.log" for n in range(3)]
    node0 = launch(*argv, log="spare0", env=token)
    wait_until(
        lambda: "joining the c10d rendezvous" in logs[0].read_text(), "node 0 to reach the rendezvous", 120
    )
    node1 = launch(*argv, log="spare1", env=token)
    wait_until(
        lambda: "job spare node 0: 2 workers" in logs[0].read_text() + logs[1].read_text(),
        "the first round",
        120,
    )
    spare = launch(*argv, log="spare2", env=token)
    wait_until(lambda: "standing by as spare" in logs[2].read_text(), "the spare to stand by", 120)
    wait_until(lambda: last_step(progress) >= 2, "every rank to train", 120)
    assert "embedded controller listening" in logs[0].read_text(), "node 0 (the store's host) survives"
    lost = {
        e["rank"] for e in events(progress) if e["event"] == "start" and e["pid"] in descendants(node1.pid)
    }
    assert len(lost) == 2
    seen = last_step(progress)
    for pid in {node1.pid, *descendants(node1.pid)}:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert node0.wait(timeout=240) == 0 and spare.wait(timeout=240) == 0
    back = restores(progress)
    assert {back[r][0] for r in lost} == {"peer"}, (
        back
    )  # the lost node's memory is gone: its copies at node 0
    assert {back[r][0] for r in set(range(4)) - lost} == {"memory"}, back
    (step,) = {step for _, step in back.values()}
    assert seen - 1 <= step <= seen + 1, (seen, back)  # a step may end between the look and the kill
    assert json.loads(result.read_text())["sha256"] == reference["fsdp"]
