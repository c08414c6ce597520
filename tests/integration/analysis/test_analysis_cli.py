"""CLI: commands registered on a fresh Typer app, outputs and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import typer

from controlplane.analysis.jsonout import ANALYSIS_SCHEMA
from tests.integration.analysis.conftest import run
from tests.integration.analysis.synth import (
    AZURE_HEADER,
    T0_US,
    azure_rows,
    burst_rates,
    iso,
    poisson_arrivals,
    write_csv,
)


@pytest.fixture(scope="module")
def tenant_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two tenants for 20 minutes; 'bursty' jumps to 30/s for 20 s at 700 s."""
    rng = np.random.default_rng(1)
    rows = []
    for tenant, rate, extra in (("steady", 5.0, []), ("bursty", 1.0, [(700, 720, 30.0)])):
        for offset in poisson_arrivals(rng, burst_rates(1200, rate, extra)):
            rows.append((iso(T0_US + round(offset * 1e6), zone=True), tenant, 500, 100))
    rows.sort()
    path = tmp_path_factory.mktemp("cli") / "tenants.csv"
    return write_csv(path, ("arrival_ts", "tenant_id", "prompt_tokens", "output_tokens"), rows)


def test_commands_are_registered(app: typer.Typer) -> None:
    code, out, _ = run(app, "--help")
    assert code == 0
    for command in ("analyze", "plan", "forecast"):
        assert command in out


def test_analyze_text(app: typer.Typer, tenant_log: Path) -> None:
    code, out, _ = run(app, "analyze", str(tenant_log))
    assert code == 0
    assert "Overall - " in out and "requests/s" in out and "10-minute windows (2)" in out
    assert "Per tenant (2 tenants)" in out and "bursty" in out
    assert "Bursts (" in out and "): 1" in out


def test_analyze_json_schema(app: typer.Typer, tenant_log: Path) -> None:
    code, out, _ = run(app, "analyze", str(tenant_log), "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["schema"] == ANALYSIS_SCHEMA
    assert set(doc) == {
        "schema",
        "source",
        "format",
        "input",
        "columns",
        "rows",
        "span",
        "binning",
        "parameters",
        "overall",
        "tenants",
        "tenants_not_shown",
        "incidents",
        "prefix_cache",
    }
    assert doc["parameters"] == {
        "bin_seconds": 1,
        "burst_k": 3.0,
        "burst_min_seconds": 5,
        "baseline_seconds": 300,
        "window_seconds": 600,
    }
    overall = doc["overall"]
    assert set(overall["rates"]["requests_per_s"]) == {
        "seconds",
        "total",
        "mean",
        "std",
        "p50",
        "p95",
        "p99",
        "max",
        "cv",
        "peak_to_mean",
    }
    assert [t["tenant"] for t in doc["tenants"]] == ["steady", "bursty"]
    (incident,) = doc["incidents"]
    assert incident["top_tenants"][0]["tenant"] == "bursty"
    assert incident["start"].endswith("Z") and incident["duration_s"] > 10
    code, out, _ = run(
        app, "analyze", str(tenant_log), "--json", "--no-per-tenant", "--burst-k", "50"
    )
    doc = json.loads(out)
    assert doc["tenants"] == [] and doc["incidents"] == []


def test_analyze_html(app: typer.Typer, tenant_log: Path, tmp_path: Path) -> None:
    target = tmp_path / "r.html"
    code, out, err = run(app, "analyze", str(tenant_log), "--json", "--html", str(target))
    assert code == 0
    json.loads(out)  # stdout stays pure JSON; the report path goes to stderr
    assert "r.html" in err
    html = target.read_text()
    assert 'id="tenants"' in html and 'id="incident-1"' in html
    assert html.count("data:image/png;base64,") >= 6  # 5 overview figures + an incident


def test_bad_input_exits_2(app: typer.Typer, tmp_path: Path) -> None:
    code, _, err = run(app, "analyze", str(tmp_path / "missing.csv"))
    assert code == 2 and "no such file" in err
    no_ts = write_csv(tmp_path / "no_ts.csv", ("a", "b"), [(1, 2)])
    code, _, err = run(app, "analyze", str(no_ts))
    assert code == 2 and "no timestamp column" in err
    bad = write_csv(
        tmp_path / "bad.csv", AZURE_HEADER, [*azure_rows([0.0], [1], [1]), ("garbage", 1, 1)]
    )
    code, _, err = run(app, "analyze", str(bad), "--on-bad-row", "fail")
    assert code == 2 and "bad.csv:3: bad row" in err
    code, out, _ = run(app, "analyze", str(bad))
    assert code == 0 and "1 bad" in out and "line 3: unparseable timestamp" in out
    code, _, err = run(app, "analyze", str(bad), "--burst-min-seconds", "0")
    assert code == 2 and "min-seconds" in err


def test_empty_log(app: typer.Typer, tmp_path: Path) -> None:
    empty = write_csv(tmp_path / "empty.csv", AZURE_HEADER, [])
    code, out, _ = run(app, "analyze", str(empty))
    assert code == 0 and "no requests to analyse" in out
    code, out, _ = run(app, "analyze", str(empty), "--html", str(tmp_path / "r.html"))
    assert code == 0 and (tmp_path / "r.html").is_file()
    code, out, _ = run(app, "plan", str(empty), "--rps", "1")
    assert code == 0 and "no requests" in out
    code, out, _ = run(app, "forecast", str(empty))
    assert code == 0 and "no requests to forecast" in out


def test_plan(app: typer.Typer, tenant_log: Path) -> None:
    code, out, _ = run(app, "plan", str(tenant_log), "--rps", "2", "--lead-time-s", "30")
    assert code == 0
    assert "recommendation: base pool" in out and "mean-based" in out
    code, out, _ = run(
        app, "plan", str(tenant_log), "--prefill-tps", "5000", "--decode-tps", "800", "--json"
    )
    assert code == 0
    plan = json.loads(out)["plan"]
    assert plan["base_engines"] >= 1 and len(plan["outcomes"]) == 6
    assert all(o["engine_hours"] > 0 for o in plan["outcomes"])
    code, _, err = run(app, "plan", str(tenant_log))
    assert code == 2 and "--rps" in err
    code, _, err = run(app, "plan", str(tenant_log), "--rps", "1", "--prefill-tps", "5")
    assert code == 2


def test_forecast(app: typer.Typer, tenant_log: Path) -> None:
    code, out, _ = run(app, "forecast", str(tenant_log), "--horizon-s", "30")
    assert code == 0 and "requests - horizon 30 s" in out and "tokens - horizon 30 s" in out
    code, out, _ = run(app, "forecast", str(tenant_log), "--tenant", "bursty", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["tenant"] == "bursty" and [a["axis"] for a in doc["axes"]] == ["requests", "tokens"]
    code, _, err = run(app, "forecast", str(tenant_log), "--tenant", "nobody")
    assert code == 2 and "no tenant 'nobody'" in err
    code, _, err = run(app, "forecast", str(tenant_log), "--train-fraction", "1.5")
    assert code == 2
