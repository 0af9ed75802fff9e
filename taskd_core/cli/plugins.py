"""``taskd plugins``: installed framework adapters with their distributions and strategies; broken ones."""

from __future__ import annotations

import argparse

from taskd_core.plugins import list_adapters


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("plugins", help="list installed framework adapters (entry-point group 'taskd')")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    adapters = list_adapters()
    if not adapters:
        print(
            "no TaskD adapters installed (entry-point group 'taskd'); "
            "install taskd-core or an adapter distribution"
        )
        return 0
    rows = [("NAME", "DISTRIBUTION", "STRATEGIES")]
    rows += [(a.name, a.distribution, ",".join(a.strategies) if not a.error else "BROKEN") for a in adapters]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for name, dist, strategies in rows:
        print(f"{name:<{widths[0]}}  {dist:<{widths[1]}}  {strategies}")
    for a in adapters:
        if a.error:
            print(f"\n{a.name} ({a.value}): {a.error}")
    return 0
