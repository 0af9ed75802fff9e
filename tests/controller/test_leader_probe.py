"""The standby's probe of the leader's address: it answers only once something that listened is gone."""

from __future__ import annotations

import asyncio

import pytest

from taskd_core.controller.leader_probe import nothing_listens
from taskd_core.testing import free_port
from tests.conftest import WAIT


def test_it_returns_once_the_listener_it_held_a_connection_to_is_gone() -> None:
    async def body() -> None:
        accepted: list[asyncio.StreamWriter] = []

        async def keep(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"greeting")  # what a gRPC server sends first (its HTTP/2 settings)
            accepted.append(writer)

        server = await asyncio.start_server(keep, "127.0.0.1", 0)
        address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        probe = asyncio.ensure_future(nothing_listens(address))
        while not accepted:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        assert not probe.done()  # something listens: no verdict
        server.close()
        await server.wait_closed()
        for writer in accepted:
            writer.transport.abort()  # a reset, as the kernel of a killed process sends
        why = await asyncio.wait_for(probe, WAIT)
        assert why == f"nothing listens at {address} any more (a new connection was refused)"

    asyncio.run(body())


@pytest.mark.parametrize("address", ["", "not-an-address", "127.0.0.1:{free}"])
def test_no_verdict_without_a_leader_a_valid_address_or_a_listener_it_ever_reached(address: str) -> None:
    # An address that never answered (a wrong --advertise) must not end every leader's lease.
    async def body() -> None:
        probe = asyncio.ensure_future(nothing_listens(address.format(free=free_port())))
        await asyncio.sleep(0.8)
        assert not probe.done()
        probe.cancel()
        await asyncio.gather(probe, return_exceptions=True)

    asyncio.run(body())
