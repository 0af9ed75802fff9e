"""Every manifest under deploy/: lint-clean, valid against published schemas, and consistent with TaskD itself.

Kubernetes' own kinds are validated by kubernetes-validate (strict: unknown
fields fail); the PyTorchJob against the training operator's SDK schema
(:mod:`kubeflow_schema`). Beyond schemas, the flags, environment variables,
policy file and certificates the manifests use are the ones TaskD reads:
a real controller is started with the Deployment's own arguments.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubeflow_schema import problems

from taskd_core.cli import build_parser
from taskd_core.controller.policy import load_policies
from taskd_core.controller.server import REPLICA_HEALTH
from taskd_core.testing import free_port
from tests.conftest import WAIT, ControllerProcess
from tests.etcd_server import EtcdServer

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
KUSTOMIZATIONS = ("controller", "etcd", "pytorch", "mindspore")
CONTROLLER_ADDRESS = "taskd-controller.taskd.svc.cluster.local:8899"


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _manifests() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*.yaml") if any("kind" in d for d in _documents(p)))


def _validate(doc: dict[str, Any], where: str) -> list[str]:
    if doc["kind"] == "PyTorchJob":
        return problems(doc, "KubeflowOrgV1PyTorchJob", where)
    try:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{where}: {exc.message} at {'.'.join(map(str, exc.path))}"]
    return []


def _kind(directory: str, kind: str) -> dict[str, Any]:
    (doc,) = [d for p in sorted((K8S / directory).glob("*.yaml")) for d in _documents(p) if d["kind"] == kind]
    return doc


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_yamllint_passes_on_deploy() -> None:
    done = subprocess.run([sys.executable, "-m", "yamllint", "--strict", str(DEPLOY)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("path", _manifests(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifest_is_valid_against_its_schema(path: Path) -> None:
    where = str(path.relative_to(ROOT))
    found = [p for doc in _documents(path) if doc["kind"] != "Kustomization" for p in _validate(doc, where)]
    assert found == []


def test_schema_check_catches_mistakes() -> None:
    job = _kind("pytorch", "PyTorchJob")
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "two"
    job["spec"]["runPolicy"]["cleanupPolicy"] = "All"
    job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "x"
    found = "\n".join(_validate(job, "job"))
    assert "'two' is not int" in found
    assert "cleanupPolicy: not a field of KubeflowOrgV1RunPolicy" in found
    assert "imagePullPolice" in found


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_kustomization_lists_files_that_exist_and_secrets_stay_out_of_git(directory: str) -> None:
    kustomization = _documents(K8S / directory / "kustomization.yaml")[0]
    for resource in kustomization["resources"]:
        assert (K8S / directory / resource).is_file(), resource
    generated = [f.partition("=")[2] or f for g in kustomization.get("secretGenerator", []) for f in g["files"]]
    assert generated and all(f.startswith("secrets/") for f in generated)
    ignored = subprocess.run(["git", "check-ignore", "-q", f"deploy/k8s/{directory}/secrets/x"], cwd=ROOT,
                             timeout=60, check=False)
    assert ignored.returncode == 0


@pytest.fixture(scope="module")
def secrets_tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A copy of deploy/k8s with the secrets make-secrets.sh writes (the checkout stays clean)."""
    if shutil.which("openssl") is None:
        pytest.skip("make-secrets.sh needs openssl")
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("secrets"))
    done = subprocess.run(["bash", str(tree / "make-secrets.sh")], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    yield tree


def test_make_secrets_writes_what_kustomize_needs_and_refuses_to_overwrite(secrets_tree: Path) -> None:
    for directory in KUSTOMIZATIONS:
        kustomization = _documents(secrets_tree / directory / "kustomization.yaml")[0]
        for generator in kustomization["secretGenerator"]:
            for spec in generator["files"]:
                path = secrets_tree / directory / (spec.partition("=")[2] or spec)
                assert path.stat().st_size > 0 and path.stat().st_mode & 0o077 == 0, path
    host = CONTROLLER_ADDRESS.rpartition(":")[0]
    san = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in",
                          str(secrets_tree / "controller/secrets/controller.pem")],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert f"DNS:{host}" in san
    verified = subprocess.run(["openssl", "verify", "-CAfile", str(secrets_tree / "controller/secrets/ca.pem"),
                               str(secrets_tree / "pytorch/secrets/node.pem")],
                              capture_output=True, text=True, timeout=60, check=False)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    again = subprocess.run(["bash", str(secrets_tree / "make-secrets.sh")], capture_output=True, text=True,
                           timeout=120, check=False)
    assert again.returncode == 1
    assert "delete deploy/k8s/*/secrets/ to make new secrets" in again.stderr


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) is not installed")
@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_kustomize_build_renders_valid_resources(secrets_tree: Path, directory: str) -> None:
    done = subprocess.run(["kubectl", "kustomize", str(secrets_tree / directory)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert [p for doc in docs for p in _validate(doc, directory)] == []
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    referenced = set(yaml.safe_dump(docs).split()) & secrets
    # Every generated Secret is referenced under its final (possibly hashed) name.
    assert referenced == secrets


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` substitution in container arguments."""
    for name, text in env.items():
        value = value.replace(f"$({name})", text)
    return value


POD_ENV = {"POD_NAME": "taskd-controller-0", "NAMESPACE": "taskd"}


def test_controller_statefulset_runs_a_real_replica_on_a_real_etcd_with_its_arguments(
    secrets_tree: Path, tmp_path: Path
) -> None:
    """The StatefulSet's own arguments, paths mapped to this machine, against an etcd that requires
    the client certificate make-secrets.sh wrote (serving with the members' certificate it wrote)."""
    statefulset = _kind("controller", "StatefulSet")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    health = container["readinessProbe"]["grpc"]["port"]
    assert container["livenessProbe"]["grpc"] == {"port": health, "service": REPLICA_HEALTH}
    admin = tmp_path / "admin"
    admin.mkdir()
    shutil.copy(secrets_tree / "controller/secrets/admin.token", admin / "token")
    # As the kubelet mounts it: the volume's mode, owned by root with the pod's fsGroup.
    pod = statefulset["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mounts["/etc/taskd/admin"]]
    (admin / "token").chmod(volume["secret"]["defaultMode"])
    if os.geteuid() == 0:
        os.chown(admin / "token", 0, pod["securityContext"]["fsGroup"])
    local = {"/etc/taskd/policy": K8S / "controller", "/etc/taskd/tls": secrets_tree / "controller/secrets",
             "/etc/taskd/etcd": secrets_tree / "controller/secrets/etcd", "/etc/taskd/admin": admin}
    assert set(local) == set(mounts)
    etcd_tls = secrets_tree / "etcd/secrets"
    client = secrets_tree / "controller/secrets/etcd"
    server = EtcdServer(tmp_path / "etcd", tls=(str(etcd_tls / "server.pem"), str(etcd_tls / "server.key"),
                                                 str(etcd_tls / "ca.pem")),
                        client=(str(client / "client.pem"), str(client / "client.key"))).start()
    probe_port = free_port()
    args = []
    for arg in container["args"][1:]:
        flag, _, value = arg.partition("=")
        value = _expand(value, POD_ENV)
        for pod_path, here in sorted(local.items(), key=lambda kv: -len(kv[0])):
            value = value.replace(pod_path, str(here))
        if flag == "--state":
            value = f"etcd://{server.endpoint}/{value.rpartition('/')[2]}"
        value = {"--listen": "127.0.0.1:0", "--health-port": str(probe_port)}.get(flag, value)
        args.append(f"{flag}={value}")
    assert container["args"][0] == "controller"
    load_policies(K8S / "controller/policy.toml")
    try:
        child = ControllerProcess(server.url("unused"), tuple(args), tmp_path / "controller.log")
        try:
            with grpc.insecure_channel(f"127.0.0.1:{probe_port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                ready = stub.Check(health_pb2.HealthCheckRequest(), timeout=WAIT)
                alive = stub.Check(health_pb2.HealthCheckRequest(service=REPLICA_HEALTH), timeout=WAIT)
            assert ready.status == alive.status == health_pb2.HealthCheckResponse.SERVING
            assert "leads, generation" in child.log.read_text()
        finally:
            assert child.terminate() == 0
    finally:
        server.kill()


def test_services_reach_the_leader_and_name_each_replica() -> None:
    (service,) = _documents(K8S / "controller/service.yaml")
    (peers,) = _documents(K8S / "controller/service-peers.yaml")
    statefulset = _kind("controller", "StatefulSet")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (port,) = service["spec"]["ports"]
    assert ports[port["targetPort"]] == port["port"] == int(CONTROLLER_ADDRESS.rpartition(":")[2])
    assert f"--listen=0.0.0.0:{port['port']}" in container["args"]
    assert service["metadata"]["name"] == CONTROLLER_ADDRESS.split(".")[0]
    assert _documents(K8S / "controller/kustomization.yaml")[0]["namespace"] == CONTROLLER_ADDRESS.split(".")[1]
    # Standbys advertise the replica's name under the headless Service, which the certificate covers.
    assert statefulset["spec"]["serviceName"] == peers["metadata"]["name"] and peers["spec"]["clusterIP"] == "None"
    advertise = _expand(next(a for a in container["args"] if a.startswith("--advertise=")), POD_ENV)
    assert advertise == f"--advertise=taskd-controller-0.{peers['metadata']['name']}.taskd.svc.cluster.local:8899"
    assert statefulset["spec"]["replicas"] == 3


def test_the_controllers_state_names_every_etcd_member_the_certificates_cover(secrets_tree: Path) -> None:
    etcd = _kind("etcd", "StatefulSet")
    (member,) = etcd["spec"]["template"]["spec"]["containers"]
    (container,) = _kind("controller", "StatefulSet")["spec"]["template"]["spec"]["containers"]
    state = next(a for a in container["args"] if a.startswith("--state=")).partition("=")[2]
    hosts = [e.rpartition(":")[0] for e in state.removeprefix("etcd://").partition("/")[0].split(",")]
    service = _kind("etcd", "Service")["metadata"]["name"]
    assert hosts == [f"{etcd['metadata']['name']}-{n}.{service}.taskd.svc.cluster.local"
                     for n in range(etcd["spec"]["replicas"])]
    assert "--client-cert-auth" in member["args"] and "--etcd-cert=/etc/taskd/etcd/client.pem" in container["args"]
    san = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in",
                          str(secrets_tree / "etcd/secrets/server.pem")],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert all(f"DNS:{host}" in san for host in hosts)
    verified = subprocess.run(["openssl", "verify", "-CAfile", str(secrets_tree / "etcd/secrets/ca.pem"),
                               str(secrets_tree / "controller/secrets/etcd/client.pem")],
                              capture_output=True, text=True, timeout=60, check=False)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def _job_containers() -> list[tuple[str, dict[str, Any]]]:
    job = _kind("pytorch", "PyTorchJob")
    msrun = _kind("mindspore", "Job")
    return [
        *((f"pytorch {role}", spec["template"]["spec"]["containers"][0])
          for role, spec in job["spec"]["pytorchReplicaSpecs"].items()),
        ("mindspore", msrun["spec"]["template"]["spec"]["containers"][0]),
    ]


@pytest.mark.parametrize(("name", "container"), _job_containers(), ids=lambda v: v if isinstance(v, str) else "")
def test_training_pods_reach_the_controller_with_tls_and_their_job_token(name: str, container: dict[str, Any]) -> None:
    env = _env(container)
    assert env["TASKD_CONTROLLER"] == CONTROLLER_ADDRESS
    assert set(env["TASKD_JOB_TOKEN"]["secretKeyRef"]) == {"name", "key"}
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    for variable in ("TASKD_TLS_CA", "TASKD_TLS_CERT", "TASKD_TLS_KEY"):
        assert os.path.dirname(env[variable]) in mounted


@pytest.mark.slow  # imports torch (taskdrun's parser is torchrun's)
def test_pytorchjob_command_is_one_taskdrun_accepts() -> None:
    (_, container), *_ = _job_containers()
    script = container["command"][-1]
    env = {"RANK": "0", "MASTER_ADDR": "taskd-ddp-master-0", "MASTER_PORT": "23456", "TASKD_JOB_ID": "taskd-ddp"}
    expanded = script
    for key, value in env.items():
        expanded = expanded.replace(f"${key}", value)
    argv = shlex.split(expanded)
    assert argv[:2] == ["exec", "taskdrun"]
    from taskd_pytorch.options import build_parser as taskdrun_parser

    args = taskdrun_parser().parse_args(argv[2:])
    assert (args.nnodes, args.node_rank, args.rdzv_endpoint) == ("2", 0, "taskd-ddp-master-0:23456")
    job = _kind("pytorch", "PyTorchJob")
    assert sum(r["replicas"] for r in job["spec"]["pytorchReplicaSpecs"].values()) == int(args.nnodes)


def test_mindspore_job_runs_msrun_with_fault_tolerance_on() -> None:
    msrun = _kind("mindspore", "Job")
    (container,) = msrun["spec"]["template"]["spec"]["containers"]
    assert _env(container)["MS_ENABLE_TFT"] == "{ARF:1}"
    script = container["command"][-1]
    assert "exec msrun " in script and '--node_rank="$JOB_COMPLETION_INDEX"' in script
    assert msrun["spec"]["completionMode"] == "Indexed"
    assert f"--worker_num={2 * msrun['spec']['completions']}" in script
    assert msrun["spec"]["template"]["spec"]["subdomain"] == _kind("mindspore", "Service")["metadata"]["name"]


def test_controller_arguments_parse_with_taskd() -> None:
    (container,) = _kind("controller", "StatefulSet")["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args([_expand(a, POD_ENV) for a in container["args"]])
    assert (args.health_port, args.tls_client_ca, args.lease_ttl) == (8898, "/etc/taskd/tls/ca.pem", 2)
    assert args.state.startswith("etcd://") and args.etcd_cacert == "/etc/taskd/etcd/ca.pem"
