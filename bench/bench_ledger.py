"""Ledger benchmark: durable records/s into PostgreSQL, and Admit p99 while
the writer runs.

    .venv/bin/python bench/bench_ledger.py --rate 10000    # ~5 minutes
    .venv/bin/python bench/bench_ledger.py --rate 10000 --decompose --admit-rounds 5
                                                           # BENCHMARKS.md, ~13 minutes
    .venv/bin/python bench/bench_ledger.py --quick         # smoke run, ~1.5 minutes

1. **Writer throughput** (one process), ``--rounds`` interleaved rounds, the
   order rotating each round, medians: ``LedgerWriter`` fed as fast as it
   accepts (``--window`` records in flight, as concurrent Completes would
   be), each record counted when its future resolves (= committed); beside
   it, in the same rounds, a plain psycopg 3 COPY of the same kind of rows
   (one connection, one COPY + COMMIT per ``--batch`` rows, nothing else):
   text COPY with ``write_row`` (the reference the issue's ratio is
   against), and binary COPY with ``set_types`` and psycopg's stock
   dumpers. Each measurement starts from an empty table after a
   CHECKPOINT. The writer runs once per ``--pipelines`` value (batches
   written at once; 1 = the group commit one batch at a time), and for each
   the CPU it used (its process and its event-loop thread) and PostgreSQL's
   (every ``postgres`` process), which shows whether the GIL or the
   database is the limit.
2. **Admit latency with the writer busy**: the real ``ControlPlane`` in a
   server process (PostgreSQL, auth and pool gate off, ``gc.freeze()``
   after start as ``serve_forever`` does) that also feeds its ledger writer
   synthetic records at ``--rate`` per second (built on the event loop,
   awaited there and then remembered in Metering's cache of recent
   records, as Completes do); a load process sends
   unary Admits (closed loop, ``--concurrency`` in flight, threads of the
   sync client) and reports p50/p99. Rounds alternate the feeder off
   (idle) and on; ``--decompose`` adds three runs per round that separate
   the costs: ``loop only`` (the database write replaced by a no-op:
   records built, queued, resolved and remembered on the event loop, no
   COPY); the same with each batch resolved only after as long as the
   durable run's batches took in that round (what keeping a Complete's
   objects alive while its batch commits costs); and that plus a separate
   process writing the same rate through ``LedgerStore.insert`` (what a
   writer process would leave, less the cost of getting the records to
   it). Each run also reports the cores used by the machine, the server
   process and PostgreSQL, and the server's garbage collections.

The load average (``/proc/loadavg``) is sampled every 5 s during the run
and reported. Needs the local PostgreSQL (BURSTGATE_TEST_PG_DSN or
127.0.0.1:5432); a temporary database is created and dropped. Prints
markdown on stdout. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import functools
import gc
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
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
    """A synthetic record with fresh objects (a new id and new Decimals), as
    ``Metering.build_record`` makes them."""
    return LedgerRecord(
        f"tenant-{i % 50}", f"req-{uuid.uuid4().hex}", i, "standard", "llama-3-70b", "a100",
        now, now, now + 1000, now + 2000, now + 2000 + i, 900, 300, 250, 1400,
        Decimal("0.250000"), "request", Decimal("1.000000"), now // NS // 300 * 300,
        Decimal("1.000000"), "USD", 4_200_000, 3_100_000, 1,
    )  # fmt: skip


def records(n: int) -> list[LedgerRecord]:
    return [record(i, time.time_ns()) for i in range(n)]


# ------------------------------------------------------------------- database


def psycopg_url(url: str) -> str:
    return url.replace("postgresql+psycopg", "postgresql")


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
    with psycopg.connect(psycopg_url(url), autocommit=True) as c:
        c.execute("TRUNCATE ledger_records")
        c.execute("CHECKPOINT")


def prepare_server_db(url: str) -> None:
    """Four generous tenants; the pool gate off (the load sends no load
    reports and no Complete: with the gate on at most 64 requests are ever
    admitted and the run measures queue timeouts, not admission)."""
    from controlplane.domain import TenantConfig
    from controlplane.domain.policy import Policy
    from controlplane.store.config import ConfigRepository
    from controlplane.store.db import make_engine

    engine = make_engine(url)
    try:
        repo = ConfigRepository(engine)
        for t in range(4):
            repo.add_tenant(TenantConfig(f"t{t}", Decimal(1_000_000), 10**9))
        repo.update_policy(Policy(), {"pool_gate": False}, [])
    finally:
        engine.dispose()


class LoadAverage:
    """``/proc/loadavg`` (1-minute figure) every ``period_s`` in a thread."""

    def __init__(self, period_s: float = 5.0) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._period = period_s
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> float:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self.samples.append(self.now())

    def start(self) -> LoadAverage:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds; 0 if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return 0.0
    rest = text[text.rindex(b")") + 2 :].split()
    return (int(rest[11]) + int(rest[12])) / _CLK_TCK


def postgres_cpu_by_pid() -> dict[int, float]:
    """CPU seconds of every process named ``postgres`` on the machine (the
    backends, the WAL writer, the checkpointer, ...)."""
    out: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() != "postgres":
                        continue
            except OSError:
                continue
            out[int(entry)] = proc_cpu_s(int(entry))
    return out


def postgres_cpu_since(before: dict[int, float]) -> float:
    """PostgreSQL CPU seconds since ``before`` (processes that ended in
    between are not counted; those started since count whole)."""
    now = postgres_cpu_by_pid()
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in now.items())


def machine_cpu_s() -> tuple[float, float]:
    """Machine-wide (busy, steal) CPU seconds from /proc/stat."""
    with open("/proc/stat", "rb") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (
            int(x) for x in f.readline().split()[1:9]
        )
    return (user + nice + system + irq + softirq) / _CLK_TCK, steal / _CLK_TCK


class CpuWindow:
    """Cores used over a window: the machine, one process, PostgreSQL."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.t0 = time.perf_counter()
        self.m0, self.st0 = machine_cpu_s()
        self.p0 = proc_cpu_s(pid)
        self.pg0 = postgres_cpu_by_pid()

    def cores(self) -> dict[str, float]:
        dt_s = time.perf_counter() - self.t0
        m1, st1 = machine_cpu_s()
        return {
            "machine": (m1 - self.m0) / dt_s,
            "steal": (st1 - self.st0) / dt_s,
            "server": (proc_cpu_s(self.pid) - self.p0) / dt_s,
            "postgres": postgres_cpu_since(self.pg0) / dt_s,
        }


# ------------------------------------------------------------ 1. throughput


def column_types(c: psycopg.Connection[Any]) -> list[str]:
    """The table's column types as the database states them (not our code's)."""
    rows = c.execute(
        "SELECT attname, format_type(atttypid, NULL) FROM pg_attribute "
        "WHERE attrelid = 'ledger_records'::regclass AND attnum > 0 AND NOT attisdropped"
    ).fetchall()
    types = {str(name): str(t) for name, t in rows}
    names = {"bigint": "int8", "character varying": "varchar", "numeric": "numeric"}
    return [names[types[col]] for col in COLUMNS]


def plain_copy(url: str, rows: Sequence[LedgerRecord], batch: int, binary: bool) -> float:
    """Plain psycopg 3: one connection, COPY + COMMIT per ``batch`` rows."""
    fmt = " (FORMAT BINARY)" if binary else ""
    sql = f"COPY ledger_records ({', '.join(COLUMNS)}) FROM STDIN{fmt}"
    with psycopg.connect(psycopg_url(url)) as c:
        types = column_types(c)
        t0 = time.perf_counter()
        for s in range(0, len(rows), batch):
            with c.cursor() as cur, cur.copy(sql) as cp:
                if binary:
                    cp.set_types(types)
                for r in rows[s : s + batch]:
                    cp.write_row(r)
            c.commit()
        return len(rows) / (time.perf_counter() - t0)


def plain_executemany(url: str, rows: Sequence[LedgerRecord], batch: int = 1000) -> float:
    sql = (
        f"INSERT INTO ledger_records ({', '.join(COLUMNS)}) "
        f"VALUES ({', '.join(['%s'] * len(COLUMNS))})"
    )
    with psycopg.connect(psycopg_url(url)) as c:
        t0 = time.perf_counter()
        for s in range(0, len(rows), batch):
            with c.cursor() as cur:
                cur.executemany(sql, rows[s : s + batch])
            c.commit()
        return len(rows) / (time.perf_counter() - t0)


async def writer_run(
    url: str,
    rows: Sequence[LedgerRecord],
    batch: int,
    window: int,
    pipeline: int,
    spool_dir: Path,
) -> dict[str, float]:
    from controlplane.ledger.spool import Spool
    from controlplane.ledger.writer import LedgerWriter, Outcome
    from controlplane.store.ledger import LedgerStore
    from controlplane.store.ledger_write import ledger_engine

    engine = ledger_engine(url)
    store = LedgerStore(engine)
    db_seconds = [0.0]
    insert = store.insert
    lock = threading.Lock()

    def timed_insert(recs: Sequence[LedgerRecord]) -> set[tuple[str, str]]:
        t0 = time.perf_counter()
        try:
            return insert(recs)
        finally:
            with lock:
                db_seconds[0] += time.perf_counter() - t0

    store.insert = timed_insert  # type: ignore[method-assign,assignment]
    writer = LedgerWriter(store, Spool(spool_dir, 1 << 30), batch_max=batch, pipeline=pipeline)
    await writer.start()
    cpu0, loop0, pg0 = time.process_time(), time.thread_time(), postgres_cpu_by_pid()
    t0 = time.perf_counter()
    pending: list[asyncio.Future[Outcome]] = []
    for r in rows:
        pending.append(writer.submit(r))
        if len(pending) >= window:
            await pending[0]
            pending = [f for f in pending if not f.done()]
    await asyncio.gather(*pending)
    elapsed = time.perf_counter() - t0
    out = {
        "process_cores": (time.process_time() - cpu0) / elapsed,
        "loop_us": (time.thread_time() - loop0) / len(rows) * 1e6,
        "postgres_cores": postgres_cpu_since(pg0) / elapsed,
        "rate": len(rows) / elapsed,
        "batches": float(writer.stats.batches),
        "spooled": float(writer.stats.spooled),
        "db_share": db_seconds[0] / elapsed,
    }
    await writer.stop()
    engine.dispose()
    return out


def throughput(
    url: str, n: int, batch: int, window: int, rounds: int, pipelines: Sequence[int]
) -> tuple[dict[str, list[float]], dict[str, dict[str, list[float]]]]:
    """Interleaved rounds; returns records/s per run, and the writers' extras."""
    extra: dict[str, dict[str, list[float]]] = {}
    runs: dict[str, Callable[[list[LedgerRecord]], float]] = {
        "copy_text": lambda rows: plain_copy(url, rows, batch, binary=False),
        "copy_binary": lambda rows: plain_copy(url, rows, batch, binary=True),
    }
    for k in pipelines:
        extra[f"writer_{k}"] = {
            key: [] for key in ("db_share", "batches", "spooled", "process_cores", "loop_us",
                                "postgres_cores")
        }  # fmt: skip
        runs[f"writer_{k}"] = functools.partial(
            writer_once, url, batch=batch, window=window, pipeline=k, extra=extra[f"writer_{k}"]
        )
    out: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    for rnd in range(rounds):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for name in order:
            rows = records(n)
            truncate(url)
            out[name].append(runs[name](rows))
        print(
            f"round {rnd + 1}: "
            + ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in out.items())
            + f" (load {LoadAverage.now():.2f})",
            file=sys.stderr,
            flush=True,
        )
    return out, extra


def writer_once(
    url: str,
    rows: list[LedgerRecord],
    *,
    batch: int,
    window: int,
    pipeline: int,
    extra: dict[str, list[float]],
) -> float:
    import uvloop

    with tempfile.TemporaryDirectory() as spool:
        res = uvloop.run(writer_run(url, rows, batch, window, pipeline, Path(spool)))
    for k in extra:
        extra[k].append(res[k])
    return res["rate"]


# ------------------------------------------------------- 2. admit with feeder


def serve(url: str, rate: int, spool_dir: str, sink: str) -> None:
    """Server process: the real ControlPlane plus a ledger feeder."""
    import uvloop

    from controlplane.server import ControlPlane
    from controlplane.settings import Settings

    async def main() -> None:
        settings = Settings(
            database_url=url, port=0, metrics_port=-1, admission_auth=False,
            ledger_spool_dir=Path(spool_dir), log_level="warning",
        )  # fmt: skip
        from controlplane.telemetry import logs

        logs.configure("console", "warning")
        plane = ControlPlane(settings)
        port = await plane.start()
        # As serve_forever does: what start built leaves the collector's sight.
        plane.service.prepare_gc_freeze()
        gc.freeze()
        print(f"READY {port}", flush=True)
        assert plane.metering is not None
        writer = plane.metering.writer
        if sink != "database":  # loop only: no database write at all
            wait_s = float(sink.split(":")[1]) if ":" in sink else 0.0

            def no_write(recs: Sequence[LedgerRecord]) -> set[tuple[str, str]]:
                if wait_s:
                    time.sleep(wait_s)  # as long as a durable batch took
                return set()

            writer.store.insert = no_write  # type: ignore[method-assign,assignment]
        done = [0]

        metering = plane.metering

        async def feed() -> None:
            tick = 0.01
            per_tick = max(1, int(rate * tick))
            nxt = time.perf_counter()
            i = 0
            while True:
                recs = [record(i + k, time.time_ns()) for k in range(per_tick)]
                futs = [writer.submit(r) for r in recs]
                i += per_tick
                asyncio.get_running_loop().create_task(_count(futs, recs, done, metering))
                nxt += tick
                await asyncio.sleep(max(0.0, nxt - time.perf_counter()))

        feeder = asyncio.get_running_loop().create_task(feed()) if rate else None
        # SIGTERM stops the plane as serve_forever does: its cells are handed
        # off at once, so the next run's server on this database owns them
        # from its start (not redirecting to this one, gone, for a lease TTL).
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        t0 = time.perf_counter()
        while True:
            try:
                await asyncio.wait_for(stop.wait(), 2)
                break
            except TimeoutError:
                pass
            el = time.perf_counter() - t0
            st, gcp = writer.stats, plane.gc_pauses
            print(f"DURABLE {done[0] / el:.0f} {st.spooled} {st.batches / el:.1f} "
                  f"{gcp.total_s:.6f} {gcp.collections[2]} {gcp.longest_s:.6f} "
                  f"{st.batch_seconds / max(st.batches, 1):.6f}", flush=True)  # fmt: skip
            gcp.longest_s = 0.0  # the longest pause of each 2-s interval
        if feeder is not None:
            feeder.cancel()
        await plane.stop(0)

    uvloop.run(main())


def copier(url: str, rate: int) -> None:
    """``--sink external:<s>``: the same COPY work as the writer's at
    ``rate`` (a batch every 10 ms through ``LedgerStore.insert``), in a
    process of its own, while the server's loop builds, queues and resolves
    its records without writing them (each batch resolved after ``<s>``, as
    long as a durable one took): what a writer process would leave, less
    the cost of getting the records to it."""
    from controlplane.store.ledger import LedgerStore
    from controlplane.store.ledger_write import ledger_engine

    engine = ledger_engine(url)
    store = LedgerStore(engine)
    tick = 0.01
    per_tick = max(1, int(rate * tick))
    nxt = time.perf_counter()
    i = 0
    while True:
        store.insert(records(per_tick))
        i += per_tick
        nxt += tick
        time.sleep(max(0.0, nxt - time.perf_counter()))


async def _count(
    futs: list[asyncio.Future[Any]], recs: list[LedgerRecord], done: list[int], metering: Any
) -> None:
    await asyncio.gather(*futs)
    done[0] += len(futs)
    for r in recs:  # as a Complete does once its record is durable
        metering._remember(r)


def admit_load(target: str, seconds: float, concurrency: int) -> list[float]:
    from burstgate_client.protoclient import ProtoClient

    lat: list[float] = []
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def worker(w: int) -> None:
        mine: list[float] = []
        with ProtoClient(target) as c:
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


def run_server_and_load(
    url: str, rate: int, seconds: float, concurrency: int, sink: str = "database"
) -> dict[str, float]:
    spool = tempfile.mkdtemp(prefix="bench-ledger-spool-")
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", url, "--rate", str(rate), "--spool", spool,
         "--sink", sink.replace("external", "wait")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    extra: subprocess.Popen[bytes] | None = None
    if sink.startswith("external"):
        extra = subprocess.Popen([sys.executable, __file__, "--copier", url, "--rate", str(rate)])
    try:
        assert proc.stdout is not None
        port = 0
        for line in proc.stdout:
            if line.startswith("READY"):
                port = int(line.split()[1])
                break
        # (when, records/s, spooled, commits/s, GC seconds, full GCs, longest GC
        # pause, mean batch seconds)
        durable: list[tuple[float, float, int, float, float, int, float, float]] = []

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("DURABLE"):
                    f = line.split()[1:]
                    durable.append((time.monotonic(), float(f[0]), int(f[1]), float(f[2]),
                                    float(f[3]), int(f[4]), float(f[5]), float(f[6])))  # fmt: skip

        threading.Thread(target=read, daemon=True).start()
        time.sleep(2)  # let the feeder reach its rate
        cpu = CpuWindow(proc.pid)
        w0 = time.monotonic()
        # A separate load process (threads of a gRPC client), as a sidecar fleet would be.
        out = subprocess.run(
            [sys.executable, __file__, "--load", f"127.0.0.1:{port}", "--seconds", str(seconds),
             "--concurrency", str(concurrency)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        cores = cpu.cores()
        time.sleep(2.5)  # the interval that ends the window
        w1 = time.monotonic()
    finally:
        for p in (proc, extra):
            if p is not None:
                p.terminate()
                p.wait(timeout=60)
    p50, p99, n = (float(x) for x in out.stdout.split())
    before = [d for d in durable if d[0] <= w0]
    during = [d for d in durable if w0 < d[0] <= w1]
    last = during[-1] if during else (0.0, 0.0, 0, 0.0, 0.0, 0, 0.0, 0.0)
    first = before[-1] if before else (0.0, 0.0, 0, 0.0, 0.0, 0, 0.0, 0.0)
    return {
        "p50_ms": p50, "p99_ms": p99, "admits": n, "durable": last[1], "spooled": last[2],
        "batches_per_s": last[3],
        "batch_ms": last[7] * 1000,
        "gc_ms_per_s": (last[4] - first[4]) * 1000 / seconds,
        "gc_full": float(last[5] - first[5]),
        "gc_longest_ms": max((d[6] for d in during), default=0.0) * 1000,
        **{f"cpu_{k}": v for k, v in cores.items()},
    }  # fmt: skip


# --------------------------------------------------------------------- main


def med(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rate", type=int, default=10_000, help="feeder records/s in part 2")
    ap.add_argument("--records", type=int, default=200_000, help="per throughput measurement")
    ap.add_argument("--batch", type=int, default=5_000, help="COPY batch = writer batch_max")
    ap.add_argument("--window", type=int, default=20_000, help="writer records in flight")
    ap.add_argument("--rounds", type=int, default=5, help="throughput rounds")
    ap.add_argument("--admit-rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument(
        "--pipelines", default="1,3", help="writer variants: batches written at once, e.g. 1,3"
    )
    ap.add_argument("--decompose", action="store_true", help="add the loop-only feeder runs")
    ap.add_argument("--skip-admit", action="store_true")
    ap.add_argument("--serve")
    ap.add_argument("--spool")
    ap.add_argument("--sink", default="database", help="database | none | wait:<s>")
    ap.add_argument("--copier")
    ap.add_argument("--load")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.rate, args.spool, args.sink)
        return
    if args.copier:
        copier(args.copier, args.rate)
        return
    if args.load:
        lat = sorted(admit_load(args.load, args.seconds, args.concurrency))
        q = statistics.quantiles(lat, n=100)
        print(f"{q[49] * 1000:.3f} {q[98] * 1000:.3f} {len(lat)}")
        return
    if args.quick:
        args.records, args.rounds, args.admit_rounds, args.seconds = 50_000, 2, 1, 5.0
    load = LoadAverage().start()
    before = LoadAverage.now()
    started = dt.datetime.now(dt.UTC)
    url = create_db()
    try:
        print(f"`{' '.join(['.venv/bin/python', 'bench/bench_ledger.py', *sys.argv[1:]])}`, "
              f"{started:%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores; PostgreSQL "
              f"{_pg_version(url)}, psycopg {psycopg.__version__} "
              f"({psycopg.pq.__impl__}).\n")  # fmt: skip
        print("## Ledger writer throughput (PostgreSQL, durable)\n")
        print(f"{args.records:,} records per measurement, {args.rounds} interleaved rounds "
              f"(order rotating), medians; COPY batch = writer batch_max = {args.batch:,}; "
              f"writer fed with {args.window:,} records in flight.\n")  # fmt: skip
        pipelines = [int(k) for k in args.pipelines.split(",")]
        tp, extra = throughput(url, args.records, args.batch, args.window, args.rounds, pipelines)
        text, binary = tp["copy_text"], tp["copy_binary"]
        rows_out = [
            (f"plain psycopg text COPY, {args.batch:,} rows per COMMIT", text),
            (f"plain psycopg binary COPY (`set_types`), {args.batch:,} rows per COMMIT", binary),
        ]
        for k in pipelines:
            what = "one batch at a time" if k == 1 else f"up to {k} batches at once"
            rows_out.append((f"`LedgerWriter`, {what} (futures resolved after COMMIT)",
                             tp[f"writer_{k}"]))  # fmt: skip
        print("| what | median records/s | / text COPY (median of rounds) | rounds |")
        print("|---|---:|---:|---|")
        for label, vals in rows_out:
            ratio = med([v / c for v, c in zip(vals, text, strict=True)])
            print(f"| {label} | {med(vals):,.0f} | {ratio:.2f} "
                  f"| {', '.join(f'{v:,.0f}' for v in vals)} |")  # fmt: skip
        truncate(url)
        em = plain_executemany(url, records(min(args.records, 50_000)))
        print(f"| plain psycopg executemany, 1,000 rows per COMMIT (once) | {em:,.0f} | | |")
        print()
        for k in pipelines:
            ex = extra[f"writer_{k}"]
            ratios = [w / c for w, c in zip(tp[f"writer_{k}"], text, strict=True)]
            print(f"- writer, pipeline {k}: / text COPY per round "
                  f"{', '.join(f'{r:.2f}' for r in ratios)}; / binary COPY "
                  f"{med(tp[f'writer_{k}']) / med(binary):.2f} (medians); time in database "
                  f"calls (summed over its threads) / wall {med(ex['db_share']) * 100:.0f}%; "
                  f"CPU: the writer's process {med(ex['process_cores']):.2f} cores (its event "
                  f"loop {med(ex['loop_us']):.1f} µs a record), PostgreSQL "
                  f"{med(ex['postgres_cores']):.2f} cores; "
                  f"{med(ex['batches']):.0f} batches per measurement; "
                  f"{sum(ex['spooled']):.0f} records spooled.")  # fmt: skip
        print()
        if not args.skip_admit:
            admit_section(url, args)
    finally:
        drop_db(url)
        load.stop()
    after = LoadAverage.now()
    samples = load.samples or [after]
    print(f"\nLoad average (1 min): {before:.2f} before, {min(samples):.2f} to {max(samples):.2f} "
          f"during ({len(samples)} samples, every 5 s), {after:.2f} after; "
          f"{(dt.datetime.now(dt.UTC) - started).total_seconds():.0f} s in all.")  # fmt: skip


def admit_section(url: str, args: argparse.Namespace) -> None:
    truncate(url)
    prepare_server_db(url)
    print("## Admit latency while the writer runs\n")
    print(f"Unary Admit, closed loop, {args.concurrency} in flight, {args.seconds:.0f} s per "
          f"run; server and load in separate processes; {args.admit_rounds} rounds "
          f"alternating the runs, medians.\n")  # fmt: skip
    durable = f"{args.rate:,}/s, durable (the writer as it is)"
    runs: list[tuple[str, int, str]] = [("off (idle)", 0, "database")]
    runs.append((durable, args.rate, "database"))
    if args.decompose:
        # The waits are the durable run's mean batch time in the same round.
        runs += [
            (f"{args.rate:,}/s, loop only: no database write", args.rate, "none"),
            (f"{args.rate:,}/s, loop only, each batch resolved after as long as a durable "
             "one took", args.rate, "wait"),
            (f"{args.rate:,}/s, the same + the same COPYs done by another process", args.rate,
             "external"),
        ]  # fmt: skip
    res: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in runs}
    for rnd in range(args.admit_rounds):
        for label, rate, sink in runs:
            if sink in ("wait", "external"):
                sink = f"{sink}:{res[durable][-1]['batch_ms'] / 1000:.4f}"
            r = run_server_and_load(url, rate, args.seconds, args.concurrency, sink)
            res[label].append(r)
            print(f"admit round {rnd + 1} {label}: p50 {r['p50_ms']:.2f} p99 {r['p99_ms']:.2f} "
                  f"durable {r['durable']:,.0f}/s in {r['batches_per_s']:.0f} commits/s "
                  f"of {r['batch_ms']:.1f} ms, "
                  f"cores: machine {r['cpu_machine']:.2f} "
                  f"server {r['cpu_server']:.2f} postgres {r['cpu_postgres']:.2f} "
                  f"steal {r['cpu_steal']:.2f}; GC {r['gc_ms_per_s']:.1f} ms/s, "
                  f"{r['gc_full']:.0f} full, longest {r['gc_longest_ms']:.1f} ms "
                  f"(load {LoadAverage.now():.2f})",
                  file=sys.stderr, flush=True)  # fmt: skip
    print("| ledger feeder | records/s acknowledged | admits measured | p50 ms | p99 ms "
          "| p99 per round | p99 / idle | cores: machine | server | PostgreSQL "
          "| server GC ms/s | full GCs | longest GC ms |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    idle_p99 = med([r["p99_ms"] for r in res[runs[0][0]]])
    for label, _, _ in runs:
        rs = res[label]
        p99 = med([r["p99_ms"] for r in rs])
        spooled = sum(r["spooled"] for r in rs)
        note = f" ({spooled:.0f} spooled)" if spooled else ""
        print(f"| {label} | {med([r['durable'] for r in rs]):,.0f}{note} "
              f"| {med([r['admits'] for r in rs]):,.0f} | {med([r['p50_ms'] for r in rs]):.2f} "
              f"| {p99:.2f} | {', '.join(f'{x:.1f}' for x in (r['p99_ms'] for r in rs))} "
              f"| {p99 / idle_p99:.2f} | {med([r['cpu_machine'] for r in rs]):.2f} "
              f"| {med([r['cpu_server'] for r in rs]):.2f} "
              f"| {med([r['cpu_postgres'] for r in rs]):.2f} "
              f"| {med([r['gc_ms_per_s'] for r in rs]):.1f} "
              f"| {med([r['gc_full'] for r in rs]):.0f} "
              f"| {max(r['gc_longest_ms'] for r in rs):.1f} |")  # fmt: skip
    print(
        "\n(cores = CPU seconds per second over the load run, from /proc: the whole "
        "machine, the server process, every `postgres` process; 2 cores in all. GC = the "
        "server's collections over the load run, timed by its GcPauses: time per second and "
        "full collections (medians of the rounds), longest pause (of all rounds).)"
    )


def _pg_version(url: str) -> str:
    with psycopg.connect(psycopg_url(url)) as c:
        row = c.execute("SHOW server_version").fetchone()
    return str(row[0]) if row else "?"


if __name__ == "__main__":
    main()
