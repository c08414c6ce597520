"""deploy/autoscaling (issue 32): the KEDA and HPA recipes, rendered with
`kubectl kustomize` as an operator applies them, and checked on the
rendered objects: each scales the pool's engine Deployment on the metrics
burstgate exports for that same pool (reactive and predicted desired
engines, as replica counts), scales up at once and down only after a
stabilisation window, and the HPA's external metrics are the ones the
prometheus-adapter rules serve."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "deploy" / "autoscaling"
METRICS = ("burstgate_pool_desired_engines", "burstgate_pool_desired_engines_predicted")


def render(overlay: str) -> dict[str, list[dict[str, Any]]]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(RECIPES / overlay)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for doc in yaml.safe_load_all(out.stdout):
        by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def engine_pool(objs: dict[str, list[dict[str, Any]]]) -> tuple[str, str]:
    """(the engine Deployment's name, the pool its sidecar reports for)."""
    [dep] = objs["Deployment"]
    [sidecar] = [c for c in dep["spec"]["template"]["spec"]["containers"]
                 if c["name"] == "burstgate-sidecar"]  # fmt: skip
    args = sidecar["args"]
    pool = args[args.index("--pool") + 1]
    assert dep["metadata"]["labels"]["burstgate.io/pool"] == pool
    assert "replicas" not in dep["spec"]  # the autoscaler owns the count
    return dep["metadata"]["name"], pool


def check_behavior(behavior: dict[str, Any]) -> None:
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0  # a burst: at once
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300  # in: once stable


def test_the_metrics_are_the_ones_the_server_exports() -> None:
    source = (ROOT / "controlplane" / "telemetry" / "live.py").read_text()
    for name in METRICS:
        assert f'"{name}"' in source, name


def test_keda_scales_the_pools_engines_on_its_desired_engines() -> None:
    objs = render("keda")
    deployment, pool = engine_pool(objs)
    [so] = objs["ScaledObject"]
    spec = so["spec"]
    assert spec["scaleTargetRef"]["name"] == deployment
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    check_behavior(spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"])
    queries = []
    for t in spec["triggers"]:
        assert t["type"] == "prometheus"
        # an engine count: AverageValue 1 makes it the replica count
        assert (t["metricType"], t["metadata"]["threshold"]) == ("AverageValue", "1")
        queries.append(t["metadata"]["query"])
    assert sorted(queries) == sorted(f'max({m}{{pool="{pool}"}})' for m in METRICS)


def test_hpa_scales_on_the_external_metrics_the_adapter_serves() -> None:
    objs = render("hpa")
    deployment, pool = engine_pool(objs)
    [hpa] = objs["HorizontalPodAutoscaler"]
    spec = hpa["spec"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert (spec["scaleTargetRef"]["kind"], spec["scaleTargetRef"]["name"]) == (
        "Deployment", deployment,
    )  # fmt: skip
    assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
    check_behavior(spec["behavior"])
    names = []
    for m in spec["metrics"]:
        ext = m["external"]
        assert ext["metric"]["selector"]["matchLabels"] == {"pool": pool}
        assert ext["target"] == {"type": "AverageValue", "averageValue": "1"}
        names.append(ext["metric"]["name"])
    assert sorted(names) == sorted(METRICS)
    [rules_cm] = objs["ConfigMap"]
    rules = yaml.safe_load(rules_cm["data"]["config.yaml"])["externalRules"]
    served = {r["name"]["as"] for r in rules}
    assert served == set(METRICS)
    for r in rules:  # one series per pool: the max over burstgate's replicas
        assert r["seriesQuery"].startswith(r["name"]["as"] + "{")
        assert "max by (pool)" in r["metricsQuery"]
