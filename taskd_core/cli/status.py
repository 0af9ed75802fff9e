"""``taskd status``: what a controller knows about its jobs (QueryStatus RPC).

Text for people; ``--json`` prints :meth:`ControllerStatus.to_json
<taskd_core.models.ControllerStatus.to_json>`, whose fields docs/events.md describes.
"""

from __future__ import annotations

import argparse
import datetime
import json
from typing import Any

from taskd_core.cli.connection import add_connection_options, credentials
from taskd_core.client.query import QueryClient
from taskd_core.models import ControllerStatus, JournalEvent
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
    p.add_argument("--json", action="store_true", help="print JSON instead of text (schema: docs/events.md)")
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


def _detail(event: JournalEvent) -> str:
    return json.dumps(dict(event.detail), sort_keys=True)


def render(status: ControllerStatus) -> str:
    lines: list[str] = []
    # Replicas on etcd number their leaders; a lone SQLite controller (generation 0) needs no line.
    if status.leader_generation:
        lines.append(f"leader {_safe(status.leader)} (generation {status.leader_generation})")
    if not status.jobs:
        return "\n".join([*lines, "no jobs"])
    for job in status.jobs:
        faults = ", ".join(f"{f.rank}:{f.fault_type.value}" for f in job.faults) or "-"
        legacy = "  (legacy: registered without a token)" if job.legacy else ""
        lines.append(f"job {_safe(job.job_id)}{legacy}")
        strategy = job.strategy.value if job.strategy is not None else "-"
        lines.append(
            f"  state      {job.state.value}  cycle {job.cycle} (used {job.cycles_used} of "
            f"{job.max_cycles})  strategy {strategy}"
        )
        lines.append(f"  faults     {faults}")
        lines.append(f"  policy     {', '.join(s.value for s in job.strategies)}")
        lines.append(f"  outcome    {_safe(job.outcome) or '-'}")
        for slow in job.slow_ranks:
            lines.append(f"  slow rank  {slow.describe()}")
        if job.slow_ranks:
            how = "learned from the job" if job.slow_rank_bound_learned else "the policy's or the default"
            lines.append(f"  slow bound {job.slow_rank_bound:g} x the peers' median ({how})")
        lines.append(f"  {'AGENT':<20} {'ROLE':<16} {'NODE':>4}  {'STREAM':<6}  {'EXIT':<10} LAST SEEN")
        for a in job.agents:
            node = "-" if a.node_rank is None else str(a.node_rank)
            ended = "-" if a.exit_code is None else f"exited {a.exit_code}"
            lines.append(
                f"  {_safe(a.agent_id):<20} {_safe(a.role):<16} {node:>4}  "
                f"{'up' if a.subscribed else 'down':<6}  {ended:<10} {_when(a.last_seen)}"
            )
            if a.hang_timeouts:
                lines.append(f"  {'':<20} hang timeouts: {_safe(a.hang_timeouts)}")
        if job.events:
            lines.append("  events")
        for e in job.events:
            lines.append(
                f"  {e.seq:>6}  {_when(e.time)}  c{e.cycle:<3} {_safe(e.kind):<16} "
                f"{_short(_safe(_detail(e)))}"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    with QueryClient(args.controller, credentials(args), timeout=args.timeout) as client:
        status = client.status(args.job, args.events)
    print(json.dumps(status.to_json(), indent=2) if args.json else render(status))
    return 0
