"""Issue 16's acceptance run, full size (docs/ha.md, "Acceptance"):

    .venv/bin/python bench/ha_acceptance.py            # ~10 minutes
    .venv/bin/python bench/ha_acceptance.py --quick    # TTL 1 s, a few faults, ~2 minutes
    BURSTGATE_SHUTDOWN_GRACE_S=1 .venv/bin/python bench/ha_acceptance.py --ttl 1 --margin 0.25 \
        --rate 300 --single 1 --steady 1 --warmup 1 --config-changes 1 --kills 1 --stops 1 \
        --cuts 1 --terms 1                             # tiny (CI's smoke run), ~40 s

Three ``burstgate serve`` processes on one fresh PostgreSQL database (each
behind a TCP proxy of its own), TTL 5 s, margin 1 s, the SDK load of
tests/integration/ha/loadgen.py at ~1,500 Admits/s over 13 cells:

1. **single**: r0 alone at a third of the rate (the same load per replica
   as later): its Admit latency.
2. **steady** (r1 and r2 joined): 60 s without faults: owner-local Admit
   latency at the same load per replica, and the tenant spread over four
   cells at twice its rate.
3. **config**: tenant rate changes through the admin API, each on the next
   replica, until every replica's GetLimits answers it.
4. **kills**: kill -9 of a replica (in turn; some of them of the gate
   tenant's owner, one of the quota tenant's owner once its quota is
   nearly spent), wait until its cells are owned elsewhere, restart it.
5. **stops**: SIGSTOP past the TTL, SIGCONT. **cuts**: the replica's
   database link cut past the TTL, restored. **terms**: SIGTERM (graceful
   handoff), restart.

Then the load stops, the ledger spools drain, every replica stops, and the
figures are computed from the servers' ownership traces, the load's
records and the ledger (tests/integration/ha/checks.py). Prints the table
of every figure against its target and writes it, with every sample, to
``<out>/acceptance.json`` (default bench/results/ha-acceptance-<UTC time>/).
Nothing here asserts; the exit code is 1 when a zero-figure is not zero.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.integration.ha import checks  # noqa: E402
from tests.integration.ha.loadgen import Spec  # noqa: E402
from tests.integration.ha.procs import Cluster  # noqa: E402
from tests.integration.ha.scenarios import (  # noqa: E402
    GATE_POOL,
    QUOTA_POOL,
    Faults,
    LoadProc,
    Mix,
    add_tenants,
    admin_key,
    analyze,
    config_changes,
    hourly_remaining,
    latencies_ms,
    owner_of,
    wait_until,
)

QUOTA_BIG = 10**12  # until the kill phase sets the real one


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--ttl", type=float, default=5.0)
    ap.add_argument("--margin", type=float, default=1.0)
    ap.add_argument("--rate", type=float, default=1500.0, help="Admits/s in total")
    ap.add_argument("--single", type=float, default=40.0, help="s of the one-replica phase")
    ap.add_argument("--steady", type=float, default=60.0, help="s of the steady phase")
    ap.add_argument("--warmup", type=float, default=5.0, help="s of load before each phase")
    ap.add_argument("--config-changes", type=int, default=20)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--stops", type=int, default=5)
    ap.add_argument("--cuts", type=int, default=5)
    ap.add_argument("--terms", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="TTL 1 s, 3 kills, 1 of each other")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.ttl, args.margin, args.rate, args.single, args.steady = 1.0, 0.25, 600.0, 15.0, 20.0
        args.config_changes, args.kills, args.stops, args.cuts, args.terms = 5, 3, 1, 1, 1
    return args


def cpu_s(pid: int | None) -> float:
    """utime + stime of a process, seconds (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, TypeError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


class CpuWindow:
    """Cores used by each named process, and by the whole machine, over a window."""

    def __init__(self, pids: dict[str, int | None]) -> None:
        self.pids = pids
        self.t0, self.busy0 = time.monotonic(), machine_busy_s()
        self.cpu0 = {k: cpu_s(v) for k, v in pids.items()}

    def cores(self) -> dict[str, float]:
        dt_s = time.monotonic() - self.t0
        out = {k: round((cpu_s(v) - self.cpu0[k]) / dt_s, 2) for k, v in self.pids.items()}
        out["machine"] = round((machine_busy_s() - self.busy0) / dt_s, 2)
        return out


def p(values: list[float], q: float) -> float | None:
    return checks.pct([v for v in values if v is not None], q)


def run(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    mix = Mix(rate=args.rate, ttl_s=args.ttl, hourly_quota=QUOTA_BIG)
    cells = sorted(set(mix.cell_of().values()))
    res: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    with Cluster(out, 3, ttl_s=args.ttl, margin_s=args.margin) as c:
        add_tenants(c.url, mix.tenants())
        key = admin_key(c.url)
        faults = Faults(c, cells, log=log)

        # 1. one replica at a third of the load
        c.start([c[0]])
        single = LoadProc(Spec([c[0].address], args.rate / 3, mix.loads(),
                               str(out / "load-single"), run_id="single"))  # fmt: skip
        time.sleep(args.warmup)
        cpu1 = CpuWindow({"r0": c[0].pid, "load": single.proc.pid})
        time.sleep(args.single)
        cores1 = cpu1.cores()
        single.stop()
        a1 = single.admits()
        t1 = single.started_ns + int(args.warmup * 1e9)
        t1_end = t1 + int(args.single * 1e9)
        lat1 = latencies_ms(a1, t1, t1_end)
        log(f"single: {len(lat1)} decisions, p99 {p(lat1, 99)} ms")

        # 2. three replicas, steady
        c.start([c[1], c[2]])
        load = LoadProc(Spec(c.addresses, args.rate, mix.loads(), str(out / "load-main"),
                             run_id="main"))  # fmt: skip
        loads = [single, load]
        try:
            faults.settle()
            time.sleep(args.warmup)
            t3 = time.monotonic_ns()
            cpu3 = CpuWindow({r.member: r.pid for r in c.replicas} | {"load": load.proc.pid})
            time.sleep(args.steady)
            cores3 = cpu3.cores()
            t3_end = time.monotonic_ns()
            log(f"steady phase done; cores {cores3}")

            # 3. config fan-out
            cfg = config_changes(c, key, args.config_changes)
            log(f"config: p99 {p(cfg, 99)} s")

            # 4. kills; the quota tenant's hour set to run out near one of them
            q_rate = args.rate * mix.weights["quota"] * 100  # tokens/s it settles
            gate_kills = {1, args.kills // 2, args.kills - 1} if args.kills >= 3 else {0}
            quota_kill = max(0, args.kills // 3)
            for k in range(args.kills):
                if k == quota_kill - 1 or (quota_kill == 0 and k == 0):
                    left = hourly_remaining(c, "quota", QUOTA_POOL) or 0
                    used = QUOTA_BIG - left
                    mix.hourly_quota = int(used + q_rate * (args.ttl + 6))
                    set_quota(c, key, mix.hourly_quota)
                    log(f"quota tenant: {used} used, quota set to {mix.hourly_quota}")
                if k == quota_kill:
                    wait_until(lambda: (hourly_remaining(c, "quota", QUOTA_POOL) or 0)
                               < 0.2 * q_rate * (args.ttl + 6), 30)  # fmt: skip
                    victim = owner_of(c, QUOTA_POOL)
                elif k in gate_kills:
                    victim = owner_of(c, GATE_POOL)
                else:
                    victim = c[k % 3]
                faults.kill(victim or c[k % 3])
                faults.settle()
                time.sleep(1.0)
            turn = 0  # victims in turn across the kinds: r0, r1, r2, r0, ...
            for what, n in (("pause", args.stops), ("cut", args.cuts), ("term", args.terms)):
                for _ in range(n):
                    getattr(faults, what)(c[turn % 3])
                    turn += 1
                    faults.settle()
                    time.sleep(1.0)
            time.sleep(2.5)  # a pricing-window flush after the last handoff
        finally:
            summary = load.stop(300)
        end = time.monotonic_ns()
        drained = c.wait_spools_drained(120)
        c.stop_all()
        fig = analyze(c, loads, mix, end_ns=end)
        a3 = load.admits()
        lat3 = latencies_ms(a3, t3, t3_end)
        spread = checks.spread_figure(
            a3, "spread", mix.spread_rate, round(mix.spread_rate), t3, args.steady
        )
        res.update(
            figures=fig, load_summary=summary, spools_drained=drained, config_s=cfg,
            single_p99_ms=p(lat1, 99), three_p99_ms=p(lat3, 99),
            single_p50_ms=p(lat1, 50), three_p50_ms=p(lat3, 50),
            single_cores=cores1, three_cores=cores3,
            steady_outcomes=outcomes(a3, t3, t3_end), single_outcomes=outcomes(a1, t1, t1_end),
            spread=spread, spread_within_limit=checks.spread_within_limit(spread),
            restarts_s=faults.restarts_s, owned_again_s=faults.owned_again_s,
            events=[vars(e) for e in c.events],
        )  # fmt: skip
    return res


def outcomes(admits: list[checks.Admit], start: int, end: int) -> dict[str, int]:
    """Admits sent in [start, end) by outcome (A, R, N not owner, O SDK offline)."""
    out: dict[str, int] = {}
    for a in admits:
        if start <= a.sent < end:
            out[a.outcome] = out.get(a.outcome, 0) + 1
    return out


def set_quota(c: Cluster, key: str, quota: int) -> None:
    from burstgate_client._proto.burstgate.v1 import admin_pb2 as apb
    from burstgate_client.admin import AdminClient
    from google.protobuf.field_mask_pb2 import FieldMask

    with AdminClient(c[0].address, key) as admin:
        admin.call("UpdateTenant", apb.UpdateTenantRequest(
            tenant=apb.Tenant(tenant_id="quota", hourly_quota=quota),
            update_mask=FieldMask(paths=["hourly_quota"]),
        ))  # fmt: skip
    time.sleep(0.5)  # LISTEN/NOTIFY: every replica has it well within this


def table(res: dict[str, Any]) -> tuple[str, bool]:
    f = res["figures"]
    led = f["ledger"]

    def s(x: float | None, unit: str = "s", spec: str = ".2f") -> str:
        return "—" if x is None else f"{x:{spec}} {unit}"

    def col(kind: str, key: str) -> list[float]:
        return [k[key] for k in f[kind] if k[key] is not None]

    def none(kind: str) -> int:
        return sum(1 for k in f[kind] if k["load_s"] is None)

    kill_load, kill_trace = col("kill", "load_s"), col("kill", "trace_s")
    term_load, term_trace = col("term", "load_s"), col("term", "trace_s")
    term_gap = [
        k["trace_s"] - k["released_s"] for k in f["term"]
        if k["trace_s"] is not None and k["released_s"] is not None
    ]  # fmt: skip
    takeovers = f["gate"]["takeovers"]
    restored = min((t["restored"] for t in takeovers), default=None)
    ratio = (res["three_p99_ms"] / res["single_p99_ms"]) if res["single_p99_ms"] else None
    sp = res["spread"]
    zero = (
        f["double_owners"] == 0 and f["admitted_outside_lease"] == 0
        and led["lost"] == 0 and led["duplicated"] == 0 and led["tokens_wrong"] == 0
        and f["stale_window_writes_landed"] == 0 and f["quota"]["overshoot"] == 0
    )  # fmt: skip
    n = {k: len({(e["member"], e["at_ns"]) for e in res["events"] if e["what"] == k})
         for k in ("kill", "pause", "cut", "term")}  # fmt: skip
    rows = [
        ("cells decided by two owners at once "
         f"({n['kill']}x kill -9, {n['pause']}x SIGSTOP, {n['cut']}x link cut, "
         f"{n['term']}x SIGTERM)",
         "0", f"{f['double_owners']} overlapping intervals of {f['intervals']}; "
         f"{f['admitted_outside_lease']} admissions outside the admitting replica's lease; "
         f"epoch disorder {f['epoch_disorder']}"),
        ("failover after kill -9 (kill → first admission under a new lease), TTL "
         f"{res['args']['ttl']} s", "p99 ≤ 8 s",
         f"p50 {s(p(kill_load, 50))}, p99 {s(p(kill_load, 99))}, max {s(p(kill_load, 100))} "
         f"({len(kill_load)} cells; {none('kill')} without an admission); new lease (trace): "
         f"p99 {s(p(kill_trace, 99))}, max {s(p(kill_trace, 100))}"),
        ("graceful SIGTERM handoff (SIGTERM → first admission under a new lease)", "≤ 1 s",
         f"p50 {s(p(term_load, 50))}, p99 {s(p(term_load, 99))}, max {s(p(term_load, 100))} "
         f"({len(term_load)} cells; {none('term')} without); new lease (trace): p99 "
         f"{s(p(term_trace, 99))}, max {s(p(term_trace, 100))}; release → new lease max "
         f"{s(p(term_gap, 100))}"),
        ("SIGSTOP / link cut past the TTL → first admission under a new lease (no target)", "",
         f"SIGSTOP p50 {s(p(col('pause', 'load_s'), 50))}, p99 {s(p(col('pause', 'load_s'), 99))};"
         f" cut p50 {s(p(col('cut', 'load_s'), 50))}, p99 {s(p(col('cut', 'load_s'), 99))}; "
         f"new lease (trace) p99 {s(p(col('pause', 'trace_s'), 99))} / "
         f"{s(p(col('cut', 'trace_s'), 99))}"),
        ("acknowledged Completes lost / duplicated", "0 / 0",
         f"{led['lost']} / {led['duplicated']} of {led['acknowledged']} acknowledged "
         f"(tokens wrong {led['tokens_wrong']}); buffered by the SDK and delivered later: "
         f"{led['buffered_lost']} / {led['buffered_duplicated']} of {led['buffered']}"),
        ("stale-epoch pricing-window writes that landed", "0",
         f"{f['stale_window_writes_landed']} of {f['window_writes_landed']} landed "
         f"({f['window_writes_refused']} refused by the fence)"),
        (f"tenant over 4 cells at 2x its limit, {sp['seconds']:.0f} s (reported)",
         "≤ limitx60 + burst, ≥ 0.9xlimitx60",
         f"{sp['admitted_tokens']:,} tokens = {sp['ratio_to_limit']:.2f}x limitx60 "
         f"(bounds {sp['lower']:,.0f}-{sp['upper']:,.0f}; offered {sp['offered_tokens']:,})"),
        ("hourly quota overshoot through a failover", "0",
         f"{f['quota']['overshoot']} tokens (quota {f['quota']['quota']:,}, ledger "
         f"{f['quota']['per_hour']})"),
        ("open reservations restored on the new owner (reported)", "≥ 99 %; gate ≤ limit",
         f"{s(None if restored is None else restored * 100, '%', '.0f')} (worst of "
         f"{len(takeovers)} takeovers); gate peak {f['gate']['peak']} in flight, limit "
         f"{f['gate']['limit']}"),
        ("config change visible on all replicas", "p99 ≤ 1 s",
         f"p50 {s(p(res['config_s'], 50), 's', '.3f')}, "
         f"p99 {s(p(res['config_s'], 99), 's', '.3f')} ({len(res['config_s'])} changes)"),
        ("owner-local Admit p99, 3 replicas vs 1 at the same load per replica", "≤ 1.1x",
         f"{s(res['three_p99_ms'], 'ms', '.1f')} vs {s(res['single_p99_ms'], 'ms', '.1f')}"
         f" = {s(ratio, 'x', '.2f')} (p50 {s(res['three_p50_ms'], 'ms', '.1f')} vs "
         f"{s(res['single_p50_ms'], 'ms', '.1f')}); cores used: 1 replica "
         f"{res['single_cores']}, 3 replicas {res['three_cores']}"),
    ]  # fmt: skip
    lines = ["| figure | target | measured |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines), zero


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = dt.datetime.now(dt.UTC)
    out: Path = (
        args.out or REPO_ROOT / "bench" / "results" / f"ha-acceptance-{started:%Y%m%dT%H%M%S}"
    )
    out.mkdir(parents=True, exist_ok=True)
    log(f"output in {out}")
    t0 = time.monotonic()
    res = run(args, out)
    res["seconds"] = time.monotonic() - t0
    res["command"] = " ".join(
        [".venv/bin/python", "bench/ha_acceptance.py", *(argv or sys.argv[1:])]
    )
    res["started"] = f"{started:%Y-%m-%d %H:%M} UTC"
    res["load_average"] = os.getloadavg()
    text, zero = table(res)
    res["table"] = text
    (out / "acceptance.json").write_text(json.dumps(res, indent=1, default=str))
    load_avg = res["load_average"][0]
    print(f"{res['command']} — {res['started']}, {res['seconds']:.0f} s, "
          f"{os.cpu_count()} cores, load average at the end {load_avg:.1f}\n")  # fmt: skip
    print(text)
    summary = res["load_summary"]
    print(f"\nload: {summary['sent']} Admits sent, {summary['skipped']} skipped; SDK counters "
          f"{json.dumps(summary['counters'])}")  # fmt: skip
    restarts = statistics.mean(res["restarts_s"]) if res["restarts_s"] else 0.0
    print(f"outcomes {res['figures']['admits']}; restarts {restarts:.1f} s mean")
    return 0 if zero else 1


if __name__ == "__main__":
    sys.exit(main())
