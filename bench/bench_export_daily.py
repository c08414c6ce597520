"""What keeping the multiplier in the daily export costs (issue 13, item 4).

On demand, not a test:

    .venv/bin/python bench/bench_export_daily.py                 # SQLite, 200,000 records
    .venv/bin/python bench/bench_export_daily.py --postgres      # a scratch PostgreSQL database
    .venv/bin/python bench/bench_export_daily.py --rows 1000000

The daily export used to be an SQL ``GROUP BY``; it now reads every record
(the base charge is rounded per record, see controlplane/ledger/revenue.py)
and sums the groups in Python, like the request export reads every record.
Times, for the same records (20 tenants, 3 models, 2 days, multipliers 1
and 1.2), the median of ``--runs`` runs of:

- ``group-by``: the former daily export's work: the SQL ``GROUP BY`` query
  with its rows formatted (``ledger.export.query`` + ``daily_values``,
  which GetUsage still uses), plus the SQL totals;
- ``daily``: the daily export (CSV) as it is now;
- ``request``: the request export (CSV) of the same records;
- ``margin``: ``burstgate margin``'s report over the period.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

from controlplane.domain.ledger_records import LedgerRecord
from controlplane.ledger.export import (
    ExportResult,
    ExportSpec,
    daily_values,
    export,
    query,
    sql_totals,
)
from controlplane.ledger.margin import margin_report
from controlplane.store.db import upgrade
from controlplane.store.ledger import LedgerStore
from controlplane.store.ledger_write import ledger_engine

NS = 1_000_000_000
T0 = 1_767_225_600 * NS  # 2026-01-01T00:00:00Z
SPAN = 2 * 86_400 * NS


def records(n: int, seed: int = 13) -> list[LedgerRecord]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ts = T0 + i * (SPAN // n)
        p, o = rng.randint(1, 8000), rng.randint(1, 1000)
        m = Decimal("1.200000") if rng.random() < 0.3 else Decimal("1.000000")
        base = p * 2000 + o * 8000  # nanos at 2 / 8 per million tokens
        out.append(LedgerRecord(
            f"t{rng.randrange(20):02d}", f"r{i}", i, "standard", f"m{rng.randrange(3)}", "p",
            ts - 5, ts - 5, ts - 3, ts, ts, p, 0, o, p + o, Decimal("0.250000"), "request", m,
            ts // NS // 300 * 300, Decimal("1.000000"), "USD", int(base * m), p * 1000 + 100_000,
            1,
        ))  # fmt: skip
    return out


def timed(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--postgres", action="store_true")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    admin = None
    if args.postgres:
        import psycopg

        admin = "postgresql://postgres@127.0.0.1:5432/postgres"
        name = f"bench_daily_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        url = f"postgresql://postgres@127.0.0.1:5432/{name}"
    else:
        url = f"sqlite:///{Path(tmp.name) / 'bench.db'}"
    try:
        upgrade(url)
        engine = ledger_engine(url)
        store = LedgerStore(engine)
        recs = records(args.rows)
        for i in range(0, len(recs), 10_000):
            store.insert(recs[i : i + 10_000])
        spec = ExportSpec(T0, T0 + SPAN, (), "csv", "daily")

        def group_by() -> None:
            with engine.connect() as conn, conn.begin():
                sql_totals(conn, spec)
                for r in conn.execute(query(spec)):
                    daily_values(r)

        def run_export(granularity: str) -> None:
            s = ExportSpec(T0, T0 + SPAN, (), "csv", granularity)
            for _ in export(engine, s, ExportResult()):
                pass

        results = {
            "group-by": timed(group_by, args.runs),
            "daily": timed(lambda: run_export("daily"), args.runs),
            "request": timed(lambda: run_export("request"), args.runs),
            "margin": timed(
                lambda: margin_report(engine, T0, T0 + SPAN, (), Decimal("1.15")), args.runs
            ),
        }
        engine.dispose()
        db = "PostgreSQL" if args.postgres else "SQLite"
        print(f"{db}, {args.rows:,} records, median of {args.runs}:")
        for k, v in results.items():
            print(f"  {k:<9} {v:7.2f} s  {args.rows / v:>10,.0f} records/s")
    finally:
        if admin is not None:
            with psycopg.connect(admin, autocommit=True) as c:
                c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        tmp.cleanup()


if __name__ == "__main__":
    main()
