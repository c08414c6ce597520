"""`burstgate loadtest` and `replay` defaults against the demo's tenants
(issue 35): the default load is not refused before its first pulse, the
HTML plots latency per lane, and replay's HTML keeps the retry columns."""

from __future__ import annotations

import json
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from controlplane.cli import app
from controlplane.configfile import DEMO_CONFIG
from controlplane.domain import TenantConfig
from controlplane.store.db import upgrade
from tests.integration.loadtest.test_replay import azure_csv
from tests.support import add_tenants

pytestmark = pytest.mark.usefixtures("server_logs_elsewhere")


def test_the_default_load_is_not_refused_before_the_first_pulse(
    sqlite_url: str, make_server: Callable[..., Any], tmp_path: Path
) -> None:
    upgrade(sqlite_url)
    applied = CliRunner().invoke(app, ["config", "apply", str(DEMO_CONFIG),
                                       "--database-url", sqlite_url])  # fmt: skip
    assert applied.exit_code == 0, applied.output
    srv = make_server(sqlite_url)
    page = tmp_path / "lt.html"
    # The default pulse's first 2.5 s: its base phase at the default 20/s,
    # with the default tenants and lengths. (Before: a third of it went to
    # free-tier, capped at 2,048 tokens and 200 tokens/s: 16 of 68
    # refused in 3 s, TOKEN_RATE and queue timeouts.)
    r = CliRunner().invoke(app, [
        "loadtest", "--target", srv.target, "--total-s", "2.5", "--json", "--no-progress",
        "--html", str(page),
    ])  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    [base, _all] = doc["phases"]
    assert base["phase"] == "base" and base["requests"] > 25
    assert base["refused"] == 0 and base["errors"] == {}, base["reasons"]
    lanes = {ln["lane"]: ln["requests"] for ln in doc["lanes"]}
    assert lanes["premium"] > lanes["standard"] > lanes.get("batch", 0)  # 20000:5000:200
    # the HTML plots latency per lane, from the per-lane series
    by_lane = doc["series"]["latency_p99_ms_by_lane"]
    assert set(by_lane) == set(lanes)
    assert all(len(v) == len(doc["series"]["t_s"]) for v in by_lane.values())
    assert "latency p99 per lane" in page.read_text()


def test_replay_html_keeps_the_retry_columns(
    sqlite_url: str, make_server: Callable[..., Any], tmp_path: Path
) -> None:
    upgrade(sqlite_url)
    add_tenants(sqlite_url, TenantConfig("tight", Decimal(400), 600, max_wait_ms=0))
    srv = make_server(sqlite_url)
    trace = azure_csv(tmp_path / "t.csv", [(i * 0.1, 200, 100) for i in range(20)])
    page = tmp_path / "replay.html"
    r = CliRunner().invoke(app, [
        "replay", str(trace), "--target", srv.target, "--speed", "4", "--tenant",
        "tight:standard", "--service-scale", "0", "--no-progress", "--html", str(page),
    ])  # fmt: skip
    assert r.exit_code == 0, r.output
    text_header = next(line for line in r.stdout.splitlines() if line.startswith("phase"))
    assert text_header.split()[-3:] == ["retries", "served_after_refusal", "gave_up"]
    html = page.read_text()
    by_phase = html.split("<h2>By phase</h2>", 1)[1].split("</table>", 1)[0]
    assert all(f"<th>{h}</th>" in by_phase
               for h in ("retries", "served after refusal", "gave up"))  # fmt: skip
    doc = json.loads(html.split('id="burstgate-data">', 1)[1].split("</script>", 1)[0]
                     .replace("<\\/", "</"))  # fmt: skip
    total = doc["phases"][-1]
    assert total["retries"] > 0
    assert f"<td>{total['retries']:,}</td>" in by_phase.rsplit("<tr>", 1)[1]


def test_local_rates_fit_the_fake_engine(tmp_path: Path) -> None:
    """`loadtest --local`: the engine is the fake one, whose capacity the
    simulator estimates; the base rate is half of it, so the base load is
    not refused for the engine's sake (at SPEC's 20/s the fake engine,
    ~8 requests/s on these lengths, was 2.5x overloaded: 137 of 397
    refused in 20 s, backpressure and queue timeouts)."""
    from controlplane.loadtest.demofit import (
        BASE_OF_CAPACITY,
        PEAK_OF_CAPACITY,
        default_rates,
        demo_tenants,
        local_capacity_rps,
    )
    from controlplane.loadtest.profile import Mix

    # (an engine 4x faster than the default: its requests, up to 1,500
    # tokens out, end within the test's seconds)
    capacity = local_capacity_rps(demo_tenants(), Mix(), 4.0)
    r = CliRunner().invoke(app, ["loadtest", "--local", "--engine-speed", "4", "--total-s", "4",
                                 "--json", "--no-progress"])  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["profile"]["base"] == round(BASE_OF_CAPACITY * capacity, 1)
    assert doc["profile"]["peak"] == round(PEAK_OF_CAPACITY * capacity, 1)
    [base, _all] = doc["phases"]
    assert base["phase"] == "base" and base["requests"] >= 10
    assert base["refused"] == 0 and base["errors"] == {}, base["reasons"]
    assert f"sustains about {capacity:.1f} requests/s" in r.stderr
    # given rates are used as given
    assert default_rates(7.0, None, True, capacity) == (7.0, round(PEAK_OF_CAPACITY * capacity, 1))
    assert default_rates(None, None, False, None) == (20.0, 80.0)
