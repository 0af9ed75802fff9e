"""``taskd plugins``: installed framework adapters with their distributions and strategies.

An adapter whose framework is missing is listed as UNAVAILABLE with the
command that installs it; one that fails to load as BROKEN with the cause.
"""

from __future__ import annotations

import argparse

from taskd_core.plugins import InstalledAdapter, list_adapters


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
    rows += [(a.name, a.distribution, _state(a)) for a in adapters]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for name, dist, strategies in rows:
        print(f"{name:<{widths[0]}}  {dist:<{widths[1]}}  {strategies}")
    for a in adapters:
        if a.unavailable or a.error:
            print(f"\n{a.name} ({a.value}): {a.unavailable or a.error}")
    return 0


def _state(adapter: InstalledAdapter) -> str:
    if adapter.unavailable:
        return "UNAVAILABLE"
    return "BROKEN" if adapter.error else ",".join(adapter.strategies)
