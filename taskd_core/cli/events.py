"""``taskd events JOB``: a job's event journal as text or JSON lines, optionally followed live.

The journal comes from a running controller (``--controller``, the
``QueryEvents`` RPC) or from a controller's SQLite state file (``--state``,
read-only, also while the controller runs). ``--json`` prints one object per
line in the stable schema of docs/events.md, ready for a log shipper.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from taskd_core.cli.connection import add_connection_options, credentials
from taskd_core.client.query import PAGE, QueryClient
from taskd_core.errors import ConfigError, ControllerUnavailableError, TaskdError
from taskd_core.models import JournalEvent
from taskd_core.values import MAX_INT64, argtype, check_seconds, parse_count

logger = logging.getLogger(__name__)

#: Reads a job's journal entries after a sequence number, oldest first.
PageReader = Callable[[int], list[JournalEvent]]


def add_source_options(p: argparse.ArgumentParser) -> None:
    """``JOB`` plus where its journal comes from.

    That is ``--controller`` (default, with its TLS and token) or ``--state``.
    """
    p.add_argument("job", metavar="JOB", help="job id")
    add_connection_options(p)
    p.add_argument(
        "--state",
        metavar="FILE",
        help="read a controller's SQLite state file instead of asking the controller",
    )


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "events",
        help="print a job's event journal (text or JSON lines), optionally following it",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_source_options(p)
    p.add_argument("--json", action="store_true", help="one JSON object per line (schema: docs/events.md)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events as they happen")
    p.add_argument(
        "--after",
        type=argtype(lambda text: parse_count(text, high=MAX_INT64)),
        default=0,
        metavar="SEQ",
        help="only events after this sequence number",
    )
    p.add_argument(
        "--interval",
        type=float,
        default=0.5,
        metavar="S",
        help="--follow: seconds between polls (default: %(default)s)",
    )
    p.set_defaults(func=run)


def _when(stamp: float) -> str:
    return datetime.datetime.fromtimestamp(stamp).strftime("%H:%M:%S.%f")[:-3]


def render(event: JournalEvent) -> str:
    detail = json.dumps(dict(event.detail), sort_keys=True, separators=(",", ":"))
    return f"{event.seq:>7}  {_when(event.time)}  c{event.cycle:<3} {event.kind:<16} {detail}"


def as_json_line(event: JournalEvent) -> str:
    return json.dumps(event.to_json(), sort_keys=True, separators=(",", ":"))


@contextlib.contextmanager
def journal_reader(args: argparse.Namespace) -> Iterator[PageReader]:
    """A :data:`PageReader` for ``args.job`` from ``--state`` or ``--controller``; checks the job exists."""
    if args.state:
        if args.state.startswith("etcd://"):
            raise ConfigError(
                f"--state {args.state}: an etcd state is read through its controller: give "
                "--controller HOST:PORT[,HOST:PORT...] (any replica) instead"
            )
        # Imported here: only reading a state file needs the controller's store.
        from taskd_core.controller.runtime import journal_event
        from taskd_core.controller.store_sqlite import SqliteStore

        store = SqliteStore(args.state, readonly=True)
        try:
            if not store.has_job(args.job):
                raise TaskdError(
                    f"job {args.job!r} is not in state file {args.state}; `taskd status` lists jobs"
                )

            def read_file(after: int) -> list[JournalEvent]:
                return [journal_event(r) for r in store.events_after(args.job, after, PAGE)]

            yield read_file
        finally:
            store.close()
        return
    with QueryClient(args.controller, credentials(args), timeout=args.timeout) as client:
        client.events(args.job, 0, 1)  # an unknown job or an absent controller fails here, clearly

        def read_controller(after: int) -> list[JournalEvent]:
            return list(client.events(args.job, after).events)

        yield read_controller


def read_all(read: PageReader, after: int = 0) -> list[JournalEvent]:
    """Every entry after ``after``."""
    events: list[JournalEvent] = []
    while True:
        page = read(events[-1].seq if events else after)
        if not page:
            return events
        events.extend(page)


def follow(
    read: PageReader, *, after: int = 0, interval: float = 0.5, stop: threading.Event | None = None
) -> Iterator[JournalEvent]:
    """Every entry after ``after``, then each new one as it is journalled, until ``stop`` is set.

    A controller that goes away after having answered (an embedded controller
    ends with its job) ends the stream quietly.
    """
    stop = stop or threading.Event()
    while not stop.is_set():
        try:
            page = read(after)
        except ControllerUnavailableError:
            logger.info("the controller is gone; no more events")
            return
        yield from page
        if page:
            after = page[-1].seq
        else:
            stop.wait(interval)


def run(args: argparse.Namespace) -> int:
    check_seconds(args.interval, "--interval", positive=True)
    line = as_json_line if args.json else render
    with journal_reader(args) as read:
        events = (
            follow(read, after=args.after, interval=args.interval)
            if args.follow
            else read_all(read, args.after)
        )
        try:
            for event in events:
                print(line(event), flush=args.follow)
        except KeyboardInterrupt:
            return 130
        except BrokenPipeError:
            # The reader went away (`| head`): not an error; keep Python from complaining at exit.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
