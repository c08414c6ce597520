"""Ledger benchmark: durable records/s into PostgreSQL, and Admit p99 while
the writer runs.

    .venv/bin/python bench/bench_ledger.py            # ~1.5 minutes
    .venv/bin/python bench/bench_ledger.py --quick    # smoke run

1. **Writer throughput** (one process): ``LedgerWriter`` fed as fast as it
   accepts, each record counted when its future resolves (= committed),
   against a plain psycopg 3 COPY of the same rows in the same run (one
   COPY + COMMIT per batch of the same size), and executemany of 1,000.
2. **Admit p99 with the writer busy**: the real ``ControlPlane`` in a
   server process (PostgreSQL, auth off) that also feeds its ledger writer
   synthetic records at ``--rate`` per second (as Completes would, futures
   awaited on the event loop); a load process in another process sends
   unary Admits (closed loop, ``--concurrency`` in flight) and reports
   p50/p99. Run with the feeder off (idle) and on.

Needs the local PostgreSQL (BURSTGATE_TEST_PG_DSN or 127.0.0.1:5432); a
temporary database is created and dropped. Prints markdown on stdout.
Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy.engine import make_url

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from controlplane.domain.ledger_records import COLUMNS, LedgerRecord  # noqa: E402

PG_ADMIN_DSN = os.environ.get(
    "BURSTGATE_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
)
NS = 1_000_000_000


def record(i: int, now: int) -> LedgerRecord:
    return LedgerRecord(
        f"tenant-{i % 50}", f"req-{uuid.uuid4().hex}", i, "standard", "llama-3-70b", "a100",
        now, now, now + 1000, now + 2000, now + 2000 + i, 900, 300, 250, 1400,
        Decimal("0.250000"), "request", Decimal("1.000000"), now // NS // 300 * 300,
        Decimal("1.000000"), "USD", 4_200_000, 3_100_000, 1,
    )  # fmt: skip


# ------------------------------------------------------------------- database


def create_db() -> str:
    name = f"burstgate_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    url = make_url(PG_ADMIN_DSN).set(database=name).render_as_string(hide_password=False)
    from controlplane.store.db import upgrade

    upgrade(url)
    return url


def drop_db(url: str) -> None:
    name = make_url(url).database
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def truncate(url: str) -> None:
    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as c:
        c.execute("TRUNCATE ledger_records")
        c.execute("CHECKPOINT")


# ------------------------------------------------------------ 1. throughput


def baseline_copy(url: str, n: int, batch: int) -> float:
    rows = [record(i, time.time_ns()) for i in range(n)]
    sql = f"COPY ledger_records ({', '.join(COLUMNS)}) FROM STDIN"
    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql")) as c:
        t0 = time.perf_counter()
        for s in range(0, n, batch):
            with c.cursor() as cur, cur.copy(sql) as cp:
                for r in rows[s : s + batch]:
                    cp.write_row(r)
            c.commit()
        return n / (time.perf_counter() - t0)


def baseline_executemany(url: str, n: int, batch: int = 1000) -> float:
    rows = [tuple(record(i, time.time_ns())) for i in range(n)]
    sql = (
        f"INSERT INTO ledger_records ({', '.join(COLUMNS)}) "
        f"VALUES ({', '.join(['%s'] * len(COLUMNS))})"
    )
    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql")) as c:
        t0 = time.perf_counter()
        for s in range(0, n, batch):
            with c.cursor() as cur:
                cur.executemany(sql, rows[s : s + batch])
            c.commit()
        return n / (time.perf_counter() - t0)


async def writer_run(url: str, n: int, batch: int, spool_dir: Path) -> tuple[float, int]:
    from controlplane.ledger.spool import Spool
    from controlplane.ledger.writer import LedgerWriter
    from controlplane.store.ledger import LedgerStore, ledger_engine

    engine = ledger_engine(url)
    writer = LedgerWriter(LedgerStore(engine), Spool(spool_dir, 1 << 30), batch_max=batch)
    await writer.start()
    rows = [record(i, time.time_ns()) for i in range(n)]
    window = batch * 4  # records in flight, as concurrent Completes would be
    t0 = time.perf_counter()
    pending: list[asyncio.Future[object]] = []
    for r in rows:
        pending.append(writer.submit(r))  # type: ignore[arg-type]
        if len(pending) >= window:
            await pending[0]
            pending = [f for f in pending if not f.done()]
    await asyncio.gather(*pending)
    rate = n / (time.perf_counter() - t0)
    batches = writer.stats.batches
    await writer.stop()
    engine.dispose()
    return rate, batches


# ------------------------------------------------------- 2. admit with feeder


def serve(url: str, rate: int, spool_dir: str) -> None:
    """Server process: the real ControlPlane plus a ledger feeder."""
    import uvloop

    from controlplane.domain import TenantConfig
    from controlplane.server import ControlPlane
    from controlplane.settings import Settings
    from controlplane.store.config import ConfigRepository
    from controlplane.store.db import make_engine

    engine = make_engine(url)
    repo = ConfigRepository(engine)
    if not repo.tenants():
        for t in range(4):
            repo.add_tenant(TenantConfig(f"t{t}", Decimal(1_000_000), 10**9))
    engine.dispose()

    async def main() -> None:
        settings = Settings(
            database_url=url, port=0, metrics_port=-1, admission_auth=False,
            ledger_spool_dir=Path(spool_dir), log_level="warning",
        )  # fmt: skip
        from controlplane.telemetry import logs

        logs.configure("console", "warning")
        plane = ControlPlane(settings)
        port = await plane.start()
        print(f"READY {port}", flush=True)
        assert plane.metering is not None
        writer = plane.metering.writer
        done = [0]

        async def feed() -> None:
            tick = 0.01
            per_tick = max(1, int(rate * tick))
            nxt = time.perf_counter()
            i = 0
            while True:
                futs = [writer.submit(record(i + k, time.time_ns())) for k in range(per_tick)]
                i += per_tick
                asyncio.get_running_loop().create_task(_count(futs, done))
                nxt += tick
                await asyncio.sleep(max(0.0, nxt - time.perf_counter()))

        if rate:
            asyncio.get_running_loop().create_task(feed())
        t0 = time.perf_counter()
        while True:
            await asyncio.sleep(2)
            print(f"DURABLE {done[0] / (time.perf_counter() - t0):.0f}", flush=True)

    uvloop.run(main())


async def _count(futs: list[asyncio.Future[Any]], done: list[int]) -> None:
    await asyncio.gather(*futs)
    done[0] += len(futs)


def admit_load(target: str, seconds: float, concurrency: int) -> list[float]:
    from controlplane.client import AdmissionClient

    lat: list[float] = []
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def worker(w: int) -> None:
        mine: list[float] = []
        with AdmissionClient(target) as c:
            i = 0
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                c.admit(f"t{w % 4}", f"w{w}-{i}-{uuid.uuid4().hex[:6]}", prompt_tokens=10,
                        max_tokens=10)  # fmt: skip
                mine.append(time.perf_counter() - t0)
                i += 1
        with lock:
            lat.extend(mine[len(mine) // 10 :])  # drop warm-up

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat


def run_server_and_load(url: str, rate: int, seconds: float, concurrency: int) -> dict[str, float]:
    spool = tempfile.mkdtemp(prefix="bench-ledger-spool-")
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", url, "--rate", str(rate), "--spool", spool],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    port = 0
    for line in proc.stdout:
        if line.startswith("READY"):
            port = int(line.split()[1])
            break
    durable: list[float] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("DURABLE"):
                durable.append(float(line.split()[1]))

    threading.Thread(target=read, daemon=True).start()
    time.sleep(2)  # let the feeder reach its rate
    # A separate load process (threads of a gRPC client), as a sidecar fleet would be.
    out = subprocess.run(
        [sys.executable, __file__, "--load", f"127.0.0.1:{port}", "--seconds", str(seconds),
         "--concurrency", str(concurrency)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    proc.terminate()
    proc.wait(timeout=60)
    p50, p99, n = (float(x) for x in out.stdout.split())
    return {"p50_ms": p50, "p99_ms": p99, "admits": n, "durable": durable[-1] if durable else 0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rate", type=int, default=50_000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--serve")
    ap.add_argument("--spool")
    ap.add_argument("--load")
    ap.add_argument("--seconds", type=float, default=15.0)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.rate, args.spool)
        return
    if args.load:
        lat = sorted(admit_load(args.load, args.seconds, args.concurrency))
        q = statistics.quantiles(lat, n=100)
        print(f"{q[49] * 1000:.3f} {q[98] * 1000:.3f} {len(lat)}")
        return
    n = 50_000 if args.quick else 300_000
    batch = 5_000
    seconds = 5.0 if args.quick else args.seconds
    url = create_db()
    try:
        print("## Ledger writer throughput (PostgreSQL, durable)\n")
        print(f"{n:,} records per measurement; COPY batch {batch:,}.\n")
        print("| what | records/s |\n|---|---:|")
        truncate(url)
        copy_rate = baseline_copy(url, n, batch)
        print(f"| plain psycopg COPY, {batch:,} rows per COMMIT | {copy_rate:,.0f} |")
        truncate(url)
        em_rate = baseline_executemany(url, min(n, 100_000))
        print(f"| plain psycopg executemany, 1,000 rows per COMMIT | {em_rate:,.0f} |")
        truncate(url)
        with tempfile.TemporaryDirectory() as spool:
            w_rate, batches = asyncio.run(writer_run(url, n, batch, Path(spool)))
        print(f"| LedgerWriter (futures resolved after COMMIT; {batches} group commits) "
              f"| {w_rate:,.0f} |")  # fmt: skip
        print(f"\nwriter / COPY = {w_rate / copy_rate:.2f}\n")
        truncate(url)
        print("## Admit latency while the writer runs\n")
        print(f"Unary Admit, {args.concurrency} in flight, {seconds:.0f} s; server and load in "
              "separate processes.\n")  # fmt: skip
        print("| ledger feeder | durable records/s | admits measured | p50 ms | p99 ms |")
        print("|---|---:|---:|---:|---:|")
        idle = run_server_and_load(url, 0, seconds, args.concurrency)
        print(f"| off (idle) | 0 | {idle['admits']:,.0f} | {idle['p50_ms']:.3f} | "
              f"{idle['p99_ms']:.3f} |")  # fmt: skip
        busy = run_server_and_load(url, args.rate, seconds, args.concurrency)
        print(f"| {args.rate:,}/s | {busy['durable']:,.0f} | {busy['admits']:,.0f} | "
              f"{busy['p50_ms']:.3f} | {busy['p99_ms']:.3f} |")  # fmt: skip
        print(f"\nAdmit p99 busy / idle = {busy['p99_ms'] / idle['p99_ms']:.2f}")
    finally:
        drop_db(url)


if __name__ == "__main__":
    main()
