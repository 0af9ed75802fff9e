"""How fast a live replica hands its state to a replacement: ``taskd_pytorch.live``'s transfer over loopback.

Two processes share a store; rank 0 holds a state of the given size (a
model's parameters plus SGD momentum, as equal float32 tensors) and hands
it to rank 1 with the same calls live recovery uses (:func:`prepare`,
:func:`serve` with its signed address and the authenticated, encrypted
stream of :mod:`taskd_core.authstream`, :func:`fetch`, :func:`restore`).
Each trial reports the wire rate (end of prepare to the verified state on
the receiver) and the end-to-end rate (prepare → restored on the receiver).
The same trials then send the same tensors over a plain TCP connection
(``sendall``/``recv_into``, nothing checked): the floor the authentication's
cost is measured against. The first trial is the one a real recovery sees
(fresh connection, fresh process); medians and the ratio are reported.

    python bench/transfer_bench.py --gib 1 --trials 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

TENSORS = 64


def _worker(rank: int, port: int, size: int, trials: int, out: Path | None) -> None:
    import torch
    import torch.distributed as dist

    from taskd_core.authstream import verify
    from taskd_pytorch.live._state import capture, fetch, prepare, restore, serve, state_key

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    per = size // (4 * TENSORS)
    state = {"params": [torch.full((per,), float(rank)) for _ in range(TENSORS)]}
    # Keyed, as in every job (a one-node launch makes its token itself).
    signing = state_key("transfer-bench")
    results = []
    for trial in range(trials):
        key = f"transfer/{trial}"
        context = key.encode()
        dist.barrier()
        began = time.perf_counter()
        if rank == 0:
            outgoing = prepare(capture(state))
            prepared_at = time.perf_counter()
            serve(outgoing, [1], "127.0.0.1", partial(store.set, key), 60.0, signing, context)
            dist.barrier()
            results.append({"pack_s": prepared_at - began, "plain_s": _plain(rank, store, trial, state)})
        else:
            address = verify(signing, context, store.get(key).decode())
            assert address is not None
            values = fetch(address, 1, capture(state), 60.0, signing, context)
            received_at = time.perf_counter()
            restore(state, values)
            restored_at = time.perf_counter()
            dist.barrier()
            results.append(
                {
                    "received_s": received_at - began,
                    "restored_s": restored_at - began,
                    "plain_s": _plain(rank, store, trial, state),
                }
            )
            assert all(bool((t == 0).all()) for t in state["params"])
            for t in state["params"]:
                t.fill_(1.0)
    gathered: list[object] = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 1 and out is not None:
        sender, receiver = gathered
        out.write_text(json.dumps({"bytes": per * 4 * TENSORS, "sender": sender, "receiver": receiver}))
    dist.destroy_process_group()


def _plain(rank: int, store: Any, trial: int, state: dict[str, Any]) -> float:
    """Seconds to send the same tensors over a plain TCP connection (the floor), measured on the receiver."""
    import torch
    import torch.distributed as dist

    from taskd_pytorch.live._state import _memory

    views = [_memory(t.view(-1).view(torch.uint8)) for t in state["params"]]
    key = f"plain/{trial}"
    dist.barrier()
    if rank == 0:
        with socket.create_server(("127.0.0.1", 0)) as server:
            store.set(key, str(server.getsockname()[1]))
            conn, _ = server.accept()
            with conn:
                for view in views:
                    conn.sendall(view)
                conn.recv(1)
        return 0.0
    began = time.perf_counter()
    with socket.create_connection(("127.0.0.1", int(store.get(key)))) as conn:
        for view in views:
            got = 0
            while got < len(view):
                got += conn.recv_into(view[got:])
        took = time.perf_counter() - began
        conn.sendall(b"\x01")
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default: %(default)s)")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--_worker", nargs=3, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = int(args.gib * 2**30)
    if args._worker:
        rank, port, trials = args._worker
        _worker(rank, port, size, trials, args._out)
        return 0
    sys.path.insert(0, str(Path(__file__).parent))
    from _common import free_port

    port, out = free_port(), Path(os.environ.get("TMPDIR", "/tmp")) / f"transfer-{os.getpid()}.json"
    cmd = [sys.executable, __file__, "--gib", str(args.gib), "--_out", str(out), "--_worker"]
    procs = [subprocess.Popen([*cmd, str(rank), str(port), str(args.trials)]) for rank in (0, 1)]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes != [0, 0]:
        print(f"transfer workers failed: exit codes {codes}", file=sys.stderr)
        return 1
    data = json.loads(out.read_text())
    out.unlink()
    gb = data["bytes"] / 1e9
    wire = [gb / (r["received_s"] - s["pack_s"]) for s, r in zip(data["sender"], data["receiver"], strict=True)]
    total = [gb / r["restored_s"] for r in data["receiver"]]
    plain = [gb / r["plain_s"] for r in data["receiver"]]
    summary = {
        "bytes": data["bytes"],
        "wire_gb_s_median": statistics.median(wire),
        "end_to_end_gb_s_median": statistics.median(total),
        "end_to_end_gb_s_first": total[0],
        "plain_tcp_gb_s_median": statistics.median(plain),
        "authenticated_over_plain": statistics.median(wire) / statistics.median(plain),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "trials": data,
    }
    print(
        f"state {data['bytes'] / 2**30:.2f} GiB: wire {summary['wire_gb_s_median']:.2f} GB/s, "
        f"end to end {summary['end_to_end_gb_s_median']:.2f} GB/s (median of {args.trials}; "
        f"first {summary['end_to_end_gb_s_first']:.2f}); plain TCP, nothing checked "
        f"{summary['plain_tcp_gb_s_median']:.2f} GB/s: authenticated / plain "
        f"{summary['authenticated_over_plain']:.2f}; load average {' '.join(summary['loadavg'])}"
    )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
