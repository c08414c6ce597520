"""Exports: totals equal SQL SUM() for random data (hypothesis), byte-identical
output, streaming through the CLI and LedgerService, analyzable by
`burstgate analyze` (SQLite and PostgreSQL)."""

from __future__ import annotations

import csv
import hashlib
import io
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import ledger_pb2 as lpb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from typer.testing import CliRunner

from controlplane.cli import app
from controlplane.domain.ledger_records import LedgerRecord
from controlplane.domain.money import format_nanos
from controlplane.ledger.export import ExportResult, ExportSpec, export
from controlplane.store.ledger import LedgerStore
from controlplane.store.ledger_write import ledger_engine
from tests.integration.ledger.conftest import NS, Served, complete

T0 = 1_700_000_000 * NS
DAY = 86_400 * NS

records_st = st.lists(
    st.builds(
        lambda t, i, settled, p, c, o, u, a, cur, model: (
            t,
            i,
            settled,
            p,
            min(c, p),
            o,
            u,
            a,
            cur,
            model,
        ),
        st.sampled_from(["acme", "beta", "gamma,inc", 'quo"te']),
        st.integers(0, 10**6),
        st.integers(0, 3 * DAY),
        st.integers(0, 10_000_000),
        st.integers(0, 10_000_000),
        st.integers(0, 10_000_000),
        st.integers(0, 10**15),  # up to a million currency units per record
        st.integers(0, 10**15),
        st.sampled_from(["USD", "EUR"]),
        st.sampled_from(["m1", "m2", ""]),
    ),
    max_size=40,
    unique_by=lambda r: (r[0], r[1]),
)


def _record(t: str, i: int, settled: int, p: int, c: int, o: int, u: int, a: int, cur: str,
            model: str) -> LedgerRecord:  # fmt: skip
    ts = T0 + settled
    return LedgerRecord(
        t, f"req-{i}", i, "standard", model, "pool", ts - 5, ts - 5, ts - 3, ts, ts, p, c, o,
        p + o, Decimal("0.250000"), "request", Decimal("1.200000"), 1_700_000_100,
        Decimal("1.000000"), cur, u, a, 0,
    )  # fmt: skip


def _sql_sums(url: str, start: int, end: int) -> dict[str, tuple[int, ...]]:
    engine = ledger_engine(url)
    try:
        with engine.connect() as c:
            rows = c.execute(
                text(
                    "SELECT currency, COUNT(*), SUM(prompt_tokens), SUM(cached_tokens), "
                    "SUM(output_tokens), SUM(user_charge_nanos), SUM(actual_cost_nanos) "
                    "FROM ledger_records WHERE settled_ns >= :s AND settled_ns < :e "
                    "GROUP BY currency"
                ),
                {"s": start, "e": end},
            )
            return {r[0]: tuple(int(v) for v in r[1:]) for r in rows}
    finally:
        engine.dispose()


def _run(url: str, spec: ExportSpec) -> tuple[bytes, ExportResult]:
    engine = ledger_engine(url)
    result = ExportResult()
    try:
        data = b"".join(export(engine, spec, result))
    finally:
        engine.dispose()
    return data, result


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(rows=records_st, fmt=st.sampled_from(["csv", "jsonl"]),
       granularity=st.sampled_from(["request", "daily"]),
       window=st.tuples(st.integers(0, 3 * DAY), st.integers(1, 3 * DAY)))  # fmt: skip
def test_export_totals_equal_sql_sum(
    migrated_url: str, rows: list[tuple[Any, ...]], fmt: str, granularity: str,
    window: tuple[int, int],
) -> None:  # fmt: skip
    engine = ledger_engine(migrated_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM ledger_records"))
        LedgerStore(engine).insert([_record(*r) for r in rows])
    finally:
        engine.dispose()
    start = T0 + window[0]
    end = start + window[1]
    spec = ExportSpec(start, end, (), fmt, granularity)
    data, result = _run(migrated_url, spec)
    sums = _sql_sums(migrated_url, start, end)
    totals = {t["currency"]: t for t in result.manifest["totals"]}
    assert set(totals) == set(sums)
    for cur, (n, p, c, o, u, a) in sums.items():
        t = totals[cur]
        assert (t["requests"], t["prompt_tokens"], t["cached_tokens"], t["output_tokens"]) == (
            n, p, c, o,
        )  # fmt: skip
        assert (t["user_charge"], t["actual_cost"]) == (format_nanos(u), format_nanos(a))
    # The file itself adds up to the same figures.
    parsed = _parse(data, fmt)
    per_cur: dict[str, list[Decimal]] = {}
    for row in parsed:
        acc = per_cur.setdefault(row["currency"], [Decimal(0), Decimal(0), Decimal(0)])
        acc[0] += Decimal(row["user_charge"])
        acc[1] += Decimal(row["actual_cost"])
        acc[2] += int(row["requests"]) if granularity == "daily" else 1
    for cur, (n, _p, _c, _o, u, a) in sums.items():
        assert per_cur[cur] == [Decimal(format_nanos(u)), Decimal(format_nanos(a)), n]
    assert result.manifest["sha256"] == hashlib.sha256(data).hexdigest()
    # Deterministic: the same records give the same bytes (and manifest).
    again, result2 = _run(migrated_url, spec)
    assert again == data and result2.manifest == result.manifest


def _parse(data: bytes, fmt: str) -> list[dict[str, str]]:
    text_ = data.decode()
    if fmt == "csv":
        return list(csv.DictReader(io.StringIO(text_)))
    return [json.loads(line) for line in text_.splitlines()]


def test_cli_export_writes_file_and_manifest_and_analyze_reads_it(
    served: Served, clock: Any, tmp_path: Path
) -> None:
    c = served.client
    start = clock()
    for i in range(30):
        c.admit("acme" if i % 2 else "beta", f"r{i}", prompt_tokens=100 + i, max_tokens=50)
        complete(c, "acme" if i % 2 else "beta", f"r{i}", prompt_tokens=100 + i,
                 generated_tokens=i, cached_prompt_tokens=i)  # fmt: skip
        clock.advance(NS // 3)
    runner = CliRunner()
    out = tmp_path / "ledger.csv"
    args = ["export", "--from", str(start // NS), "--to", str(clock() // NS + 1), "--out",
            str(out), "--database-url", served.url]  # fmt: skip
    res = runner.invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "ledger.csv.manifest.json").read_text())
    assert manifest["rows"] == 30
    first = out.read_bytes()
    assert runner.invoke(app, args, catch_exceptions=False).exit_code == 0
    assert out.read_bytes() == first  # byte-identical
    header = first.decode().splitlines()[0].split(",")
    assert header[:13] == [
        "tenant_id", "request_id", "lane", "model", "pool", "arrival_ts", "queue_start_ts",
        "exec_start_ts", "end_ts", "prompt_tokens", "cached_tokens", "output_tokens", "decision",
    ]  # fmt: skip
    analyzed = runner.invoke(app, ["analyze", str(out), "--json"], catch_exceptions=False)
    assert analyzed.exit_code == 0, analyzed.output
    daily = tmp_path / "daily.jsonl"
    res = runner.invoke(
        app, [*args[:5], "--format", "jsonl", "--granularity", "daily", "--out", str(daily),
              "--database-url", served.url], catch_exceptions=False,
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    lines = [json.loads(line) for line in daily.read_text().splitlines()]
    assert sum(line["requests"] for line in lines) == 30


def test_export_over_grpc_streams_file_then_manifest(served: Served, clock: Any) -> None:
    c = served.client
    start = clock()
    for i in range(5):
        c.admit("acme", f"g{i}", prompt_tokens=10, max_tokens=10)
        complete(c, "acme", f"g{i}", prompt_tokens=10, generated_tokens=i)
    clock.advance(NS)
    chunks = list(
        served.ledger().ExportLedger(
            lpb.ExportLedgerRequest(
                tenant_ids=["acme"], start_unix_ns=start, format=lpb.EXPORT_FORMAT_JSONL
            ),
            timeout=30,
            metadata=(("authorization", f"Bearer {served.key}"),),
        )
    )
    data = b"".join(ch.data for ch in chunks)
    manifest = json.loads(chunks[-1].manifest_json)
    assert manifest["rows"] == 5 and len(data.splitlines()) == 5
    assert manifest["sha256"] == hashlib.sha256(data).hexdigest()
    assert all(not ch.manifest_json for ch in chunks[:-1])


def test_export_over_grpc_refuses_bad_tenant_ids_naming_the_field(served: Served) -> None:
    """Found by tests/integration/fuzz: a NUL in a tenant id reached
    PostgreSQL, and the stream ended UNKNOWN with the SQL in its message; a
    10,000-character id came back whole in the message."""
    md = (("authorization", f"Bearer {served.key}"),)
    for bad in ("acme\x00", "x" * 10_000, ""):
        with pytest.raises(grpc.RpcError) as err:
            list(served.ledger().ExportLedger(
                lpb.ExportLedgerRequest(tenant_ids=["acme", bad]), timeout=30, metadata=md
            ))  # fmt: skip
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert err.value.details().startswith("tenant_ids"), err.value.details()
        assert len(err.value.details()) < 200


def test_export_over_grpc_answers_internal_for_an_unexpected_error(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure inside the export stream is INTERNAL with the generic
    message, as for unary calls: never UNKNOWN with the exception's text
    (which carried the SQL statement)."""

    def failing(*_: Any) -> Any:
        raise RuntimeError("SELECT secret FROM ledger_records")
        yield b""  # a generator, as export() is

    monkeypatch.setattr("controlplane.rpc.ledger.export", failing)
    md = (("authorization", f"Bearer {served.key}"),)
    with pytest.raises(grpc.RpcError) as err:
        list(served.ledger().ExportLedger(lpb.ExportLedgerRequest(), timeout=30, metadata=md))
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "SELECT" not in (err.value.details() or "")


def test_parquet_export(served: Served, clock: Any, tmp_path: Path) -> None:
    # the parquet extra is part of `make test`'s install: a missing pyarrow
    # fails here rather than skipping
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    c = served.client
    start = clock()
    for i in range(4):
        c.admit("acme", f"q{i}", prompt_tokens=10, max_tokens=10)
        complete(c, "acme", f"q{i}", prompt_tokens=10, generated_tokens=i)
    clock.advance(NS)
    out = tmp_path / "l.parquet"
    res = CliRunner().invoke(
        app, ["export", "--from", str(start // NS), "--to", str(clock() // NS + 1), "--format",
              "parquet", "--out", str(out), "--database-url", served.url],
        catch_exceptions=False,
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    table = pq.read_table(out)
    assert table.num_rows == 4
    assert sum(table.column("user_charge").to_pylist()) == Decimal(
        json.loads((tmp_path / "l.parquet.manifest.json").read_text())["totals"][0]["user_charge"]
    )
