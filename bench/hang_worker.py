"""The worker of ``hang_bench.py``'s light part: beats, then rank 0 hangs in the chosen way, once per start.

``python bench/hang_worker.py MODE TRIALS EVENTS``: every start beats 30 times
(every 50 ms) through :mod:`taskd_core.worker`, logging its first beat; then,
while ``TASKD_RESTART_COUNT < TRIALS``, rank 0 logs ``hang`` with the time the
hang began and hangs (``stopped``: SIGSTOPs itself; ``heartbeat``: spins
silently; ``section``: spins inside a section with a 1 s timeout; ``timer``:
spins after arming a torch-protocol file timer of 1 s) while the other ranks
keep beating. The last start beats and exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from taskd_core import worker

PERIOD = 0.05
BEATS = 30
#: The explicit timeout of the section and timer modes.
EXPLICIT = 1.0
LIFETIME = 300.0


def log(events: Path, event: str, when: float, **extra: object) -> None:
    line = {"event": event, "rank": int(os.environ["RANK"]), "restart": int(os.environ["TASKD_RESTART_COUNT"]),
            "time": when, **extra}
    with open(events, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def spin() -> None:
    end = time.monotonic() + LIFETIME
    while time.monotonic() < end:
        pass


def hang(mode: str, events: Path) -> None:
    if mode == "stopped":
        log(events, "hang", time.time())
        os.kill(os.getpid(), signal.SIGSTOP)
    elif mode == "heartbeat":
        log(events, "hang", time.time())  # the last beat was just sent: the silence starts now
        spin()
    elif mode == "section":
        with worker.section("bench", timeout=EXPLICIT):
            log(events, "hang", time.time())
            spin()
    elif mode == "timer":
        now = time.time()
        request = {"version": 1, "pid": os.getpid(), "scope_id": "bench", "expiration_time": now + EXPLICIT,
                   "signal": int(signal.SIGKILL)}
        fd = os.open(os.environ["TORCHELASTIC_TIMER_FILE"], os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, (json.dumps(request) + "\n").encode())
        os.close(fd)
        log(events, "hang", now)
        spin()


def main() -> int:
    mode, trials, events = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    rank, restart = int(os.environ["RANK"]), int(os.environ["TASKD_RESTART_COUNT"])
    for beat in range(BEATS):
        time.sleep(PERIOD)
        worker.heartbeat()
        if beat == 0:
            log(events, "step", time.time())
    if restart >= trials:
        worker.done()
        return 0
    if rank == 0:
        hang(mode, events)
        return 1
    end = time.monotonic() + LIFETIME
    while time.monotonic() < end:  # the peer keeps stepping until the recovery restarts it
        time.sleep(PERIOD)
        worker.heartbeat()
    return 1


if __name__ == "__main__":
    sys.exit(main())
