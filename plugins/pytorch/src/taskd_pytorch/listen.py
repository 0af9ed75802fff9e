"""Where the listeners TaskD starts for a job bind: the interface the job uses, never every interface.

torch's ``TCPStore`` server listens on every interface whatever host it is
given (``[::]``), so any host of the network reaches a job's store, and with
it the keys its workers meet by. :func:`listening_store` gives the store a
socket bound to one address instead (torch's ``master_listen_fd``): loopback
when the whole job runs on this host, else the address by which this host
reaches the others (:func:`job_interface`).
"""

from __future__ import annotations

import socket
from datetime import timedelta

# torch.distributed re-exports its C stores without listing them in __all__.
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from taskd_core.values import is_loopback


def job_interface(near: str) -> str:
    """The local address by which this host reaches ``near`` (loopback for a loopback ``near``).

    :raises OSError: when ``near`` does not resolve or no route leads there.
    """
    if is_loopback(near):
        return "::1" if ":" in near else "127.0.0.1"
    family, _, _, _, sockaddr = socket.getaddrinfo(near, 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)  # no packet is sent: this only picks the route's local address
        return str(probe.getsockname()[0])


def listening_store(host: str, port: int, timeout: timedelta, *, multi_tenant: bool = False) -> TCPStore:
    """A ``TCPStore`` server listening on ``host`` only (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
        store = TCPStore(
            host_name=host,
            port=sock.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timeout,
            multi_tenant=multi_tenant,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the socket now and closes it
    return store
