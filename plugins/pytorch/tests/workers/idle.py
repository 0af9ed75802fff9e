"""A worker without torch: records its environment, then idles, exits or fails as told.

Usage: idle.py OUT_DIR [--exit-code N] [--after SECONDS] [--ignore-sigterm]
Writes OUT_DIR/rank<RANK>.<pid>.json with its pid and TaskD/torchrun variables.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TASKD_RESTART_COUNT",
         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--after", type=float, default=120.0, help="seconds before exiting")
    parser.add_argument("--ignore-sigterm", action="store_true")
    args = parser.parse_args()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record = {"pid": os.getpid(), **{k: os.environ.get(k) for k in _KEYS}}
    tmp = args.out / f".rank{os.environ['RANK']}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record))
    tmp.rename(args.out / f"rank{os.environ['RANK']}.{os.getpid()}.json")
    print(f"worker rank {os.environ['RANK']} pid {os.getpid()} up", flush=True)
    time.sleep(args.after)
    raise SystemExit(args.exit_code)


if __name__ == "__main__":
    main()
