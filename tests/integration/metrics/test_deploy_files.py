"""The shipped Grafana dashboard and Prometheus alert rules against a real
server: every metric their PromQL selects is on its /metrics, every
expression is valid PromQL (promtool parses it), the rules pass
``promtool check rules`` and their unit tests (``promtool test rules``).

promtool comes with the OS package ``prometheus`` (``make os-packages``).
Under CI (CI=true) a missing promtool fails these tests; elsewhere they are
skipped with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from controlplane._proto.burstgate.v1 import admission_pb2 as pb
from controlplane.client import AdmissionClient, make_batch
from controlplane.store.db import upgrade
from tests.conftest import ServerThread
from tests.integration.ledger.conftest import ACME_PRICE, setup_db
from tests.integration.metrics.promql import label_values_metric, metric_names
from tests.support import wait_until

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy" / "grafana" / "burstgate-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "burstgate-alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "burstgate-alerts.test.yml"
# Series Prometheus makes itself for every target; no exporter serves them.
SYNTHETIC = frozenset({"up"})
# What Grafana substitutes before a query reaches Prometheus (for promtool).
GRAFANA_VARS = {
    "$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h",
    "$job": ".*", "$instance": ".*", "$tenant": ".*", "$lane": ".*",
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


def rules() -> list[dict[str, Any]]:
    loaded = yaml.safe_load(RULES.read_text())
    return [r for g in loaded["groups"] for r in g["rules"]]


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
    """A server driven through every kind of call, scraped: (names, text)."""
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
        with AdmissionClient(srv.target) as c:
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
        yield exposed(text), text
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
        if used - names - SYNTHETIC:
            missing[rule["alert"]] = sorted(used - names - SYNTHETIC)
    assert not missing, missing


def test_the_dashboard_is_templated_on_its_datasource() -> None:
    d = dashboard()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    assert {"job", "instance", "tenant", "lane"} <= set(variables)
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
        "cpu", "backpressure",
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
    assert len(tested) >= 8


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
