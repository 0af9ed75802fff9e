"""The steps of one taskdrun node that need no workers: parsing the command line, the controller's address."""

from __future__ import annotations

import socket

import pytest

from taskd_core.controller.etcd_client import EtcdTls
from taskd_core.errors import ConfigError
from taskd_pytorch.launch import NodeJob, controller_host, parse
from taskd_pytorch.options import build_parser


def parsed(*argv: str) -> NodeJob:
    return parse(build_parser().parse_args([*argv, "train.py", "--lr", "1"]))


def test_one_node_without_a_rendezvous_is_torchruns_standalone() -> None:
    job = parsed("--nproc-per-node=2")
    assert (job.config.rdzv_backend, job.config.rdzv_endpoint, job.master_host) == ("c10d", "localhost:0", "localhost")
    # torchrun runs a script with this interpreter: `python -u train.py ...`.
    assert (job.entry_args[-3:], job.config.nproc_per_node) == (("train.py", "--lr", "1"), 2)
    assert job.options.node.job_id == job.config.run_id  # the generated rendezvous id names the job


def test_the_static_form_keeps_its_master_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASKD_JOB_TOKEN", "t")  # several nodes beyond loopback share a token
    job = parsed("--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.7", "--master-port=29511")
    assert (job.config.rdzv_backend, job.master_host, job.options.node.nnodes) == ("static", "10.0.0.7", 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--nnodes=1:2",), "--nnodes=1:2 with --rdzv-backend=static: a job whose number of nodes may change"),
        (("--duplicate-stdout-filters=x",), "does not support --duplicate-stdout-filters"),
    ],
)
def test_options_taskdrun_cannot_honour_are_config_errors(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parsed(*argv)


def test_the_elastic_form_keeps_min_and_max_with_a_rendezvous_that_has_rounds() -> None:
    job = parsed("--nnodes=2:3", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0")
    assert (job.config.min_nodes, job.config.max_nodes) == (2, 3)
    assert job.command()["--nnodes"] == "2:3"  # a spare or a late node must be started with it too


def test_the_controller_host_is_the_one_torch_gives_the_workers() -> None:
    assert controller_host("static", "10.0.0.7", None) == "10.0.0.7"
    assert controller_host("c10d", "127.0.0.2", "10.0.0.9") == "127.0.0.1"
    assert controller_host("c10d", "head", "10.0.0.9") == "10.0.0.9"
    assert controller_host("etcd-v2", "head", None) == socket.getfqdn()


def test_the_etcd_rendezvous_keeps_the_controller_replicas_state_in_its_etcd() -> None:
    job = parsed("--nnodes=3", "--rdzv-backend=etcd-v2", "--rdzv-endpoint=127.0.0.1", "--rdzv-id=my job/1")
    assert job.options.node.controller_state == "etcd://127.0.0.1:2379/taskd/rdzv/my%20job%2F1"
    assert job.options.node.etcd_tls is None
    # torch's own TLS options for its etcd client are the replicas' too (each backend names them its way).
    tls = parsed("--nnodes=2", "--rdzv-backend=etcd-v2", "--rdzv-endpoint=127.0.0.1:2400", "--rdzv-id=j",
                 "--rdzv-conf=protocol=https,ca_cert=/ca.pem,ssl_cert=/c.pem,ssl_cert_key=/k.pem")
    assert tls.options.node.etcd_tls == EtcdTls(ca="/ca.pem", cert="/c.pem", key="/k.pem")
    old = parsed("--nnodes=2", "--rdzv-backend=etcd", "--rdzv-endpoint=127.0.0.1:2400", "--rdzv-id=j",
                 "--rdzv-conf=protocol=https,cacert=/ca.pem")
    assert old.options.node.etcd_tls == EtcdTls(ca="/ca.pem")


def test_an_explicit_controller_or_another_rendezvous_keeps_the_state_in_memory() -> None:
    given = parsed("--nnodes=2", "--rdzv-backend=etcd-v2", "--rdzv-endpoint=127.0.0.1", "--taskd-controller=127.0.0.1:1")
    assert given.options.node.controller_state == ":memory:"
    assert parsed("--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1").options.node.controller_state == (
        ":memory:"
    )
