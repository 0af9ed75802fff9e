"""A worker without torch: records its environment, then idles, exits or fails as told.

Usage: idle.py OUT_DIR [--exit-code N] [--after SECONDS] [--only-rank R] [--until FILE] [--ignore-sigterm] [--escape]
Writes OUT_DIR/rank<RANK>.<pid>.json with its pid and TaskD/torchrun variables (with ``--escape``,
first leaves two children in sessions of their own, one exec'd and one only forked, and records
their pids as ``escaped``), then exits with ``--exit-code`` after ``--after`` seconds (only global rank
``--only-rank`` when given; the others idle), or with 0 as soon as FILE exists.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

_KEYS = (
    "RANK",
    "GROUP_RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TASKD_RESTART_COUNT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TASKD_LIVE_DIR",
    "TASKD_JOB_TOKEN",
)
_POLL = 0.05


def _escape() -> list[int]:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(w, str(os.getpid()).encode())
            time.sleep(300)
        os._exit(0)
    os.close(w)
    return [sleeper.pid, int(os.read(r, 20))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--after", type=float, default=120.0, help="seconds before exiting")
    parser.add_argument(
        "--only-rank", type=int, default=None, help="only this global rank exits after --after"
    )
    parser.add_argument("--until", type=Path, default=None, help="exit 0 once this file exists")
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--escape", action="store_true", help="leave two children outside the process group")
    args = parser.parse_args()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank = int(os.environ["RANK"])
    record: dict[str, object] = {"pid": os.getpid(), **{k: os.environ.get(k) for k in _KEYS}}
    if args.escape:
        record["escaped"] = _escape()
    tmp = args.out / f".rank{rank}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record))
    tmp.rename(args.out / f"rank{rank}.{os.getpid()}.json")
    deadline = time.monotonic() + (args.after if args.only_rank in (None, rank) else 600.0)
    while time.monotonic() < deadline:
        if args.until is not None and args.until.exists():
            raise SystemExit(0)
        time.sleep(_POLL)
    raise SystemExit(args.exit_code)


if __name__ == "__main__":
    main()
