"""Values a user gives TaskD, each checked one way, with its bounds: the leaf every layer takes them from.

- where: hosts, ports, ``HOST:PORT`` addresses (an IPv6 host in brackets) and
  comma-separated lists of them (:func:`parse_address`, :func:`join_address`,
  :func:`parse_addresses`), and the one rule of what loopback is (:func:`is_loopback`),
  which every bind and every dial applies;
- how long and how many: seconds (at most :data:`MAX_SECONDS`), whole numbers
  (at most :data:`MAX_INT32`, what the wire carries), worker and node counts
  (:data:`MAX_LOCAL_WORKERS`, :data:`MAX_NODES`);
- what: signals (a dump request must be one a worker can catch), module names,
  switches (``1``/``0``, ``on``/``off`` ...) and secrets (tokens);
- paths TaskD will write (a file's directory exists, a log directory can be made);
- :func:`argtype`, which makes any parser here an argparse ``type=`` whose
  :class:`~taskd_core.errors.ConfigError` is a usage error (exit 2).

Each ``parse_*`` takes the text and ``what`` (the flag or variable it came
from, named in the error; empty under argparse, which names the flag itself);
each ``check_*`` takes a value already typed. Imports nothing of TaskD but
:mod:`taskd_core.errors`, so settings, the controller and workers can all use it.
"""

from __future__ import annotations

import errno
import ipaddress
import math
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TypeVar

from taskd_core.errors import ConfigError

T = TypeVar("T")

#: The loopback address TaskD binds and dials when nothing else is said.
LOCALHOST = "127.0.0.1"
#: The reference controller's (ClusterD's) gRPC port; the default for multi-node jobs.
DEFAULT_CONTROLLER_PORT = 8899
#: Where a controller listens, and its clients look, when nothing else is said.
DEFAULT_CONTROLLER = f"{LOCALHOST}:{DEFAULT_CONTROLLER_PORT}"
#: Longest duration a user may give (a day): any timeout, bound, window or delay beyond it is a typo.
MAX_SECONDS = 86_400.0
#: Largest whole number a user may give: the wire's int32 fields carry no more.
MAX_INT32 = 2**31 - 1
#: Largest sequence number (the journal's, an int64 on the wire).
MAX_INT64 = 2**63 - 1
#: Most workers one launcher starts. Far above any machine's accelerators or cores, far below its pid limit.
MAX_LOCAL_WORKERS = 1024
#: Most nodes one job has.
MAX_NODES = 65_536
#: Longest token or launch identity accepted; a longer header is refused before any lookup.
MAX_SECRET = 512
#: Signals a process cannot catch: no request to save anything can be made with them.
UNCATCHABLE = frozenset({signal.SIGKILL, signal.SIGSTOP})

_WILDCARDS = frozenset({"", "0.0.0.0", "::"})
_SWITCHES = {
    "1": True,
    "on": True,
    "true": True,
    "yes": True,
    "0": False,
    "off": False,
    "false": False,
    "no": False,
}


def _where(what: str) -> str:
    return f"{what}: " if what else ""


# --- hosts, ports and addresses ---------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only: ``localhost``, 127.0.0.0/8, ``::1`` (brackets allowed).

    The one rule for both sides: a listener there needs no TLS, and a launcher
    binds its embedded controller there when the job's master address is one.
    Linux routes all of 127.0.0.0/8 to the loopback interface and drops packets
    from other hosts addressed to it.
    """
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if name.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def is_wildcard(host: str) -> bool:
    """Whether a listener on ``host`` listens on every interface (``0.0.0.0``, ``::``, ``[::]``)."""
    return host.strip("[]") in _WILDCARDS


def check_host(host: str, what: str) -> None:
    """Raise :class:`ConfigError` unless ``host`` is an IP address or a plausible host name."""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    labels = host.split(".")
    if (
        not host
        or len(host) > 253
        or not host.isascii()
        or not all(
            label
            and len(label) <= 63
            and label.replace("-", "").replace("_", "").isalnum()
            and label[0] != "-"
            for label in labels
        )
    ):
        raise ConfigError(f"{_where(what)}{host!r} is neither an IP address nor a host name")


def check_port(port: int, what: str, *, allow_zero: bool = False) -> None:
    """Raise :class:`ConfigError` unless ``port`` is a TCP port (0 only with ``allow_zero``)."""
    low = 0 if allow_zero else 1
    if not low <= port <= 65535:
        raise ConfigError(f"{_where(what)}{port} is not a TCP port ({low}..65535)")


class Address(NamedTuple):
    """A checked ``HOST:PORT``: the host without brackets; ``str()`` writes it back (brackets for IPv6)."""

    host: str
    port: int

    def __str__(self) -> str:
        return join_address(self.host, self.port)


def parse_address(text: str, what: str = "controller address", *, allow_zero: bool = False) -> Address:
    """``HOST:PORT`` (IPv6 as ``[::1]:PORT``) split and checked; port 0 only with ``allow_zero``.

    :raises ConfigError: naming ``what``.
    """
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not port_text.isdigit() or not port_text.isascii() or len(port_text) > 5:
        raise ConfigError(f"{_where(what)}{text!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            raise ConfigError(f"{_where(what)}{text!r}: brackets are for IPv6 hosts only")
    elif ":" in host:
        raise ConfigError(f"{_where(what)}{text!r}: an IPv6 host goes in brackets, e.g. [::1]:8899")
    check_host(host, what)
    port = int(port_text)
    check_port(port, what, allow_zero=allow_zero)
    return Address(host, port)


def join_address(host: str, port: int) -> str:
    """``HOST:PORT``, with an IPv6 host in brackets (what :func:`parse_address` reads back)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_addresses(text: str, what: str = "controller addresses") -> tuple[Address, ...]:
    """A comma-separated list of ``HOST:PORT`` (``A,B,C``), in order, each once; at least one."""
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise ConfigError(f"{_where(what)}no address given; expected HOST:PORT[,HOST:PORT...]")
    if not all(items):
        raise ConfigError(f"{_where(what)}{text!r} has an empty entry; expected HOST:PORT[,HOST:PORT...]")
    addresses = tuple(parse_address(item, what) for item in items)
    if len(set(addresses)) != len(addresses):
        raise ConfigError(f"{_where(what)}{text!r} names an address twice")
    return addresses


def parse_controller(text: str, what: str = "controller address") -> str:
    """A controller address, or every replica's comma-separated, as given (spaces dropped) once
    :func:`parse_addresses` accepted them."""
    parse_addresses(text, what)
    return ",".join(part.strip() for part in text.split(","))


# --- seconds and counts ---------------------------------------------------------------


def _up_to(high: float) -> str:
    return f"{high:g} (a day)" if high == MAX_SECONDS else f"{high:g}"


def check_seconds(value: float, what: str, *, positive: bool = False, high: float = MAX_SECONDS) -> None:
    """Raise :class:`ConfigError` unless ``value`` is finite seconds (>= 0, or > 0) up to ``high``."""
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0) and value <= high):
        rule = (
            f"a positive number of seconds up to {_up_to(high)}"
            if positive
            else (f"a number of seconds from 0 to {_up_to(high)}")
        )
        raise ConfigError(f"{what} must be {rule}, not {value}")


def parse_seconds(text: str, what: str = "", *, positive: bool = False, high: float = MAX_SECONDS) -> float:
    """Finite seconds (>= 0, or > 0 with ``positive``, at most ``high``) from ``text``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        rule = "> 0" if positive else ">= 0"
        raise ConfigError(f"{_where(what)}{text!r} is not a finite number of seconds {rule}")
    if value > high:
        day = " (a day)" if high == MAX_SECONDS else ""
        raise ConfigError(f"{_where(what)}{text!r} is more than {high:g} seconds{day}")
    return value


def check_count(value: int, what: str, *, low: int = 0, high: int = MAX_INT32) -> None:
    """Raise :class:`ConfigError` unless ``low <= value <= high``."""
    if value < low:
        raise ConfigError(f"{what} must be at least {low}, not {value}")
    if value > high:
        raise ConfigError(f"{what} must be at most {high}, not {value}")


def parse_count(text: str, what: str = "", *, low: int = 0, high: int = MAX_INT32) -> int:
    """A whole number in ``low..high`` from ``text``."""
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise ConfigError(f"{_where(what)}{text!r} is not a whole number >= {low}")
    if value > high:
        raise ConfigError(f"{_where(what)}{text!r} is more than {high}")
    return value


def parse_port(text: str, what: str = "", *, allow_zero: bool = True) -> int:
    """A TCP port from ``text``: 0..65535 (0, any free one, only with ``allow_zero``)."""
    low = 0 if allow_zero else 1
    stripped = text.strip()
    if not (stripped.isdigit() and stripped.isascii() and low <= int(stripped) <= 65535):
        raise ConfigError(f"{_where(what)}{text!r} is not a TCP port ({low}..65535)")
    return int(stripped)


# --- signals, modules, switches and secrets -----------------------------------------------


def parse_signal(text: str, what: str = "", *, catchable: bool = False) -> signal.Signals:
    """A signal by name (``USR1``, ``SIGUSR1``) or number; with ``catchable``, none a process cannot catch."""
    name = text.strip().upper()
    try:
        sig = (
            signal.Signals(int(name))
            if name.isdigit()
            else signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
        )
    except (KeyError, ValueError):
        raise ConfigError(f"{_where(what)}unknown signal {text!r}") from None
    if catchable:
        check_catchable(sig, what)
    return sig


def check_catchable(sig: signal.Signals, what: str) -> None:
    """Raise :class:`ConfigError` for a signal a process cannot catch (``SIGKILL``, ``SIGSTOP``)."""
    if sig in UNCATCHABLE:
        raise ConfigError(
            f"{_where(what)}{sig.name} cannot be caught, so no worker can save its state on it; "
            "pick a signal the workers handle (the default is SIGUSR1)"
        )


def parse_modules(text: str, what: str = "") -> tuple[str, ...]:
    """Module names, comma separated (``''`` for none)."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if not all(part.isidentifier() for part in n.split("."))]
    if bad:
        raise ConfigError(f"{_where(what)}not module names: {', '.join(bad)}")
    return names


def parse_switch(text: str, what: str = "") -> bool:
    """On or off: ``1``/``on``/``true``/``yes`` or ``0``/``off``/``false``/``no`` (any case)."""
    try:
        return _SWITCHES[text.strip().lower()]
    except KeyError:
        raise ConfigError(
            f"{_where(what)}{text!r} is neither on (1, on, true, yes) nor off (0, off, false, no)"
        ) from None


def check_secret(value: str, what: str) -> None:
    """Tokens and launch identities: printable ASCII without spaces, at most :data:`MAX_SECRET` long."""
    if len(value) > MAX_SECRET or not all("!" <= c <= "~" for c in value):
        raise ConfigError(f"{what}: must be printable ASCII without spaces, at most {MAX_SECRET} characters")


# --- paths TaskD writes -------------------------------------------------------------------


def check_writable_file(path: Path, what: str = "") -> Path:
    """``path`` if TaskD can create or replace a file there: its directory exists and is writable.

    Checked before anything starts, so that a typo ends at once with one line
    rather than after the work the file was for.
    """
    where = f"{what} {path}" if what else str(path)
    parent = path.parent
    if path.is_dir():
        raise ConfigError(f"{where}: is a directory; give the path of a file")
    if not parent.is_dir():
        raise ConfigError(f"{where}: directory {parent} does not exist; create it first (mkdir -p {parent})")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{where}: directory {parent} is not writable by this process (its permissions, or a read-only "
            "mount); pick another place"
        )
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(
            f"{where}: the file is not writable by this process (its permissions, or a read-only mount); "
            f"make it writable (chmod u+w {path}) or pick another"
        )
    return path


def check_creatable_dir(path: Path, what: str = "") -> Path:
    """``path`` if it is, or can be made, a writable directory: its nearest existing ancestor is one."""
    where = f"{what} {path}" if what else str(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{where}: {existing} is a file, not a directory; pick a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: {existing} is not writable by this process; pick another directory")
    return path


# --- argparse -----------------------------------------------------------------------------


def argtype(convert: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse ``type=`` from one of the parsers above: its :class:`ConfigError` becomes a usage error."""
    import argparse  # here: workers import this module, and only command lines need argparse

    def checked(text: str) -> T:
        try:
            return convert(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    checked.__name__ = getattr(convert, "__name__", "value")
    return checked


def cannot_bind(what: str, host: str, port: int, exc: Exception) -> ConfigError:
    """What a failed bind of ``host:port`` means, found out again with a plain socket."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        return ConfigError(
            f"{what}: cannot resolve {host!r} ({err.strerror}); give an address of this machine"
        )
    family, kind, proto, _, address = infos[0]
    # The plain socket binds: the port is free and the address is ours, so the cause is elsewhere.
    reason = f"{exc}; the address and port themselves are usable"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as err:
            reason = {
                errno.EADDRINUSE: "the port is in use; pick a free port",
                errno.EADDRNOTAVAIL: "not an address of this machine; give one of its addresses",
                errno.EACCES: f"port {port} needs privileges; pick one above 1023",
            }.get(err.errno or 0, err.strerror or str(err))
    return ConfigError(f"{what}: cannot bind on {host} ({reason})")
