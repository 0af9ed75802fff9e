"""A worker that makes progress, then stops in a named function the tests look for in its stack.

``python hangs.py MODE``; it beats through :mod:`taskd_core.worker` ``BEATS``
times (every ``PERIOD`` seconds) first, then:

* ``stop``      sleeps in ``wait_for_stop`` (the test SIGSTOPs it);
* ``spin``      spins in ``spin_without_heartbeat`` (busy, silent);
* ``sleep``     sleeps in ``sleep_without_heartbeat`` (silent, not busy: like a rank blocked in a collective);
* ``section``   enters section ``load`` with a 0.5 s timeout and spins in ``stuck_in_section``;
* ``timer``     arms a torch-protocol file timer of 0.5 s and spins in ``overrun_timer``;
* ``healthy``   keeps beating with steps that vary by 5x until told to finish (file ``finish`` beside it),
                then says it is done and stays busy for a while, as a worker tearing down does.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

from taskd_core import worker

BEATS = 30
PERIOD = 0.05
#: Bound on every loop here, so a forgotten worker ends on its own.
LIFETIME = 120.0
#: Seconds of silent work after the last beat (longer than twice the tests' floor).
TEARDOWN = 2.5


def wait_for_stop() -> None:
    print("waiting for SIGSTOP", flush=True)
    time.sleep(LIFETIME)


def spin_without_heartbeat() -> None:
    end = time.monotonic() + LIFETIME
    while time.monotonic() < end:
        pass


def sleep_without_heartbeat() -> None:
    time.sleep(LIFETIME)


def stuck_in_section() -> None:
    with worker.section("load", timeout=0.5):
        spin_without_heartbeat()


def overrun_timer() -> None:
    request = {"version": 1, "pid": os.getpid(), "scope_id": "step", "expiration_time": time.time() + 0.5, "signal": 9}
    fd = os.open(os.environ["TORCHELASTIC_TIMER_FILE"], os.O_WRONLY | os.O_NONBLOCK)
    os.write(fd, (json.dumps(request) + "\n").encode())
    os.close(fd)
    spin_without_heartbeat()


def healthy(here: Path) -> None:
    rng = random.Random(0)
    end = time.monotonic() + LIFETIME
    while not (here / "finish").exists() and time.monotonic() < end:
        time.sleep(PERIOD * rng.uniform(1.0, 5.0))
        worker.heartbeat()
    worker.done()
    end = time.monotonic() + TEARDOWN
    while time.monotonic() < end:
        pass


def main() -> None:
    mode = sys.argv[1]
    for _ in range(BEATS):
        time.sleep(PERIOD)
        worker.heartbeat()
    if mode == "healthy":
        healthy(Path(sys.argv[2]))
        return
    {
        "stop": wait_for_stop,
        "spin": spin_without_heartbeat,
        "sleep": sleep_without_heartbeat,
        "section": stuck_in_section,
        "timer": overrun_timer,
    }[mode]()


if __name__ == "__main__":
    main()
