"""A worker without torch: records its environment, then idles, exits or fails as told.

Usage: idle.py OUT_DIR [--exit-code N] [--after SECONDS] [--only-rank R] [--until FILE] [--ignore-sigterm]
Writes OUT_DIR/rank<RANK>.<pid>.json with its pid and TaskD/torchrun variables,
then exits with ``--exit-code`` after ``--after`` seconds (only global rank
``--only-rank`` when given; the others idle), or with 0 as soon as FILE exists.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

_KEYS = ("RANK", "GROUP_RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TASKD_RESTART_COUNT",
         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TASKD_LIVE_DIR",
         "TASKD_JOB_TOKEN")
_POLL = 0.05


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--after", type=float, default=120.0, help="seconds before exiting")
    parser.add_argument("--only-rank", type=int, default=None, help="only this global rank exits after --after")
    parser.add_argument("--until", type=Path, default=None, help="exit 0 once this file exists")
    parser.add_argument("--ignore-sigterm", action="store_true")
    args = parser.parse_args()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank = int(os.environ["RANK"])
    record = {"pid": os.getpid(), **{k: os.environ.get(k) for k in _KEYS}}
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
