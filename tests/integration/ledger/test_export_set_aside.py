"""Issue 30 item 10, the export half: one record that cannot be written never
fails an export. Reannounce once let a pricing window of year 10,000 into the
ledger, and every later export and ExportLedger then failed INTERNAL. The
input is validated now (tests/integration/test_reannounce_grpc.py); a record
left by an older server, or written by hand, is set aside: not in the file,
named in the manifest, its figures reconciled beside the rows written.
Through the real doors: LedgerService.ExportLedger and `burstgate export`
(SQLite and PostgreSQL, as `migrated_url` runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from burstgate_client._proto.burstgate.v1 import ledger_pb2 as lpb
from sqlalchemy import text
from typer.testing import CliRunner

from controlplane.cli import app
from controlplane.store.ledger_write import ledger_engine
from tests.integration.ledger.conftest import NS, Served, complete

YEAR_10000 = 253_402_300_800  # Unix s: what no ISO 8601 year of four digits can say


def _fill(served: Served, clock: Any, n: int = 5) -> int:
    c = served.client
    start = int(clock())
    for i in range(n):
        c.admit("acme", f"g{i}", prompt_tokens=10, max_tokens=10)
        complete(c, "acme", f"g{i}", prompt_tokens=10, generated_tokens=i + 1)
    clock.advance(NS)
    engine = ledger_engine(served.url)
    try:
        with engine.begin() as conn:
            hit = conn.execute(
                text("UPDATE ledger_records SET pricing_window = :w WHERE request_id = 'g2'"),
                {"w": YEAR_10000},
            )
            assert hit.rowcount == 1
    finally:
        engine.dispose()
    return start


def _export(served: Served, start: int, **kw: Any) -> tuple[bytes, dict[str, Any]]:
    chunks = list(
        served.ledger().ExportLedger(
            lpb.ExportLedgerRequest(start_unix_ns=start, **kw), timeout=30,
            metadata=(("authorization", f"Bearer {served.key}"),),
        )
    )  # fmt: skip
    return b"".join(ch.data for ch in chunks), json.loads(chunks[-1].manifest_json)


def test_export_over_grpc_sets_aside_the_record_it_cannot_write(
    served: Served, clock: Any
) -> None:
    start = _fill(served, clock)
    data, manifest = _export(served, start, format=lpb.EXPORT_FORMAT_JSONL)
    written = [json.loads(line) for line in data.splitlines()]
    assert sorted(r["request_id"] for r in written) == ["g0", "g1", "g3", "g4"]
    assert manifest["rows"] == 4 and manifest["set_aside_rows"] == 1
    [aside] = manifest["set_aside"]
    assert (aside["tenant_id"], aside["request_id"]) == ("acme", "g2")
    assert "year" in aside["reason"] or "range" in aside["reason"], aside
    # Written plus set aside is the whole period: nothing billed disappears.
    [written_totals] = manifest["totals"]
    [aside_totals] = manifest["set_aside_totals"]
    assert written_totals["requests"] + aside_totals["requests"] == 5
    assert written_totals["output_tokens"] + aside_totals["output_tokens"] == sum(range(1, 6))
    assert aside_totals["output_tokens"] == 3
    assert manifest["reconciled_with"].startswith("SUM()")
    # The daily rows do not carry the window: nothing is set aside there.
    data, daily = _export(served, start, format=lpb.EXPORT_FORMAT_JSONL,
                          granularity=lpb.EXPORT_GRANULARITY_DAILY)  # fmt: skip
    assert "set_aside" not in daily
    assert sum(json.loads(line)["requests"] for line in data.splitlines()) == 5


def test_cli_export_sets_aside_and_warns_in_every_format(
    served: Served, clock: Any, tmp_path: Path
) -> None:
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    start = _fill(served, clock)
    for fmt in ("csv", "jsonl", "parquet"):
        out = tmp_path / f"ledger.{fmt}"
        res = CliRunner().invoke(
            app, ["export", "--from", str(start // NS), "--to", str(clock() // NS + 1),
                  "--format", fmt, "--out", str(out), "--database-url", served.url],
            catch_exceptions=False,
        )  # fmt: skip
        assert res.exit_code == 0, res.output
        assert "1 ledger records could not be written" in res.output, res.output
        manifest = json.loads((tmp_path / f"ledger.{fmt}.manifest.json").read_text())
        assert manifest["rows"] == 4 and manifest["set_aside"][0]["request_id"] == "g2"
        if fmt == "parquet":
            ids = pq.read_table(out).column("request_id").to_pylist()
        elif fmt == "csv":
            ids = [line.split(",")[1] for line in out.read_text().splitlines()[1:]]
        else:
            ids = [json.loads(line)["request_id"] for line in out.read_text().splitlines()]
        assert sorted(ids) == ["g0", "g1", "g3", "g4"]


def test_a_clean_export_has_no_set_aside_entries(served: Served, clock: Any) -> None:
    c = served.client
    start = clock()
    c.admit("acme", "ok", prompt_tokens=10, max_tokens=10)
    complete(c, "acme", "ok", prompt_tokens=10, generated_tokens=1)
    clock.advance(NS)
    _, manifest = _export(served, start)
    assert manifest["rows"] == 1
    assert "set_aside" not in manifest and "set_aside_rows" not in manifest
