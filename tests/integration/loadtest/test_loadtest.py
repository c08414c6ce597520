"""`burstgate loadtest`: the profiles give the counts they promise, and a run
against a real server sends exactly its plan, within its time, with every
answer agreeing with the server's own metrics and the ledger."""

from __future__ import annotations

import asyncio
import json
import math
import urllib.request
from collections import Counter
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from controlplane.cli import app
from controlplane.domain import TenantConfig
from controlplane.loadtest import profile as prof
from controlplane.loadtest.report import SCHEMA, by_lane, summarize
from controlplane.loadtest.run import ADMIT_DEADLINE_S, check_loopback, run
from controlplane.store.db import upgrade
from tests.integration.ledger.conftest import ledger_rows_once
from tests.support import add_tenants

TENANTS = [prof.Tenant("gold", "premium", 1), prof.Tenant("std", "standard", 2),
           prof.Tenant("cheap", "batch", 1)]  # fmt: skip

# A server thread of the test logs; the command's --json output must stay JSON.
pytestmark = pytest.mark.usefixtures("server_logs_elsewhere")


def test_pulse_phases_follow_the_spec_example() -> None:
    # 20 -> 80 QPS for 30 s every 90 s, 5 minutes (SPEC section 6)
    phases = prof.pulse(20, 80, 30, 90, 300)
    assert [(p.name, p.start_s, p.end_s, p.rate) for p in phases] == [
        ("base", 0, 60, 20), ("pulse", 60, 90, 80),
        ("recovery", 90, 120, 20), ("base", 120, 150, 20), ("pulse", 150, 180, 80),
        ("recovery", 180, 210, 20), ("base", 210, 240, 20), ("pulse", 240, 270, 80),
        ("recovery", 270, 300, 20),
    ]  # fmt: skip
    plan = prof.arrivals(phases, TENANTS, prof.Mix(), uniform=True)
    counts = Counter(a.phase for a in plan)
    # evenly spaced: rate x length per segment, less at most one per segment edge
    assert counts["pulse"] in range(3 * 80 * 30 - 3, 3 * 80 * 30 + 1)
    assert counts["base"] in range(20 * 120 - 3, 20 * 120 + 1)
    assert counts["recovery"] in range(20 * 90 - 3, 20 * 90 + 1)


def test_poisson_counts_and_mix_within_stated_tolerance() -> None:
    phases = prof.step(20, 80, 30, 30, 30)
    plan = prof.arrivals(phases, TENANTS, prof.Mix(), seed=3)
    counts = Counter(a.phase for a in plan)
    # Poisson: each phase's count within 4 standard deviations of rate x length
    for name, expected in (("warmup", 600), ("burst", 2400), ("recovery", 600)):
        assert abs(counts[name] - expected) <= 4 * math.sqrt(expected), (name, counts[name])
    # 20 % long prompts, 20 % long outputs, tenants 1:2:1 (4 sigma of a binomial)
    n = len(plan)
    for share, observed in (
        (0.2, sum(a.prompt_tokens >= 4000 for a in plan)),
        (0.2, sum(a.max_tokens >= 800 for a in plan)),
        (0.5, sum(a.tenant.tenant_id == "std" for a in plan)),
    ):
        assert abs(observed - share * n) <= 4 * math.sqrt(n * share * (1 - share))
    assert prof.arrivals(phases, TENANTS, prof.Mix(), seed=3) == plan  # seeded


def test_bad_profiles_and_targets_are_refused() -> None:
    with pytest.raises(ValueError, match="--pulse-s"):
        prof.pulse(20, 80, 90, 90, 300)
    with pytest.raises(ValueError, match="--total-s"):
        prof.constant(10, 10_000)
    with pytest.raises(ValueError, match="loopback"):
        check_loopback("192.0.2.10:50051")
    check_loopback("127.0.0.1:50051")
    check_loopback("localhost:1")
    runner = CliRunner()
    r = runner.invoke(app, ["loadtest", "--target", "192.0.2.10:50051", "--total-s", "1"])
    assert r.exit_code == 2 and "loopback" in r.stderr
    r = runner.invoke(app, ["loadtest", "--tenant", "a:b:c:d", "--total-s", "1"])
    assert r.exit_code == 2 and "--tenant" in r.stderr


def _scrape(port: int) -> dict[str, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    by_decision: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "burstgate_decisions_total":
                by_decision[s.labels["decision"]] += int(s.value)
    return dict(by_decision)


def test_a_run_sends_its_plan_and_agrees_with_the_server(
    db_url: str, make_server: Callable[..., Any]
) -> None:
    upgrade(db_url)
    add_tenants(
        db_url,
        TenantConfig("gold", Decimal(50_000), 500_000),
        TenantConfig("std", Decimal(20_000), 100_000),
        TenantConfig("cheap", Decimal(500), 5_000, max_wait_ms=200),  # refused often
    )
    srv = make_server(db_url, metrics_port=0)
    phases = prof.pulse(8, 40, 1.0, 2.0, 4.0)
    plan = prof.arrivals(phases, TENANTS, prof.Mix(), seed=1, uniform=True)
    result = asyncio.run(run(srv.target, plan, service_scale=0.01, run_id="t1"))
    outcomes = result.outcomes
    assert len(outcomes) == len(plan)
    # within its time: every request left by the end of its profile (plus
    # scheduling slack), and the run waited for no more than one deadline
    assert max(o.sent_s for o in outcomes) < phases[-1].end_s + 5.0  # (a loaded host lags)
    assert result.duration_s < phases[-1].end_s + ADMIT_DEADLINE_S
    assert all(o.decision and not o.error for o in outcomes)
    decisions = Counter(o.decision for o in outcomes)
    assert decisions["admit"] > 0 and decisions["reject"] > 0
    # the server counted the same decisions
    served = _scrape(srv.plane.metrics_port)
    assert {k: v for k, v in served.items() if v} == dict(decisions)
    # every admitted request was completed, and the ledger holds exactly those
    admitted = {f"t1-{i}" for i, o in enumerate(outcomes) if o.decision == "admit"}
    assert {f"t1-{i}" for i, o in enumerate(outcomes) if o.completed} == admitted
    assert {row.request_id for row in ledger_rows_once(db_url, len(admitted))} == admitted
    stats = {s.name: s for s in summarize(phases, result)}
    assert stats["all"].requests == len(plan)
    assert sum(stats[n].requests for n in ("base", "pulse", "recovery")) == len(plan)
    assert stats["pulse"].requests == sum(a.phase == "pulse" for a in plan)
    assert stats["all"].admitted == decisions["admit"]
    lanes = {s.name: s for s in by_lane(phases, result)}
    assert set(lanes) == {"premium", "standard", "batch"}
    assert sum(s.requests for s in lanes.values()) == len(plan)
    assert lanes["batch"].requests == sum(a.tenant.lane == "batch" for a in plan)
    assert sum(s.admitted for s in lanes.values()) == decisions["admit"]


def test_the_command_json_and_html(
    sqlite_url: str, make_server: Callable[..., Any], tmp_path: Path
) -> None:
    upgrade(sqlite_url)
    add_tenants(sqlite_url, TenantConfig("gold", Decimal(50_000), 500_000))
    srv = make_server(sqlite_url)
    page = tmp_path / "lt.html"
    r = CliRunner().invoke(app, [
        "loadtest", "--target", srv.target, "--profile", "constant", "--base", "20",
        "--total-s", "1.5", "--tenant", "gold:premium", "--uniform", "--service-scale", "0",
        "--json", "--html", str(page), "--no-progress",
    ])  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["schema"] == SCHEMA and doc["requests"] == 29  # 20/s for 1.5 s, evenly spaced
    [constant, total] = doc["phases"]
    assert constant["phase"] == "constant" and constant["admitted"] == 29
    assert total["latency_ms"]["p50"] is not None and total["errors"] == {}
    assert doc["completed"] == 29
    [lane] = doc["lanes"]
    assert lane["lane"] == "premium" and lane["requests"] == 29 and "phase" not in lane
    text = page.read_text()
    assert "burstgate loadtest: constant" in text and "data:image/png;base64," in text
    embedded = text.split('id="burstgate-data">', 1)[1].split("</script>", 1)[0]
    assert json.loads(embedded.replace("<\\/", "</")) == doc


def test_local_starts_and_stops_a_demo_control_plane() -> None:
    r = CliRunner().invoke(app, [
        "loadtest", "--local", "--profile", "constant", "--base", "5", "--total-s", "2",
        "--uniform", "--tenant", "acme:premium", "--service-scale", "0", "--json",
        "--no-progress",
    ])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "started a demo control plane on 127.0.0.1:" in r.stderr
    assert "stopped the demo control plane" in r.stderr
    doc = json.loads(r.stdout)
    target = doc["target"]
    assert target.startswith("127.0.0.1:") and doc["requests"] == 9  # 5/s for 2 s, evenly
    assert doc["phases"][-1]["admitted"] == 9 and doc["completed"] == 9
    # it is gone: nothing listens there any more
    import socket

    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(target.rsplit(":", 1)[1])), timeout=2)


def test_in_front_of_a_fake_engine_the_ledger_holds_what_it_served(
    sqlite_url: str, make_server: Callable[..., Any]
) -> None:
    from controlplane.fakeengine import FakeEngine
    from controlplane.loadtest.engine import EngineLink

    upgrade(sqlite_url)
    add_tenants(sqlite_url, TenantConfig("gold", Decimal(100_000), 1_000_000))
    srv = make_server(sqlite_url, metrics_port=0)
    phases = prof.constant(20, 1.5)
    plan = prof.arrivals(phases, [prof.Tenant("gold", "premium")], prof.Mix(), uniform=True)

    async def main() -> tuple[Any, dict[str, float]]:
        engine = FakeEngine(port=0, speed=50)  # fifty times faster than the modelled GPU
        await engine.start()
        try:
            async with EngineLink(engine) as link:
                result = await run(srv.target, plan, engine=link, run_id="e1")
            e = engine.live.engine
            return result, {"generated": e.generation_tokens_total,
                            "finished": e.finished_total}  # fmt: skip
        finally:
            await engine.stop()

    result, engine_counts = asyncio.run(main())
    outcomes = result.outcomes
    assert len(outcomes) == 29 and all(o.decision == "admit" for o in outcomes)
    assert all(o.completed for o in outcomes) and result.engine_errors == 0
    rows = ledger_rows_once(sqlite_url, len(outcomes))
    # settled with the engine's own usage: its lengths are the plan's (the hint header)
    assert sorted((r.prompt_tokens, r.output_tokens) for r in rows) == sorted(
        (a.prompt_tokens, a.max_tokens) for a in plan
    )
    assert sum(r.output_tokens for r in rows) == engine_counts["generated"]
    assert engine_counts["finished"] == 29
    assert all(r.exec_start_ns > 0 and r.end_ns >= r.exec_start_ns for r in rows)
    # and the control plane heard the engine's load reports
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.plane.metrics_port}/metrics") as resp:
        text = resp.read().decode()
    reporting = [
        s.value for f in text_string_to_metric_families(text) for s in f.samples
        if s.name == "burstgate_pool_engines_reporting" and s.labels.get("pool") == "default"
    ]  # fmt: skip
    assert reporting == [1.0]


def test_stream_mode_micro_batches_and_agrees_with_the_server(
    sqlite_url: str, make_server: Callable[..., Any]
) -> None:
    upgrade(sqlite_url)
    add_tenants(sqlite_url, TenantConfig("gold", Decimal(1_000_000), 100_000_000))
    srv = make_server(sqlite_url, metrics_port=0)
    plan = prof.arrivals(prof.constant(1000, 0.5), [prof.Tenant("gold", "premium")],
                         prof.Mix(), uniform=True)  # fmt: skip
    result = asyncio.run(run(srv.target, plan, run_id="s1", service_scale=0,
                             batch_window_s=0.005, batch_max=50))  # fmt: skip
    outcomes = result.outcomes
    assert len(outcomes) == 499 and all(o.decision and not o.error for o in outcomes)
    # coalesced: 1,000/s over 5 ms windows is ~5 per batch (a loaded host sends fewer, bigger)
    assert result.batches < len(outcomes) / 2
    # a batch is answered at once: what the gate has no room for (no engine
    # reports here: 64 in flight) is refused, not held
    decisions = Counter(o.decision for o in outcomes)
    assert decisions["admit"] > 0  # how many depends on how fast Completes return
    assert set(Counter(o.reason for o in outcomes if o.decision != "admit")) <= {"backpressure"}
    served = _scrape(srv.plane.metrics_port)
    assert {k: v for k, v in served.items() if v} == dict(decisions)
    admitted = {o.request_id for o in outcomes if o.decision == "admit"}
    assert {o.request_id for o in outcomes if o.completed} == admitted
    assert {r.request_id for r in ledger_rows_once(sqlite_url, len(admitted))} == admitted


def test_loadtest_retries_when_asked(sqlite_url: str, make_server: Callable[..., Any]) -> None:
    upgrade(sqlite_url)
    add_tenants(sqlite_url, TenantConfig("tight", Decimal(2_000), 3_000, max_wait_ms=0))
    srv = make_server(sqlite_url)
    args = ["loadtest", "--target", srv.target, "--profile", "constant", "--base", "20",
            "--total-s", "1", "--tenant", "tight:standard", "--uniform", "--service-scale", "0",
            "--json", "--no-progress"]  # fmt: skip
    plain = json.loads(CliRunner().invoke(app, args).stdout)["phases"][-1]
    assert plain["retries"] == 0 and plain["refused"] > 0  # over its rate: refusals
    retried = json.loads(CliRunner().invoke(app, [*args, "--retries"]).stdout)["phases"][-1]
    assert retried["retries"] > 0 and retried["served_after_refusal"] > 0
    assert retried["admitted"] > plain["admitted"]
