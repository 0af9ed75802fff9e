"""``taskd controller``: run the recovery controller as a daemon."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any

from taskd_core.controller.etcd_client import EtcdTls, is_etcd_url, parse_etcd_url
from taskd_core.controller.policy import load_policies, parse_strategies
from taskd_core.controller.quotas import Quotas
from taskd_core.controller.runtime import Limits
from taskd_core.controller.server import ControllerConfig, ControllerServer, listen_address, serve
from taskd_core.errors import ConfigError
from taskd_core.rpc.security import ServerTls
from taskd_core.values import (
    DEFAULT_CONTROLLER,
    MAX_SECONDS,
    argtype,
    check_writable_file,
    join_address,
    parse_address,
    parse_count,
    parse_port,
    parse_seconds,
)

logger = logging.getLogger(__name__)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "controller",
        help="run the recovery controller (gRPC service Recover)",
        description="Run the ClusterD-compatible recovery controller until SIGTERM/SIGINT.",
    )
    p.add_argument(
        "--listen",
        default=DEFAULT_CONTROLLER,
        help="HOST:PORT to serve on; port 0 picks one. Any address but loopback needs TLS or --insecure "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--state",
        default="./taskd-state.db",
        help="SQLite state file (':memory:' keeps nothing), or etcd://HOST:PORT[,HOST:PORT...]/PREFIX for "
        "replicas sharing their state in etcd: one leads, the others stand by (default: %(default)s)",
    )
    p.add_argument("--policy", type=Path, help='TOML policy file with [defaults] and [jobs."<id>"] tables')
    p.add_argument("--strategies", help="default strategies, comma-separated, e.g. recover,dump,exit")
    seconds = argtype(parse_seconds)
    positive = argtype(lambda text: parse_seconds(text, positive=True))
    p.add_argument("--report-timeout", type=positive, metavar="S", help="deadline of each wait for reports")
    p.add_argument(
        "--flush-seconds", type=seconds, metavar="S", help="fault flush window before stopping training"
    )
    p.add_argument(
        "--max-cycles",
        type=argtype(parse_count),
        metavar="N",
        help="recovery cycles a job may use in the window",
    )
    p.add_argument(
        "--cycle-window",
        type=seconds,
        metavar="S",
        help="seconds over which --max-cycles counts; 0: a job's whole life (default: 3600)",
    )
    p.add_argument(
        "--keepalive-interval",
        type=positive,
        default=5.0,
        metavar="S",
        help="seconds between keep-alive signals (default: %(default)s)",
    )
    p.add_argument("--port-file", type=Path, help="write the bound HOST:PORT here once serving")
    p.add_argument(
        "--health-port",
        type=argtype(parse_port),
        metavar="PORT",
        help="also serve the gRPC health service alone, in plaintext, on this port of the --listen host "
        "(for Kubernetes gRPC probes, which cannot use TLS)",
    )
    rep = p.add_argument_group("replicas on etcd (see docs/deploy.md)")
    rep.add_argument(
        "--advertise",
        metavar="HOST:PORT",
        default="",
        help="where other hosts reach this replica; standbys send clients to the leader's "
        "(default: the --listen address, this host's name for a wildcard host)",
    )
    rep.add_argument(
        "--lease-ttl",
        type=argtype(lambda text: parse_count(text, high=int(MAX_SECONDS))),
        default=2,
        metavar="S",
        help="seconds of the leader's lease: a frozen or cut-off leader is replaced about this long "
        "later; one whose process ended, at once (default: %(default)s)",
    )
    rep.add_argument(
        "--etcd-timeout",
        type=positive,
        default=5.0,
        metavar="S",
        help="seconds to reach etcd at start before giving up (default: %(default)s)",
    )
    rep.add_argument(
        "--etcd-cacert", metavar="FILE", default="", help="CA that signed etcd's certificate (TLS to etcd)"
    )
    rep.add_argument("--etcd-cert", metavar="FILE", default="", help="client certificate for etcd (PEM)")
    rep.add_argument("--etcd-key", metavar="FILE", default="", help="the client certificate's private key")
    rep.add_argument(
        "--replace-policy",
        action="store_true",
        help="make this replica's policy the one every replica uses (the others, started with the old "
        "one, then stop leading and exit); without it a replica with another policy is refused",
    )
    sec = p.add_argument_group("security (see docs/security.md)")
    sec.add_argument("--tls-cert", metavar="FILE", help="serve TLS with this certificate (PEM chain)")
    sec.add_argument("--tls-key", metavar="FILE", help="the certificate's private key (PEM)")
    sec.add_argument(
        "--tls-client-ca", metavar="FILE", help="require client certificates signed by this CA (mutual TLS)"
    )
    sec.add_argument(
        "--insecure",
        action="store_true",
        help="allow plaintext on an address other hosts can reach (anyone there can read the traffic)",
    )
    sec.add_argument(
        "--allow-legacy-clients",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="accept jobs registered without a job token, as the reference's clients do "
        "(default: only on a loopback listener)",
    )
    sec.add_argument(
        "--admin-token-file", metavar="FILE", default="", help="token that may list and change every job"
    )
    sec.add_argument(
        "--abandon-after",
        type=positive,
        default=Limits().abandon_after,
        metavar="S",
        help="seconds a job whose agents are all silent stays its launch's; only then may a new launch "
        "with the same token take the id over. Keep it above the agents' --connect-timeout "
        "(default: %(default)s, the agents' default 60 s plus 30 s)",
    )
    quota = p.add_argument_group("quotas per job token and per host (see docs/security.md)")
    count = argtype(lambda text: parse_count(text, low=1))
    defaults = Quotas()
    for flag, field_name, what in (
        ("--max-jobs-per-token", "jobs_per_token", "jobs that have not ended one job token may hold"),
        ("--max-jobs-per-peer", "jobs_per_peer", "jobs that have not ended one host may have claimed"),
        ("--max-agents-per-token", "agents_per_token", "agents the jobs of one token may register"),
        ("--max-agents-per-peer", "agents_per_peer", "agents the jobs one host claimed may register"),
        ("--max-agents", "agents", "agents of all jobs together"),
        (
            "--max-requests-per-second",
            "requests_per_second",
            "requests a second one token or host may send on average (bursts of ten times as many pass)",
        ),
        (
            "--max-journal-bytes-per-second",
            "journal_bytes_per_second",
            "journal bytes a second the jobs of "
            "one token may write on average (bursts of 64 times as many pass)",
        ),
    ):
        default = int(getattr(defaults, field_name))
        quota.add_argument(
            flag,
            type=count,
            default=default,
            metavar="N",
            dest=f"quota_{field_name}",
            help=f"{what} (default: %(default)s)",
        )
    p.add_argument(
        "--metrics-port",
        type=argtype(parse_port),
        metavar="P",
        help="serve Prometheus /metrics on this port of the --listen host, over HTTPS with --tls-cert "
        "(0: any free port; default: off)",
    )
    p.set_defaults(func=run)


def server_tls(cert: str | None, key: str | None, client_ca: str | None) -> ServerTls | None:
    """The TLS settings the flags give; :class:`ConfigError` for an incomplete set."""
    if not cert and not key:
        if client_ca:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key: mutual TLS is TLS first")
        return None
    if not (cert and key):
        raise ConfigError("--tls-cert and --tls-key go together: give the certificate and its key")
    return ServerTls(cert, key, client_ca or "")


def etcd_tls(args: argparse.Namespace) -> EtcdTls | None:
    """TLS to etcd from the flags; None for plaintext. ConfigError when given without an etcd state."""
    if not (args.etcd_cacert or args.etcd_cert or args.etcd_key):
        return None
    if not is_etcd_url(args.state):
        raise ConfigError("--etcd-cacert/--etcd-cert/--etcd-key are for an etcd --state (etcd://...)")
    return EtcdTls(args.etcd_cacert, args.etcd_cert, args.etcd_key)


def run(args: argparse.Namespace) -> int:
    listen_address(args.listen)
    if args.port_file is not None:
        check_writable_file(args.port_file, "--port-file")
    if is_etcd_url(args.state):
        parse_etcd_url(args.state)  # a malformed URL is one line before anything else happens
    elif args.state != ":memory:":
        check_writable_file(Path(args.state), "--state")
    if args.lease_ttl < 1:
        raise ConfigError("--lease-ttl 0: the leader's lease needs at least 1 second")
    flags = {
        # An empty --strategies is an error, not "the default": parse it whenever it is given.
        "strategies": parse_strategies(args.strategies, key="--strategies")
        if args.strategies is not None
        else None,
        "report_timeout": args.report_timeout,
        "flush_seconds": args.flush_seconds,
        "max_cycles": args.max_cycles,
        "cycle_window": args.cycle_window,
    }
    policies = load_policies(args.policy, **{k: v for k, v in flags.items() if v is not None})
    logger.info("default policy: %s; %d job-specific policies", policies.defaults, len(policies.jobs))
    config = ControllerConfig(
        listen=args.listen,
        state=args.state,
        policies=policies,
        keepalive_interval=args.keepalive_interval,
        tls=server_tls(args.tls_cert, args.tls_key, args.tls_client_ca),
        insecure=args.insecure,
        allow_legacy=args.allow_legacy_clients,
        admin_token_file=args.admin_token_file,
        health_port=args.health_port,
        metrics_port=args.metrics_port,
        advertise=args.advertise,
        lease_ttl=args.lease_ttl,
        etcd_tls=etcd_tls(args),
        replace_policy=args.replace_policy,
        state_timeout=args.etcd_timeout,
        limits=Limits(abandon_after=args.abandon_after),
        quotas=Quotas(**{f.name: getattr(args, f"quota_{f.name}") for f in dataclasses.fields(Quotas)}),
    )

    def ready(server: ControllerServer) -> None:
        if args.port_file is not None:
            tmp = args.port_file.with_suffix(".tmp")
            try:
                tmp.write_text(server.address + "\n")
                tmp.replace(args.port_file)  # readers never see a half-written file
            except OSError as exc:
                raise ConfigError(f"--port-file {args.port_file}: cannot write it ({exc.strerror})") from None
        print(f"listening on {server.address}", flush=True)
        if server.metrics_port is not None:
            scheme = "http" if config.tls is None else "https"
            host = parse_address(server.address).host
            print(f"metrics on {scheme}://{join_address(host, server.metrics_port)}/metrics", flush=True)

    asyncio.run(serve(config, on_ready=ready, handle_signals=True))
    return 0
