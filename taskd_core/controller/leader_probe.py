"""Whether anything still listens at the leading replica's address: a TCP connection a standby holds to it.

A standby otherwise learns that the leader is gone only when the leader's
etcd lease ran out (2 s by default). When the leader's *process* ends while
its machine's kernel lives on (it was killed or crashed, or its whole node's
processes were), the kernel resets its connections and refuses new ones at
once. :func:`nothing_listens` holds one plain TCP connection to the leader's
address (it never sends a byte: the server's greeting is read and dropped)
and returns once that connection closed *and* a new one was refused: proof
that no process listens there any more. A machine that lost power, or a
network cut, closes nothing; there the lease stays the bound. What a standby
does with the proof (it ends the leader's lease) is in
:mod:`taskd_core.controller.election`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from taskd_core.errors import ConfigError
from taskd_core.values import parse_address

logger = logging.getLogger(__name__)

#: A held connection that the server closed sooner than this is not opened again before this long,
#: so a server that drops idle connections at once is not dialled in a loop.
SHORTEST_HOLD = 1.0
#: Seconds between tries while the address cannot be reached at all (no proof either way).
UNREACHABLE_RETRY = 0.5


async def nothing_listens(address: str) -> str:
    """Return (why) once a connection to ``address`` closed and a new one was refused; else never.

    Runs until cancelled while something listens (or ``address`` is empty),
    while the address cannot be reached (a timeout, no route: that proves
    nothing), or while it never answered at all.
    """
    if not address:  # no leader known: the watch decides alone
        return await _until_cancelled()
    try:
        host, port = parse_address(address, "leader address")
    except ConfigError as exc:
        logger.info("not probing the leader: %s", exc)
        return await _until_cancelled()
    opened = float("-inf")
    held_one = False
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except ConnectionRefusedError:
            # Only once something listened there: an address that never answered (a wrong
            # --advertise) must not end the lease of every leader that names it.
            if held_one:
                return f"nothing listens at {address} any more (a new connection was refused)"
            await asyncio.sleep(UNREACHABLE_RETRY)
            continue
        except OSError:
            await asyncio.sleep(UNREACHABLE_RETRY)
            continue
        held_one = True
        held = time.monotonic()
        if held - opened < SHORTEST_HOLD:
            await asyncio.sleep(SHORTEST_HOLD)
        opened = held
        try:
            while await reader.read(4096):
                pass
        except OSError:
            pass  # reset: what a killed process's kernel does
        finally:
            writer.close()


async def _until_cancelled() -> str:
    """Never returns: a probe with nothing to probe, cancelled with the watch it runs beside."""
    await asyncio.Event().wait()
    raise AssertionError("an event nobody sets was set")
