"""The pulse evaluation of issue 14: SPEC section 6's pulse (20 -> 80 requests/s
for 30 s every 90 s, 5 minutes, three tenants in three lanes) against
``burstgate serve`` on PostgreSQL, then the same plan against the empty
handler (bench/_grpc_empty.py: same gRPC stack, no decisions), with the
decision latency per phase and the server process's CPU time for each.

    .venv/bin/python bench/bench_pulse.py [--minutes 5] [--pg-dsn postgresql://postgres@127.0.0.1:5432/postgres]

Both servers run as processes of their own; their CPU is read from
/proc/<pid>/stat (user + system) before and after the load. The load
generator is `controlplane.loadtest` (simulated service time, unary Admit).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controlplane.loadtest import profile as prof  # noqa: E402
from controlplane.loadtest.report import by_lane, percentile, summarize  # noqa: E402
from controlplane.loadtest.run import run  # noqa: E402

TENANTS = [prof.Tenant("acme", "premium"), prof.Tenant("agentco", "standard"),
           prof.Tenant("free-tier", "batch")]  # fmt: skip
EMPTY_SERVER = """
import asyncio, sys
sys.path.insert(0, {bench!r})
from _grpc_empty import create_empty_server
from controlplane.service import AdmissionService, ServiceLimits
from controlplane.settings import Settings

async def main():
    service = AdmissionService(ServiceLimits.of(Settings(database_url="sqlite://")))
    server, port = create_empty_server(service, "127.0.0.1:0")
    await server.start()
    print(f"burstgate listening on 127.0.0.1:{{port}}", flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def started(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("burstgate listening on "):
            return proc, line.split()[3]
    raise SystemExit(f"{cmd[:4]} did not start (exit {proc.wait()})")


def measure(name: str, proc: subprocess.Popen[str], target: str, phases: Any,
            plan: Any) -> dict[str, Any]:  # fmt: skip
    before = cpu_s(proc.pid)
    result = asyncio.run(run(target, plan, run_id=f"{name}-{uuid.uuid4().hex[:6]}"))
    cpu = cpu_s(proc.pid) - before
    proc.terminate()
    proc.wait(timeout=60)
    return {"name": name, "cpu_s": cpu, "result": result,
            "phases": summarize(phases, result), "lanes": by_lane(phases, result)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--pg-dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = ap.parse_args()
    phases = prof.pulse(20, 80, 30, 90, args.minutes * 60)
    plan = prof.arrivals(phases, TENANTS, prof.Mix(), seed=0)
    db = f"burstgate_bench_pulse_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.pg_dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{db}"')
    url = args.pg_dsn.rsplit("/", 1)[0] + f"/{db}"
    env = {**os.environ, "BURSTGATE_DATABASE_URL": url, "BURSTGATE_ADMISSION_AUTH": "false",
           "BURSTGATE_LOG_LEVEL": "warning"}  # fmt: skip
    bg = [sys.executable, "-m", "controlplane"]
    runs = []
    try:
        subprocess.run([*bg, "migrate"], env=env, check=True, cwd=ROOT, capture_output=True)
        subprocess.run([*bg, "config", "apply", "controlplane/demo.yaml"], env=env, check=True,
                       cwd=ROOT, capture_output=True)  # fmt: skip
        proc, target = started([*bg, "serve", "--port", "0", "--metrics-port", "-1"], env)
        runs.append(measure("burstgate serve (PostgreSQL)", proc, target, phases, plan))
        code = EMPTY_SERVER.format(bench=str(ROOT / "bench"))
        proc, target = started([sys.executable, "-c", code], env)
        runs.append(measure("empty handler", proc, target, phases, plan))
    finally:
        with psycopg.connect(args.pg_dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    print(f"{len(plan):,} requests, pulse 20 -> 80/s 30 s every 90 s, {args.minutes:g} min\n")
    print("| server | phase | requests | admitted | p50 ms | p95 ms | p99 ms | max ms "
          "| not held: n, p50 / p99 ms |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        for s in r["phases"]:
            lat = s.latency_ms
            quick = [o.latency_ms for o in r["result"].outcomes if o.decision
                     and o.queue_wait_ms == 0 and s.name in ("all", o.arrival.phase)]  # fmt: skip
            print(f"| {r['name']} | {s.name} | {s.requests:,} | {s.admitted:,} | {lat['p50']} | "
                  f"{lat['p95']} | {lat['p99']} | {lat['max']} | {len(quick):,}, "
                  f"{percentile(quick, 50)} / {percentile(quick, 99)} |")  # fmt: skip
    print("\n| server | lane | requests | admitted | p50 ms | p99 ms |")
    print("|---|---|---:|---:|---:|---:|")
    for r in runs:
        for s in r["lanes"]:
            print(f"| {r['name']} | {s.name} | {s.requests:,} | {s.admitted:,} | "
                  f"{s.latency_ms['p50']} | {s.latency_ms['p99']} |")  # fmt: skip
    print()
    for r in runs:
        print(f"{r['name']}: server CPU {r['cpu_s']:.1f} s over {r['result'].duration_s:.0f} s")
    print(f"CPU ratio (burstgate / empty): {runs[0]['cpu_s'] / max(runs[1]['cpu_s'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
