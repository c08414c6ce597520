"""Soak: a real ``burstgate serve`` on PostgreSQL under steady mixed load for
an hour, with database outages and server restarts, then the ledger
reconciled against every acknowledged Complete. On demand; CI runs it only
at tiny size, to check that it still runs (the last command below).

    .venv/bin/python bench/soak.py                      # 1 h (docs/benchmarks-history.md "Soak")
    .venv/bin/python bench/soak.py --duration 180 --cut-every 60 --restart-every 90
                                                        # a 3-minute smoke run
    .venv/bin/python bench/soak.py --duration 9 --tail 2 --restart-every 1 --sigkill-at 1 \
        --cut-every 6.5 --cut-length 0.5 --ttl 2 --rate 100 --report-every 2 --sample-every 1 \
        --server-env BURSTGATE_SHUTDOWN_GRACE_S=1      # tiny (CI's smoke run), ~25 s

What it does:

1. A fresh PostgreSQL database (BURSTGATE_TEST_PG_DSN or 127.0.0.1:5432),
   set up with the CLI as an operator would: ``burstgate migrate``, four
   tenants with different limits (``tenant add``), a default price
   (``price set``), a sidecar key (``keys create --role sidecar``; with
   ``--no-auth`` the server runs with BURSTGATE_ADMISSION_AUTH=false
   instead).
2. ``burstgate serve`` as a subprocess whose database connections go through
   a TCP proxy the soak controls (bench/_dbproxy.py), with a short
   reservation TTL (``--ttl``, 60 s) so the requests left unsettled expire
   during the run.
3. ``--rate`` admissions/s (unary Admit and AdmitStream batches), Completes
   for most admitted requests, load reports from fake engines
   (bench/_soak_load.py), open loop.
4. Every ``--cut-every`` s a ``--cut-length`` s database outage, alternating
   refused connections and a hang; every ``--restart-every`` s a server
   restart on the same port and spool directory: SIGTERM, except restart
   number ``--sigkill-at`` (SIGKILL). A restart due during an outage waits
   until 5 s after it (the server needs the database to start).
5. Every ``--report-every`` s (60) a row: the server's RSS (/proc VmRSS),
   p50/p99 latency per RPC, calls by status code, decisions, open and
   expired reservations, spool and database state (/metrics), with their
   maxima over samples every ``--sample-every`` s (5).
6. At the end: the database restored, the spool drained, the server stopped
   with SIGTERM, the ledger exported with ``burstgate export``, and both the
   acknowledgements (the load's CSV) and the export loaded into the
   database to compare them in SQL (nothing per request is held in this
   process): every acknowledged Complete exported exactly once, the same
   charges, and the export's totals equal the ledger table's.

Writes ``<out>/soak.json`` and the server logs under ``--out`` (default
bench/results/soak-<UTC time>/) and prints markdown for BENCHMARKS.md on
stdout; progress on stderr. Nothing here asserts a time; the exit code is 1
when the reconciliation finds a lost, duplicated or mis-charged record.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Popen (server restarts) from a process with gRPC threads: no fork handlers.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import psycopg
from sqlalchemy.engine import make_url

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _dbproxy import DbProxy  # noqa: E402
from _soak_load import POOL as SOAK_POOL  # noqa: E402
from _soak_load import Interval, Load, LoadConfig, TenantLoad  # noqa: E402
from _soak_server import ServerProc, free_port, rss_mib  # noqa: E402

PG_ADMIN_DSN = os.environ.get(
    "BURSTGATE_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
)

# (tenant, share of the admissions, `burstgate tenant add` options): one
# that never runs short, one capped in concurrency, one whose bucket is
# short at the soak's rate (TOKEN_RATE refusals, queueing), one with an
# hourly quota it exhausts within minutes (HOURLY_QUOTA refusals).
TENANTS: tuple[tuple[str, float, tuple[str, ...]], ...] = (
    ("soak-a", 0.4, ("--rate", "1000000", "--burst", "10000000")),
    ("soak-b", 0.3, ("--rate", "1000000", "--burst", "10000000", "--max-concurrency", "200")),
    ("soak-c", 0.2, ("--rate", "20000", "--burst", "40000", "--max-concurrency", "50",
                     "--default-lane", "batch")),
    ("soak-d", 0.1, ("--rate", "100000", "--burst", "200000", "--hourly-quota", "2000000")),
)  # fmt: skip
PRICE = (
    "--input", "0.50", "--cached-input", "0.10", "--output", "1.50", "--gpu-prefill", "0.20",
    "--gpu-decode", "0.80", "--gpu-overhead", "0.00002", "--lane-multiplier", "premium=1.5",
)  # fmt: skip


# ------------------------------------------------------------------ set-up


def cli(url: str, *args: str) -> str:
    """``burstgate <args>`` on ``url``; its stdout."""
    env = {**os.environ, "BURSTGATE_DATABASE_URL": url}
    out = subprocess.run(
        [sys.executable, "-m", "controlplane", *args],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"burstgate {' '.join(args)} failed:\n{out.stdout}{out.stderr}")
    return out.stdout


def create_db() -> str:
    name = f"burstgate_soak_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    return make_url(PG_ADMIN_DSN).set(database=name).render_as_string(hide_password=False)


def drop_db(url: str) -> None:
    name = make_url(url).database
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def pg_dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def set_up(url: str, auth: bool) -> str | None:
    """Schema, tenants, price and (with auth) a sidecar key, via the CLI."""
    cli(url, "migrate")
    for tenant, _, opts in TENANTS:
        cli(url, "tenant", "add", tenant, *opts)
    cli(url, "price", "set", "*", *PRICE)
    if not auth:
        return None
    # Scoped to the soak's tenants and every pool (a sidecar key names both).
    scope = [a for t, _, _ in TENANTS for a in ("--tenant", t)] + ["--pool", "*"]
    made = json.loads(
        cli(url, "keys", "create", "--role", "sidecar", "--name", "soak", *scope, "--json")
    )
    return str(made["key"])


# ---------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Event:
    at_s: float
    what: str  # cut-refuse | cut-hang | restore | restart-sigterm | restart-sigkill


def schedule(args: argparse.Namespace) -> list[Event]:
    """Cuts at k x cut_every (alternating refuse, hang), restarts at
    k x restart_every (moved to 5 s after a cut they fall in), all ending
    at least ``--tail`` (20) s before the end of the run."""
    end = args.duration - args.tail
    events: list[Event] = []
    cuts: list[tuple[float, float]] = []
    k = 1
    while args.cut_every > 0 and k * args.cut_every + args.cut_length <= end:
        start = k * args.cut_every
        mode = "refuse" if k % 2 else "hang"
        cuts.append((start, start + args.cut_length))
        events += [Event(start, f"cut-{mode}"), Event(start + args.cut_length, "restore")]
        k += 1
    k = 1
    while args.restart_every > 0 and k * args.restart_every <= end:
        at = k * args.restart_every
        for start, stop in cuts:
            if start - 5 <= at <= stop + 5:
                at = stop + 5
        if at <= end:
            sig = "sigkill" if k == args.sigkill_at else "sigterm"
            events.append(Event(at, f"restart-{sig}"))
        k += 1
    return sorted(events, key=lambda e: e.at_s)


# -------------------------------------------------------------------- run


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


@dataclass
class Soak:
    args: argparse.Namespace
    server: ServerProc
    proxy: DbProxy
    load: Load
    t0: float = 0.0
    restarts: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    pending_events: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    peaks: dict[str, float] = field(default_factory=dict)
    replay_mismatches: list[str] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def note(self, what: str, at: float | None = None, **detail: Any) -> None:
        at = self.now() if at is None else at
        self.events.append({"t_s": round(at, 1), "what": what, **detail})
        self.pending_events.append(what)
        print(f"soak: {at:7.1f} s {what} {detail or ''}", file=sys.stderr, flush=True)

    async def control(self, events: list[Event]) -> None:
        for ev in events:
            delay = ev.at_s - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            if ev.what.startswith("cut-"):
                self.proxy.cut("refuse" if ev.what == "cut-refuse" else "hang")
                self.note(ev.what)
            elif ev.what == "restore":
                self.proxy.restore()
                self.note("restore")
            else:
                sig = signal.SIGKILL if ev.what == "restart-sigkill" else signal.SIGTERM
                at = self.now()
                t = time.monotonic()
                code = await asyncio.to_thread(self.server.stop, sig)
                stopped = time.monotonic() - t
                self.restarts += 1
                took = await self.start_again()
                # stop_s: signal to exit (SIGTERM: the shutdown grace while
                # the AdmitStream stays open); start_s: to the ready line.
                self.note(ev.what, at=at, exit_code=code, stop_s=round(stopped, 1),
                          start_s=round(took, 1))  # fmt: skip

    async def start_again(self) -> float:
        """Start the server; while it will not (each try is several
        attempts), note it and try again every 10 s, until 5 minutes past the
        run's end: an hour's run keeps its load and still reconciles."""
        t0 = time.monotonic()
        while True:
            try:
                await asyncio.to_thread(self.server.start)
                return time.monotonic() - t0
            except RuntimeError as exc:
                self.note("start-failed", error=str(exc)[:200])
                if self.now() > self.args.duration + 300:
                    raise
                await asyncio.sleep(10)

    async def report(self, until: float) -> None:
        every = self.args.report_every
        k = 1
        while True:
            at = k * every
            if at > until:
                return
            await asyncio.sleep(max(0.0, at - self.now()))
            iv = self.load.take()
            # /metrics may take its timeout to answer (a server shutting
            # down): never on the event loop, which times the load.
            sample = await asyncio.to_thread(self.sample)
            self.row(k, iv, sample)
            k += 1

    def sample(self) -> tuple[dict[str, float], float | None]:
        m, rss = self.server.metrics() or {}, self.server.rss_mib()
        # Peaks between rows (the rows fall on the cuts' starts, when the
        # spool is still empty): sampled every --sample-every s as well.
        pk = self.peaks
        for key, value in (
            ("rss_mib", rss),
            ("open_reservations", m.get("burstgate_open_reservations")),
            ("spool_records", m.get("burstgate_ledger_spool_records")),
            ("spool_bytes", m.get("burstgate_ledger_spool_bytes")),
        ):
            if value is not None:
                pk[key] = max(pk.get(key, value), value)
        if m.get("burstgate_ledger_database_up") == 0:
            pk["db_down_samples"] = pk.get("db_down_samples", 0) + 1
        if m:
            pk["samples"] = pk.get("samples", 0) + 1
        return m, rss

    async def sampler(self) -> None:
        while True:
            await asyncio.sleep(self.args.sample_every)
            await asyncio.to_thread(self.sample)

    def row(self, k: int, iv: Interval, sample: tuple[dict[str, float], float | None]) -> None:
        m, rss = sample

        def metric(name: str) -> float | None:
            return m.get(name)

        codes: dict[str, dict[str, int]] = {}
        for (rpc, code), n in sorted(iv.codes.items()):
            codes.setdefault(rpc, {})[code] = n
        errors: dict[str, int] = {}
        for (_rpc, code), n in iv.codes.items():
            if code != "OK":
                errors[code] = errors.get(code, 0) + n
        row: dict[str, Any] = {
            "interval": k,
            "t_s": round(self.now(), 1),
            "events": self.pending_events,
            "server_start": self.server.starts,
            "rss_mib": rss,
            "driver_rss_mib": rss_mib(os.getpid()),
            "latency_ms": {
                rpc: {"n": len(v), "p50": pct(v, 50), "p99": pct(v, 99), "max": max(v)}
                for rpc, v in sorted(iv.latency_ms.items())
            },
            "calls": codes,
            "errors": errors,
            "decisions": dict(iv.decisions),
            "skipped": iv.skipped,
            "stream_skipped": iv.stream_skipped,
            "completes_acked": iv.completes_acked,
            "completes_not_found": iv.completes_not_found,
            "replays_ok": iv.replays_ok,
            "replay_mismatches": len(iv.replay_mismatches),
            "open_reservations": metric("burstgate_open_reservations"),
            "expired_total": metric("burstgate_reservations_expired_total"),
            "spool_records": metric("burstgate_ledger_spool_records"),
            "spool_bytes": metric("burstgate_ledger_spool_bytes"),
            "db_up": metric("burstgate_ledger_database_up"),
            "replayed_total": metric("burstgate_ledger_replayed_records_total"),
            "proxy": self.proxy.mode,
            "peak": self.peaks,  # maxima over the interval's samples
        }
        self.peaks = {}
        self.pending_events = []
        self.replay_mismatches += iv.replay_mismatches[:20]
        self.rows.append(row)
        print(f"soak: {short_row(row)}", file=sys.stderr, flush=True)

    async def run(self, events: list[Event]) -> None:
        self.t0 = time.monotonic()
        until = self.t0 + self.args.duration
        control = asyncio.create_task(self.control(events))
        report = asyncio.create_task(self.report(self.args.duration))
        sampler = asyncio.create_task(self.sampler())
        await self.load.run(until)
        await control
        report.cancel()
        sampler.cancel()
        iv = self.load.take()  # the tail: the Completes pending at the end
        self.row(len(self.rows) + 1, iv, await asyncio.to_thread(self.sample))


def short_row(r: dict[str, Any]) -> str:
    lat = r["latency_ms"]

    def p(rpc: str) -> str:
        x = lat.get(rpc)
        return f"{x['p50']:.1f}/{x['p99']:.1f}" if x else "-"

    rss = f"{r['rss_mib']:.0f}" if r["rss_mib"] is not None else "-"
    return (
        f"#{r['interval']} t={r['t_s']:.0f}s rss={rss}MiB admit={p('Admit')} "
        f"queued={p('Admit(queued)')} "
        f"batch={p('AdmitStream')} complete={p('Complete')} errors={r['errors']} "
        f"open={r['open_reservations']} spool={r['spool_records']} db={r['db_up']} "
        f"acked={r['completes_acked']} {' '.join(r['events'])}"
    )


# ----------------------------------------------------------- the end


def drain(server: ServerProc, timeout: float = 120.0) -> dict[str, float | None]:
    """Wait until the ledger writer is back on the database with an empty
    spool (bounded); what /metrics said last."""
    deadline = time.monotonic() + timeout
    m: dict[str, float] = {}
    while time.monotonic() < deadline:
        m = server.metrics() or {}
        if (m.get("burstgate_ledger_database_up") == 1
                and m.get("burstgate_ledger_spool_records") == 0
                and m.get("burstgate_ledger_queue") == 0):  # fmt: skip
            break
        time.sleep(1.0)
    return {k: m.get(f"burstgate_ledger_{k}") for k in ("database_up", "spool_records", "queue")}


def reconcile(url: str, acks: Path, out_dir: Path) -> dict[str, Any]:
    """The acknowledgements against ``burstgate export``, in SQL."""
    export = out_dir / "ledger.csv"
    cli(url, "export", "--from", "0", "--out", str(export),
        "--manifest", str(out_dir / "ledger.manifest.json"))  # fmt: skip
    manifest = json.loads((out_dir / "ledger.manifest.json").read_text())
    with export.open() as head:
        header = head.readline().strip().split(",")
    with psycopg.connect(pg_dsn(url), autocommit=True) as c:
        c.execute(
            "CREATE TABLE soak_acks (tenant_id text, request_id text, duplicate int, "
            "user_charge numeric, actual_cost numeric, attempt int)"
        )
        c.execute(f"CREATE TABLE soak_export ({', '.join(f'{h} text' for h in header)})")
        for table, path, opts in (
            ("soak_acks", acks, "(FORMAT csv)"),
            ("soak_export", export, "(FORMAT csv, HEADER true)"),
        ):
            with (
                c.cursor() as cur,
                cur.copy(f"COPY {table} FROM STDIN {opts}") as cp,
                path.open("rb") as data,
            ):
                while chunk := data.read(1 << 20):
                    cp.write(chunk)

        def one(sql: str) -> Any:
            row = c.execute(sql).fetchone()
            return row[0] if row else None

        c.execute(
            "CREATE TABLE soak_acked AS SELECT tenant_id, request_id, min(user_charge) AS uc, "
            "max(user_charge) AS uc_max, min(actual_cost) AS ac, max(actual_cost) AS ac_max, "
            "bool_or(duplicate = 0) AS first_ack FROM soak_acks GROUP BY tenant_id, request_id"
        )
        c.execute(
            "CREATE TABLE soak_exported AS SELECT tenant_id, request_id, count(*) AS n, "
            "sum(user_charge::numeric) AS uc, sum(actual_cost::numeric) AS ac "
            "FROM soak_export GROUP BY tenant_id, request_id"
        )
        j = "soak_acked a LEFT JOIN soak_exported e USING (tenant_id, request_id)"
        result = {
            "acknowledged_calls": one("SELECT count(*) FROM soak_acks"),
            "acknowledged": one("SELECT count(*) FROM soak_acked"),
            "acknowledged_first": one("SELECT count(*) FROM soak_acked WHERE first_ack"),
            "acknowledged_duplicate_only": one(
                "SELECT count(*) FROM soak_acked WHERE NOT first_ack"
            ),
            "ack_figures_inconsistent": one(
                "SELECT count(*) FROM soak_acked WHERE uc <> uc_max OR ac <> ac_max"
            ),
            "exported_rows": one("SELECT count(*) FROM soak_export"),
            "exported": one("SELECT count(*) FROM soak_exported"),
            "missing": one(f"SELECT count(*) FROM {j} WHERE e.n IS NULL"),
            "duplicated": one("SELECT count(*) FROM soak_exported WHERE n > 1"),
            "charge_mismatches": one(
                f"SELECT count(*) FROM {j} WHERE e.n = 1 AND (e.uc <> a.uc OR e.ac <> a.ac)"
            ),
            "exported_not_acknowledged": one(
                "SELECT count(*) FROM soak_exported e LEFT JOIN soak_acked a "
                "USING (tenant_id, request_id) WHERE a.uc IS NULL"
            ),
            "acknowledged_user_charge": str(one("SELECT coalesce(sum(uc), 0) FROM soak_acked")),
            "exported_user_charge_of_acknowledged": str(
                one(f"SELECT coalesce(sum(e.uc), 0) FROM {j}")
            ),
            "acknowledged_actual_cost": str(one("SELECT coalesce(sum(ac), 0) FROM soak_acked")),
            "exported_actual_cost_of_acknowledged": str(
                one(f"SELECT coalesce(sum(e.ac), 0) FROM {j}")
            ),
            "ledger_table_rows": one("SELECT count(*) FROM ledger_records"),
            "ledger_table_user_charge": str(
                one("SELECT coalesce(sum(user_charge_nanos), 0) / 1e9::numeric FROM ledger_records")
            ),
            "export_user_charge": str(
                one("SELECT coalesce(sum(user_charge::numeric), 0) FROM soak_export")
            ),
            "manifest": manifest,
            "missing_sample": [
                f"{t}/{r}"
                for t, r in c.execute(
                    f"SELECT a.tenant_id, a.request_id FROM {j} WHERE e.n IS NULL LIMIT 10"
                )
            ],
        }
    result["ok"] = (
        result["missing"] == 0
        and result["duplicated"] == 0
        and result["charge_mismatches"] == 0
        and result["ack_figures_inconsistent"] == 0
        and result["ledger_table_rows"] == result["exported_rows"]
    )
    return result


# ---------------------------------------------------------------- report


def log_levels(out_dir: Path) -> dict[str, int]:
    """Lines per level in the server logs (JSON lines; others: "other")."""
    counts: dict[str, int] = {}
    for path in sorted(out_dir.glob("server-*.log")):
        with path.open(errors="replace") as f:
            for line in f:
                try:
                    level = str(json.loads(line).get("level", "other"))
                except (ValueError, AttributeError):
                    level = "other"
                counts[level] = counts.get(level, 0) + 1
    return counts


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(res: dict[str, Any]) -> str:
    a = res["args"]
    out = [
        f"`{res['command']}`, {res['started']} UTC, {res['cores']} cores; "
        f"{a['rate']:g} admissions/s ({1 - a['stream_share']:.0%} unary Admit, the rest in "
        f"AdmitStream batches of {a['batch']}), {a['engines']} engines reporting every "
        f"{a['report_interval']:g} s, {a['unsettled']:.0%} of admitted requests left "
        f"unsettled (TTL {a['ttl']:g} s); admission auth "
        f"{'on (a sidecar key)' if a['auth'] else 'off (BURSTGATE_ADMISSION_AUTH=false)'}.",
        "",
        "Events: "
        + (", ".join(f"{e['t_s']:.0f} s {e['what']}" for e in res["events"]) or "none")
        + ".",
        "",
        "| t (min) | events | server RSS MiB (end / max) | Admit p50 / p99 ms "
        "| queued Admits: n, p99 ms | AdmitStream batch p50 / p99 ms | Complete p50 / p99 ms "
        "| ReportLoad p99 ms | calls OK | errors (RPC status count) | admitted / refused "
        "| open reservations (end / max) | expired (total) | spool records (max) "
        "| ledger DB down (samples) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in res["intervals"]:
        lat = r["latency_ms"]

        def pp(rpc: str, lat: dict[str, Any] = lat) -> str:
            x = lat.get(rpc)
            return f"{x['p50']:.1f} / {x['p99']:.1f}" if x else "-"

        q = lat.get("Admit(queued)")
        queued = f"{q['n']:,}, {q['p99']:,.0f}" if q else "0"
        rl = lat.get("ReportLoad")
        ok = sum(n for codes in r["calls"].values() for c, n in codes.items() if c == "OK")
        errs = (
            "; ".join(
                f"{rpc} " + ", ".join(f"{c} {n:,}" for c, n in sorted(codes.items()) if c != "OK")
                for rpc, codes in sorted(r["calls"].items())
                if any(c != "OK" for c in codes)
            )
            or "0"
        )
        adm = r["decisions"].get("admit", 0)
        refused = sum(n for k, n in r["decisions"].items() if k != "admit")
        pk = r["peak"]
        down = f"{pk.get('db_down_samples', 0):.0f} of {pk.get('samples', 0):.0f}"
        out.append(
            f"| {r['t_s'] / 60:.1f} | {' '.join(r['events'])} "
            f"| {fmt(r['rss_mib'], '.0f')} / {fmt(pk.get('rss_mib'), '.0f')} "
            f"| {pp('Admit')} | {queued} | {pp('AdmitStream')} | {pp('Complete')} "
            f"| {fmt(rl['p99'] if rl else None)} | {ok:,} | {errs} | {adm:,} / {refused:,} "
            f"| {fmt(r['open_reservations'], ',.0f')} / {fmt(pk.get('open_reservations'), ',.0f')} "
            f"| {fmt(r['expired_total'], ',.0f')} | {fmt(pk.get('spool_records'), ',.0f')} "
            f"| {down} |"
        )
    rec = res["reconciliation"]
    out += [
        "",
        "| ledger reconciliation | |",
        "|---|---:|",
        f"| Completes acknowledged OK (distinct requests) | {rec['acknowledged']:,} |",
        f"| of which first acknowledged as a duplicate (an earlier attempt's answer lost) "
        f"| {rec['acknowledged_duplicate_only']:,} |",
        f"| exported (`burstgate export`), rows | {rec['exported_rows']:,} |",
        f"| acknowledged and missing from the export | {rec['missing']:,} |",
        f"| exported more than once | {rec['duplicated']:,} |",
        f"| charge differs from the acknowledgement | {rec['charge_mismatches']:,} |",
        f"| exported, never acknowledged (answer lost, or the call failed after the record "
        f"was durable) | {rec['exported_not_acknowledged']:,} |",
        f"| user charge: acknowledged / exported (same requests) "
        f"| {rec['acknowledged_user_charge']} / {rec['exported_user_charge_of_acknowledged']} |",
        f"| ledger table rows / export rows | {rec['ledger_table_rows']:,} / "
        f"{rec['exported_rows']:,} |",
        f"| replayed Completes with the same figures / mismatched "
        f"| {res['replays_ok']:,} / {res['replay_mismatches']:,} |",
        f"| unary Admits not sent (client in-flight cap, or > 1 s behind schedule) "
        f"| {res['skipped']:,} |",
        f"| AdmitStream entries not sent while the stream was reopened (restarts) "
        f"| {res['stream_skipped']:,} |",
        "",
        f"Reconciliation {'OK' if rec['ok'] else 'FAILED'}. Server RSS (sampled every "
        f"{res['args']['sample_every']:g} s): "
        f"{fmt(res['rss']['first'], '.0f')} MiB max in the first interval, "
        f"{fmt(res['rss']['max'], '.0f')} max, {fmt(res['rss']['last'], '.0f')} last (before "
        "the final SIGTERM); "
        f"{res['server_starts']} server starts. The load driver's RSS: "
        f"{fmt(res['driver_rss']['first'], '.0f')} MiB first sample, "
        f"{fmt(res['driver_rss']['max'], '.0f')} max. Server log lines by level: "
        + (", ".join(f"{k} {v:,}" for k, v in sorted(res["server_log"].items())) or "none")
        + ".",
    ]
    return "\n".join(out)


# ------------------------------------------------------------------ main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--duration", type=float, default=3600, help="seconds of load")
    ap.add_argument("--rate", type=float, default=200, help="admissions/s, unary + stream")
    ap.add_argument("--stream-share", type=float, default=0.5, help="of --rate in AdmitStream")
    ap.add_argument("--batch", type=int, default=20, help="entries per AdmitStream batch")
    ap.add_argument("--unsettled", type=float, default=0.05, help="admitted, never completed")
    ap.add_argument("--replay", type=float, default=0.01, help="acknowledged Completes re-sent")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--report-interval", type=float, default=0.25, help="load report period, s")
    ap.add_argument("--ttl", type=float, default=60, help="BURSTGATE_RESERVATION_TTL_S")
    ap.add_argument("--cut-every", type=float, default=600, help="s between outages (0 = none)")
    ap.add_argument("--cut-length", type=float, default=30)
    ap.add_argument("--restart-every", type=float, default=900, help="s (0 = none)")
    ap.add_argument("--sigkill-at", type=int, default=2, help="this restart is SIGKILL (0: none)")
    ap.add_argument("--tail", type=float, default=20, help="s of load after the last event")
    ap.add_argument("--report-every", type=float, default=60)
    ap.add_argument("--sample-every", type=float, default=5, help="/metrics and RSS peaks, s")
    ap.add_argument("--max-in-flight", type=int, default=2000)
    ap.add_argument("--no-auth", dest="auth", action="store_false",
                    help="serve with BURSTGATE_ADMISSION_AUTH=false, no sidecar key")  # fmt: skip
    ap.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                    help="extra server setting (repeatable)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--out", type=Path, help="default: bench/results/soak-<UTC time>")
    ap.add_argument("--keep-db", action="store_true", help="do not drop the database")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import uvloop

    args = parse(argv)
    started = dt.datetime.now(dt.UTC)
    out_dir: Path = args.out or REPO_ROOT / "bench" / "results" / f"soak-{started:%Y%m%dT%H%M%S}"
    out_dir.mkdir(parents=True, exist_ok=True)
    url = create_db()
    print(f"soak: database {make_url(url).database}, output {out_dir}", file=sys.stderr)
    proxy: DbProxy | None = None
    server: ServerProc | None = None
    try:
        token = set_up(url, args.auth)
        u = make_url(url)
        proxy = DbProxy((u.host or "127.0.0.1", u.port or 5432))
        env = {
            "BURSTGATE_DATABASE_URL": u.set(port=proxy.port).render_as_string(hide_password=False),
            "BURSTGATE_ADMISSION_AUTH": "true" if args.auth else "false",
            "BURSTGATE_RESERVATION_TTL_S": str(args.ttl),
            "BURSTGATE_LEDGER_SPOOL_DIR": str(out_dir / "spool"),
            "BURSTGATE_LOG_FORMAT": "json",
            "BURSTGATE_LOG_LEVEL": "warning",
            "BURSTGATE_POLICY__KNOWN_POOLS": json.dumps([SOAK_POOL]),  # declared
        }
        for kv in args.server_env:
            name, _, value = kv.partition("=")
            env[name] = value
        server = ServerProc(env, free_port(), free_port(), out_dir)
        server.start()
        run_id = f"k{started:%H%M%S}"
        cfg = LoadConfig(
            target=server.target, token=token,
            tenants=tuple(TenantLoad(t, w) for t, w, _ in TENANTS), rate=args.rate,
            stream_share=args.stream_share, batch=args.batch, unsettled=args.unsettled,
            replay=args.replay, engines=args.engines, report_interval_s=args.report_interval,
            max_in_flight=args.max_in_flight, run_id=run_id, acks_path=out_dir / "acks.csv",
            seed=args.seed,
        )  # fmt: skip
        soak = Soak(args, server, proxy, Load(cfg, epoch=lambda: soak.restarts))
        events = schedule(args)
        print(f"soak: {len(events)} events planned: "
              f"{', '.join(f'{e.at_s:.0f} s {e.what}' for e in events)}",
              file=sys.stderr, flush=True)  # fmt: skip
        try:
            uvloop.run(soak.run(events))
        finally:
            soak.load.close()
        proxy.restore()
        final = drain(server)
        rss_end = server.rss_mib()
        code = server.stop(signal.SIGTERM)
        soak.note("stop-sigterm", exit_code=code, ledger=final)
        rec = reconcile(url, out_dir / "acks.csv", out_dir)
        rss = [r["peak"]["rss_mib"] for r in soak.rows if "rss_mib" in r["peak"]]
        drss = [r["driver_rss_mib"] for r in soak.rows if r["driver_rss_mib"] is not None]
        res: dict[str, Any] = {
            "command": " ".join([".venv/bin/python", "bench/soak.py", *(argv or sys.argv[1:])]),
            "started": f"{started:%Y-%m-%d %H:%M}",
            "cores": os.cpu_count(),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "events": soak.events,
            "intervals": soak.rows,
            "reconciliation": rec,
            "replays_ok": sum(r["replays_ok"] for r in soak.rows),
            "replay_mismatches": sum(r["replay_mismatches"] for r in soak.rows),
            "replay_mismatch_samples": soak.replay_mismatches[:20],
            "skipped": sum(r["skipped"] for r in soak.rows),
            "stream_skipped": sum(r["stream_skipped"] for r in soak.rows),
            "rss": {
                "first": rss[0] if rss else None,
                "max": max(rss, default=None),
                "last": rss_end,
            },
            "driver_rss": {"first": drss[0] if drss else None, "max": max(drss, default=None)},
            "server_starts": server.starts,
            "server_log": log_levels(out_dir),
            "server_exit_codes": server.exit_codes,
            "proxy_connections": proxy.accepted,
            "load": asdict(cfg) | {"acks_path": str(cfg.acks_path)},
        }
        (out_dir / "soak.json").write_text(json.dumps(res, indent=1, default=str))
        print(markdown(res))
        print(f"soak: wrote {out_dir / 'soak.json'}", file=sys.stderr)
        return 0 if rec["ok"] and not res["replay_mismatches"] else 1
    finally:
        if server is not None and server.pid is not None:
            server.stop(signal.SIGKILL)
        if proxy is not None:
            proxy.close()
        if not args.keep_db:
            drop_db(url)


if __name__ == "__main__":
    sys.exit(main())
