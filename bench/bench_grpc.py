"""gRPC benchmark of burstgate's AdmissionService vs an empty handler and vs
a Redis token bucket in Lua called per request.

    .venv/bin/python bench/bench_grpc.py            # full run, ~4 minutes
    .venv/bin/python bench/bench_grpc.py --quick    # smoke run, < 90 s
    .venv/bin/python bench/bench_grpc.py --profile  # + cProfile of our server
    .venv/bin/python bench/bench_grpc.py --no-redis # ours and empty only

Prints a markdown report on stdout (progress goes to stderr). Nothing here
asserts a time: it is run on demand and its figures go to BENCHMARKS.md.

Processes (all spawned, all on 127.0.0.1):

* "ours": ``controlplane.server.ControlPlane`` -- the production wiring
  (grpc.aio on uvloop, health, reflection, expiry and config-poll tasks) over
  a temporary SQLite database migrated with ``controlplane.store.db.upgrade``
  and holding four tenants (three generous ones, one tight one that gets one
  AdmitStream row in ten and refuses it almost always; unary Admits go to
  the generous ones only, the hot-path issue's "non-waiting tenants": a
  refused unary call of the tight one would wait server-side by design),
  with the pool gate off unless
  ``--pool-gate`` (see ``prepare_db``).
* "empty": ``controlplane.rpc.assembly.create_server`` with the servicer swapped
  for ``_grpc_empty.EmptyAdmissionServicer`` (same messages, pre-built
  answers of the same size, no decisions), also on uvloop.
* "redis": the same ``create_server`` stack with the servicer swapped for
  ``_grpc_redis.RedisAdmissionServicer``: a token bucket per tenant kept in
  a private redis-server (started by this benchmark on a free loopback port,
  nothing saved, stopped at the end -- never the machine's shared instance)
  and evaluated by a Lua script, one EVALSHA per request (a batch's
  pipelined in one round trip). Same tenants and limits as ours. Its server
  CPU counts the redis-server's too.
* the load generator (``_loadgen``), which drives one server at a time.

All servers run for the whole benchmark. Each scenario runs ``rounds``
rounds; a round measures the servers back to back, in an order that rotates
from round to round (two servers: alternating), after waiting for all of
them to go idle. Tables show the median across rounds and the ratios of the
medians (ours/empty, redis/empty, ours/redis).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import multiprocessing as mp
import os
import pstats
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import _harness as h
import _loadgen as lg
from _harness import median as _med

from controlplane.telemetry.gcpause import GcPauses

# Core admission performance targets (measured by this benchmark, never by a timed test).
TARGET_STREAM_DPS = 300_000
TARGET_P99_MS = 1.0
TARGET_RATIO = 1.15

# A unary Admit's server CPU over the empty handler's (hot-path issue,
# round two, item 2).
TARGET_UNARY_CPU_RATIO = 1.10

# Ours must reach this multiple of the Redis+Lua service's AdmitStream
# decisions/s (hot-path issue, item 6).
TARGET_VS_REDIS = 10.0

GENEROUS_TENANTS = ("bench-a", "bench-b", "bench-c")
TIGHT_TENANT = "bench-d"
# (token_rate per s, burst tokens): the same for ours and the Redis service.
GENEROUS_LIMIT = (1_000_000, 10**12)
# ~13 requests of 150 tokens, then ~7 per second: mostly refused.
TIGHT_LIMIT = (1000, 2_000)


# ------------------------------------------------------------ server process


def server_main(
    conn: Connection, mode: str, db_url: str, ttl_s: float | None, redis_port: int
) -> None:
    """Process entry point of the "ours", "empty" and "redis" servers."""
    h.run_server(_serve(conn, mode, db_url, ttl_s, redis_port))


async def _serve(
    conn: Connection, mode: str, db_url: str, ttl_s: float | None, redis_port: int
) -> None:
    from _grpc_empty import create_empty_server

    from controlplane.server import ControlPlane
    from controlplane.service import AdmissionService, ServiceLimits
    from controlplane.settings import Settings

    overrides: dict[str, Any] = {} if ttl_s is None else {"reservation_ttl_s": ttl_s}
    # Sidecar tokens off: this measures admission, not authentication
    # (docs/operating.md has the auth cost). No cap on open reservations: the
    # stream phase admits millions and completes none, and what is measured
    # is the decision, not the (cheaper) refusal at the memory cap.
    settings = Settings(
        database_url=db_url, host="127.0.0.1", port=0, metrics_port=-1, admission_auth=False,
        max_open_reservations=0, max_open_reservations_per_tenant=0, **overrides,
    )  # fmt: skip
    gc_timer = GcPauses().install()
    plane: ControlPlane | None = None
    server: Any = None
    redis_servicer: Any = None
    if mode == "ours":
        plane = ControlPlane(settings)
        port = await plane.start()
        plane.freeze_gc()  # as `burstgate serve` does (controlplane/server/process.py)
        implementation: str = plane.service.implementation
    elif mode == "redis":
        import _grpc_redis as gr

        limits = {t: gr.Limit(*GENEROUS_LIMIT) for t in GENEROUS_TENANTS}
        limits[TIGHT_TENANT] = gr.Limit(*TIGHT_LIMIT)
        redis_servicer = await gr.RedisAdmissionServicer.connect("127.0.0.1", redis_port, limits)
        service = AdmissionService(ServiceLimits.of(settings))
        server, port = gr.create_redis_server(service, redis_servicer, "127.0.0.1:0")
        await server.start()
        implementation = "redis+lua"
    else:
        service = AdmissionService(ServiceLimits.of(settings))
        server, port = create_empty_server(service, "127.0.0.1:0")
        await server.start()
        implementation = service.implementation
    conn.send(("ready", port, os.getpid(), implementation, settings.reservation_ttl_s))

    def stats(*how: str) -> dict[str, Any]:
        out: dict[str, Any] = {
            "gc_total_s": gc_timer.total_s,
            "gc_max_s": gc_timer.longest_s,
            "gc_collections": list(gc_timer.collections),
            "rss_mb": h.rss_mb(),
            "open_reservations": plane.service.views.open_reservations if plane else 0,
            # request ids remembered (admitted until the TTL, refused ~1 s)
            "records": plane.service.views.remembered_requests if plane else 0,
            # O(objects): only when asked, outside any measured window
            "tracked_objects": len(gc.get_objects()) if how == ("full",) else -1,
        }
        gc_timer.longest_s = 0.0  # the max is per interval between two "stats"
        return out

    await h.serve_commands(conn, {"stats": stats})
    if plane is not None:
        await plane.stop(0)
    if server is not None:
        await server.stop(0)
    if redis_servicer is not None:
        await redis_servicer.aclose()


@dataclass
class ServerHandle(h.Child):
    """A server process; port, implementation and TTL come with its "ready"."""

    port: int = 0
    implementation: str = ""
    ttl_s: float = 0.0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def await_ready(self, timeout: float = 60.0) -> None:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name} server did not start within {timeout:.0f} s")
        _, self.port, _pid, self.implementation, self.ttl_s = self.conn.recv()


def start_server(
    ctx: Any, mode: str, db_url: str, ttl_s: float | None, redis_port: int = 0
) -> ServerHandle:
    proc, conn = h.spawn(ctx, f"bench-{mode}", server_main, mode, db_url, ttl_s, redis_port)
    return ServerHandle(mode, proc, conn)


def start_loadgen(ctx: Any) -> h.Child:
    return h.Child("load generator", *h.spawn(ctx, "bench-loadgen", lg.loadgen_main))


# -------------------------------------------------------------- orchestration


@dataclass(frozen=True)
class Plan:
    rounds: int
    stream_seconds: float
    unary_seconds: float
    unary_warmup_s: float
    window: int
    batch_sizes: tuple[int, ...] = (100, 1000)
    rates: tuple[int, ...] = (1000, 2000)
    # Longest wait for an idle machine before each measurement.
    quiesce_s: float = 2.0
    # Upper bound on decisions per stream round (the time bound is seconds).
    max_stream_decisions_per_s: int = 3_000_000


@dataclass
class Sample:
    result: Any  # lg.StreamResult | lg.UnaryResult
    gc_total_s: float
    gc_max_s: float
    rss_mb: float
    quiet: bool  # both servers and the machine were idle before the round


@dataclass
class Scenario:
    kind: str  # "stream" | "unary"
    size: int  # batch size or offered rate
    samples: dict[str, list[Sample]] = field(default_factory=dict)


def run_one(
    sc: Scenario,
    mode: str,
    rnd: int,
    plan: Plan,
    servers: dict[str, ServerHandle],
    loadgen: h.Child,
    backend_pids: dict[str, tuple[int, ...]],
) -> Sample:
    srv = servers[mode]
    extra = backend_pids.get(mode, ())
    all_pids = [s.pid for s in servers.values()] + [p for ps in backend_pids.values() for p in ps]
    quiet = h.quiesce(all_pids, plan.quiesce_s)
    before = srv.call("stats")
    # Unique request ids across every round of every scenario.
    prefix = f"{sc.kind[0]}{sc.size}r{rnd}{mode[0]}-"
    params: lg.StreamParams | lg.UnaryParams
    if sc.kind == "stream":
        max_batches = int(plan.max_stream_decisions_per_s * plan.stream_seconds / sc.size) + 50
        params = lg.StreamParams(
            target=srv.target,
            server_pid=srv.pid,
            batch=sc.size,
            window=plan.window,
            seconds=plan.stream_seconds,
            max_batches=max_batches,
            warmup_batches=max(20, 20_000 // sc.size),
            id_prefix=prefix,
            check_batch_ids=mode != "empty",
            extra_pids=extra,
        )
        timeout = plan.stream_seconds + 60
    else:
        params = lg.UnaryParams(
            target=srv.target,
            server_pid=srv.pid,
            rate=float(sc.size),
            seconds=plan.unary_seconds,
            warmup_s=plan.unary_warmup_s,
            id_prefix=prefix,
            extra_pids=extra,
            tenants=GENEROUS_TENANTS,
        )
        timeout = plan.unary_seconds + plan.unary_warmup_s + 60
    result = loadgen.run(params, timeout)
    after = srv.call("stats")
    return Sample(
        result=result,
        gc_total_s=after["gc_total_s"] - before["gc_total_s"],
        gc_max_s=after["gc_max_s"],
        rss_mb=after["rss_mb"],
        quiet=quiet,
    )


def round_order(modes: Sequence[str], rnd: int) -> list[str]:
    """The servers' order in round ``rnd``: rotated by one each round, so
    each goes first, and follows each other server, equally often over
    len(modes) rounds (two servers: alternating, ours first in even rounds)."""
    k = rnd % len(modes)
    return [*modes[k:], *modes[:k]]


def run_all(
    plan: Plan,
    servers: dict[str, ServerHandle],
    loadgen: h.Child,
    backend_pids: dict[str, tuple[int, ...]],
) -> list[Scenario]:
    modes = list(servers)
    scenarios = [Scenario("stream", n) for n in plan.batch_sizes]
    scenarios += [Scenario("unary", r) for r in plan.rates]
    for sc in scenarios:
        sc.samples = {m: [] for m in modes}
        for rnd in range(plan.rounds):
            for mode in round_order(modes, rnd):
                s = run_one(sc, mode, rnd, plan, servers, loadgen, backend_pids)
                sc.samples[mode].append(s)
                _progress(sc, mode, rnd, s)
    return scenarios


def _progress(sc: Scenario, mode: str, rnd: int, s: Sample) -> None:
    r = s.result
    if sc.kind == "stream":
        what = f"{r.decisions_per_s:,.0f} decisions/s p99 {r.p99_ms:.3f} ms"
    else:
        what = f"p50 {r.p50_ms:.3f} ms p99 {r.p99_ms:.3f} ms errors {r.errors}"
    print(
        f"  {sc.kind} {sc.size} round {rnd} {mode:5s}: {what}"
        f" server cpu {r.server_cpu_s + r.extra_cpu_s:.2f} s gc max {s.gc_max_s * 1e3:.1f} ms",
        file=sys.stderr,
        flush=True,
    )


def prepare_db(url: str, pool_gate: bool = False) -> None:
    """Migrate ``url`` and add the four tenants. The pool gate (on in the
    default policy) is turned off unless ``pool_gate``: the load generator
    sends no load reports and no Complete, so with the gate on at most
    ``gate_fallback_inflight`` (64) requests are ever admitted and the run
    measures refusals and queue timeouts, not admission (the Redis+Lua
    baseline has no such gate either)."""
    from controlplane.domain import TenantConfig
    from controlplane.domain.policy import Policy
    from controlplane.store.config import ConfigRepository
    from controlplane.store.db import make_engine, upgrade

    with contextlib.redirect_stdout(sys.stderr):
        upgrade(url)
        engine = make_engine(url)
        try:
            repo = ConfigRepository(engine)
            for tenant_id in GENEROUS_TENANTS:
                rate, burst = GENEROUS_LIMIT
                repo.add_tenant(
                    TenantConfig(tenant_id=tenant_id, token_rate=Decimal(rate), burst_tokens=burst)
                )
            rate, burst = TIGHT_LIMIT
            repo.add_tenant(
                TenantConfig(tenant_id=TIGHT_TENANT, token_rate=Decimal(rate), burst_tokens=burst)
            )
            # the load generator's pool, declared (docs/operating.md)
            policy: dict[str, Any] = {"known_pools": [lg.POOL]}
            if not pool_gate:
                policy["pool_gate"] = False
            repo.update_policy(Policy(), policy, [])
        finally:
            engine.dispose()


# ------------------------------------------------------------------ profile


def profile_ours(
    plan: Plan, servers: dict[str, ServerHandle], loadgen: h.Child, tmp: Path
) -> list[tuple[str, str]]:
    """cProfile the ours server's event-loop thread for one stream round
    (batch 100) and one unary round (2,000/s); return (label, top table)."""
    ours = servers["ours"]
    out: list[tuple[str, str]] = []
    stream = lg.StreamParams(
        target=ours.target,
        server_pid=ours.pid,
        batch=100,
        window=plan.window,
        seconds=min(3.0, plan.stream_seconds),
        max_batches=100_000,
        warmup_batches=200,
        id_prefix="p100-",
        check_batch_ids=True,
    )
    unary = lg.UnaryParams(
        target=ours.target,
        server_pid=ours.pid,
        rate=2000.0,
        seconds=min(3.0, plan.unary_seconds),
        warmup_s=0.2,
        id_prefix="pu2000-",
        tenants=GENEROUS_TENANTS,
    )
    for label, params in (
        ("AdmitStream, batch 100", stream),
        ("unary Admit, 2,000/s", unary),
    ):
        h.quiesce([s.pid for s in servers.values()], plan.quiesce_s)
        path = tmp / f"profile-{len(out)}.pstats"
        ours.call("profile_on")
        result = loadgen.run(params, 120)
        ours.call("profile_off", str(path))
        buf = io.StringIO()
        stats = pstats.Stats(str(path), stream=buf)
        stats.sort_stats("tottime").print_stats(18)
        text = h.clean_paths(buf.getvalue())
        lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
        if isinstance(result, lg.StreamResult):
            head = f"{result.decisions_per_s:,.0f} decisions/s under the profiler"
        else:
            head = f"p99 {result.p99_ms:.3f} ms under the profiler"
        out.append((f"{label} ({head})", "\n".join(lines)))
    return out


# ------------------------------------------------------------------- report


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


# Ratio rows: (numerator, denominator), shown when both servers ran.
RATIO_PAIRS = (("ours", "empty"), ("redis", "empty"), ("ours", "redis"))


def _pairs(modes: Sequence[str]) -> list[tuple[str, str]]:
    return [(a, b) for a, b in RATIO_PAIRS if a in modes and b in modes]


def report(
    plan: Plan,
    scenarios: list[Scenario],
    servers: dict[str, ServerHandle],
    argv: Sequence[str],
    elapsed_s: float,
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
    profiles: list[tuple[str, str]],
    final: dict[str, dict[str, Any]],
    redis_info: dict[str, Any] | None,
    pool_gate: bool,
) -> str:
    ours = servers["ours"]
    modes = list(servers)
    pairs = _pairs(modes)
    lines = ["# burstgate gRPC benchmark", ""]
    lines.append(f"Command: `{' '.join(argv)}` (run took {elapsed_s:.0f} s)")
    lines.append("")
    lines += h.machine()
    lines.append(
        f"- servers: grpc.aio on uvloop, loopback 127.0.0.1; ours = `ControlPlane` "
        f"(fastpath `{ours.implementation}`, reservation_ttl_s {ours.ttl_s:g}, SQLite, "
        f"pool gate {'on' if pool_gate else 'off'}); "
        "empty = `create_server` with a no-op servicer"
        + (
            "; redis = `create_server` with a servicer deciding by a token bucket in Lua "
            f"(one EVALSHA per request, a batch's pipelined) on a private {redis_info['server']}"
            f" (redis-py {redis_info['client']}, hiredis {redis_info['hiredis']}); its server "
            "CPU includes the redis-server's ('of it, redis-server')"
            if redis_info
            else ""
        )
    )
    lines.append(
        f"- load average before / after: {load_before[0]:.2f} / {load_after[0]:.2f} "
        "(shared, noisy 2-core machine: compare the servers within this run only)"
    )
    lines.append(
        f"- {plan.rounds} rounds per scenario, the servers back to back in an order rotating "
        "each round; tables are medians across rounds; ratio a/b = a's median / b's median"
    )
    n_busy = sum(not s.quiet for sc in scenarios for ss in sc.samples.values() for s in ss)
    if n_busy:
        lines.append(
            f"- note: {n_busy} round(s) started on a busy machine (other processes kept using "
            f"> 0.5 core for {plan.quiesce_s:g} s); see the 'other load' column"
        )
    lines.append("")

    # Stream.
    lines.append(
        f"## AdmitStream: closed loop, {plan.window} batches in flight on one stream, "
        f"~{plan.stream_seconds:g} s per round"
    )
    lines.append("")
    lines.append(
        "| batch | server | decisions/s | p50 ms/batch | p99 ms/batch | max ms | "
        "server CPU ns/decision | of it, redis-server | client CPU % | server GC max ms "
        "| admitted | bytes req/resp | other load cores / steal |"
    )
    lines.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for sc in (s for s in scenarios if s.kind == "stream"):
        med: dict[str, dict[str, float]] = {}
        for mode in modes:
            ss = sc.samples[mode]
            rs: list[lg.StreamResult] = [s.result for s in ss]
            m = {
                "dps": _med([r.decisions_per_s for r in rs]),
                "p50": _med([r.p50_ms for r in rs]),
                "p99": _med([r.p99_ms for r in rs]),
                "max": _med([r.max_ms for r in rs]),
                "cpu": _med(
                    [
                        (r.server_cpu_s + r.extra_cpu_s) / r.decisions * 1e9
                        for r in rs
                        if r.decisions
                    ]
                ),
                "xcpu": _med([r.extra_cpu_s / r.decisions * 1e9 for r in rs if r.decisions]),
                "ccpu": _med([r.client_cpu_s / r.elapsed_s * 100 for r in rs]),
                "gc": _med([s.gc_max_s * 1e3 for s in ss]),
                "adm": _med([r.admitted_fraction * 100 for r in rs]),
                "oth": _med([r.other_cores for r in rs]),
                "stl": _med([r.steal_fraction * 100 for r in rs]),
            }
            med[mode] = m
            r0 = rs[-1]
            xcpu = f"{m['xcpu']:,.0f}" if mode == "redis" else ""
            lines.append(
                f"| {sc.size:,} | {mode} | {m['dps']:,.0f} | {m['p50']:.3f} | {m['p99']:.3f} "
                f"| {m['max']:.2f} | {m['cpu']:,.0f} | {xcpu} | {m['ccpu']:.0f} | {m['gc']:.1f} "
                f"| {m['adm']:.0f}% | {r0.request_bytes:,}/{r0.response_bytes:,} "
                f"| {m['oth']:.2f} / {m['stl']:.0f}% |"
            )
        for a, b in pairs:
            o, e = med[a], med[b]
            lines.append(
                f"| {sc.size:,} | **{a}/{b}** | **{_ratio(o['dps'], e['dps'])}** "
                f"| {_ratio(o['p50'], e['p50'])} | **{_ratio(o['p99'], e['p99'])}** "
                f"| {_ratio(o['max'], e['max'])} | {_ratio(o['cpu'], e['cpu'])} | | | | | | |"
            )
    capped = sum(
        s.result.hit_count_limit for sc in scenarios if sc.kind == "stream"
        for ss in sc.samples.values() for s in ss
    )  # fmt: skip
    if capped:
        lines.append("")
        lines.append(f"{capped} stream round(s) stopped at the batch-count bound before the time.")
    lines.append("")
    lines.append("Per round (decisions/s; p99 ms; other load in cores):")
    lines.append("")
    for sc in (s for s in scenarios if s.kind == "stream"):
        for mode in modes:
            rs = [s.result for s in sc.samples[mode]]
            lines.append(
                f"- batch {sc.size:,} {mode}: "
                + ", ".join(
                    f"{r.decisions_per_s:,.0f}; {r.p99_ms:.3f}; {r.other_cores:.2f}" for r in rs
                )
            )
    lines.append("")

    # Unary.
    lines.append(
        f"## Unary Admit: open loop (fixed schedule, latency from the scheduled send), "
        f"~{plan.unary_seconds:g} s per round"
    )
    lines.append("")
    lines.append(
        "| offered/s | server | completed/s | p50 ms | p99 ms | max ms | "
        "server CPU us/call | of it, redis-server | client CPU us/call | "
        "client send lag p99 ms | errors (all rounds) | server GC max ms | admitted | "
        "other load cores / steal |"
    )
    lines.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for sc in (s for s in scenarios if s.kind == "unary"):
        umed: dict[str, dict[str, float]] = {}
        for mode in modes:
            ss = sc.samples[mode]
            us: list[lg.UnaryResult] = [s.result for s in ss]
            m = h.unary_medians(us) | {
                "cpu": _med(
                    [(r.server_cpu_s + r.extra_cpu_s) / r.calls * 1e6 for r in us if r.calls]
                ),
                "xcpu": _med([r.extra_cpu_s / r.calls * 1e6 for r in us if r.calls]),
                "gc": _med([s.gc_max_s * 1e3 for s in ss]),
                "ccpu": _med([r.client_cpu_s / r.calls * 1e6 for r in us if r.calls]),
            }
            umed[mode] = m
            xcpu = f"{m['xcpu']:.0f}" if mode == "redis" else ""
            lines.append(
                f"| {sc.size:,} | {mode} | {m['done']:,.0f} | {m['p50']:.3f} | {m['p99']:.3f} "
                f"| {m['max']:.2f} | {m['cpu']:.0f} | {xcpu} | {m['ccpu']:.0f} | {m['lag']:.3f} "
                f"| {m['err']:.0f} | {m['gc']:.1f} | {m['adm']:.0f}% "
                f"| {m['oth']:.2f} / {m['stl']:.0f}% |"
            )
        for a, b in pairs:
            o, e = umed[a], umed[b]
            lines.append(
                f"| {sc.size:,} | **{a}/{b}** | | {_ratio(o['p50'], e['p50'])} "
                f"| **{_ratio(o['p99'], e['p99'])}** | {_ratio(o['max'], e['max'])} "
                f"| **{_ratio(o['cpu'], e['cpu'])}** | | | | | | | |"
            )
    lines.append("")
    lines.append("Per round (p99 ms; server CPU us/call; other load in cores):")
    lines.append("")
    for sc in (s for s in scenarios if s.kind == "unary"):
        for mode in modes:
            us = [s.result for s in sc.samples[mode]]
            lines.append(
                f"- {sc.size:,}/s {mode}: "
                + ", ".join(
                    f"{r.p99_ms:.3f}; {(r.server_cpu_s + r.extra_cpu_s) / r.calls * 1e6:.0f}; "
                    f"{r.other_cores:.2f}"
                    for r in us
                )
            )
    errs = sorted(
        {e for sc in scenarios if sc.kind == "unary" for ss in sc.samples.values()
         for s in ss for e in s.result.error_samples}
    )  # fmt: skip
    if errs:
        lines.append("")
        lines.append(
            "Call errors seen (deadline 2 s; a server-side deadline shows as CANCELLED): "
            + "; ".join(errs)
        )
    lines.append("")

    # Targets.
    lines.append("## Targets (core admission)")
    lines.append("")
    lines += _targets(scenarios)
    lines.append("")
    fo, fe = final["ours"], final["empty"]
    extra_mb = fo["rss_mb"] - fe["rss_mb"]
    per_record = extra_mb * 2**20 / fo["records"] if fo["records"] else float("nan")
    lines.append("## Server memory and GC (whole run)")
    lines.append("")
    lines.append(
        "| server | RSS MB | request ids remembered | GC-tracked objects | "
        "collections gen0/1/2 | GC pause total s |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|")
    for mode in modes:
        st = final[mode]
        lines.append(
            f"| {mode} | {st['rss_mb']:,.0f} | {st['records']:,} | {st['tracked_objects']:,} "
            f"| {'/'.join(str(c) for c in st['gc_collections'])} | {st['gc_total_s']:.2f} |"
        )
    if redis_info:
        lines.append(f"| redis-server | {redis_info['rss_mb']:,.0f} | | | | |")
    lines.append("")
    if fo["records"] >= 100_000:  # RSS does not shrink after expiry; small counts say nothing
        lines.append(
            f"Ours holds ~{per_record:,.0f} bytes of RSS per remembered request id "
            f"(reservation_ttl_s {ours.ttl_s:g}); the 'server GC max ms' columns above are "
            "the longest single collection pause in each round."
        )
    else:
        lines.append(
            "The 'server GC max ms' columns above are the longest single collection pause "
            "in each round."
        )
    for label, table in profiles:
        lines.append("")
        lines.append(f"## Server profile, ours: {label}")
        lines.append("")
        lines.append("```")
        lines.append(table)
        lines.append("```")
    return "\n".join(lines) + "\n"


def _targets(scenarios: list[Scenario]) -> list[str]:
    def med(kind: str, size: int, mode: str, fn: Callable[[Any], float]) -> float | None:
        for sc in scenarios:
            if sc.kind == kind and sc.size == size and sc.samples.get(mode):
                return _med([fn(s.result) for s in sc.samples[mode]])
        return None

    def verdict(ok: bool) -> str:
        return "met" if ok else "**not met**"

    out: list[str] = []
    dps = med("stream", 100, "ours", lambda r: r.decisions_per_s)
    p99 = med("stream", 100, "ours", lambda r: r.p99_ms)
    edps = med("stream", 100, "empty", lambda r: r.decisions_per_s)
    if dps is not None and p99 is not None and edps is not None:
        out.append(
            f"- AdmitStream batch 100: {dps:,.0f} decisions/s (target >= {TARGET_STREAM_DPS:,}), "
            f"p99 {p99:.3f} ms/batch (target < {TARGET_P99_MS:g} ms): "
            f"{verdict(dps >= TARGET_STREAM_DPS and p99 < TARGET_P99_MS)}; "
            f"empty stream here: {edps:,.0f}/s (reference figure: ~435,000/s)"
        )
    u1 = med("unary", 1000, "ours", lambda r: r.p99_ms)
    if u1 is not None:
        out.append(
            f"- unary 1,000/s: p99 {u1:.3f} ms (target < {TARGET_P99_MS:g} ms): "
            f"{verdict(u1 < TARGET_P99_MS)}"
        )
    o99 = med("unary", 2000, "ours", lambda r: r.p99_ms)
    e99 = med("unary", 2000, "empty", lambda r: r.p99_ms)
    ocpu = med("unary", 2000, "ours", lambda r: r.server_cpu_s / r.calls)
    ecpu = med("unary", 2000, "empty", lambda r: r.server_cpu_s / r.calls)
    if o99 is not None and e99 and ocpu is not None and ecpu:
        out.append(
            f"- unary 2,000/s: p99 {o99 / e99:.2f}x and server CPU/call {ocpu / ecpu:.2f}x the "
            f"empty handler (target <= {TARGET_RATIO}x each): "
            f"{verdict(o99 / e99 <= TARGET_RATIO and ocpu / ecpu <= TARGET_RATIO)}"
        )
    for n in (100, 1000):
        ours_dps = med("stream", n, "ours", lambda r: r.decisions_per_s)
        redis_dps = med("stream", n, "redis", lambda r: r.decisions_per_s)
        if ours_dps is not None and redis_dps:
            x = ours_dps / redis_dps
            out.append(
                f"- AdmitStream batch {n:,} vs the Redis+Lua service on the same cores: "
                f"{ours_dps:,.0f} / {redis_dps:,.0f} decisions/s = {x:.2f}x "
                f"(target >= {TARGET_VS_REDIS:g}x): {verdict(x >= TARGET_VS_REDIS)}"
            )
    return out


def record_unary(scenarios: list[Scenario], argv: Sequence[str]) -> None:
    """The targets table's unary rows (bench/_summary.py): our server's CPU
    per unary Admit over the empty handler's, measured in the same run, at
    each offered rate."""
    from _summary import record

    for sc in (s for s in scenarios if s.kind == "unary"):
        cpu = {
            mode: _med([(r.server_cpu_s + r.extra_cpu_s) / r.calls * 1e6 for r in rs if r.calls])
            for mode, rs in ((m, [s.result for s in ss]) for m, ss in sc.samples.items())
            if any(r.calls for r in rs)
        }
        if "ours" not in cpu or not cpu.get("empty"):
            continue
        ratio = cpu["ours"] / cpu["empty"]
        record(
            what=f"unary Admit, server CPU per call, {sc.size:,}/s offered",
            ours=round(cpu["ours"], 1),
            unit="us CPU/call",
            baseline=round(cpu["empty"], 1),
            baseline_name="empty handler (same create_server stack, no-op servicer)",
            ratio=round(ratio, 3),
            target=f"<= {TARGET_UNARY_CPU_RATIO:.2f}x empty",
            met=ratio <= TARGET_UNARY_CPU_RATIO,
            note=(
                "ours also runs the auth/metrics interceptor"
                if ratio <= TARGET_UNARY_CPU_RATIO
                else "the rest is Python per call: the service's decision (answer, "
                "token signing, request log: ~60%), then the interceptor and wrappers"
            ),
            bench=" ".join(argv),
        )


# --------------------------------------------------------------------- main


# AdmitStream rows of the targets table (bench/_summary.py): ours over the
# empty stream (decisions/s) and over the Redis+Lua service, same run.
STREAM_VS_EMPTY = {100: 0.8, 1000: 0.6}
STREAM_P99_MS = 1.5  # per batch of 100
STREAM_VS_REDIS = {100: 10.0, 1000: 25.0}


def record_stream_targets(scenarios: list[Scenario], command: str) -> None:
    """``record(...)`` the AdmitStream rows (a no-op unless
    BURSTGATE_BENCH_SUMMARY is set)."""
    from _summary import record

    def med(size: int, mode: str, fn: Callable[[Any], float]) -> float | None:
        for sc in scenarios:
            if sc.kind == "stream" and sc.size == size and sc.samples.get(mode):
                return _med([fn(s.result) for s in sc.samples[mode] if s.result.decisions])
        return None

    def cpu(r: Any) -> float:
        return float((r.server_cpu_s + r.extra_cpu_s) / r.decisions * 1e9)

    for n, floor in STREAM_VS_EMPTY.items():
        ours = med(n, "ours", lambda r: r.decisions_per_s)
        empty = med(n, "empty", lambda r: r.decisions_per_s)
        if ours is None or not empty:
            continue
        p99 = med(n, "ours", lambda r: r.p99_ms)
        ocpu, ecpu = med(n, "ours", cpu), med(n, "empty", cpu)
        met = ours / empty >= floor
        target = f"≥ {floor}x empty"
        if n == 100:
            met = met and p99 is not None and p99 <= STREAM_P99_MS
            target += f"; p99 ≤ {STREAM_P99_MS} ms per batch"
        note = f"p99 {p99:.2f} ms/batch" if p99 is not None else ""
        if ocpu and ecpu:
            note += f"; server CPU {ocpu:,.0f} vs {ecpu:,.0f} ns/decision"
        record(
            what=f"AdmitStream, batch {n:,}", ours=ours, unit="decisions/s", baseline=empty,
            baseline_name="empty stream", target=target, met=met, note=note, bench=command,
        )  # fmt: skip
    for n, floor in STREAM_VS_REDIS.items():
        ours = med(n, "ours", lambda r: r.decisions_per_s)
        redis = med(n, "redis", lambda r: r.decisions_per_s)
        if ours is None or not redis:
            continue
        record(
            what=f"AdmitStream vs Redis + Lua, batch {n:,}", ours=ours, unit="decisions/s",
            baseline=redis, baseline_name="Redis + Lua token bucket", target=f"≥ {floor:g}x",
            met=ours / redis >= floor, bench=command,
        )  # fmt: skip


@contextlib.contextmanager
def _start_redis(tmp: Path) -> Iterator[Any]:
    """The Redis+Lua server's private redis-server (``_grpc_redis``)."""
    import _grpc_redis as gr

    workdir = tmp / "redis"
    workdir.mkdir()
    with gr.redis_server(str(workdir)) as proc:
        print(f"redis-server (private) on 127.0.0.1:{proc.port}", file=sys.stderr, flush=True)
        yield proc


def _redis_info(proc: Any) -> dict[str, Any]:
    """Versions and the redis-server's RSS, for the report."""
    import subprocess
    from importlib.metadata import version

    import _grpc_redis as gr

    out = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True, check=False
    ).stdout
    server = next((w for w in out.split() if w.startswith("v=")), "v=?")[2:]
    try:
        hiredis = version("hiredis")
    except Exception:
        hiredis = "not installed"
    return {
        "server": f"redis-server {server}",
        "client": version("redis"),
        "hiredis": hiredis,
        "rss_mb": gr.rss_mb(proc.pid),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 short rounds per scenario (< 90 s)")
    ap.add_argument("--rounds", type=int, help="rounds per scenario (default 4; quick: 2)")
    ap.add_argument("--seconds", type=float, help="measured seconds per round (default 5)")
    ap.add_argument("--window", type=int, default=2, help="AdmitStream batches in flight")
    ap.add_argument(
        "--reservation-ttl",
        type=float,
        default=None,
        help="reservation_ttl_s of the ours server (default: the Settings default)",
    )
    ap.add_argument(
        "--profile", action="store_true", help="also cProfile the ours server (extra rounds)"
    )
    ap.add_argument(
        "--pool-gate",
        action="store_true",
        help="keep ours' pool gate on (the default policy); without load reports and "
        "Complete it then admits only the first 64 requests",
    )
    ap.add_argument(
        "--no-redis",
        action="store_true",
        help="leave out the Redis+Lua server (needs redis-server and the redis package)",
    )
    args = ap.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 4)
    seconds = args.seconds or (2.0 if args.quick else 5.0)
    if rounds < 1 or seconds <= 0 or not 1 <= args.window <= 64:
        ap.error("need rounds >= 1, seconds > 0, 1 <= window <= 64")
    no_redis = args.no_redis
    if not no_redis and shutil.which("redis-server") is None:
        print("redis-server not found: running without the Redis+Lua server", file=sys.stderr)
        no_redis = True
    plan = Plan(
        rounds=rounds,
        stream_seconds=seconds,
        unary_seconds=seconds,
        unary_warmup_s=0.3 if args.quick else 0.5,
        window=args.window,
        quiesce_s=0.5 if args.quick else 2.0,
    )

    started = time.monotonic()
    load_before = os.getloadavg()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="burstgate-bench-") as tmpdir:
        tmp = Path(tmpdir)
        db_url = f"sqlite:///{tmp}/bench.db"
        print(f"preparing {db_url}", file=sys.stderr, flush=True)
        prepare_db(db_url, pool_gate=args.pool_gate)
        with contextlib.ExitStack() as stack:
            redis_proc = None if no_redis else stack.enter_context(_start_redis(tmp))
            servers = {
                "ours": start_server(ctx, "ours", db_url, args.reservation_ttl),
                "empty": start_server(ctx, "empty", db_url, None),
            }
            backend_pids: dict[str, tuple[int, ...]] = {}
            if redis_proc is not None:
                servers["redis"] = start_server(ctx, "redis", db_url, None, redis_proc.port)
                backend_pids["redis"] = (redis_proc.pid,)
            loadgen = start_loadgen(ctx)
            try:
                for srv in servers.values():
                    srv.await_ready()
                print(
                    "servers up: " + ", ".join(f"{m} {s.target}" for m, s in servers.items()),
                    file=sys.stderr,
                    flush=True,
                )
                scenarios = run_all(plan, servers, loadgen, backend_pids)
                profiles = profile_ours(plan, servers, loadgen, tmp) if args.profile else []
                final = {mode: srv.call("stats", "full") for mode, srv in servers.items()}
                redis_info = _redis_info(redis_proc) if redis_proc is not None else None
                load_after = os.getloadavg()
            finally:
                loadgen.stop(None)
                for srv in servers.values():
                    srv.stop(("stop",))
    record_stream_targets(scenarios, " ".join(h.command_line(__file__, argv)))
    text = report(
        plan,
        scenarios,
        servers,
        h.command_line(__file__, argv),
        time.monotonic() - started,
        load_before,
        load_after,
        profiles,
        final,
        redis_info,
        args.pool_gate,
    )
    sys.stdout.write(text)
    record_unary(scenarios, h.command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
