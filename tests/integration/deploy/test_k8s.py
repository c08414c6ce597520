"""deploy/k8s: every kustomization rendered with `kubectl kustomize` as an
operator applies it, the Kubernetes objects validated against the
Kubernetes schemas (kubernetes-validate, offline, strict: an unknown field
fails), the Prometheus Operator's objects checked by their structure, and
the rendered objects held to the kit's rules (deploy/README.md): probes on
the real health endpoints, requests and limits, non-root read-only
containers that write only to volumes, Secrets that are documented, the
shipped alerts and dashboard as they are."""

from __future__ import annotations

import json
import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_validate import utils as kubernetes_validate

from controlplane.rpc.assembly import ADMISSION_SERVICE
from tools import deploykit

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
# Every kustomization of the kit (and the autoscaling recipes built on its
# engine pool): a new overlay is rendered and checked without a change here.
KUSTOMIZATIONS = sorted(
    str(p.parent.relative_to(ROOT))
    for base in (K8S, ROOT / "deploy" / "autoscaling")
    for p in base.rglob("kustomization.yaml")
)
# The oldest Kubernetes the kit supports (gRPC probes are GA in 1.27) and
# the newest the schemas know.
VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
CRDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ScaledObject"}
PLANE_PORT, METRICS_PORT, SIDECAR_PORT = 50051, 9464, 8080

Obj = dict[str, Any]


@cache
def render(path: str) -> tuple[Obj, ...]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(ROOT / path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, f"kubectl kustomize {path}:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def kinds(objs: tuple[Obj, ...], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def named(objs: tuple[Obj, ...], kind: str, name: str) -> Obj:
    [obj] = [o for o in kinds(objs, kind) if o["metadata"]["name"] == name]
    return obj


def pod_specs(objs: tuple[Obj, ...]) -> list[tuple[str, Obj]]:
    out = []
    for o in objs:
        if o["kind"] in ("Deployment", "Job", "StatefulSet", "DaemonSet"):
            out.append((o["metadata"]["name"], o["spec"]["template"]["spec"]))
    return out


def overlays() -> list[str]:
    return [k for k in KUSTOMIZATIONS if k.startswith("deploy/k8s/overlays/")]


def test_the_kit_has_the_overlays_the_issue_asks_for() -> None:
    assert {"deploy/k8s/overlays/production", "deploy/k8s/overlays/vllm-sidecar"} <= set(
        overlays()
    )


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_every_object_is_valid_against_the_kubernetes_schemas(path: str) -> None:
    for obj in render(path):
        if obj["kind"] in CRDS:
            assert "/" in obj["apiVersion"] and obj["metadata"]["name"], obj
            continue
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                pytest.fail(f"{path}: {obj['kind']}/{obj['metadata']['name']} at {where} "
                            f"(Kubernetes {version}): {exc.message}")  # fmt: skip


def test_the_schema_check_is_strict() -> None:
    """A misspelt field must fail, or the test above proves little."""
    dep = json.loads(json.dumps(named(render("deploy/k8s/base"), "Deployment", "burstgate")))
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, VERSIONS[0], strict=True)


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_every_container_has_requests_limits_and_no_escalation(path: str) -> None:
    for name, spec in pod_specs(render(path)):
        assert spec.get("automountServiceAccountToken") is False, name
        for c in spec["containers"]:
            res = c["resources"]
            assert {"cpu", "memory"} <= set(res["requests"]), (name, c["name"])
            assert "memory" in res["limits"], (name, c["name"])
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, (name, c["name"])


def _burstgate_containers(objs: tuple[Obj, ...]) -> list[tuple[Obj, Obj]]:
    """(pod spec, container) of every burstgate image's container."""
    return [
        (spec, c)
        for _, spec in pod_specs(objs)
        for c in spec["containers"]
        if c["image"].split("/")[-1].split(":")[0] in ("burstgate", "burstgate-sidecar")
    ]


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_burstgate_runs_non_root_read_only_and_writes_only_to_volumes(path: str) -> None:
    found = _burstgate_containers(render(path))
    assert found, f"{path}: no burstgate container"
    for spec, c in found:
        ctx = {**spec.get("securityContext", {}), **c["securityContext"]}
        assert ctx["runAsNonRoot"] is True and ctx.get("runAsUser", 1) != 0, c["name"]
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, c["name"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}, c["name"]
        volumes = {v["name"] for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert set(mounts.values()) <= volumes
        assert "/tmp" in mounts, c["name"]
        # every path it is told to write to lies on a mounted volume
        args = c.get("args", [])
        writes = [args[i + 1] for i, a in enumerate(args) if a == "--spool"]
        writes += [e["value"] for e in c.get("env", [])
                   if e["name"] == "BURSTGATE_LEDGER_SPOOL_DIR"]  # fmt: skip
        for target in writes:
            assert any(Path(target).is_relative_to(m) for m in mounts), (c["name"], target)
        if c["image"].startswith("burstgate-sidecar"):
            assert writes, f"{c['name']}: the sidecar runs without --spool"


def _plane(objs: tuple[Obj, ...]) -> Obj:
    dep = named(objs, "Deployment", "burstgate")
    containers: list[Obj] = dep["spec"]["template"]["spec"]["containers"]
    [c] = containers
    return c


@pytest.mark.parametrize("path", [p for p in KUSTOMIZATIONS if p.startswith("deploy/k8s/overlays")]
                         + ["deploy/k8s/base"])  # fmt: skip
def test_the_plane_is_probed_on_its_grpc_health_service(path: str) -> None:
    objs = render(path)
    dep = named(objs, "Deployment", "burstgate")
    assert dep["spec"]["replicas"] >= 3
    c = _plane(objs)
    env = {e["name"]: e for e in c["env"]}
    assert env["BURSTGATE_PORT"]["value"] == str(PLANE_PORT)
    assert env["BURSTGATE_METRICS_PORT"]["value"] == str(METRICS_PORT)
    assert env["BURSTGATE_HOST"]["value"] == "0.0.0.0"  # probes come from the kubelet
    # each replica advertises its own pod (redirects must reach the owner)
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["BURSTGATE_ADVERTISE_ADDRESS"]["value"] == f"$(POD_IP):{PLANE_PORT}"
    assert list(env).index("POD_IP") < list(env).index("BURSTGATE_ADVERTISE_ADDRESS")
    assert c["readinessProbe"]["grpc"] == {"port": PLANE_PORT, "service": ADMISSION_SERVICE}
    assert c["livenessProbe"]["grpc"] == {"port": PLANE_PORT, "service": ""}
    assert c["startupProbe"]["grpc"]["port"] == PLANE_PORT
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": PLANE_PORT, "metrics": METRICS_PORT}
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > 10  # BURSTGATE_SHUTDOWN_GRACE_S and the drain


def test_the_service_pdb_and_monitors_select_the_plane() -> None:
    objs = render("deploy/k8s/base")
    pod_labels = named(objs, "Deployment", "burstgate")["spec"]["template"]["metadata"]["labels"]

    def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
        return selector.items() <= labels.items()

    svc = named(objs, "Service", "burstgate")
    assert selects(svc["spec"]["selector"], pod_labels)
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {
        "grpc": PLANE_PORT, "metrics": METRICS_PORT,
    }  # fmt: skip
    pdb = named(objs, "PodDisruptionBudget", "burstgate")
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels)
    assert pdb["spec"]["maxUnavailable"] == 1
    sm = named(objs, "ServiceMonitor", "burstgate")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert selects(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
    # the scrape job is the label's value: the job the shipped alerts read
    job = svc["metadata"]["labels"][sm["spec"]["jobLabel"]]
    alerts = (ROOT / "deploy" / "prometheus" / "burstgate-alerts.yml").read_text()
    assert set(re.findall(r'job="([^"]+)"', alerts)) == {job}


def test_the_migration_job_migrates_the_database_the_plane_serves() -> None:
    objs = render("deploy/k8s/base")
    job = named(objs, "Job", "burstgate-migrate")
    [c] = job["spec"]["template"]["spec"]["containers"]
    assert c["args"] == ["migrate"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("OnFailure", "Never")
    db = {e["name"]: e for e in c["env"]}["BURSTGATE_DATABASE_URL"]
    plane_db = {e["name"]: e for e in _plane(objs)["env"]}["BURSTGATE_DATABASE_URL"]
    assert db == plane_db and "secretKeyRef" in db["valueFrom"]
    assert c["image"] == _plane(objs)["image"]


def _readme_secrets() -> set[str]:
    """The Secrets deploy/README.md tells the operator to create: its
    table's first column under "Secrets"."""
    text = (ROOT / "deploy" / "README.md").read_text()
    section = text.split("## Secrets", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z0-9-]+)` \|", section, re.MULTILINE))


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_every_secret_referenced_is_documented_as_user_provided(path: str) -> None:
    objs = render(path)
    made = {o["metadata"]["name"] for o in kinds(objs, "Secret")}
    documented = _readme_secrets()
    for _, spec in pod_specs(objs):
        for c in spec["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    assert ref["name"] in made | documented, (path, c["name"], ref["name"])
            for src in c.get("envFrom", []):
                if "secretRef" in src:
                    assert src["secretRef"]["name"] in made | documented, (path, src)
    assert not made, "the kit ships no Secret: they are the operator's"


def test_the_prometheus_rule_is_the_shipped_alert_file() -> None:
    assert deploykit.stale() == [], f"out of date: run `{deploykit.SYNC}`"
    objs = render("deploy/k8s/base")
    [rule] = kinds(objs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    shipped = yaml.safe_load((ROOT / "deploy" / "prometheus" / "burstgate-alerts.yml").read_text())
    assert set(shipped) == {"groups"}
    assert rule["spec"] == shipped


def test_the_dashboard_configmap_is_the_shipped_dashboard() -> None:
    objs = render("deploy/k8s/base")
    cm = named(objs, "ConfigMap", "burstgate-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    [(key, text)] = cm["data"].items()
    shipped = (ROOT / "deploy" / "grafana" / "burstgate-dashboard.json").read_text()
    assert key.endswith(".json") and text == shipped


def test_sync_regenerates_what_check_finds_stale(tmp_path: Path) -> None:
    shipped = ("deploy/prometheus/burstgate-alerts.yml", "deploy/grafana/burstgate-dashboard.json")
    for rel in shipped:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes((ROOT / rel).read_bytes())
    assert len(deploykit.stale(tmp_path)) == 2  # nothing generated yet
    deploykit.sync(tmp_path)
    assert deploykit.stale(tmp_path) == []
    alerts = tmp_path / "deploy/prometheus/burstgate-alerts.yml"
    alerts.write_text(alerts.read_text().replace("for: 2m", "for: 3m", 1))
    assert deploykit.stale(tmp_path) == ["deploy/k8s/base/generated/prometheusrule.yaml"]


def test_production_spreads_the_replicas_and_spells_out_ha() -> None:
    objs = render("deploy/k8s/overlays/production")
    assert {o["metadata"].get("namespace") for o in objs} == {"burstgate"}
    spec = named(objs, "Deployment", "burstgate")["spec"]["template"]["spec"]
    keys = {t["topologyKey"]: t["whenUnsatisfiable"] for t in spec["topologySpreadConstraints"]}
    assert keys["kubernetes.io/hostname"] == "DoNotSchedule"  # never two on one node
    assert "topology.kubernetes.io/zone" in keys
    env = {e["name"]: e.get("value") for e in _plane(objs)["env"]}
    assert env["BURSTGATE_ADMISSION_AUTH"] == "true"
    for name in ("BURSTGATE_HA_LEASE_TTL_S", "BURSTGATE_HA_MARGIN_S", "BURSTGATE_LISTEN_NOTIFY"):
        assert name in env
    # the margin stays below two thirds of the TTL (controlplane/settings.py refuses otherwise)
    assert float(env["BURSTGATE_HA_MARGIN_S"]) < 2 / 3 * float(env["BURSTGATE_HA_LEASE_TTL_S"])


def test_the_vllm_overlay_runs_the_sidecar_beside_vllm_and_the_podmonitor_finds_it() -> None:
    objs = render("deploy/k8s/overlays/vllm-sidecar")
    engine = named(objs, "Deployment", "vllm-gpu-a")
    pod = engine["spec"]["template"]
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    assert containers["vllm"]["image"].startswith("vllm/vllm-openai")
    vllm_args = containers["vllm"]["args"]
    engine_port = int(vllm_args[vllm_args.index("--port") + 1])
    sidecar = containers["burstgate-sidecar"]
    args = sidecar["args"]
    assert args[args.index("--upstream") + 1] == f"http://127.0.0.1:{engine_port}"
    # the control plane's Service, at its gRPC port, in this namespace
    svc = named(objs, "Service", "burstgate")
    assert args[args.index("--control-plane") + 1] == f"{svc['metadata']['name']}:{PLANE_PORT}"
    assert pod["metadata"]["labels"]["burstgate.io/pool"] == args[args.index("--pool") + 1]
    [port] = sidecar["ports"]
    assert (port["name"], port["containerPort"]) == ("bg-metrics", SIDECAR_PORT)
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/health", "port": "bg-metrics"}
    assert "tcpSocket" in sidecar["livenessProbe"]  # a slow engine never restarts it
    pm = named(objs, "PodMonitor", "burstgate-sidecars")
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["bg-metrics"]
    assert [e["path"] for e in pm["spec"]["podMetricsEndpoints"]] == ["/metrics"]
    # the plane's pods carry no bg-metrics port: not scraped twice
    assert "bg-metrics" not in {p["name"] for p in _plane(objs)["ports"]}
    # clients reach the pool through the sidecars only
    engine_svc = named(objs, "Service", "vllm-gpu-a")
    assert [p["targetPort"] for p in engine_svc["spec"]["ports"]] == ["bg-metrics"]
    assert "127.0.0.1" in vllm_args
