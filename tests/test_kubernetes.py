"""deploy/kubernetes against the Kubernetes schemas, offline (`kubernetes-validate --strict`), and
against each other (names, ports, the token, the probes); a broken copy must fail the validator."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
MANIFESTS = REPO / "deploy" / "kubernetes"
# grpc probes are GA from 1.27; the newest schemas the validator bundles must accept them too
VERSIONS = ["1.27.0", "1.33.0"]

pytestmark = pytest.mark.timeout(120)


def validator() -> str:
    exe = Path(sys.executable).parent / "kubernetes-validate"
    found = str(exe) if exe.exists() else shutil.which("kubernetes-validate")
    if found is None:
        pytest.skip("kubernetes-validate is not installed (pip install -e '.[dev]')")
    return found


def validate(files: list[Path], version: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([validator(), "--strict", "--quiet", "-k", version, *map(str, files)],
                          capture_output=True, text=True, timeout=90)


def kustomization(root: Path = MANIFESTS) -> dict[str, Any]:
    return yaml.safe_load((root / "kustomization.yaml").read_text())


def resources(root: Path = MANIFESTS) -> list[Path]:
    return [root / name for name in kustomization(root)["resources"]]


def load_all() -> dict[tuple[str, str], dict[str, Any]]:
    docs: dict[tuple[str, str], dict[str, Any]] = {}
    for path in resources():
        for doc in yaml.safe_load_all(path.read_text()):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def test_every_manifest_is_listed_and_valid() -> None:
    listed = {p.name for p in resources()}
    on_disk = {p.name for p in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk, "kustomization.yaml must list every manifest (and only those)"
    for version in VERSIONS:
        r = validate(resources(), version)
        assert r.returncode == 0, f"against {version}:\n{r.stdout}{r.stderr}"


def _container(docs: dict[tuple[str, str], dict[str, Any]], name: str) -> dict[str, Any]:
    containers = docs[("StatefulSet", name)]["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def test_manifests_agree_with_each_other() -> None:
    docs = load_all()
    service = docs[("Service", "pathways-controller")]
    port = service["spec"]["ports"][0]["port"]
    controller = _container(docs, "pathways-controller")
    worker = _container(docs, "pathways-worker")
    assert docs[("StatefulSet", "pathways-controller")]["spec"]["replicas"] == 1  # one controller
    assert docs[("StatefulSet", "pathways-controller")]["spec"]["volumeClaimTemplates"], "SQLite needs a volume"
    assert f"--listen 0.0.0.0:{port}" in " ".join(controller["args"])
    args = worker["command"]
    assert f"--server=pathways-controller:{port}" in args
    assert "--name=$(POD_NAME)" in args
    env = {e["name"]: e for e in worker["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # the token: one generated Secret, read by the controller (file) and the workers (env)
    generated = {g["name"] for g in kustomization()["secretGenerator"]}
    assert env["PWCTL_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] in generated
    volumes = docs[("StatefulSet", "pathways-controller")]["spec"]["template"]["spec"]["volumes"]
    assert {v["secret"]["secretName"] for v in volumes if "secret" in v} <= generated
    # probes: the standard gRPC health service on each container's own port
    for c in (controller, worker):
        ports = {p["containerPort"] for p in c["ports"]}
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] in ports, (c["name"], probe)
    gpu = worker["resources"]
    assert gpu["requests"]["nvidia.com/gpu"] == gpu["limits"]["nvidia.com/gpu"]  # extended resources


def test_the_controller_metrics_are_exposed_for_prometheus() -> None:
    """The controller serves metrics beyond loopback on the port its container names `metrics`,
    the Service publishes it, and the pod's prometheus.io annotations point a scrape at it."""
    from server.controller.metrics import DEFAULT_LISTEN

    docs = load_all()
    controller = _container(docs, "pathways-controller")
    ports = {p["name"]: p["containerPort"] for p in controller["ports"]}
    metrics_port = ports["metrics"]
    assert str(metrics_port) == DEFAULT_LISTEN.rsplit(":", 1)[1]  # the port the docs name everywhere
    assert f"--metrics-listen 0.0.0.0:{metrics_port}" in " ".join(controller["args"])
    service = {p["name"]: p for p in docs[("Service", "pathways-controller")]["spec"]["ports"]}
    assert service["metrics"]["port"] == metrics_port and service["metrics"]["targetPort"] == "metrics"
    notes = docs[("StatefulSet", "pathways-controller")]["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/port"] == str(metrics_port)
    assert notes["prometheus.io/path"] == "/metrics"


def _broken_copy(tmp_path: Path, edit: Any) -> list[Path]:
    root = tmp_path / "kubernetes"
    shutil.copytree(MANIFESTS, root)
    path = root / "workers.yaml"
    doc = yaml.safe_load(path.read_text())
    edit(doc)
    path.write_text(yaml.safe_dump(doc))
    return resources(root)


def test_broken_manifests_fail(tmp_path: Path) -> None:
    def drop_containers(doc: dict[str, Any]) -> None:
        del doc["spec"]["template"]["spec"]["containers"]  # a required field

    def unknown_field(doc: dict[str, Any]) -> None:
        doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["path"] = "/healthz"

    for name, edit in (("missing", drop_containers), ("unknown", unknown_field)):
        files = _broken_copy(tmp_path / name, edit)
        r = validate(files, VERSIONS[0])
        assert r.returncode != 0, f"the validator passed a broken manifest ({name}):\n{r.stdout}{r.stderr}"
        assert "workers.yaml" in r.stdout + r.stderr


def test_every_pod_serves_tls_from_the_tls_secret() -> None:
    """Controller and workers mount the kubernetes.io/tls Secret the kustomization generates and
    pass its three files as --tls-cert/--tls-key/--tls-ca; their probes ask the plaintext health
    port (`--health-listen`), since kubelet's grpc probes cannot speak TLS."""
    generated = {g["name"]: g for g in kustomization()["secretGenerator"]}
    assert generated["pathways-tls"]["type"] == "kubernetes.io/tls"
    assert set(generated["pathways-tls"]["files"]) == {"tls.crt", "tls.key", "ca.crt"}
    docs = load_all()
    for name in ("pathways-controller", "pathways-worker"):
        pod = docs[("StatefulSet", name)]["spec"]["template"]["spec"]
        c = _container(docs, name)
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        tls_volume = next(v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "pathways-tls")
        where = mounts[tls_volume["name"]]
        line = " ".join(c.get("args", []) + c.get("command", [])).replace("=", " ")
        for flag, file in (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key"), ("--tls-ca", "ca.crt")):
            assert f"{flag} {where}/{file}" in line, (name, flag)
        health = {p["name"]: p["containerPort"] for p in c["ports"]}["health"]
        assert f":{health}" in line.split("--health-listen ")[1].split()[0], name
        assert c["readinessProbe"]["grpc"]["port"] == c["livenessProbe"]["grpc"]["port"] == health
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["PATHWAYS_TLS_SERVER_NAME"] == "pathways-controller.pathways.svc", name
