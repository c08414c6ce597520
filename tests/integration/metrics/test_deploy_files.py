"""The shipped Grafana dashboard and Prometheus alert rules against a real
server: every metric their PromQL selects is on its /metrics (all but the
kube-state-metrics series the autoscaling alert compares with), every
expression is valid PromQL (promtool parses it), the rules pass
``promtool check rules`` and their unit tests (``promtool test rules``).

promtool comes with the OS package ``prometheus`` (``make os-packages``).
Under CI (CI=true) a missing promtool fails these tests; elsewhere they are
skipped with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.protoclient import ProtoClient, make_batch
from prometheus_client.parser import text_string_to_metric_families

from controlplane.store.db import upgrade
from tests.conftest import ServerThread
from tests.integration.ledger.conftest import ACME_PRICE, setup_db
from tests.integration.metrics.promql import label_values_metric, metric_names
from tests.integration.sidecar.fresh import fresh_metrics_page
from tests.support import wait_until

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy" / "grafana" / "burstgate-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "burstgate-alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "burstgate-alerts.test.yml"
AUTOSCALING = ROOT / "deploy" / "autoscaling"
# Series Prometheus makes itself for every target; no exporter serves them.
SYNTHETIC = frozenset({"up"})
# Series of other exporters, alert -> names: the autoscaler's maximum is
# kube-state-metrics' (burstgate cannot know it). The dashboard uses none.
EXTERNAL = {
    "BurstgatePoolDesiredEnginesAboveMax": {"kube_horizontalpodautoscaler_spec_max_replicas"}
}
# What the plane exports for autoscaling (docs/autoscaling.md, "Signals").
AUTOSCALING_METRICS = frozenset(
    {
        "burstgate_pool_backlog_requests", "burstgate_pool_backlog_tokens",
        "burstgate_pool_predicted_wait_seconds", "burstgate_pool_demand_tokens_per_second",
        "burstgate_pool_demand_requests_per_second", "burstgate_pool_desired_engines",
        "burstgate_pool_desired_engines_predicted",
    }
)  # fmt: skip
# What Grafana substitutes before a query reaches Prometheus (for promtool).
GRAFANA_VARS = {
    "$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h",
    "$job": ".*", "$instance": ".*", "$tenant": ".*", "$lane": ".*", "$pool": ".*",
    "$sidecar": ".*",
}  # fmt: skip
# The sample names a family declares, by type (our collectors set no
# _created timestamps, so none are counted as served).
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
    "gauge": ("",),
    "unknown": ("",),
}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        reason = "promtool not found: install the OS package 'prometheus' (make os-packages)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return path


# ----------------------------------------------------- the shipped queries


def walk_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from walk_panels(p.get("panels", []))


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def dashboard_exprs() -> dict[str, str]:
    """'panel title [refId]' -> PromQL, for every query target."""
    return {
        f"{p['title']} [{t['refId']}]": t["expr"]
        for p in walk_panels(dashboard()["panels"])
        for t in p.get("targets", [])
    }


def variable_metrics() -> dict[str, str]:
    """Template variable -> the metric its label_values() query reads."""
    out = {}
    for v in dashboard()["templating"]["list"]:
        if v["type"] != "query":
            continue
        query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        metric = label_values_metric(query)
        assert metric, f"variable {v['name']}: not a label_values() query: {query}"
        out[v["name"]] = metric
    return out


def row_panels(d: dict[str, Any], title: str) -> list[dict[str, Any]]:
    """The panels of the row titled ``title``: its own when collapsed, else
    those after it up to the next row."""
    top = d["panels"]
    rows = [i for i, p in enumerate(top) if p["type"] == "row" and p["title"] == title]
    assert len(rows) == 1, f"{len(rows)} rows titled {title!r}"
    at = rows[0]
    if top[at]["collapsed"]:
        return list(top[at]["panels"])
    out = []
    for p in top[at + 1 :]:
        if p["type"] == "row":
            break
        out.append(p)
    return out


def rules() -> list[dict[str, Any]]:
    loaded = yaml.safe_load(RULES.read_text())
    return [r for g in loaded["groups"] for r in g["rules"]]


def alert_rule(name: str) -> dict[str, Any]:
    (found,) = (r for r in rules() if r.get("alert") == name)
    return found


# ------------------------------------------------- the server's /metrics


def exposed(text: str) -> set[str]:
    """Every series name /metrics can serve: the samples present, plus each
    family's names by its type (a histogram with no observation yet still
    declares its _bucket, _sum and _count)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(s.name for s in family.samples)
        names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[set[str], str]]:
    """A server driven through every kind of call, scraped: (names, text);
    the names include a fresh sidecar's."""
    url = f"sqlite:///{tmp_path_factory.mktemp('deploy') / 'bg.db'}"
    upgrade(url)
    setup_db(url, "acme", prices=(ACME_PRICE,))
    import time

    from controlplane.settings import Settings

    settings = Settings(
        database_url=url, host="127.0.0.1", port=0, metrics_port=0, metrics_sample_s=0.05,
        admission_auth=False,
    )  # fmt: skip
    srv = ServerThread(settings, time.time_ns)
    try:
        with ProtoClient(srv.target) as c:
            c.report_load(
                pb.LoadReport(
                    pool="a100", engine_id="e1", batch_tokens=10, max_batch_tokens=1000,
                    queue_depth=0, queue_capacity=100, kv_cache_miss_rate=0.1,
                    gpu_utilization=0.5,
                )
            )  # fmt: skip
            c.admit("acme", "r1", prompt_tokens=100, max_tokens=10, pool="a100")
            c.complete("acme", "r1", prompt_tokens=100, generated_tokens=5)
            c.admit("nobody", "r1", prompt_tokens=1, max_tokens=1)
            list(c.admit_stream([make_batch(1, ["acme"], ["s1"], [5], [5], pool="a100")]))

        def scraped() -> str | None:
            port = srv.plane.metrics_port
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text: str = r.read().decode()
            return text if 'pool="a100"' in text and "AdmitStream" in text else None

        text = wait_until(scraped, message="the load report and the stream in /metrics")
        # and a sidecar's own page: the Sidecars row and alerts read it
        yield exposed(text) | exposed(fresh_metrics_page()), text
    finally:
        srv.stop()


# --------------------------------------------------------------- the tests


def test_the_name_reader_reads_names_and_nothing_else() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, lane) (rate(a_bucket{lane=~"x|y",job="$job"}'
        "[$__rate_interval]))) > on (job, lane) group_left b_seconds * 1e3 "
        "and ignoring(scope) c / on() d{s='sum(e)'} offset 5m unless absent(up) "
        "or sum without (tenant) (f) by (g) or vector(1) - Inf"
    )
    assert metric_names(expr) == {"a_bucket", "b_seconds", "c", "d", "up", "f"}
    assert metric_names("1 + 2") == set()
    assert label_values_metric('label_values(m_info{job=~"$job"}, instance)') == "m_info"


def test_every_metric_of_the_dashboard_exists_on_a_running_server(
    served: tuple[set[str], str],
) -> None:
    names, _ = served
    missing = {}
    for where, expr in dashboard_exprs().items():
        used = metric_names(expr)
        assert used, f"{where}: no metric in {expr!r}"
        if used - names:
            missing[where] = sorted(used - names)
    for var, metric in variable_metrics().items():
        if metric not in names:
            missing[f"variable ${var}"] = [metric]
    assert not missing, missing


def test_every_metric_of_the_alert_rules_exists_on_a_running_server(
    served: tuple[set[str], str],
) -> None:
    names, _ = served
    missing = {}
    for rule in rules():
        used = metric_names(rule["expr"])
        assert used, f"{rule['alert']}: no metric in {rule['expr']!r}"
        external = EXTERNAL.get(rule["alert"], set())
        assert external <= used, f"{rule['alert']} no longer reads {external - used}"
        if used - names - SYNTHETIC - external:
            missing[rule["alert"]] = sorted(used - names - SYNTHETIC - external)
    assert not missing, missing


def test_the_dashboard_is_templated_on_its_datasource() -> None:
    d = dashboard()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    assert {"job", "instance", "tenant", "lane", "pool"} <= set(variables)
    ids = []
    for p in walk_panels(d["panels"]):
        ids.append(p["id"])
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"], p["title"]
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
    assert len(ids) == len(set(ids))
    # The panels the operators asked for are there.
    titles = " | ".join(p["title"] for p in walk_panels(d["panels"])).lower()
    for wanted in (
        "decisions by outcome", "refusals by tenant", "admitted tokens by tenant",
        "user charge vs actual cost", "margin", "queue wait p99 by lane", "requests by method",
        "errors by method", "latency p99 by method", "ledger batch latency", "resident memory",
        "cpu", "backpressure", "autoscaling (per pool)",
    ):  # fmt: skip
        assert wanted in titles, wanted
    # No two panels overlap on the grid.
    cells: set[tuple[int, int]] = set()
    for p in walk_panels(d["panels"]):
        g = p["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, p["title"]
        cells |= mine


def test_the_dashboard_has_an_autoscaling_row() -> None:
    """Demand, backlog, predicted wait and desired vs predicted vs running
    engines, per pool, filtered by the pool variable."""
    d = dashboard()
    panels = row_panels(d, "Autoscaling (per pool)")
    assert len(panels) >= 4
    used: dict[str, set[str]] = {}
    for p in panels:
        assert p["type"] != "row" and p["description"], p["title"]
        for t in p["targets"]:
            assert 'pool=~"$pool"' in t["expr"], f"{p['title']}: {t['expr']}"
            for name in metric_names(t["expr"]):
                used.setdefault(name, set()).add(p["title"])
    missing = AUTOSCALING_METRICS - set(used)
    assert not missing, sorted(missing)
    # Desired, predicted desired and running engines on one panel; running
    # is the plane's own count of engines reporting (no kube-state-metrics),
    # and its description says so.
    (engines,) = used["burstgate_pool_desired_engines"]
    assert used["burstgate_pool_desired_engines_predicted"] == {engines}
    assert used["burstgate_pool_engines_reporting"] == {engines}
    (panel,) = (p for p in panels if p["title"] == engines)
    assert "burstgate_pool_engines_reporting" in panel["description"]
    assert set(used) == AUTOSCALING_METRICS | {"burstgate_pool_engines_reporting"}
    # Lane-labelled signals are shown by lane, and filtered by the lane variable.
    by_lane = {
        "burstgate_pool_backlog_requests", "burstgate_pool_backlog_tokens",
        "burstgate_pool_predicted_wait_seconds",
    }  # fmt: skip
    for p in panels:
        for t in p["targets"]:
            if metric_names(t["expr"]) & by_lane:
                assert "by (pool, lane)" in t["expr"] and 'lane=~"$lane"' in t["expr"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variable_metrics()["pool"] == "burstgate_pool_desired_engines"
    assert variables["pool"]["includeAll"] and variables["pool"]["allValue"] == ".*"


def test_the_desired_engines_alert_compares_with_the_autoscalers_maximum() -> None:
    """Desired engines above the autoscaler's maxReplicas (kube-state-metrics)
    for 15 minutes; the pool is read from the autoscaler's name, which must
    be the name the shipped recipes give it."""
    r = alert_rule("BurstgatePoolDesiredEnginesAboveMax")
    assert r["for"] == "15m"
    assert r["labels"]["severity"] in {"ticket", "page"}
    assert {"summary", "description"} <= set(r["annotations"])
    expr = r["expr"]
    assert metric_names(expr) == {
        "burstgate_pool_desired_engines",
        "kube_horizontalpodautoscaler_spec_max_replicas",
    }
    assert "max by (pool) (burstgate_pool_desired_engines)" in expr
    assert re.search(r"\)\s*>\s*0\s*$", expr), "fires only above the maximum"
    # label_replace(..., "pool", "$1", "horizontalpodautoscaler", REGEX)
    found = re.search(r'"pool",\s*"\$1",\s*"horizontalpodautoscaler",\s*"([^"]+)"', expr)
    assert found, expr
    hpa_name = re.compile(found.group(1))  # anchored, as Prometheus anchors it

    def pool_of(name: str) -> str | None:
        m = hpa_name.fullmatch(name)
        return m.group(1) if m else None

    # The plain HPA recipe: the HPA is the object itself.
    hpa = yaml.safe_load((AUTOSCALING / "hpa" / "hpa.yaml").read_text())
    hpa_pools = {
        m["external"]["metric"]["selector"]["matchLabels"]["pool"] for m in hpa["spec"]["metrics"]
    }
    assert hpa["spec"]["maxReplicas"] >= 1
    assert {pool_of(hpa["metadata"]["name"])} == hpa_pools
    # KEDA: the HPA it makes is keda-hpa-<ScaledObject> unless named otherwise.
    so = yaml.safe_load((AUTOSCALING / "keda" / "scaledobject.yaml").read_text())
    named = so["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("name")
    keda_hpa = named or f"keda-hpa-{so['metadata']['name']}"
    queries = [t["metadata"]["query"] for t in so["spec"]["triggers"]]
    keda_pools = {m.group(1) for q in queries if (m := re.search(r'pool="([^"]+)"', q))}
    assert len(keda_pools) == 1 and {pool_of(keda_hpa)} == keda_pools
    # An autoscaler of something else is no pool's.
    assert pool_of("web") is None and pool_of("keda-hpa-web") is None


def test_the_alert_rules_pass_promtool(tmp_path: Path) -> None:
    tool = promtool()
    check = subprocess.run(
        [tool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(rules())} rules found" in check.stdout
    # Unit tests of the alerts (they fire on made-up series shaped like ours).
    tests = subprocess.run(
        [tool, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=120,
        cwd=RULE_TESTS.parent,
    )  # fmt: skip
    assert tests.returncode == 0, tests.stdout + tests.stderr
    tested = {
        t["alertname"] for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for t in case["alert_rule_test"]
    }  # fmt: skip
    assert tested <= {r["alert"] for r in rules()}
    assert len(tested) >= 9
    assert "BurstgatePoolDesiredEnginesAboveMax" in tested


def test_the_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Each query, with Grafana's variables substituted, as a recording rule:
    promtool parses it with Prometheus's own parser."""
    tool = promtool()
    recording = []
    for i, expr in enumerate(dashboard_exprs().values()):
        for var, value in sorted(GRAFANA_VARS.items(), key=lambda kv: -len(kv[0])):
            expr = expr.replace(var, value)
        assert "$" not in expr, expr
        recording.append({"record": f"burstgate:dashboard_query_{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": recording}]}))
    check = subprocess.run(
        [tool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_metrics_pass_promtool_lint(served: tuple[set[str], str]) -> None:
    """``promtool check metrics``: Prometheus's naming rules (counters end in
    _total, units are base units, ...) on what the server really serves."""
    tool = promtool()
    _, text = served
    lint = subprocess.run(
        [tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
