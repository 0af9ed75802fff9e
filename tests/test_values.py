"""The one home of values: addresses and lists of them, the loopback rule, and the bounds of every number."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import pytest

from taskd_core.errors import ConfigError
from taskd_core.values import (
    MAX_INT32,
    Address,
    argtype,
    check_catchable,
    check_creatable_dir,
    check_seconds,
    check_writable_file,
    is_loopback,
    is_wildcard,
    join_address,
    parse_address,
    parse_addresses,
    parse_count,
    parse_port,
    parse_seconds,
    parse_signal,
    parse_switch,
)


def test_loopback_is_one_rule_for_binds_and_dials() -> None:
    """All of 127/8 and ::1 (bracketed or IPv4-mapped too) and localhost; nothing another host can reach."""
    assert all(
        is_loopback(h)
        for h in ("127.0.0.1", "127.0.0.2", "127.255.0.9", "::1", "[::1]", "localhost", "LOCALHOST", "::ffff:127.0.0.3")
    )
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "[::]", "10.0.0.1", "192.0.2.2", "node0", "", "::ffff:10.0.0.1"))
    assert all(is_wildcard(h) for h in ("0.0.0.0", "::", "[::]"))
    assert not is_wildcard("127.0.0.1")


def test_addresses_round_trip_with_ipv6_in_brackets() -> None:
    assert parse_address("[::1]:8899") == Address("::1", 8899)
    assert str(parse_address(" node-1.cluster:29500 ")) == "node-1.cluster:29500"
    assert parse_address(join_address("fd00::5", 9000)) == ("fd00::5", 9000)
    assert str(Address("fd00::5", 9000)) == "[fd00::5]:9000"
    assert parse_address("127.0.0.1:0", allow_zero=True).port == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("::::", "is not HOST:PORT"),
        ("fd00::5:9000", "an IPv6 host goes in brackets"),
        ("[node]:80", "brackets are for IPv6 hosts only"),
        ("host:0", "0 is not a TCP port"),
        ("host:123456", "is not HOST:PORT"),
        ("hôst:80", "neither an IP address nor a host name"),
        ("host:８０", "is not HOST:PORT"),
    ],
)
def test_bad_addresses_are_named(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"^--x: .*{message}"):
        parse_address(text, "--x")


def test_address_lists_for_several_controllers() -> None:
    """What `--controller A,B,C` and TASKD_CONTROLLER=A,B,C parse to: each address once, in order."""
    assert parse_addresses("a:1, [::1]:2,10.0.0.3:3") == (Address("a", 1), Address("::1", 2), Address("10.0.0.3", 3))
    assert parse_addresses("a:1") == (Address("a", 1),)
    for text, message in (("", "no address given"), ("a:1,,b:2", "empty entry"), ("a:1,a:1", "twice"), ("a:1,b", "not HOST:PORT")):
        with pytest.raises(ConfigError, match=f"TASKD_CONTROLLER: .*{message}"):
            parse_addresses(text, "TASKD_CONTROLLER")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1e308", r"'1e308' is more than 86400 seconds \(a day\)"),
        ("86400.5", "is more than 86400 seconds"),
        ("nan", "'nan' is not a finite number of seconds >= 0"),
        ("inf", "is not a finite number"),
        ("-1", "is not a finite number of seconds >= 0"),
    ],
)
def test_seconds_are_finite_and_at_most_a_day(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_seconds(text)
    assert parse_seconds("86400") == 86400.0


def test_checked_seconds_say_the_bound() -> None:
    with pytest.raises(ConfigError, match=r"stop timeout must be a number of seconds from 0 to 86400 \(a day\), not 1e\+308"):
        check_seconds(1e308, "stop timeout")
    with pytest.raises(ConfigError, match="a positive number of seconds"):
        check_seconds(0.0, "interval", positive=True)


def test_counts_fit_the_wire() -> None:
    assert parse_count(str(MAX_INT32)) == MAX_INT32
    with pytest.raises(ConfigError, match="'99999999999' is more than 2147483647"):
        parse_count("99999999999")
    with pytest.raises(ConfigError, match="'5' is more than 4"):
        parse_count("5", high=4)


@pytest.mark.parametrize("text", ["-1", "65536", "http", "99999", "８０"])
def test_ports(text: str) -> None:
    with pytest.raises(ConfigError, match=rf"{text!r} is not a TCP port \(0..65535\)"):
        parse_port(text)
    assert parse_port("0") == 0
    with pytest.raises(ConfigError, match=r"\(1..65535\)"):
        parse_port("0", allow_zero=False)


def test_a_signal_nobody_can_catch_is_no_dump_request() -> None:
    assert parse_signal("usr2", catchable=True) is signal.SIGUSR2
    assert parse_signal("9") is signal.SIGKILL  # as a signal it exists; only a request to save refuses it
    for text in ("KILL", "SIGSTOP", "19"):
        with pytest.raises(ConfigError, match="cannot be caught"):
            parse_signal(text, catchable=True)
    with pytest.raises(ConfigError, match="dump signal: SIGKILL cannot be caught"):
        check_catchable(signal.SIGKILL, "dump signal")


def test_switches() -> None:
    assert [parse_switch(t) for t in ("1", "ON", "true", "yes", "0", "off", "False", "no")] == [True] * 4 + [False] * 4
    with pytest.raises(ConfigError, match="TASKD_INSECURE: 'maybe' is neither on"):
        parse_switch("maybe", "TASKD_INSECURE")


def test_paths_taskd_writes(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert check_writable_file(tmp_path / "new.db", "--state") == tmp_path / "new.db"
    with pytest.raises(ConfigError, match="--port-file .*missing/port: directory .*missing does not exist; create it first"):
        check_writable_file(tmp_path / "missing" / "port", "--port-file")
    with pytest.raises(ConfigError, match="is a directory"):
        check_writable_file(tmp_path, "--state")
    assert check_creatable_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    with pytest.raises(ConfigError, match="file is a file, not a directory"):
        check_creatable_dir(tmp_path / "file" / "logs", "--log-dir")
    if os.geteuid() != 0:  # root may write anything; tests/controller/test_cli.py tries it as another user
        (tmp_path / "ro.db").write_text("")
        (tmp_path / "ro.db").chmod(0o444)
        with pytest.raises(ConfigError, match="read-only"):
            check_writable_file(tmp_path / "ro.db", "--state")


def test_argtype_makes_the_error_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="t")
    parser.add_argument("--n", type=argtype(parse_count))
    with pytest.raises(SystemExit) as ended:
        parser.parse_args(["--n", "99999999999"])
    assert ended.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "t: error: argument --n: '99999999999' is more than 2147483647"
