"""What a launch shows the controller: job token, launch identity, TLS files, unique default job id."""

from __future__ import annotations

import hashlib

import pytest

from taskd_core.cli import build_parser
from taskd_core.errors import ConfigError
from taskd_core.launcher.flags import OptionValues, node_settings
from taskd_core.launcher.settings import NodeSettings


def settings(argv: list[str], env: dict[str, str] | None = None) -> NodeSettings:
    args = build_parser().parse_args(["run", *argv, "--", "true"])
    return node_settings(
        OptionValues(env or {}, args),
        launcher="taskd",
        shared=f"{args.master_addr}:{args.master_port}",
        node_rank=args.node_rank,
        nnodes=args.nnodes,
        master_addr=args.master_addr,
    )


def test_one_node_generates_a_token_and_a_unique_job_id_per_launch() -> None:
    first, second = settings([]), settings([])
    for one in (first, second):
        assert len(one.agent.credentials.token) >= 40 and one.job_id.startswith("taskd-")
    assert first.agent.credentials.token != second.agent.credentials.token
    assert first.job_id != second.job_id and first.agent.credentials.launch != second.agent.credentials.launch
    assert first.agent.credentials.token not in repr(first)  # the token is never shown
    assert settings([], {"TASKD_JOB_TOKEN": "mine"}).agent.credentials.token == "mine"


def test_nodes_of_one_launch_agree_on_job_id_and_launch_identity() -> None:
    env = {"TASKD_JOB_TOKEN": "shared"}
    argv = ["--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "29400", "--insecure"]
    node0, node1 = (settings([*argv, "--node-rank", str(n)], env) for n in (0, 1))
    assert node0.job_id == node1.job_id and node0.job_id.startswith("taskd-")
    assert node0.agent.credentials == node1.agent.credentials
    other = settings([*argv[:-3], "29401", "--insecure"], env)
    assert other.job_id != node0.job_id  # another rendezvous, another launch


def test_a_multi_node_job_id_cannot_be_computed_without_the_token() -> None:
    """Whoever knows only the master address and port cannot claim the default id before the launch."""
    argv = ["--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "29400", "--insecure"]
    real = settings(argv, {"TASKD_JOB_TOKEN": "the-secret"})
    guess = "taskd-" + hashlib.sha256(b"10.0.0.1:29400").hexdigest()[:12]
    assert real.job_id != guess and guess[6:] not in real.agent.credentials.launch
    attacker = settings(argv, {"TASKD_JOB_TOKEN": "another"})
    assert attacker.job_id != real.job_id
    assert attacker.agent.credentials.launch != real.agent.credentials.launch


def test_several_nodes_need_a_shared_token_beyond_loopback() -> None:
    with pytest.raises(ConfigError, match="needs TASKD_JOB_TOKEN"):
        settings(["--nnodes", "2", "--master-addr", "10.0.0.1"])
    with pytest.raises(ConfigError, match="needs TASKD_JOB_TOKEN"):
        settings(["--nnodes", "2", "--controller", "10.0.0.9:8899"])
    legacy = settings(["--nnodes", "2", "--master-addr", "127.0.0.1"])  # loopback: a legacy job
    assert legacy.agent.credentials.token == ""


def test_tls_files_come_from_the_flag_or_the_environment() -> None:
    env = {"TASKD_TLS_CA": "/env/ca.pem", "TASKD_TLS_CERT": "/c.pem", "TASKD_TLS_KEY": "/k.pem"}
    assert settings([], env).agent.credentials.tls_ca == "/env/ca.pem"
    flagged = settings(["--tls-ca", "/flag/ca.pem", "--insecure"], env)
    assert (flagged.agent.credentials.tls_ca, flagged.agent.credentials.tls_cert) == (
        "/flag/ca.pem",
        "/c.pem",
    )
    assert flagged.insecure and not settings([]).insecure
