"""`burstgate margin` and the multiplier in the daily export, through the real
CLI, on ledgers written by a running server (SQLite and PostgreSQL).

Every figure is checked against an independent recomputation from the
request-level export of the same period (the ledger rows): the margin
report's rows, its total rows (= the sum of its rows), the base charge
(recomputed two ways: from each row's charge and multiplier, and from the
price catalog at multiplier 1), the daily rows and both manifests."""

from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path
from typing import Any

import pytest
from burstgate_client._proto.burstgate.v1 import ledger_pb2 as lpb
from typer.testing import CliRunner

from controlplane.cli import app
from controlplane.cli.margin import COLUMNS as MARGIN_COLUMNS
from controlplane.domain.catalog import PRICE_FIELDS, user_charge
from tests.integration.ledger.conftest import (
    ACME_PRICE,
    DEFAULT_PRICE,
    NS,
    Served,
    complete,
    ledger_rows,
)

WINDOW_NS = 300 * NS
DAY_NS = 86_400 * NS
NANO = Decimal("0.000000001")
RATIO = Decimal("1.15")
PRICES = {"acme": ACME_PRICE, "beta": DEFAULT_PRICE}
LANES = {"premium": Decimal("1.5")}  # ACME_PRICE's; DEFAULT_PRICE has none

pytestmark = pytest.mark.usefixtures("server_logs_elsewhere")



def run(*args: str, code: int = 0) -> Any:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == code, (args, result.stdout, result.stderr, result.exception)
    return result


def _boundary(clock: Any, every: int) -> None:
    clock.advance((clock() // every + 1) * every - clock())


def _request(served: Served, tenant: str, rid: str, prompt: int, out: int, *, cached: int = 0,
             lane: str = "", miss: float = 0.0) -> str:  # fmt: skip
    d = served.client.admit(tenant, rid, prompt_tokens=prompt, max_tokens=out, lane=lane,
                            model="m", pool="p")  # fmt: skip
    complete(served.client, tenant, rid, prompt_tokens=prompt, generated_tokens=out,
             cached_prompt_tokens=cached, kv_cache_miss_rate=miss)  # fmt: skip
    return str(d.pricing_multiplier)


def _traffic(served: Served, clock: Any) -> tuple[int, int]:
    """Two UTC days, multipliers 1 and 1.2, two lanes, two currencies (acme
    USD, beta EUR); beta's tiny requests cost more than they are charged.
    Returns the period [start, end) in Unix seconds."""
    # beta's price (EUR), set through the API: live at once
    price = lpb.Price(
        tenant_id=DEFAULT_PRICE.tenant_id, model=DEFAULT_PRICE.model,
        currency=DEFAULT_PRICE.currency,
    )  # fmt: skip
    for f in PRICE_FIELDS:
        setattr(price, f, str(getattr(DEFAULT_PRICE, f)))
    served.ledger().SetPrice(lpb.SetPriceRequest(price=price), timeout=10)
    start = clock() // NS
    _boundary(clock, WINDOW_NS)
    seen = [
        _request(served, "acme", "r1", 1000, 300, cached=200, miss=0.5),
        _request(served, "acme", "r2", 2000, 100, lane="premium", miss=0.5),
        _request(served, "beta", "b1", 1, 1),
        _request(served, "beta", "b2", 3, 2, cached=1),
    ]
    clock.advance(WINDOW_NS)  # window k measured 0.5: 1.20 now
    seen += [
        _request(served, "acme", "r3", 500, 250, cached=100),
        _request(served, "acme", "r4", 777, 33, lane="premium"),
        _request(served, "beta", "b3", 5, 1),
    ]
    midnight = (clock() // DAY_NS + 1) * DAY_NS
    clock.advance(midnight - WINDOW_NS - clock())  # the day's last window (after idle ones): 1
    seen.append(_request(served, "acme", "r5", 1234, 56, miss=0.9))
    clock.advance(WINDOW_NS + 3 * NS)  # the new day: 1.20
    seen += [
        _request(served, "acme", "r6", 4321, 654, cached=321, lane="premium"),
        _request(served, "beta", "b4", 2, 2),
    ]
    assert seen == ["1.000000"] * 4 + ["1.200000"] * 3 + ["1.000000"] + ["1.200000"] * 2
    clock.advance(NS)
    return start, clock() // NS + 1


def _export(url: str, period: tuple[int, int], out: Path, *extra: str) -> tuple[bytes, Any]:
    run("export", "--from", str(period[0]), "--to", str(period[1]), "--out", str(out),
        "--database-url", url, *extra)  # fmt: skip
    manifest = json.loads(out.with_name(out.name + ".manifest.json").read_text())
    return out.read_bytes(), manifest


def _nanos(text: str) -> int:
    return int(Decimal(text) / NANO)


def _base(row: dict[str, str]) -> int:
    """The charge at multiplier 1: the recorded charge / the recorded
    multiplier, to the nano, half-to-even (per record)."""
    exact = Decimal(row["user_charge"]) / Decimal(row["pricing_multiplier"])
    return _nanos(str(exact.quantize(NANO, rounding=ROUND_HALF_EVEN)))


def _catalog_base(row: dict[str, str]) -> int:
    """The same from the price catalog (unchanged during the test)."""
    lane = LANES.get(row["lane"], Decimal(1)) if row["tenant_id"] == "acme" else Decimal(1)
    tokens = (int(row["prompt_tokens"]), int(row["cached_tokens"]), int(row["output_tokens"]))
    charge = user_charge(PRICES[row["tenant_id"]], *tokens, Decimal(1), lane)
    return _nanos(str(charge.quantize(NANO, rounding=ROUND_HALF_EVEN)))


def _sums(rows: list[dict[str, str]]) -> dict[str, int]:
    s: defaultdict[str, int] = defaultdict(int)
    for r in rows:
        base = _base(r)
        assert base == _catalog_base(r), r
        s["requests"] += 1
        s["prompt_tokens"] += int(r["prompt_tokens"])
        s["cached_tokens"] += int(r["cached_tokens"])
        s["output_tokens"] += int(r["output_tokens"])
        s["user"] += _nanos(r["user_charge"])
        s["cost"] += _nanos(r["actual_cost"])
        s["base"] += base
        s["m_base"] += int(Decimal(r["pricing_multiplier"]) * 1_000_000) * base
        s["m_sum"] += int(Decimal(r["pricing_multiplier"]) * 1_000_000)
    return dict(s)


def _money(nanos: int) -> str:
    return str((Decimal(nanos) * NANO).quantize(NANO))


def _expected_margin(s: dict[str, int]) -> dict[str, Any]:
    pct = None
    if s["user"]:
        pct = str((Decimal(s["user"] - s["cost"]) * 100 / Decimal(s["user"])).quantize(
            Decimal("0.01"), rounding=ROUND_HALF_EVEN))  # fmt: skip
    return {
        "requests": s["requests"], "prompt_tokens": s["prompt_tokens"],
        "cached_tokens": s["cached_tokens"], "output_tokens": s["output_tokens"],
        "tokens": s["prompt_tokens"] + s["output_tokens"], "user_charge": _money(s["user"]),
        "actual_cost": _money(s["cost"]), "gross_margin": _money(s["user"] - s["cost"]),
        "margin_percent": pct, "base_charge": _money(s["base"]),
        "dynamic_revenue": _money(s["user"] - s["base"]),
        "warning": Decimal(s["cost"]) > RATIO * Decimal(s["user"]),
    }  # fmt: skip


def _request_rows(data: bytes) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(data.decode())))


def test_margin_report_equals_sums_over_the_ledger(
    served: Served, clock: Any, tmp_path: Path
) -> None:
    period = _traffic(served, clock)
    data, _ = _export(served.url, period, tmp_path / "requests.csv")
    rows = _request_rows(data)
    assert len(rows) == len(ledger_rows(served.url)) == 10
    dyn = [r for r in rows if r["pricing_multiplier"] != "1.000000"]
    assert dyn and all(_base(r) < _nanos(r["user_charge"]) for r in dyn)

    db = ("--from", str(period[0]), "--to", str(period[1]), "--database-url", served.url)
    report = json.loads(run("margin", *db, "--json", code=1).stdout)  # beta is over: exit 1
    by_tenant: dict[tuple[str, str], list[dict[str, str]]] = defaultdict(list)
    for r in rows:
        by_tenant[r["tenant_id"], r["currency"]].append(r)
    assert [(t["tenant_id"], t["currency"]) for t in report["tenants"]] == sorted(by_tenant)
    for t in report["tenants"]:
        expected = _expected_margin(_sums(by_tenant[t["tenant_id"], t["currency"]]))
        assert {k: t[k] for k in expected} == expected, t["tenant_id"]
    assert [t["warning"] for t in report["tenants"]] == [False, True]  # acme, beta
    assert report["ratio"] == "1.15" and report["warned"] is True
    # The total rows: per currency, the sum of the tenant rows.
    for total in report["totals"]:
        mine = [t for t in report["tenants"] if t["currency"] == total["currency"]]
        for k in ("requests", "prompt_tokens", "cached_tokens", "output_tokens", "tokens"):
            assert total[k] == sum(t[k] for t in mine)
        for k in ("user_charge", "actual_cost", "gross_margin", "base_charge", "dynamic_revenue"):
            assert Decimal(total[k]) == sum(Decimal(t[k]) for t in mine)
        cur_rows = [r for r in rows if r["currency"] == total["currency"]]
        assert total["margin_percent"] == _expected_margin(_sums(cur_rows))["margin_percent"]
    # The server's own report (GetMarginReport) over the same period agrees.
    server = served.ledger().GetMarginReport(
        lpb.GetMarginReportRequest(start_unix_ns=period[0] * NS, end_unix_ns=period[1] * NS),
        timeout=10,
    )
    assert [(m.tenant_id, m.requests, m.user_charge, m.actual_cost, m.warning)
            for m in server.tenants] == [
        (t["tenant_id"], t["requests"], t["user_charge"], t["actual_cost"], t["warning"])
        for t in report["tenants"]
    ]  # fmt: skip

    # The table: a header, one table per currency with a total row, warnings on stderr.
    shown = run("margin", *db, code=1)
    lines = shown.stdout.splitlines()
    assert lines[0].startswith("margin ") and "actual_cost > 1.15 x user_charge" in lines[0]
    headers = [i for i, line in enumerate(lines) if line.split()[:1] == ["tenant_id"]]
    assert len(headers) == 2 and all(lines[i].split() == list(MARGIN_COLUMNS) for i in headers)
    totals = [line.split() for line in lines if line.split()[:1] == ["total"]]
    assert [f[1] for f in totals] == ["EUR", "USD"]
    for f, total in zip(totals, sorted(report["totals"], key=lambda t: t["currency"]),
                        strict=True):  # fmt: skip
        assert f[2:8] == [str(total["requests"]), str(total["tokens"]), total["user_charge"],
                          total["actual_cost"], total["gross_margin"],
                          f"{total['margin_percent']}%"]  # fmt: skip
        assert f[8:] == [total["dynamic_revenue"], "yes" if total["warning"] else "no"]
    acme = next(line.split() for line in lines if line.startswith("acme"))
    assert acme[-2:] == [report["tenants"][0]["dynamic_revenue"], "no"]
    assert "margin warning: beta" in shown.stderr and "acme" not in shown.stderr

    # --tenant and --ratio: no tenant over, exit 0.
    only = json.loads(run("margin", *db, "--tenant", "acme", "--json").stdout)
    assert [t["tenant_id"] for t in only["tenants"]] == ["acme"]
    assert only["totals"][0] | {"tenant_id": "acme"} == only["tenants"][0]
    lax = json.loads(run("margin", *db, "--ratio", "1000", "--json").stdout)
    assert not lax["warned"] and lax["ratio"] == "1000"


def test_margin_refuses_a_bad_ratio_and_says_so_for_an_empty_period(migrated_url: str) -> None:
    db = ("--from", "2026-01-01", "--to", "2026-01-02", "--database-url", migrated_url)
    for bad in ("abc", "0", "-1", "NaN"):
        out = run("margin", *db, "--ratio", bad, code=2).output
        assert "--ratio" in out and "Traceback" not in out, out
    assert "no settled requests in the period" in run("margin", *db).stdout
    assert json.loads(run("margin", *db, "--json").stdout)["tenants"] == []


def test_daily_export_keeps_the_multiplier_and_reconciles(
    served: Served, clock: Any, tmp_path: Path
) -> None:
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    period = _traffic(served, clock)
    data, req_manifest = _export(served.url, period, tmp_path / "requests.csv")
    rows = _request_rows(data)
    daily_bytes, manifest = _export(served.url, period, tmp_path / "daily.csv",
                                    "--granularity", "daily")  # fmt: skip
    daily = list(csv.DictReader(io.StringIO(daily_bytes.decode())))
    groups: dict[tuple[str, ...], list[dict[str, str]]] = defaultdict(list)
    for r in rows:
        groups[r["tenant_id"], r["settled_ts"][:10], r["model"], r["currency"]].append(r)
    assert [(d["tenant_id"], d["day"], d["model"], d["currency"]) for d in daily] == sorted(groups)
    assert len({d["day"] for d in daily}) == 2
    for d in daily:
        s = _sums(groups[d["tenant_id"], d["day"], d["model"], d["currency"]])
        mean = Decimal(s["m_base"]) / Decimal(s["base"] * 1_000_000)
        assert d == d | {
            "requests": str(s["requests"]), "prompt_tokens": str(s["prompt_tokens"]),
            "cached_tokens": str(s["cached_tokens"]), "output_tokens": str(s["output_tokens"]),
            "user_charge": _money(s["user"]), "actual_cost": _money(s["cost"]),
            "base_charge": _money(s["base"]), "dynamic_revenue": _money(s["user"] - s["base"]),
            "pricing_multiplier": str(mean.quantize(Decimal("0.000001"), ROUND_HALF_EVEN)),
        }, d  # fmt: skip
    means = {(d["tenant_id"], d["day"]): d["pricing_multiplier"] for d in daily}
    assert means["acme", "2023-11-15"] == "1.200000"  # r6 only
    assert 1 < Decimal(means["acme", "2023-11-14"]) < Decimal("1.2")  # r1-r5, weighted by base
    # The manifests agree, base charge and dynamic revenue included, and
    # user_charge = base_charge + dynamic_revenue per currency.
    assert manifest["totals"] == req_manifest["totals"]
    for t in manifest["totals"]:
        assert Decimal(t["user_charge"]) == Decimal(t["base_charge"]) + Decimal(
            t["dynamic_revenue"]
        )
        assert Decimal(t["dynamic_revenue"]) > 0
    report = json.loads(
        run("margin", "--from", str(period[0]), "--to", str(period[1]), "--database-url",
            served.url, "--json", code=1).stdout
    )  # fmt: skip
    for t, m in zip(manifest["totals"], report["totals"], strict=True):
        assert t["currency"] == m["currency"]
        assert (t["base_charge"], t["dynamic_revenue"]) == (m["base_charge"], m["dynamic_revenue"])
    # Deterministic, and the same figures in JSON Lines and Parquet.
    assert _export(served.url, period, tmp_path / "daily.csv", "--granularity", "daily") == (
        daily_bytes, manifest,
    )  # fmt: skip
    jsonl, _ = _export(served.url, period, tmp_path / "daily.jsonl", "--granularity", "daily",
                       "--format", "jsonl")  # fmt: skip
    as_text = [{k: str(v) for k, v in json.loads(line).items()} for line in jsonl.splitlines()]
    assert as_text == daily
    _export(served.url, period, tmp_path / "daily.parquet", "--granularity", "daily",
            "--format", "parquet")  # fmt: skip
    table = pq.read_table(tmp_path / "daily.parquet").to_pylist()
    figures = ("base_charge", "dynamic_revenue", "pricing_multiplier", "user_charge")
    assert [[t[f] for f in figures] for t in table] == [
        [Decimal(d[f]) for f in figures] for d in daily
    ]


def test_price_list_is_a_table_with_the_set_options_names(migrated_url: str) -> None:
    db = ("--database-url", migrated_url)
    run("price", "set", "acme", "--input", "2", "--cached-input", "0.5", "--output", "8",
        "--gpu-prefill", "1", "--lane-multiplier", "premium=1.5", *db)  # fmt: skip
    run("price", "set", "*", "--currency", "EUR", "--input", "1", *db)
    lines = run("price", "list", *db).stdout.splitlines()
    assert lines[0].split() == ["tenant_id", "model", "currency", "input", "cached_input",
                                "output", "gpu_prefill", "gpu_decode", "gpu_overhead",
                                "lane_multipliers"]  # fmt: skip
    rows = [line.split() for line in lines[1:]]
    assert [(r[0], r[2]) for r in rows] == [("*", "EUR"), ("acme", "USD")]
    acme = rows[1]
    assert [Decimal(v) for v in acme[3:9]] == [2, Decimal("0.5"), 8, 1, 0, 0]
    assert acme[9] == "premium=1.5" and rows[0][9] == "-"
    listed = json.loads(run("price", "list", "--json", *db).stdout)
    assert [(e["tenant_id"], Decimal(e["input_per_mtok"])) for e in listed] == [
        ("*", Decimal(1)),
        ("acme", Decimal(2)),
    ]
