"""Ledger exports for billing: deterministic, streaming, reconciled.

- **Deterministic**: a fixed row order (tenant, settled time, request id;
  aggregated: tenant, day, model, currency), fixed number formats (amounts
  with 9 decimals, rates and multipliers with 6, ISO 8601 UTC timestamps
  with nanoseconds) and no generation time anywhere: the same records give
  byte-identical files, manifest included.
- **Streaming**: rows come through a server-side cursor (PostgreSQL) or a
  lazily stepped cursor (SQLite) ``FETCH_ROWS`` at a time and leave as
  ~64 KiB chunks; the period is never held in memory.
- **Reconciled**: the manifest's totals are ``SUM()``s computed by the
  database in the same snapshot as the rows (REPEATABLE READ on
  PostgreSQL; one read transaction on SQLite), and the export checks that
  the rows it wrote add up to exactly those sums before it emits the
  manifest (``ExportMismatch`` otherwise).
- **The multiplier in every granularity**: request rows carry the
  multiplier locked at admission; daily rows carry the base charge (the
  charge at multiplier 1, derived per record: ``ledger/revenue.py``), the
  dynamic revenue (user charge - base charge) and the base-charge-weighted
  mean multiplier. Daily rows are therefore summed here from the request
  rows (read in group order, one group in memory at a time) rather than by
  SQL ``GROUP BY``: the base charge is rounded per record, which SQL cannot
  do exactly on both databases.
- **Never failed by one row**: a record that cannot be written (a time
  outside what ISO 8601 and Parquet's 64-bit nanoseconds can say, left by
  an older server or written into the database by hand)
  is *set aside*: not in the file, listed in the manifest's ``set_aside``
  (tenant, request id, settled time, why), its figures in
  ``set_aside_totals``, and the reconciliation checks rows written plus rows
  set aside against the database's sums. Finance sees every record either
  in the file or named in the manifest; the rest of the period exports.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import structlog
from sqlalchemy import Connection, Engine, Select  # types: the SQL is in store/ledger_reads.py

from controlplane.domain.errors import InvalidArgument, excerpt
from controlplane.domain.exportspec import MAX_TIME_NS, ExportFormat, Granularity, check_time_ns
from controlplane.domain.ledger_records import COLUMNS, iso_ns
from controlplane.domain.money import format_fixed, format_nanos
from controlplane.domain.validate import check_id
from controlplane.ledger.revenue import MicroCache, Sums, add_record
from controlplane.store.ledger_reads import (
    SUM_COLUMNS,
    currency_sums,
    daily_records_query,
    daily_sums_query,
    request_rows_query,
)

log = structlog.get_logger("burstgate.export")

FETCH_ROWS = 5_000
# The manifest names at most this many set-aside rows (all are counted and summed).
SET_ASIDE_LISTED = 1_000
# What rendering a damaged record raises (datetime, Decimal, int conversions).
_UNWRITABLE = (ValueError, OverflowError, ArithmeticError, TypeError)
CHUNK_BYTES = 64 * 1024


FORMATS = tuple(f.value for f in ExportFormat)
GRANULARITIES = tuple(g.value for g in Granularity)

REQUEST_COLUMNS: tuple[str, ...] = (
    # The request-log columns `burstgate analyze` reads (docs/analysis.md) ...
    "tenant_id", "request_id", "lane", "model", "pool", "arrival_ts", "queue_start_ts",
    "exec_start_ts", "end_ts", "prompt_tokens", "cached_tokens", "output_tokens", "decision",
    # ... then the ledger's own.
    "settled_ts", "reservation_id", "reserved_tokens", "kv_cache_miss_rate", "miss_rate_source",
    "pricing_multiplier", "pricing_window_start", "lane_multiplier", "currency", "user_charge",
    "actual_cost", "price_id", "correlation_id",
)  # fmt: skip
DAILY_COLUMNS: tuple[str, ...] = (
    "tenant_id", "day", "model", "currency", "requests", "prompt_tokens", "cached_tokens",
    "output_tokens", "user_charge", "actual_cost",
    # The dynamic part of the user charge (ledger/revenue.py; docs/ledger.md).
    "base_charge", "dynamic_revenue", "pricing_multiplier",
)  # fmt: skip
_IDX = {name: i for i, name in enumerate(COLUMNS)}


class ExportMismatch(RuntimeError):
    """The rows written do not add up to the database's sums (never expected)."""


@dataclass(frozen=True, slots=True)
class ExportSpec:
    start_ns: int
    end_ns: int
    tenants: tuple[str, ...] = ()
    fmt: str = "csv"
    granularity: str = "request"

    def validate(self) -> ExportSpec:
        if self.fmt not in FORMATS:
            raise InvalidArgument("format", f"must be one of {', '.join(FORMATS)}")
        if self.granularity not in GRANULARITIES:
            raise InvalidArgument("granularity", f"must be one of {', '.join(GRANULARITIES)}")
        check_time_ns("start", self.start_ns)
        check_time_ns("end", self.end_ns)
        if self.end_ns <= self.start_ns:
            raise InvalidArgument("end", "the period must be non-empty (end after start)")
        for t in self.tenants:
            # As tenant ids are everywhere: 1..128 printable characters (a NUL
            # would reach PostgreSQL, which refuses it in text).
            check_id("tenant_ids", t)
        return self


# A currency's totals: the SQL-summable figures plus the base charge.
Totals = Sums


@dataclass
class ExportResult:
    rows: int = 0
    sha256: str = ""
    totals: dict[str, Totals] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)
    set_aside: int = 0  # records not written (listed in the manifest)


@dataclass
class _SetAside:
    """Records that could not be written, named for the manifest."""

    count: int = 0
    listed: list[dict[str, Any]] = field(default_factory=list)
    totals: dict[str, Totals] = field(default_factory=dict)
    unsummed: int = 0  # whose amounts could not be read either

    def add(self, r: Sequence[Any], daily: bool, exc: Exception, micro: MicroCache) -> None:
        self.count += 1
        if daily:  # (tenant, day, model, currency, sums...)
            entry = {"tenant_id": str(r[0]), "day": str(r[1]), "model": str(r[2])}
        else:
            entry = {"tenant_id": str(r[_IDX["tenant_id"]]),
                     "request_id": str(r[_IDX["request_id"]]),
                     "settled_unix_ns": str(r[_IDX["settled_ns"]])}  # fmt: skip
        entry["reason"] = excerpt(f"{type(exc).__name__}: {exc}")
        if len(self.listed) < SET_ASIDE_LISTED:
            self.listed.append(entry)
        log.warning("ledger record set aside from an export", **entry)
        try:
            if daily:
                sums = self.totals.setdefault(r[3], Totals())
                add_record(sums, r, 4, micro)
            else:
                _add_request(self.totals, r, micro)
        except _UNWRITABLE:
            self.unsummed += 1


def sql_totals(conn: Connection, spec: ExportSpec) -> dict[str, Totals]:
    """Per currency, straight from SQL SUM()."""
    return {cur: Totals(*sums) for cur, sums in currency_sums(conn, spec).items()}


def query(spec: ExportSpec) -> Select[Any]:
    """Request rows; daily: SQL-summed groups (GetUsage; no base charge)."""
    return request_rows_query(spec) if spec.granularity == "request" else daily_sums_query(spec)


def _request_values(r: Sequence[Any]) -> list[Any]:
    """A ledger row as export values (text where exactness needs it)."""
    i = _IDX
    window = int(r[i["pricing_window"]])
    return [
        r[i["tenant_id"]], r[i["request_id"]], r[i["lane"]], r[i["model"]], r[i["pool"]],
        iso_ns(r[i["arrival_ns"]]), iso_ns(r[i["queue_start_ns"]]),
        iso_ns(r[i["exec_start_ns"]]), iso_ns(r[i["end_ns"]]),
        int(r[i["prompt_tokens"]]), int(r[i["cached_tokens"]]), int(r[i["output_tokens"]]),
        "admit",
        iso_ns(r[i["settled_ns"]]), int(r[i["reservation_id"]]), int(r[i["reserved_tokens"]]),
        format_fixed(Decimal(r[i["kv_cache_miss_rate"]]), 6), r[i["miss_rate_source"]],
        format_fixed(Decimal(r[i["pricing_multiplier"]]), 6),
        iso_ns(window * 1_000_000_000) if window else "",
        format_fixed(Decimal(r[i["lane_multiplier"]]), 6), r[i["currency"]],
        format_nanos(int(r[i["user_charge_nanos"]])), format_nanos(int(r[i["actual_cost_nanos"]])),
        int(r[i["price_id"]] or 0), r[i["correlation_id"]] or "",
    ]  # fmt: skip


def _day_text(day: Any) -> str:
    return datetime.fromtimestamp(int(day) * 86_400, UTC).strftime("%Y-%m-%d")


def daily_values(r: Sequence[Any]) -> list[Any]:
    """A row of the SQL-summed daily query (GetUsage)."""
    return [
        r[0], _day_text(r[1]), r[2], r[3], int(r[4]), int(r[5] or 0), int(r[6] or 0),
        int(r[7] or 0), format_nanos(int(r[8] or 0)), format_nanos(int(r[9] or 0)),
    ]  # fmt: skip


def daily_export_values(key: tuple[Any, ...], t: Sums) -> list[Any]:
    """A daily export row: the group key, its sums, then the dynamic part."""
    mean = t.mean_multiplier()
    return [
        key[0], _day_text(key[1]), key[2], key[3], t.requests, t.prompt_tokens,
        t.cached_tokens, t.output_tokens, format_nanos(t.user_charge_nanos),
        format_nanos(t.actual_cost_nanos), format_nanos(t.base_charge_nanos),
        format_nanos(t.dynamic_revenue_nanos),
        format_fixed(mean, 6) if mean is not None else "",
    ]  # fmt: skip


_REQUEST_SUM_AT = tuple(_IDX[name] for name in SUM_COLUMNS)


def _add_request(totals: dict[str, Totals], r: Sequence[Any], micro: MicroCache) -> None:
    p, c, o, u, a, m = _REQUEST_SUM_AT
    totals.setdefault(r[_IDX["currency"]], Totals()).add(
        int(r[p]), int(r[c]), int(r[o]), int(r[u]), int(r[a]), micro(r[m])
    )


class _Text:
    """CSV or JSON Lines, encoded to UTF-8 in chunks."""

    def __init__(self, fmt: str, columns: Sequence[str]) -> None:
        self.fmt = fmt
        self.columns = columns
        self.buf = io.StringIO()
        self._csv = csv.writer(self.buf, lineterminator="\n") if fmt == "csv" else None
        if self._csv is not None:
            self._csv.writerow(columns)

    def prepare(self, values: list[Any]) -> list[Any]:
        return values  # text takes any rendered row

    def add(self, values: list[Any]) -> None:
        if self._csv is not None:
            self._csv.writerow(values)
        else:
            self.buf.write(
                json.dumps(
                    dict(zip(self.columns, values, strict=True)),
                    ensure_ascii=False,
                    separators=(",", ":"),
                )
            )
            self.buf.write("\n")

    def take(self, final: bool = False) -> bytes:
        if not final and self.buf.tell() < CHUNK_BYTES:
            return b""
        data = self.buf.getvalue().encode()
        self.buf.seek(0)
        self.buf.truncate()
        return data


class _Parquet:
    """Parquet through pyarrow (the ``parquet`` extra), a row group per fetch."""

    def __init__(self, columns: Sequence[str], granularity: str) -> None:
        try:
            import pyarrow as pa  # type: ignore[import-untyped,import-not-found,unused-ignore]
            import pyarrow.parquet as pq  # type: ignore[import-untyped,import-not-found,unused-ignore]
        except ImportError:
            raise InvalidArgument(
                "format", "parquet needs pyarrow: pip install 'burstgate[parquet]'"
            ) from None
        self.pa = pa
        money = pa.decimal128(38, 9)
        ratio = pa.decimal128(18, 6)
        ts = pa.timestamp("ns", tz="UTC")
        if granularity == "request":
            types = [
                pa.string(), pa.string(), pa.string(), pa.string(), pa.string(), ts, ts, ts, ts,
                pa.int64(), pa.int64(), pa.int64(), pa.string(), ts, pa.int64(), pa.int64(),
                ratio, pa.string(), ratio, ts, ratio, pa.string(), money, money, pa.int64(),
                pa.string(),
            ]  # fmt: skip
        else:
            types = [
                pa.string(), pa.date32(), pa.string(), pa.string(), pa.int64(), pa.int64(),
                pa.int64(), pa.int64(), money, money, money, money, ratio,
            ]  # fmt: skip
        self.schema = pa.schema(list(zip(columns, types, strict=True)))
        self.sink = io.BytesIO()
        self.writer = pq.ParquetWriter(self.sink, self.schema, compression="zstd")
        self.granularity = granularity
        self.rows: list[list[Any]] = []

    def prepare(self, values: list[Any]) -> list[Any]:
        """The row as Arrow values, checked here so that a row Parquet cannot
        hold is set aside alone rather than failing its whole row group."""
        return self._native(values)

    def add(self, values: list[Any]) -> None:
        self.rows.append(values)  # as prepare() made them

    def _native(self, values: list[Any]) -> list[Any]:
        out: list[Any] = []
        for v, f in zip(values, self.schema, strict=True):
            t = f.type
            if self.pa.types.is_timestamp(t):
                ns = _iso_to_ns(v) if v else None
                if ns is not None and not 0 <= ns <= MAX_TIME_NS:
                    raise OverflowError(f"{f.name} {v} is past Parquet's 64-bit nanoseconds")
                out.append(ns)
            elif self.pa.types.is_decimal(t):
                out.append(Decimal(v) if v != "" else None)
            elif self.pa.types.is_date32(t):
                out.append(datetime.strptime(v, "%Y-%m-%d").date())
            else:
                out.append(v)
        return out

    def take(self, final: bool = False) -> bytes:
        if self.rows:
            cols = list(zip(*self.rows, strict=True))
            arrays = [
                self.pa.array(col, type=f.type) for col, f in zip(cols, self.schema, strict=True)
            ]
            self.writer.write_table(self.pa.Table.from_arrays(arrays, schema=self.schema))
            self.rows.clear()
        if final:
            self.writer.close()
        data = self.sink.getvalue()
        self.sink.seek(0)
        self.sink.truncate()
        return data


def _iso_to_ns(text: str) -> int:
    base, _, frac = text.rstrip("Z").partition(".")
    secs = int(datetime.strptime(base, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC).timestamp())
    return secs * 1_000_000_000 + int(frac or 0)


class _DailyGroups:
    """Consecutive records of one (tenant, day, model, currency) summed into
    one daily row; only the group being summed is held."""

    def __init__(self, running: dict[str, Totals]) -> None:
        self.running = running
        self.micro = MicroCache()
        self.key: tuple[Any, ...] | None = None
        self.sums = Sums()

    def feed(self, r: Sequence[Any]) -> list[Any] | None:
        """Add a record; the finished group's row when this one starts a new group."""
        key = (r[0], int(r[1]), r[2], r[3])
        one = Sums()
        add_record(one, r, 4, self.micro)  # first: a record that cannot be read changes nothing
        done = self.finish() if key != self.key else None
        self.key = key
        self.sums.merge(one)
        return done

    def finish(self) -> list[Any] | None:
        if self.key is None:
            return None
        values = daily_export_values(self.key, self.sums)
        # The reconciliation adds up the rows written, not the records read.
        self.running.setdefault(self.key[3], Totals()).merge(self.sums)
        self.key, self.sums = None, Sums()
        return values


def export(engine: Engine, spec: ExportSpec, result: ExportResult) -> Iterator[bytes]:
    """Yield the file's bytes; fill ``result`` (manifest) when done."""
    spec.validate()
    daily = spec.granularity == "daily"
    columns = DAILY_COLUMNS if daily else REQUEST_COLUMNS
    sha = hashlib.sha256()
    out: _Text | _Parquet = (
        _Parquet(columns, spec.granularity) if spec.fmt == "parquet" else _Text(spec.fmt, columns)
    )
    running: dict[str, Totals] = {}
    groups = _DailyGroups(running)
    micro = MicroCache()
    aside = _SetAside()
    rows = 0
    options: dict[str, Any] = {}
    if engine.dialect.name == "postgresql":
        options["isolation_level"] = "REPEATABLE READ"  # one snapshot for rows and sums
    with engine.connect().execution_options(**options) as conn, conn.begin():
        expected = sql_totals(conn, spec)
        cursor = conn.execution_options(stream_results=True, yield_per=FETCH_ROWS).execute(
            daily_records_query(spec) if daily else query(spec)
        )
        for part in cursor.partitions():
            for r in part:
                if daily:
                    try:
                        done = groups.feed(r)
                    except _UNWRITABLE as exc:
                        aside.add(r, True, exc, micro)
                        continue
                    if done is not None:
                        out.add(out.prepare(done))
                        rows += 1
                else:
                    try:  # rendered whole before anything of it is written
                        values = out.prepare(_request_values(r))
                    except _UNWRITABLE as exc:
                        aside.add(r, False, exc, micro)
                        continue
                    out.add(values)
                    _add_request(running, r, micro)
                    rows += 1
            data = out.take(final=False) if spec.fmt != "parquet" else out.take()
            if data:
                sha.update(data)
                yield data
        last = groups.finish()
        if last is not None:
            out.add(out.prepare(last))
            rows += 1
    data = out.take(final=True)
    if data:
        sha.update(data)
        yield data
    accounted: dict[str, Totals] = {}
    for part_totals in (running, aside.totals):
        for currency, t in part_totals.items():
            accounted.setdefault(currency, Totals()).merge(t)
    reconciled = not aside.unsummed
    if reconciled and (
        {k: v.key() for k, v in accounted.items()} != {k: v.key() for k, v in expected.items()}
    ):
        raise ExportMismatch(f"export rows add up to {running} (set aside: {aside.totals}), "
                             f"the database's SUM() to {expected}")  # fmt: skip
    result.rows = rows
    result.set_aside = aside.count
    result.sha256 = sha.hexdigest()
    # The SQL figures equal the rows' (checked above); the rows' sums also
    # carry the base charge.
    result.totals = running
    result.manifest = {
        "format": spec.fmt,
        "granularity": spec.granularity,
        "columns": list(columns),
        "period": {"start": iso_ns(spec.start_ns), "end": iso_ns(spec.end_ns)},
        "tenants": sorted(set(spec.tenants)) or "all",
        "order": (
            ["tenant_id", "day", "model", "currency"]
            if daily
            else ["tenant_id", "settled_ts", "request_id"]
        ),
        "rows": rows,
        "totals": [running[c].as_json(c) for c in sorted(running)],
        "reconciled_with": (
            "SUM() over ledger_records in the export's snapshot"
            if reconciled
            else f"not reconciled: {aside.unsummed} set-aside records have unreadable amounts"
        ),
        "sha256": result.sha256,
    }
    if aside.count:  # only then: a clean export's manifest is unchanged
        result.manifest["set_aside_rows"] = aside.count
        result.manifest["set_aside"] = aside.listed
        result.manifest["set_aside_totals"] = [
            aside.totals[c].as_json(c) for c in sorted(aside.totals)
        ]


def manifest_json(result: ExportResult) -> str:
    return json.dumps(result.manifest, indent=2, ensure_ascii=False) + "\n"
