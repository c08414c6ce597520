"""`burstgate pricing show|windows` through the real CLI against a running
server (SQLite and PostgreSQL): what it shows equals the server's gRPC
answers, and equals what the traffic set (multipliers from the step table,
rates measured from completions)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from decimal import Decimal
from typing import Any

import pytest
from burstgate_client._proto.burstgate.v1 import ledger_pb2 as lpb
from typer.testing import CliRunner

from controlplane.cli import app
from controlplane.cli.pricing import POOL_COLUMNS, WINDOW_COLUMNS
from controlplane.domain.keys import Role
from tests.conftest import FakeClock
from tests.integration.ledger.conftest import NS, Served, admin_key, complete

WINDOW_S = 300
WINDOW_NS = WINDOW_S * NS

pytestmark = pytest.mark.usefixtures("server_logs_elsewhere")


@pytest.fixture
def clock() -> FakeClock:
    """The server's clock starts at this machine's: `pricing show` looks back
    from the local clock (the API has no server time), as it would in use."""
    return FakeClock(time.time_ns())



def cli(served: Served, *args: str, code: int = 0, key: str | None = None) -> Any:
    env = {"BURSTGATE_ADMIN_TARGET": served.srv.target, "BURSTGATE_API_KEY": key or served.key}
    result = CliRunner().invoke(app, ["pricing", *args], env=env)
    assert result.exit_code == code, (args, result.stdout, result.stderr, result.exception)
    return result


def _to_boundary(clock: Any) -> int:
    nxt: int = (clock() // WINDOW_NS + 1) * WINDOW_NS
    clock.advance(nxt - clock())
    return nxt


def _traffic(served: Served, clock: Any) -> int:
    """Window k measures 0.5 on p/m (-> 1.20 next) and 0.1 on q/m (-> 1);
    window k+1, 7 s in, has measured 0.05 on p/m and 0.6 on q/m so far; acme
    had a margin warning in window k. Returns window k's start (ns)."""
    c = served.client
    start = _to_boundary(clock)
    for rid, pool, rate in (("a1", "p", 0.5), ("a2", "q", 0.1)):
        c.admit("acme", rid, prompt_tokens=100, max_tokens=10, model="m", pool=pool)
        complete(c, "acme", rid, prompt_tokens=100, generated_tokens=10, kv_cache_miss_rate=rate)
    for i in range(3):  # tiny requests: the per-request overhead outweighs the charge
        c.admit("acme", f"tiny{i}", prompt_tokens=1, max_tokens=1, model="m", pool="p")
        complete(c, "acme", f"tiny{i}", prompt_tokens=1, generated_tokens=1)
    clock.advance(WINDOW_NS + 7 * NS)
    shown = {}
    for rid, pool, rate in (("b1", "p", 0.05), ("b2", "q", 0.6)):
        d = c.admit("acme", rid, prompt_tokens=100, max_tokens=10, model="m", pool=pool)
        shown[pool] = d.pricing_multiplier
        complete(c, "acme", rid, prompt_tokens=100, generated_tokens=10, kv_cache_miss_rate=rate)
    assert shown == {"p": "1.200000", "q": "1.000000"}
    m = served.srv.plane.metering
    # The windows as they stand now, written (the server's RPCs flush first;
    # the CLI reads the table, which the periodic flush may not have reached)
    for step in (m.flush_windows, m.close_margin_windows):
        fut = served.srv.on_loop(lambda step=step: asyncio.ensure_future(step()))
        asyncio.run_coroutine_threadsafe(_wait(fut), served.srv.loop).result(10)
    return start


async def _wait(fut: Any) -> Any:
    return await fut


def test_pricing_show_equals_the_servers_answers(served: Served, clock: Any) -> None:
    start = _traffic(served, clock)
    shown = json.loads(cli(served, "show", "--json").stdout)
    ledger = served.ledger()
    windows = ledger.ListPricingWindows(
        lpb.ListPricingWindowsRequest(start_unix_ns=start), timeout=10
    ).windows
    state = ledger.GetPricing(lpb.GetPricingRequest(), timeout=10)
    warnings = ledger.ListMarginWarnings(
        lpb.ListMarginWarningsRequest(start_unix_ns=start), timeout=10
    ).warnings
    k = start // NS
    assert shown["current_window_start"] == k + WINDOW_S
    assert shown["next_window_start"] == k + 2 * WINDOW_S
    assert shown["window_ms"] == state.window_ms == WINDOW_S * 1000
    assert shown["margin_warning_ratio"] == state.margin_warning_ratio
    assert shown["steps"] == [
        {"above_miss_rate": s.above_miss_rate, "multiplier": s.multiplier} for s in state.steps
    ]
    current = {(w.pool, w.model): w for w in windows if w.window_start == k + WINDOW_S}
    previous = {(w.pool, w.model): w for w in windows if w.window_start == k}
    in_force = {(f.pool, f.model): f for f in state.in_force}
    rows = {(r["pool"], r["model"]): r for r in shown["pools"]}
    assert set(rows) == set(current) == set(in_force) == {("p", "m"), ("q", "m")}
    for key, r in rows.items():
        assert r["multiplier"] == current[key].multiplier == in_force[key].multiplier
        assert r["next_multiplier"] == current[key].next_multiplier
        assert r["miss_rate"] == current[key].miss_rate
        assert r["previous_miss_rate"] == previous[key].miss_rate
        assert r["previous_miss_rate"] == in_force[key].previous_window_miss_rate
        assert (r["completions"], r["load_reports"]) == (
            current[key].completions, current[key].load_reports,
        )  # fmt: skip
    # ... and those are the figures the traffic set (step: above 0.30 -> 1.20).
    figures = ("multiplier", "next_multiplier", "miss_rate", "previous_miss_rate")
    assert [rows["p", "m"][f] for f in figures] == ["1.200000", "1.000000", "0.050000", "0.500000"]
    assert [rows["q", "m"][f] for f in figures] == ["1.000000", "1.200000", "0.600000", "0.100000"]
    assert [(w["tenant_id"], w["window_start"], w["requests"], w["actual_cost"])
            for w in shown["margin_warnings"]] == [
        (w.tenant_id, w.window_start, w.requests, w.actual_cost) for w in warnings
    ] == [("acme", k, 5, warnings[0].actual_cost)]  # fmt: skip

    text = cli(served, "show").stdout.splitlines()
    header = next(i for i, line in enumerate(text) if line.split()[:2] == ["pool", "model"])
    assert text[header].split() == list(POOL_COLUMNS)
    assert text[header + 1].split()[:6] == ["p", "m", "1.200000", "1.000000", "0.050000",
                                            "0.500000"]  # fmt: skip
    assert text[header + 2].split()[:6] == ["q", "m", "1.000000", "1.200000", "0.600000",
                                            "0.100000"]  # fmt: skip
    nxt = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(k + 2 * WINDOW_S))
    assert any(line.startswith("next_window") and nxt in line for line in text), text
    assert "margin warnings: 1" in text
    assert any(line.split()[2:4] == ["acme", "USD"] for line in text), text
    # the warning's own cost ratio, and the threshold it crossed (was "ratio")
    [w] = shown["margin_warnings"]
    ratio = Decimal(w["actual_cost"]) / Decimal(w["user_charge"])
    assert Decimal(w["cost_ratio"]) == ratio.quantize(Decimal("0.001"))
    assert w["threshold"] == warnings[0].ratio and "ratio" not in w
    assert Decimal(w["cost_ratio"]) > Decimal(w["threshold"])  # why it was recorded
    header = next(line for line in text if line.split()[:2] == ["window_start", "tenant_id"])
    assert header.split()[-2:] == ["cost_ratio", "threshold"]

    # --pool: one pool's series only.
    only_q = json.loads(cli(served, "show", "--pool", "q", "--json").stdout)
    assert [(r["pool"], r["multiplier"]) for r in only_q["pools"]] == [("q", "1.000000")]


def test_pricing_windows_equal_the_servers_answer(served: Served, clock: Any) -> None:
    start = _traffic(served, clock)
    k = start // NS
    listed = json.loads(cli(served, "windows", "--from", str(k), "--json").stdout)
    server = (
        served.ledger()
        .ListPricingWindows(lpb.ListPricingWindowsRequest(start_unix_ns=start), timeout=10)
        .windows
    )
    assert [
        (r["pool"], r["model"], r["window_start"], r["window_ms"], r["completions"],
         r["load_reports"], r["miss_rate"] or "", r["multiplier"], r["next_multiplier"],
         r["closed"]) for r in listed
    ] == [
        (w.pool, w.model, w.window_start, w.window_ms, w.completions, w.load_reports,
         w.miss_rate, w.multiplier, w.next_multiplier, w.closed) for w in server
    ]  # fmt: skip
    got = {(r["window_start"], r["pool"]): r for r in listed}
    assert (got[k, "p"]["miss_rate"], got[k, "p"]["next_multiplier"]) == ("0.500000", "1.200000")
    assert got[k, "p"]["closed"] and not got[k + WINDOW_S, "p"]["closed"]
    assert got[k + WINDOW_S, "p"]["multiplier"] == "1.200000"
    # --to bounds the window starts: window k only; --pool filters.
    only_k = json.loads(
        cli(served, "windows", "--from", str(k), "--to", str(k + WINDOW_S), "--pool", "q",
            "--json").stdout
    )  # fmt: skip
    assert [(r["window_start"], r["pool"], r["miss_rate"]) for r in only_k] == [
        (k, "q", "0.100000")
    ]
    text = cli(served, "windows", "--from", str(k)).stdout.splitlines()
    assert text[0].split() == list(WINDOW_COLUMNS)
    assert len(text) == 1 + len(listed)
    first = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(k))
    assert text[1].startswith(first) and text[1].split()[4:6] == ["p", "m"]


def test_a_viewer_key_may_look_and_bad_input_is_named(served: Served, clock: Any) -> None:
    _traffic(served, clock)
    viewer = admin_key(served.url, Role.VIEWER)
    assert json.loads(cli(served, "show", "--json", key=viewer).stdout)["pools"]
    bad = cli(served, "windows", "--from", "yesterday", code=2)
    assert "--from" in bad.output and "not an ISO 8601 time" in bad.output
    bad = cli(served, "windows", "--from", "2026-02-01", "--to", "2026-01-01", code=2)
    assert "--to" in bad.output and "must be after --from" in bad.output
    bad = cli(served, "show", "--warnings-from", "later", code=2)
    assert "--warnings-from" in bad.output
    wrong = cli(served, "show", code=2, key="bgk_not_a_key")
    assert "UNAUTHENTICATED" in wrong.stderr and "Traceback" not in wrong.output


def test_pricing_in_a_real_process(served: Served, clock: Any) -> None:
    start = _traffic(served, clock)
    run = subprocess.run(
        [sys.executable, "-m", "controlplane", "pricing", "--target", served.srv.target,
         "windows", "--from", str(start // NS), "--json"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "BURSTGATE_API_KEY": served.key},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert {(w["pool"], w["window_start"]) for w in json.loads(run.stdout)} == {
        (p, start // NS + d) for p in ("p", "q") for d in (0, WINDOW_S)
    }
    down = subprocess.run(
        [sys.executable, "-m", "controlplane", "pricing", "--target", "127.0.0.1:1",
         "--timeout", "2", "show"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "BURSTGATE_API_KEY": served.key},
    )  # fmt: skip
    assert down.returncode == 69, down.stderr  # EX_UNAVAILABLE: no server there
    assert "no burstgate server answered at 127.0.0.1:1" in down.stderr, down.stderr
    assert "Traceback" not in down.stderr


def test_a_server_without_the_ledger_is_said_so(migrated_url: str, make_server: Any) -> None:
    srv = make_server(migrated_url, ledger_enabled=False)
    env = {"BURSTGATE_ADMIN_TARGET": srv.target, "BURSTGATE_API_KEY": admin_key(migrated_url)}
    for args in (["show"], ["windows"]):
        result = CliRunner().invoke(app, ["pricing", *args], env=env)
        assert result.exit_code == 2, (result.output, result.exception)
        assert "BURSTGATE_LEDGER_ENABLED=false" in result.stderr
        assert "every multiplier is 1" in result.stderr
