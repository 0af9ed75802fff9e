"""``taskd status``: what a controller knows about its jobs (QueryStatus RPC)."""

from __future__ import annotations

import argparse
import datetime
import json
from typing import Any

from taskd_core.cli.connection import add_connection_options, credentials
from taskd_core.client.status import query_status
from taskd_core.values import MAX_INT32, argtype, parse_count


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "status",
        help="show a controller's jobs, agents, cycles and events",
        description="Ask a running controller for its jobs, their agents, cycle state and latest events.",
    )
    add_connection_options(p)
    p.add_argument("--job", default="", help="only this job id")
    p.add_argument(
        "--events",
        type=argtype(parse_count),
        default=10,
        metavar="N",
        help=f"latest journal events per job, 0..{MAX_INT32} (default: %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)


def _safe(text: str) -> str:
    """A value from the controller as it may be shown on a terminal: control characters escaped."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _when(stamp: float) -> str:
    return datetime.datetime.fromtimestamp(stamp).strftime("%H:%M:%S.%f")[:-3] if stamp else "-"


def _short(detail: str, most: int = 300) -> str:
    """One event per line: a long detail (a hung rank's stack) is cut; ``--json`` has it whole."""
    flat = detail.replace("\\n", " | ")
    return flat if len(flat) <= most else flat[: most - 3] + "..."


def render(status: dict[str, Any]) -> str:
    lines: list[str] = []
    jobs = status.get("jobs", [])
    if not jobs:
        return "no jobs"
    for job in jobs:
        faults = ", ".join(f"{f['rankId']}:{f['faultType']}" for f in job["faultRanks"]) or "-"
        lines.append(
            f"job {_safe(job['jobId'])}{'  (legacy: registered without a token)' if job['legacy'] else ''}"
        )
        lines.append(
            f"  state      {job['state']}  cycle {job['cycle']} (used {job['cyclesUsed']} of "
            f"{job['maxCycles']})  strategy {job['strategy'] or '-'}"
        )
        lines.append(f"  faults     {faults}")
        lines.append(f"  policy     {', '.join(job['strategies'])}")
        lines.append(f"  outcome    {job['outcome'] or '-'}")
        lines.append(f"  {'AGENT':<20} {'ROLE':<16} {'NODE':>4}  {'STREAM':<6}  {'EXIT':<10} LAST SEEN")
        for a in job["agents"]:
            node = "-" if a["nodeRank"] < 0 else str(a["nodeRank"])
            lines.append(
                f"  {_safe(a['agentId']):<20} {_safe(a['role']):<16} {node:>4}  "
                f"{'up' if a['subscribed'] else 'down':<6}"
                f"  {a['exitState'] or '-':<10} {_when(a['lastSeen'])}"
            )
            if a.get("progress"):
                lines.append(f"  {'':<20} hang timeouts: {_safe(a['progress'])}")
        if job["events"]:
            lines.append("  events")
        for e in job["events"]:
            lines.append(
                f"  {e['seq']:>6}  {_when(e['time'])}  c{e['cycle']:<3} {e['kind']:<16} "
                f"{_short(_safe(e['detail']))}"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    status = query_status(args.controller, args.job, args.events, args.timeout, credentials(args))
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0
