"""What TLS and job tokens cost: fault → strategy latency and an idle agent's CPU, secured vs plaintext.

For each mode a ``taskd controller`` child process (state ``:memory:``, no
flush window) serves one client, a real ``DLRecoverManager`` in a child
process of its own:

* ``plaintext``: no TLS, no token (a legacy job on loopback);
* ``tls+token``: TLS (a trustme CA and certificate) and a job token;
* ``mtls+token``: mutual TLS (the client presents its certificate) and a job token.

Part 1, latency: the client reports a fault and answers every signal at once
from its handler (stopped, strategies, recovered); the time from calling
``report_process_fault`` to the ``changeStrategy`` signal arriving in the
handler is one sample, over ``--cycles`` cycles.

Part 2, idle CPU: the client holds the signal stream and calls HealthCheck at
the node agent's interval, and measures its own ``time.process_time()`` over
``--seconds``, as % of one core.

Part 3, one call: ``--calls`` HealthCheck calls back to back on the same
kind of channel (TLS and the token's metadata included): the p50 of one call.

The three controllers run side by side for the whole bench, and the clients
take turns in ``--rounds`` rounds (each round runs every mode once, in a
rotated order, with its share of the cycles and seconds), so a change in the
machine's load falls on every mode alike.

Run::

    .venv/bin/python bench/security_bench.py --cycles 200 --seconds 20 --json /tmp/security.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import PYTHON, Children, fmt, markdown_table, percentile, poll_until, setup_logging, write_json

from taskd_core.agent.node_agent import AgentConfig
from taskd_core.client.manager import DLRecoverManager
from taskd_core.models import Credentials, Signal
from taskd_core.rpc import recover_pb2 as pb
from taskd_core.rpc import recover_pb2_grpc
from taskd_core.rpc.security import open_channel

MODES = ("plaintext", "tls+token", "mtls+token")
#: HealthCheck calls per client child (part 3).
CALLS = 100
TOKEN = "bench-token"
#: The node agent's HealthCheck interval (its AgentConfig default).
AGENT_HEALTH = AgentConfig(job_id="security-bench", controller="127.0.0.1:1").health_interval
#: Targets of issue 14: what TLS + tokens may add.
LATENCY_TARGET_MS = 2.0
IDLE_TARGET_POINTS = 0.2


def make_pki(root: Path) -> dict[str, str]:
    """A CA, the controller's certificate and a client certificate, as files under ``root``."""
    import trustme

    ca = trustme.CA()
    files = {"ca": root / "ca.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    for name, identity in (("server", "127.0.0.1"), ("client", "agent.bench.test")):
        cert = ca.issue_cert(identity)
        files[name] = root / f"{name}.pem"
        files[f"{name}_key"] = root / f"{name}.key"
        files[name].write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
        cert.private_key_pem.write_to_path(str(files[f"{name}_key"]))
    return {k: str(v) for k, v in files.items()}


def credentials(mode: str, pki: dict[str, str]) -> Credentials:
    if mode == "plaintext":
        return Credentials()
    if mode == "tls+token":
        return Credentials(tls_ca=pki["ca"], token=TOKEN)
    return Credentials(pki["ca"], pki["client"], pki["client_key"], TOKEN)


def start_controller(children: Children, mode: str, pki: dict[str, str], workdir: Path) -> str:
    port_file = workdir / f"{mode}.port"
    tls = {
        "plaintext": [],
        "tls+token": ["--tls-cert", pki["server"], "--tls-key", pki["server_key"]],
        "mtls+token": ["--tls-cert", pki["server"], "--tls-key", pki["server_key"], "--tls-client-ca", pki["ca"]],
    }[mode]
    children.start(
        [
            PYTHON, "-m", "taskd_core", "--log-level", "WARNING", "controller", "--listen", "127.0.0.1:0",
            "--state", ":memory:", "--port-file", str(port_file), "--flush-seconds", "0",
            "--report-timeout", "120", "--max-cycles", "1000000", "--strategies", "recover,exit", *tls,
        ],
        log=workdir / f"{mode}.log",
    )
    return poll_until(lambda: port_file.exists() and port_file.read_text().strip(), 60.0, f"{mode} controller")


class _Answerer:
    """A signal handler that answers every step of a cycle at once and times fault → changeStrategy."""

    def __init__(self) -> None:
        self.client: DLRecoverManager | None = None
        self.changed = threading.Event()
        self.at = 0.0

    def __call__(self, signal: Signal) -> None:
        assert self.client is not None
        if signal.signal_type == "stopTrain":
            self.client.report_stop_complete(0, "stopped", {0: 1})
        elif signal.signal_type == "globalFault":
            self.client.report_recover_strategy({0: 1}, ["recover", "exit"])
        elif signal.signal_type == "changeStrategy":
            self.at = time.perf_counter()
            self.changed.set()
            self.client.report_recover_status(0, "recovered", {0: 1}, signal.change_strategy)


def client_child(mode: str, address: str, pki_json: str, cycles: int, seconds: float) -> None:
    """One client: its fault → changeStrategy samples and idle CPU %, printed as JSON."""
    answer = _Answerer()
    client = DLRecoverManager(
        pb.ClientInfo(jobId=f"security-{mode}", role="bench"),
        address,
        agent_id="node-0",
        rank_ids=(0,),
        handler=answer,
        health_interval=AGENT_HEALTH,
        credentials=credentials(mode, json.loads(pki_json)),
    )
    answer.client = client
    try:
        client.init_clusterd()
        client.register()
        threading.Thread(target=client.start_subscribe, name="subscriber", daemon=True).start()
        time.sleep(2.0)  # subscribed
        samples = []
        for _ in range(cycles):
            answer.changed.clear()
            t0 = time.perf_counter()
            client.report_process_fault({0: 1})
            if not answer.changed.wait(60.0):
                raise RuntimeError("no changeStrategy within 60 s")
            samples.append(answer.at - t0)
            time.sleep(0.05)  # the recovered report lands before the next fault
        time.sleep(1.0)
        cpu0, t0 = time.process_time(), time.monotonic()
        time.sleep(seconds)
        idle = 100.0 * (time.process_time() - cpu0) / (time.monotonic() - t0)
        print(json.dumps({"latency_s": samples, "idle_cpu_percent": idle, "call_s": _calls(mode, address, pki_json)}))
    finally:
        client.close()


def _calls(mode: str, address: str, pki_json: str, calls: int = CALLS) -> list[float]:
    """Seconds of each of ``calls`` HealthCheck calls, back to back, on a channel of ``mode``."""
    with open_channel(address, credentials(mode, json.loads(pki_json))) as channel:
        stub = recover_pb2_grpc.RecoverStub(channel)
        info = pb.ClientInfo(jobId=f"security-{mode}")
        stub.HealthCheck(info, timeout=10.0)  # connected
        out = []
        for _ in range(calls):
            t0 = time.perf_counter()
            stub.HealthCheck(info, timeout=10.0)
            out.append(time.perf_counter() - t0)
    return out


def measure(cycles: int, seconds: float, rounds: int) -> dict[str, Any]:
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    calls: dict[str, list[float]] = {mode: [] for mode in MODES}
    idle: dict[str, list[float]] = {mode: [] for mode in MODES}
    per_cycles, per_seconds = max(1, cycles // rounds), seconds / rounds
    with tempfile.TemporaryDirectory(prefix="taskd-security-bench-") as tmp, Children() as children:
        workdir = Path(tmp)
        pki = make_pki(workdir)
        addresses = {mode: start_controller(children, mode, pki, workdir) for mode in MODES}
        for n in range(rounds):
            for mode in MODES[n % len(MODES) :] + MODES[: n % len(MODES)]:
                args = [mode, addresses[mode], json.dumps(pki), str(per_cycles), str(per_seconds)]
                proc = subprocess.run(
                    [PYTHON, __file__, "--client-child", *args],
                    capture_output=True, text=True, check=True, timeout=per_cycles * 5 + per_seconds + 120,
                )
                data = json.loads(proc.stdout.strip().splitlines()[-1])
                samples[mode] += data["latency_s"]
                calls[mode] += data["call_s"]
                idle[mode].append(data["idle_cpu_percent"])
    return {
        mode: {
            "p50_ms": percentile(samples[mode], 50) * 1e3,
            "p99_ms": percentile(samples[mode], 99) * 1e3,
            "n": len(samples[mode]),
            "idle_cpu_percent": sum(idle[mode]) / len(idle[mode]),
            "call_p50_ms": percentile(calls[mode], 50) * 1e3,
        }
        for mode in MODES
    }


def verdicts(results: dict[str, Any]) -> list[list[str]]:
    """The issue's targets, as rows of (target, measured, verdict); the worse secured mode counts."""
    plain = results["plaintext"]
    added_ms, worst_ms = max((results[m]["p50_ms"] - plain["p50_ms"], m) for m in MODES[1:])
    added_cpu, worst_cpu = max((results[m]["idle_cpu_percent"] - plain["idle_cpu_percent"], m) for m in MODES[1:])
    return [
        [
            f"TLS + token add < {LATENCY_TARGET_MS:g} ms to fault → strategy p50",
            f"{fmt(added_ms)} ms ({worst_ms} {fmt(results[worst_ms]['p50_ms'])} vs {fmt(plain['p50_ms'])})",
            "met" if added_ms < LATENCY_TARGET_MS else "missed",
        ],
        [
            f"TLS + token add < {IDLE_TARGET_POINTS:g} % of a core to an idle agent",
            (
                f"{fmt(added_cpu)} points ({worst_cpu} {fmt(results[worst_cpu]['idle_cpu_percent'])} vs"
                f" {fmt(plain['idle_cpu_percent'])} %)"
            ),
            "met" if added_cpu < IDLE_TARGET_POINTS else "missed",
        ],
    ]


def report(results: dict[str, Any]) -> str:
    rows = [
        [mode, int(r["n"]), fmt(r["p50_ms"]), fmt(r["p99_ms"]), fmt(r["call_p50_ms"], 3), fmt(r["idle_cpu_percent"])]
        for mode, r in ((m, results[m]) for m in MODES)
    ]
    return markdown_table(
        [
            "mode", "cycles", "fault → changeStrategy p50 (ms)", "p99 (ms)", "one HealthCheck p50 (ms)",
            "idle client CPU (% of a core)",
        ],
        rows,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=200)
    p.add_argument("--seconds", type=float, default=20.0, help="idle CPU window per mode (split over the rounds)")
    p.add_argument("--rounds", type=int, default=4, help="turns each mode takes (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--client-child", nargs=5, metavar=("MODE", "ADDR", "PKI", "CYCLES", "SECONDS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    setup_logging(args.log_level)
    if args.client_child:
        mode, address, pki_json, cycles, seconds = args.client_child
        client_child(mode, address, pki_json, int(cycles), float(seconds))
        return 0
    results = measure(args.cycles, args.seconds, args.rounds)
    print(report(results))
    print(markdown_table(["target", "measured", "verdict"], verdicts(results)))
    write_json(args.json, {"cycles": args.cycles, "seconds": args.seconds, "rounds": args.rounds, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
