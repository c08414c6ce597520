"""Benchmark of server-side waiting (burst shaping): 1,000 Admit calls
waiting in a lane's queue.

    .venv/bin/python bench/bench_shaping.py            # full run, ~3.5 minutes
    .venv/bin/python bench/bench_shaping.py --quick    # smoke run, < 90 s
    .venv/bin/python bench/bench_shaping.py --profile  # + cProfile of the server

Prints a markdown report on stdout (progress goes to stderr). Nothing here
asserts a time; figures go to BENCHMARKS.md.

Processes (all spawned, all on 127.0.0.1):

* the server: ``controlplane.server.ControlPlane`` (grpc.aio on uvloop, the
  production wiring and background tasks) over a temporary SQLite database
  migrated with ``controlplane.store.db.upgrade``, with admission auth and
  the pool gate off and, unless ``--ledger``, the ledger off (Complete
  settles in memory, so the per-admission CPU is admission and queueing,
  not SQLite commits). Its control pipe answers state questions on the
  event-loop thread (how many calls wait, open reservations, queue
  internals) outside measured windows.
* the holder (``_shaping_load.holder_main``): the sidecar of tenant
  ``blocked`` (max_concurrency K, max_queued 2,000, max_wait 120 s, lane
  ``batch`` whose wait target is raised to 180 s). It takes the K slots,
  leaves 1,000 more Admit calls waiting, and settles with Complete.
* the prober (``_shaping_load.prober_main``): bench_grpc's open-loop unary
  generator (``_loadgen``), sending to tenant ``free`` (never refused).

Scenario A, CPU per admitted request when capacity frees: at a fixed tick
rate the holder settles its oldest admission (Complete) and then sends one
new Admit. With 1,000 calls waiting, each Complete frees a slot that a
queued call takes, and the new Admit joins the queue (depth stays ~1,000);
with no waiters, the new Admit is admitted at once. Both modes do one
Complete + one Admit RPC per admission at the same rate, so server CPU per
admission differs by the queueing work. The two run back to back in each
round, alternating which goes first; the ratio is taken per round.

Scenario B, Admit p99 of the non-waiting path while 1,000 calls wait: the
holder keeps K slots of ``blocked`` taken and 1,000 calls waiting for the
whole measurement; the prober sends open-loop Admits for ``free`` at a fixed
rate (latency from the scheduled send time); compared with the same
measurement with no waiters (the 1,000 are cancelled in between), rounds
alternating. Burst-shaping target: p99 no worse than 1.2x the idle p99.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import io
import multiprocessing as mp
import os
import pstats
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import _harness as h
import _loadgen as lg
import _shaping_load as sl
import bench_grpc as bg
from _harness import median as _med

from controlplane.telemetry.gcpause import GcPauses

# Burst-shaping target: Admit p99 with the calls waiting / idle Admit p99.
TARGET_P99_RATIO = 1.2
# The core admission target for unary Admit p99 (bench_grpc.py), for reference.
CORE_P99_MS = 1.0

BLOCKED = "blocked"  # the tenant whose calls wait
FREE = "free"  # the tenant the prober measures (always admitted)
WAIT_LANE = "batch"
WAITERS = 1_000
MAX_WAIT_MS = 120_000
LANE_WAIT_TARGET_MS = 180_000
# gRPC deadline of the holder's calls: beyond the max wait, so the wait ends
# by the tenant's max wait (a call is cancelled long before either).
HOLDER_CALL_TIMEOUT_S = 150.0

SERVER = "server"


# ------------------------------------------------------------ server process


def server_main(conn: Connection, db_url: str, ledger: bool) -> None:
    """Process entry point of the server."""
    h.run_server(_serve(conn, db_url, ledger))


def _server_stats(plane: Any, gc_timer: GcPauses, full: bool) -> dict[str, Any]:
    from fastpath import Reason

    svc = plane.service
    reasons: dict[str, int] = {}
    for (_decision, reason), count in svc.stats.decision_counts.items():
        name = Reason(reason).name
        reasons[name] = reasons.get(name, 0) + count
    stats: dict[str, Any] = {
        "waiting": svc.waiting,
        "depths": svc.views.queue_depths(),
        "open_reservations": svc.views.open_reservations,
        "blocked_inflight": svc.views.tenant_state(BLOCKED)["inflight"],
        "records": svc.views.remembered_requests,
        "cancelled_total": svc.stats.cancelled_total,
        **svc.views.queue_footprint(),
        "loop_tasks": len(asyncio.all_tasks()),
        "timer_armed": plane.waiting.timer_armed,
        "reasons": reasons,
        "gc_total_s": gc_timer.total_s,
        "gc_max_s": gc_timer.longest_s,
        "gc_collections": list(gc_timer.collections),
        "rss_mb": h.rss_mb(),
        "tracked_objects": -1,
        "top_types": [],
    }
    if full:  # O(objects): only when asked, outside any measured window
        objects = gc.get_objects()
        stats["tracked_objects"] = len(objects)
        stats["top_types"] = Counter(type(o).__name__ for o in objects).most_common(6)
        del objects
    gc_timer.longest_s = 0.0  # the max is per interval between two "stats"
    return stats


async def _serve(conn: Connection, db_url: str, ledger: bool) -> None:
    from controlplane.server import ControlPlane
    from controlplane.settings import Settings

    settings = Settings(
        database_url=db_url,
        host="127.0.0.1",
        port=0,
        metrics_port=-1,
        admission_auth=False,
        ledger_enabled=ledger,
    )
    gc_timer = GcPauses().install()
    plane = ControlPlane(settings)
    port = await plane.start()
    conn.send(
        ("ready", port, os.getpid(), plane.service.implementation, settings.reservation_ttl_s)
    )

    async def await_waiting(n: int, timeout_s: float) -> int:
        # Poll on the loop until exactly n calls wait (bounded in time).
        deadline = time.monotonic() + timeout_s
        while plane.service.waiting != n and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        waiting: int = plane.service.waiting
        return waiting

    def gc_collect() -> str:
        gc.collect()
        return "ok"

    await h.serve_commands(
        conn,
        {
            "stats": lambda *how: _server_stats(plane, gc_timer, how == ("full",)),
            "await_waiting": await_waiting,
            "gc_collect": gc_collect,
        },
    )
    await plane.stop(0)


def prepare_db(url: str, concurrency: int) -> None:
    """The two tenants, and the pool gate off (on in the default policy):
    nothing here reports load, so the gate would let only its fallback of
    64 requests in at a time, and ``free``'s calls, never settled, would
    queue behind them (as bench_grpc.prepare_db)."""
    from controlplane.domain import TenantConfig
    from controlplane.domain.policy import Policy
    from controlplane.store.config import ConfigRepository
    from controlplane.store.db import make_engine, upgrade

    with contextlib.redirect_stdout(sys.stderr):
        upgrade(url)
        engine = make_engine(url)
        try:
            repo = ConfigRepository(engine)
            lane = next(ln for ln in repo.lanes() if ln.name == WAIT_LANE)
            # The waiters must outlive a whole scenario: the lane's wait
            # target would otherwise end their wait first.
            repo.upsert_lane(dataclasses.replace(lane, wait_target_ms=LANE_WAIT_TARGET_MS))
            repo.add_tenant(
                TenantConfig(
                    tenant_id=BLOCKED,
                    token_rate=Decimal(1_000_000),
                    burst_tokens=10**12,
                    max_concurrency=concurrency,
                    max_queued=2 * WAITERS,
                    max_wait_ms=MAX_WAIT_MS,
                    default_lane=WAIT_LANE,
                )
            )
            repo.add_tenant(
                TenantConfig(tenant_id=FREE, token_rate=Decimal(1_000_000), burst_tokens=10**12)
            )
            # the load generator's pool declared (docs/operating.md)
            repo.update_policy(Policy(), {"pool_gate": False, "known_pools": [lg.POOL]}, [])
        finally:
            engine.dispose()


# ----------------------------------------------------------- load processes


def start_worker(ctx: Any, name: str, target: Callable[..., None], *args: Any) -> h.Child:
    return h.Child(name, *h.spawn(ctx, name, target, *args))


# -------------------------------------------------------------- orchestration


@dataclass(frozen=True)
class Plan:
    rounds: int
    concurrency: int
    cycle_rate: float
    cycle_seconds: float
    cycle_warmup_s: float
    probe_rates: tuple[int, ...]
    probe_seconds: float
    probe_warmup_s: float
    quiesce_s: float
    gc_collect: bool = False


@dataclass
class Env:
    server: bg.ServerHandle
    holder: h.Child
    prober: h.Child
    checks: list[str] = field(default_factory=list)  # anomalies seen (should stay empty)
    notes: list[str] = field(default_factory=list)  # load effects worth knowing
    prefix_seq: int = 0

    def prefix(self, tag: str) -> str:
        self.prefix_seq += 1
        return f"{tag}{self.prefix_seq}-"

    def stats(self) -> dict[str, Any]:
        st: dict[str, Any] = self.server.call("stats")
        return st

    def await_waiting(self, n: int, timeout_s: float) -> int:
        got: int = self.server.call("await_waiting", n, timeout_s, timeout=timeout_s + 10)
        return got

    def settle_gc(self, plan: Plan) -> None:
        """With --gc-collect: a full collection in the server before the
        measurement, so garbage the setup made is not collected inside it."""
        if plan.gc_collect:
            self.server.call("gc_collect")

    def quiesce(self, plan: Plan) -> bool:
        return h.quiesce([self.server.pid, self.holder.pid, self.prober.pid], plan.quiesce_s)

    def fill(self, admitted: int, waiting: int, tag: str) -> sl.FillResult:
        fr: sl.FillResult = self.holder.run(
            sl.Fill(
                target=self.server.target,
                tenant=BLOCKED,
                lane=WAIT_LANE,
                admitted=admitted,
                waiting=waiting,
                prefix=self.prefix(tag),
                call_timeout_s=HOLDER_CALL_TIMEOUT_S,
            ),
            90,
        )
        if fr.refused:
            self.checks.append(f"{tag}: fill refused calls that had free slots: {fr.refused}")
        if waiting:
            got = self.await_waiting(waiting, 30)
            if got != waiting:
                raise RuntimeError(f"{tag}: {got} calls waiting on the server, expected {waiting}")
        return fr

    def cancel_waiting(self, tag: str) -> sl.CancelResult:
        cr: sl.CancelResult = self.holder.run(sl.CancelWaiting(), 60)
        left = self.await_waiting(0, 10)
        if left:
            self.checks.append(f"{tag}: {left} calls still waiting 10 s after cancelling them all")
        return cr

    def settle_all(self, tag: str) -> sl.SettleResult:
        sr: sl.SettleResult = self.holder.run(sl.SettleAll(self.server.target, BLOCKED), 90)
        if sr.errors:
            self.checks.append(f"{tag}: {sr.errors} Complete errors: {sr.error_samples}")
        return sr


@dataclass(frozen=True)
class GcDelta:
    """The server's garbage collections between two "stats" answers."""

    total_s: float  # pauses, summed
    max_s: float  # longest single pause
    full: int  # generation-2 (full) collections

    @classmethod
    def between(cls, s0: dict[str, Any], s1: dict[str, Any]) -> GcDelta:
        return cls(
            s1["gc_total_s"] - s0["gc_total_s"],
            s1["gc_max_s"],
            s1["gc_collections"][2] - s0["gc_collections"][2],
        )


@dataclass
class CycleSample:
    mode: str  # "waiting" | "none"
    rnd: int
    result: sl.CycleResult
    depth_start: int
    depth_end: int
    gc: GcDelta
    quiet: bool


@dataclass
class ProbeSample:
    mode: str  # "waiting" | "idle"
    rate: int
    rnd: int
    result: lg.UnaryResult
    depth_start: int
    depth_end: int
    gc: GcDelta
    quiet: bool


def cycle_round(env: Env, plan: Plan, mode: str, rnd: int) -> CycleSample:
    tag = f"A round {rnd} {mode}"
    base = env.stats()
    env.fill(plan.concurrency, WAITERS if mode == "waiting" else 0, f"a{mode[0]}")
    env.settle_gc(plan)
    quiet = env.quiesce(plan)
    s0 = env.stats()
    res: sl.CycleResult = env.holder.run(
        sl.Cycle(
            target=env.server.target,
            server_pid=env.server.pid,
            tenant=BLOCKED,
            lane=WAIT_LANE,
            rate=plan.cycle_rate,
            seconds=plan.cycle_seconds,
            warmup_s=plan.cycle_warmup_s,
            prefix=env.prefix(f"c{mode[0]}"),
            call_timeout_s=HOLDER_CALL_TIMEOUT_S,
        ),
        plan.cycle_seconds + plan.cycle_warmup_s + 120,
    )
    s1 = env.stats()
    if mode == "waiting":
        env.cancel_waiting(tag)
    env.settle_all(tag)
    s2 = env.stats()
    if not res.drained:
        env.checks.append(
            f"{tag}: not drained: {res.admissions} admissions for {res.completes} Completes"
        )
    if res.starved:
        env.notes.append(
            f"{tag}: {res.starved} of {res.ticks} ticks found no admitted request to settle "
            "(the settle loop fell behind its rate)"
        )
    if res.errors:
        env.checks.append(f"{tag}: {res.errors} call errors: {res.error_samples}")
    if res.refusals:
        env.checks.append(f"{tag}: refusals during the cycle: {res.refusals}")
    if (
        s2["waiting"]
        or s2["blocked_inflight"]
        or s2["open_reservations"] != base["open_reservations"]
    ):
        env.checks.append(
            f"{tag}: after teardown waiting {s2['waiting']}, blocked in flight "
            f"{s2['blocked_inflight']}, open reservations {s2['open_reservations']} "
            f"(before the round: {base['open_reservations']})"
        )
    return CycleSample(mode, rnd, res, s0["waiting"], s1["waiting"], GcDelta.between(s0, s1), quiet)


def probe_round(env: Env, plan: Plan, mode: str, rate: int, rnd: int) -> ProbeSample:
    tag = f"B {rate}/s round {rnd} {mode}"
    if mode == "waiting":
        env.fill(0, WAITERS, f"b{rate}")
    env.settle_gc(plan)
    quiet = env.quiesce(plan)
    s0 = env.stats()
    res: lg.UnaryResult = env.prober.run(
        lg.UnaryParams(
            target=env.server.target,
            server_pid=env.server.pid,
            rate=float(rate),
            seconds=plan.probe_seconds,
            warmup_s=plan.probe_warmup_s,
            id_prefix=env.prefix(f"u{rate}{mode[0]}"),
            tenants=(FREE,),
        ),
        plan.probe_seconds + plan.probe_warmup_s + 60,
    )
    s1 = env.stats()
    if mode == "waiting":
        if s1["waiting"] != WAITERS:
            env.checks.append(f"{tag}: {s1['waiting']} waiting after the probe, not {WAITERS}")
        env.cancel_waiting(tag)
    if res.errors:
        env.checks.append(f"{tag}: {res.errors} prober errors: {res.error_samples}")
    if res.admitted_fraction < 1:
        env.checks.append(f"{tag}: only {res.admitted_fraction:.1%} of {FREE}'s calls admitted")
    gc_delta = GcDelta.between(s0, s1)
    return ProbeSample(mode, rate, rnd, res, s0["waiting"], s1["waiting"], gc_delta, quiet)


def _progress(line: str) -> None:
    print(f"  {line}", file=sys.stderr, flush=True)


def run_cycles(env: Env, plan: Plan) -> list[CycleSample]:
    out: list[CycleSample] = []
    for rnd in range(plan.rounds):
        order = ("waiting", "none") if rnd % 2 == 0 else ("none", "waiting")
        for mode in order:
            s = cycle_round(env, plan, mode, rnd)
            out.append(s)
            r = s.result
            _progress(
                f"A round {rnd} {mode:7s}: {r.admissions} admissions, server "
                f"{r.server_cpu_s / max(1, r.admissions) * 1e6:.0f} us/admission, "
                f"handoff p50 {r.handoff_p50_ms:.2f} ms, depth {s.depth_start}->{s.depth_end}, "
                f"other load {r.other_cores:.2f} cores"
            )
    return out


def run_probes(env: Env, plan: Plan) -> list[ProbeSample]:
    out: list[ProbeSample] = []
    # K slots of the blocked tenant stay taken for the whole scenario, so
    # every waiting call stays queued.
    env.fill(plan.concurrency, 0, "bk")
    try:
        for rate in plan.probe_rates:
            for rnd in range(plan.rounds):
                order = ("waiting", "idle") if rnd % 2 == 0 else ("idle", "waiting")
                for mode in order:
                    s = probe_round(env, plan, mode, rate, rnd)
                    out.append(s)
                    r = s.result
                    _progress(
                        f"B {rate}/s round {rnd} {mode:7s}: p50 {r.p50_ms:.3f} ms p99 "
                        f"{r.p99_ms:.3f} ms, server {r.server_cpu_s / r.calls * 1e6:.0f} us/call, "
                        f"waiting {s.depth_start}->{s.depth_end}, other load "
                        f"{r.other_cores:.2f} cores"
                    )
    finally:
        env.settle_all("B teardown")
    return out


# ------------------------------------------------------------------ profile

# Functions whose cost per admission the profile section compares.
_FOCUS = (
    ("waiting.py", "admit"),
    ("waiting.py", "reschedule"),
    ("waiting.py", "_fire"),
    ("admission.py", "admit_or_wait"),
    ("admission.py", "_enqueue"),
    ("admission.py", "_dispatch"),
    ("admission.py", "_decide"),
    ("admission.py", "_block"),
    ("admission.py", "_resolve"),
    ("admission.py", "next_wakeup_ns"),
    ("completion.py", "apply"),
    ("admission.py", "cancel"),
    ("queueing.py", "add"),
    ("queueing.py", "remove"),
    ("queueing.py", "pick"),
    ("queueing.py", "next_deadline"),
    ("admission.py", "Admit"),
    ("admission.py", "Complete"),
)


def _profiled(env: Env, path: Path, run: Callable[[], Any]) -> tuple[Any, pstats.Stats]:
    env.server.call("profile_on")
    try:
        result = run()
    finally:
        env.server.call("profile_off", str(path))
    return result, pstats.Stats(str(path))


def _top(st: pstats.Stats, n: int = 16) -> str:
    buf = io.StringIO()
    st.stream = buf  # type: ignore[attr-defined]
    st.sort_stats("tottime").print_stats(n)
    lines = [ln.rstrip() for ln in h.clean_paths(buf.getvalue()).splitlines() if ln.strip()]
    # drop the header lines (file name, date, "Ordered by", "List reduced")
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    return "\n".join(lines[start:])


def _focus_table(a: tuple[pstats.Stats, int], b: tuple[pstats.Stats, int], unit: str) -> str:
    """Calls and cumulative time of the burstgate functions per ``unit``,
    for profile a (with waiters) and b (without)."""
    head = (
        f"{'function':30s} {'calls/' + unit + ' w':>13s} {'cum us w':>9s} "
        f"{'calls/' + unit + ' n':>13s} {'cum us n':>9s}"
    )
    rows = [head, "-" * len(head)]
    for fname, func in _FOCUS:
        cells: list[str] = []
        for st, n in (a, b):
            raw: dict[Any, Any] = st.stats  # type: ignore[attr-defined]
            calls = cum = 0.0
            for (path, _line, name), (_cc, nc, _tt, ct, _callers) in raw.items():
                if name == func and path.endswith(fname):
                    calls += nc
                    cum += ct
            cells.append(f"{calls / n:13.2f} {cum / n * 1e6:9.1f}")
        rows.append(f"{fname[:-3] + '.' + func:30s} " + " ".join(cells))
    return "\n".join(rows)


def profile_all(env: Env, plan: Plan, tmp: Path) -> list[tuple[str, str]]:
    """cProfile the server's loop thread over one A cycle and one B probe
    (highest rate) per condition; return (title, text) sections."""
    out: list[tuple[str, str]] = []
    cyc: dict[str, tuple[pstats.Stats, int]] = {}
    heads: dict[str, str] = {}
    for mode in ("waiting", "none"):
        env.fill(plan.concurrency, WAITERS if mode == "waiting" else 0, f"p{mode[0]}")
        env.quiesce(plan)
        params = sl.Cycle(
            target=env.server.target,
            server_pid=env.server.pid,
            tenant=BLOCKED,
            lane=WAIT_LANE,
            rate=plan.cycle_rate,
            seconds=min(3.0, plan.cycle_seconds),
            warmup_s=0.0,
            prefix=env.prefix(f"pc{mode[0]}"),
            call_timeout_s=HOLDER_CALL_TIMEOUT_S,
        )
        res, st = _profiled(env, tmp / f"cycle-{mode}.pstats", partial(env.holder.run, params, 180))
        if mode == "waiting":
            env.cancel_waiting("profile A")
        env.settle_all("profile A")
        n = max(1, res.admissions)
        cyc[mode] = (st, n)
        heads[mode] = (
            f"{n} admissions, {res.server_cpu_s / n * 1e6:.0f} us server CPU per admission "
            "under the profiler"
        )
    out.append(
        (
            "A, burstgate functions per admission: with 1,000 waiting (w) vs none (n); "
            "cumulative us include callees and the profiler's overhead",
            _focus_table(cyc["waiting"], cyc["none"], "adm"),
        )
    )
    out.append(
        (f"A with 1,000 waiting, top by own time ({heads['waiting']})", _top(cyc["waiting"][0]))
    )
    out.append((f"A without waiters, top by own time ({heads['none']})", _top(cyc["none"][0])))

    rate = max(plan.probe_rates)
    prb: dict[str, tuple[pstats.Stats, int]] = {}
    env.fill(plan.concurrency, 0, "pbk")
    try:
        for mode in ("waiting", "idle"):
            if mode == "waiting":
                env.fill(0, WAITERS, "pb")
            env.quiesce(plan)
            up = lg.UnaryParams(
                target=env.server.target,
                server_pid=env.server.pid,
                rate=float(rate),
                seconds=min(3.0, plan.probe_seconds),
                warmup_s=0.2,
                id_prefix=env.prefix(f"pu{mode[0]}"),
                tenants=(FREE,),
            )
            ures, st = _profiled(
                env, tmp / f"probe-{mode}.pstats", partial(env.prober.run, up, 120)
            )
            if mode == "waiting":
                env.cancel_waiting("profile B")
            # the profile spans the warm-up calls too
            prb[mode] = (st, max(1, int(rate * (up.seconds + up.warmup_s))))
            heads[mode] = f"p99 {ures.p99_ms:.3f} ms under the profiler"
    finally:
        env.settle_all("profile B")
    out.append(
        (
            f"B at {rate:,}/s, burstgate functions per `{FREE}` Admit: with 1,000 waiting (w) "
            "vs idle (n)",
            _focus_table(prb["waiting"], prb["idle"], "call"),
        )
    )
    out.append(
        (
            f"B at {rate:,}/s with 1,000 waiting, top by own time ({heads['waiting']})",
            _top(prb["waiting"][0]),
        )
    )
    out.append((f"B at {rate:,}/s idle, top by own time ({heads['idle']})", _top(prb["idle"][0])))
    return out


# ------------------------------------------------------------------- report


def _fmt_ratio(x: float) -> str:
    return "n/a" if x != x else f"{x:.2f}x"


def _paired(samples: Sequence[Any], num: str, den: str, fn: Callable[[Any], float]) -> list[float]:
    """Per-round ratios fn(num sample) / fn(den sample) of back-to-back runs."""
    by_round: dict[int, dict[str, Any]] = {}
    for s in samples:
        by_round.setdefault(s.rnd, {})[s.mode] = s
    out: list[float] = []
    for rnd in sorted(by_round):
        pair = by_round[rnd]
        if num in pair and den in pair and fn(pair[den]):
            out.append(fn(pair[num]) / fn(pair[den]))
    return out


def _gc_per_adm(s: CycleSample) -> float:
    r = s.result
    return s.gc.total_s / r.admissions * 1e6 if r.admissions else float("nan")


def _cpu_per_adm(s: CycleSample) -> float:
    r = s.result
    return r.server_cpu_s / r.admissions * 1e6 if r.admissions else float("nan")


def report(
    plan: Plan,
    cycles: list[CycleSample],
    probes: list[ProbeSample],
    env: Env,
    argv: Sequence[str],
    elapsed_s: float,
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
    ledger: bool,
    profiles: list[tuple[str, str]],
    initial: dict[str, Any],
    final: dict[str, Any],
) -> str:
    srv = env.server
    lines = ["# burstgate burst-shaping benchmark: 1,000 waiting Admit calls", ""]
    lines.append(f"Command: `{' '.join(argv)}` (run took {elapsed_s:.0f} s)")
    lines.append("")
    lines += h.machine()
    lines.append(
        f"- server: `ControlPlane` on grpc.aio + uvloop, loopback 127.0.0.1, fastpath "
        f"`{srv.implementation}`, SQLite config store, admission auth off, ledger "
        f"{'on (Complete commits to SQLite)' if ledger else 'off (Complete settles in memory)'}, "
        f"reservation_ttl_s {srv.ttl_s:g}"
    )
    if plan.gc_collect:
        lines.append(
            "- `--gc-collect`: the server ran gc.collect() before every measurement (both "
            "conditions), so collections the setup triggered stay out of the windows"
        )
    lines.append(
        f"- tenant `{BLOCKED}`: max_concurrency {plan.concurrency}, max_queued {2 * WAITERS:,}, "
        f"max_wait_ms {MAX_WAIT_MS:,}, lane `{WAIT_LANE}` (wait target raised to "
        f"{LANE_WAIT_TARGET_MS:,} ms); tenant `{FREE}`: no limits that bind, lane `standard`"
    )
    lines.append(
        f"- load average (1 min) before / after: {load_before[0]:.2f} / {load_after[0]:.2f} "
        f"(5 min: {load_before[1]:.2f} / {load_after[1]:.2f}); a shared 2-core machine where "
        "other test runs compete: read the ratios of back-to-back runs, not absolute figures"
    )
    n_busy = sum(not c.quiet for c in cycles) + sum(not p.quiet for p in probes)
    n_all = len(cycles) + len(probes)
    lines.append(
        f"- {plan.rounds} rounds per scenario, the two conditions back to back in alternating "
        "order; tables show medians across rounds; 'paired ratio' = median of the per-round "
        f"ratios. {n_busy} of {n_all} measurements started without the machine going idle "
        f"(< 0.5 core busy) within {plan.quiesce_s:g} s; see 'other load'"
    )
    lines.append("")

    # ---------------------------------------------------------------- A
    lines.append(
        f"## A. Server CPU per admitted request when capacity frees "
        f"({WAITERS:,} calls waiting vs none)"
    )
    lines.append("")
    lines.append(
        f"Open loop at {plan.cycle_rate:,.0f} ticks/s for ~{plan.cycle_seconds:g} s per round; "
        "each tick = Complete of the oldest admitted request, then one new Admit. "
        f"'waiting': {WAITERS:,} calls queued on `{BLOCKED}` (its {plan.concurrency} slots "
        "taken): each Complete lets one queued call in and the new Admit joins the queue. "
        "'none': no queue; the new Admit is admitted at once. Server CPU (all threads, "
        "schedstat) over the window / admissions seen by the client; it covers one Admit and "
        "one Complete RPC per admission."
    )
    lines.append("")
    lines.append(
        "| condition | admissions/round | server CPU us/admission | client CPU us/admission "
        "| server GC pauses us/admission | GC max pause ms / full GCs per round "
        "| handoff p50 / p99 ms | server queue_wait p50 ms | queue depth start -> end "
        "| other load cores / steal |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    a_med: dict[str, float] = {}
    for mode, label in (("waiting", f"{WAITERS:,} waiting"), ("none", "no waiters")):
        ss = [s for s in cycles if s.mode == mode]
        rs = [s.result for s in ss]
        if not ss:
            continue
        cpu = _med([_cpu_per_adm(s) for s in ss])
        a_med[mode] = cpu
        lines.append(
            f"| {label} | {_med([r.admissions for r in rs]):,.0f} | {cpu:,.1f} "
            f"| {_med([r.client_cpu_s / r.admissions * 1e6 for r in rs if r.admissions]):,.0f} "
            f"| {_med([_gc_per_adm(s) for s in ss]):,.1f} "
            f"| {_med([s.gc.max_s * 1e3 for s in ss]):.1f} / {_med([s.gc.full for s in ss]):g} "
            f"| {_med([r.handoff_p50_ms for r in rs]):.2f} / "
            f"{_med([r.handoff_p99_ms for r in rs]):.2f} "
            f"| {_med([r.queue_wait_p50_ms for r in rs]):,.1f} "
            f"| {_med([s.depth_start for s in ss]):,.0f} -> {_med([s.depth_end for s in ss]):,.0f} "
            f"| {_med([r.other_cores for r in rs]):.2f} / "
            f"{_med([r.steal_fraction * 100 for r in rs]):.0f}% |"
        )
    paired = _paired(cycles, "waiting", "none", _cpu_per_adm)
    diffs = [
        _cpu_per_adm(w) - _cpu_per_adm(n)
        for w in cycles
        for n in cycles
        if w.mode == "waiting" and n.mode == "none" and w.rnd == n.rnd
    ]
    diffs_ex_gc = [
        (_cpu_per_adm(w) - _gc_per_adm(w)) - (_cpu_per_adm(n) - _gc_per_adm(n))
        for w in cycles
        for n in cycles
        if w.mode == "waiting" and n.mode == "none" and w.rnd == n.rnd
    ]
    if "waiting" in a_med and "none" in a_med:
        lines.append(
            f"| **waiting / none** | | **{_fmt_ratio(_med(paired))}** paired "
            f"({_fmt_ratio(a_med['waiting'] / a_med['none'])} of medians) | | | | | | | |"
        )
        lines.append(
            f"| **queueing cost** | | **{_med(diffs):+,.1f} us** per admission (paired; "
            f"range {min(diffs):+,.0f} to {max(diffs):+,.0f}) | | "
            f"{_med(diffs_ex_gc):+,.1f} us of it outside GC pauses | | | | | |"
        )
    lines.append("")
    lines.append(
        "'handoff': Complete sent -> the next admission's answer at the client (waiting: the "
        "queued call that took the freed slot; none: includes the new Admit's own round trip, "
        "which follows the Complete's answer). 'GC pauses': time in the server's garbage "
        "collections during the window (gc.callbacks), per admission. Per round (server CPU "
        "us/admission; GC pauses us/admission; other load in cores):"
    )
    lines.append("")
    for rnd in sorted({s.rnd for s in cycles}):
        parts = [
            f"{s.mode} {_cpu_per_adm(s):,.1f}; {_gc_per_adm(s):,.1f}; {s.result.other_cores:.2f}"
            for s in cycles
            if s.rnd == rnd
        ]
        pair = [s for s in cycles if s.rnd == rnd]
        ratio = _paired(pair, "waiting", "none", _cpu_per_adm)
        lines.append(
            f"- round {rnd}: " + ", ".join(parts) + (f" -> ratio {ratio[0]:.2f}x" if ratio else "")
        )
    lines.append("")

    # ---------------------------------------------------------------- B
    lines.append(f"## B. Admit latency of the non-waiting path while {WAITERS:,} calls wait")
    lines.append("")
    lines.append(
        f"Open-loop unary Admit for tenant `{FREE}` (always admitted, never settled), latency "
        f"from the scheduled send time, ~{plan.probe_seconds:g} s per round after "
        f"{plan.probe_warmup_s:g} s warm-up; call deadline 2 s. 'waiting': {WAITERS:,} calls "
        f"of `{BLOCKED}` queued in lane `{WAIT_LANE}` for the whole round; 'idle': none."
    )
    lines.append("")
    lines.append(
        "| offered/s | condition | completed/s | p50 ms | p99 ms | max ms | server CPU us/call "
        "| client send lag p99 ms | errors | admitted | waiting start -> end "
        "| server GC pauses ms / max ms / full GCs "
        "| other load cores / steal |"
    )
    lines.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    verdicts: list[str] = []
    for rate in plan.probe_rates:
        bm: dict[str, dict[str, float]] = {}
        for mode in ("waiting", "idle"):
            pss = [s for s in probes if s.rate == rate and s.mode == mode]
            if not pss:
                continue
            pus = [s.result for s in pss]
            m = h.unary_medians(pus) | {
                "gct": _med([s.gc.total_s * 1e3 for s in pss]),
                "gc": _med([s.gc.max_s * 1e3 for s in pss]),
                "gcf": _med([s.gc.full for s in pss]),
            }
            bm[mode] = m
            label = f"{WAITERS:,} waiting" if mode == "waiting" else "idle"
            lines.append(
                f"| {rate:,} | {label} | {m['done']:,.0f} | {m['p50']:.3f} | {m['p99']:.3f} "
                f"| {m['max']:.2f} | {m['cpu']:.0f} | {m['lag']:.3f} | {m['err']:.0f} "
                f"| {m['adm']:.0f}% | {_med([s.depth_start for s in pss]):,.0f} -> "
                f"{_med([s.depth_end for s in pss]):,.0f} | {m['gct']:.1f} / {m['gc']:.1f} / "
                f"{m['gcf']:g} "
                f"| {m['oth']:.2f} / {m['stl']:.0f}% |"
            )
        if len(bm) < 2:
            continue
        prs = [s for s in probes if s.rate == rate]
        p99_ratios = _paired(prs, "waiting", "idle", lambda s: s.result.p99_ms)
        p99_pair = _med(p99_ratios)
        p50_pair = _med(_paired(prs, "waiting", "idle", lambda s: s.result.p50_ms))
        cpu_pair = _med(
            _paired(prs, "waiting", "idle", lambda s: s.result.server_cpu_s / s.result.calls)
        )
        w, i = bm["waiting"], bm["idle"]
        lines.append(
            f"| {rate:,} | **waiting / idle** (paired) | | {_fmt_ratio(p50_pair)} "
            f"| **{_fmt_ratio(p99_pair)}** | | {_fmt_ratio(cpu_pair)} | | | | | | |"
        )
        of_medians = w["p99"] / i["p99"] if i["p99"] else float("nan")
        other = max(w["oth"], i["oth"])
        verdicts.append(
            f"- {rate:,}/s: p99 with {WAITERS:,} waiting = **{_fmt_ratio(p99_pair)}** the idle "
            f"p99 (median of per-round ratios, range {_fmt_ratio(min(p99_ratios))}-"
            f"{_fmt_ratio(max(p99_ratios))}; {_fmt_ratio(of_medians)} of the medians "
            f"{w['p99']:.3f} / {i['p99']:.3f} ms); target <= {TARGET_P99_RATIO}x: "
            f"{'met' if p99_pair <= TARGET_P99_RATIO else '**not met**'}"
            + (
                f" -- measured with {other:.2f} cores of other load: p99 here is mostly "
                "other processes' scheduling delay; server CPU per call "
                f"{_fmt_ratio(cpu_pair)}, p50 {_fmt_ratio(p50_pair)}"
                if other > 0.5
                else ""
            )
        )
    lines.append("")
    lines.append(
        "Per round (p99 ms; server CPU us/call; longest server GC pause ms; other load in cores):"
    )
    lines.append("")
    for rate in plan.probe_rates:
        for mode in ("waiting", "idle"):
            pss = [s for s in probes if s.rate == rate and s.mode == mode]
            lines.append(
                f"- {rate:,}/s {mode}: "
                + ", ".join(
                    f"{s.result.p99_ms:.3f}; {s.result.server_cpu_s / s.result.calls * 1e6:.0f}; "
                    f"{s.gc.max_s * 1e3:.1f}; {s.result.other_cores:.2f}"
                    for s in pss
                )
            )
    lines.append("")

    # ---------------------------------------------------------- targets
    lines.append("## Targets (burst shaping)")
    lines.append("")
    lines += verdicts
    idle_1000 = [s.result.p99_ms for s in probes if s.rate == 1000 and s.mode == "idle"]
    if idle_1000:
        lines.append(
            f"- for reference, idle p99 at 1,000/s here: {_med(idle_1000):.3f} ms (the core "
            f"admission target: < {CORE_P99_MS:g} ms; this run's machine load applies)"
        )
    if "waiting" in a_med and "none" in a_med:
        lines.append(
            f"- CPU per admission when capacity frees with {WAITERS:,} waiting: "
            f"{a_med['waiting']:,.1f} us vs {a_med['none']:,.1f} us without waiters "
            f"({_fmt_ratio(_med(paired))} paired, {_med(diffs):+,.1f} us); burst shaping "
            "sets no target for it"
        )
    lines.append("")

    # ----------------------------------------------------------- checks
    lines.append("## Server state checks")
    lines.append("")
    if env.notes:
        lines.append("Load effects (not service faults):")
        lines.append("")
        lines += [f"- {n}" for n in env.notes]
        lines.append("")
    if env.checks:
        lines.append("Anomalies seen during the run:")
        lines.append("")
        lines += [f"- {c}" for c in env.checks]
    else:
        lines.append(
            "No anomaly: every fill queued exactly 1,000 calls, every cycle drained (one "
            "admission per Complete, no refusal), the waiters stayed queued "
            "through every B round, cancelling them emptied the queue, and settling left no "
            f"reservation of `{BLOCKED}` open."
        )
    lines.append("")
    lines.append(
        "| server | waiting | open reservations | calls cancelled (total) "
        "| deadline-heap entries | waiters by key | loop tasks | RSS MB | GC-tracked objects "
        "| decisions by reason |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for label, st in (("at start", initial), ("after the run", final)):
        reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(st["reasons"].items())) or "-"
        lines.append(
            f"| {label} | {st['waiting']} | {st['open_reservations']:,} "
            f"| {st['cancelled_total']:,} | {st['deadline_heap']:,} "
            f"| {st['waiters_by_key']:,} | {st['loop_tasks']} | {st['rss_mb']:,.0f} "
            f"| {st['tracked_objects']:,} | {reasons} |"
        )
    lines.append("")
    lines.append(
        f"Open reservations at the end are `{FREE}`'s (the prober never settles). "
        "'deadline-heap entries': the service's heap of waiter deadlines (an entry of a "
        "waiter already gone is dropped when it reaches the top)."
    )
    lines.append("")
    for label, st in (("at start", initial), ("after the run", final)):
        top = ", ".join(f"{name} {n:,}" for name, n in st["top_types"])
        lines.append(f"- most common GC-tracked types {label}: {top}")
    for label, text in profiles:
        lines.append("")
        lines.append(f"## Server profile (cProfile, loop thread), {label}")
        lines.append("")
        lines.append("```")
        lines.append(text)
        lines.append("```")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short rounds (< 90 s in all)")
    ap.add_argument("--rounds", type=int, help="rounds per scenario (default 5; quick: 3)")
    ap.add_argument(
        "--concurrency",
        type=int,
        default=32,
        help="max_concurrency of the waiting tenant (K; the slots buffer the settle loop)",
    )
    ap.add_argument(
        "--cycle-rate", type=float, default=500.0, help="scenario A ticks (admissions) per second"
    )
    ap.add_argument(
        "--rates", default="500,1000", help="scenario B offered Admit rates, comma separated"
    )
    ap.add_argument("--ledger", action="store_true", help="keep the SQLite ledger on")
    ap.add_argument(
        "--gc-collect",
        action="store_true",
        help="gc.collect() in the server before each measurement (both conditions), so a\n"
        "full collection the setup triggers does not land in the measured window",
    )
    ap.add_argument(
        "--profile", action="store_true", help="also cProfile the server over scenario A"
    )
    args = ap.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 5)
    rates = tuple(int(x) for x in args.rates.split(",") if x.strip())
    if args.quick and args.rates == "500,1000":
        rates = (1000,)
    if rounds < 1 or not 1 <= args.concurrency <= 1000 or not 1 <= args.cycle_rate <= 20_000:
        ap.error("need rounds >= 1, 1 <= concurrency <= 1000, 1 <= cycle rate <= 20000")
    if not rates or min(rates) < 1 or max(rates) > 20_000:
        ap.error("rates must be in 1..20000")
    plan = Plan(
        rounds=rounds,
        concurrency=args.concurrency,
        cycle_rate=args.cycle_rate,
        cycle_seconds=1.5 if args.quick else 4.0,
        cycle_warmup_s=0.2 if args.quick else 0.3,
        probe_rates=rates,
        probe_seconds=2.0 if args.quick else 5.0,
        probe_warmup_s=0.3 if args.quick else 0.5,
        quiesce_s=0.5 if args.quick else 1.0,
        gc_collect=args.gc_collect,
    )

    started = time.monotonic()
    load_before = os.getloadavg()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="burstgate-bench-shaping-") as tmpdir:
        tmp = Path(tmpdir)
        db_url = f"sqlite:///{tmp}/bench.db"
        print(f"preparing {db_url}", file=sys.stderr, flush=True)
        prepare_db(db_url, plan.concurrency)
        sproc, sconn = h.spawn(ctx, "bench-server", server_main, db_url, args.ledger)
        server = bg.ServerHandle(SERVER, sproc, sconn)
        holder = start_worker(ctx, "bench-holder", sl.holder_main)
        prober = start_worker(ctx, "bench-prober", sl.prober_main, (FREE,))
        try:
            server.await_ready()
            env = Env(server, holder, prober)
            initial = server.call("stats", "full")
            print(f"server up: {server.target}", file=sys.stderr, flush=True)
            cycles = run_cycles(env, plan)
            probes = run_probes(env, plan)
            profiles = profile_all(env, plan, tmp) if args.profile else []
            final = server.call("stats", "full")
            load_after = os.getloadavg()
        finally:
            for w in (holder, prober):
                w.stop(None)
            server.stop(("stop",))
    text = report(
        plan,
        cycles,
        probes,
        env,
        h.command_line(__file__, argv),
        time.monotonic() - started,
        load_before,
        load_after,
        args.ledger,
        profiles,
        initial,
        final,
    )
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
