"""The client SDK's micro-batching vs unary Admit calls, side by side.

    .venv/bin/python bench/bench_sdk.py            # ~1 minute
    .venv/bin/python bench/bench_sdk.py --quick    # smoke run, ~15 s

N concurrent callers (asyncio tasks, closed loop: each sends its next Admit
as soon as the last is answered) ask for decisions for ``--seconds`` after a
warm-up, each with a fresh request id, through:

* ``sdk``: one ``controlplane.sdk.AsyncAdmissionClient`` (its defaults: a
  300 µs window, batches of up to 256, the SDK's 250 ms deadline, so each
  entry may wait in the server's queue: ``max_wait_ms`` is sent, and the
  server decides the batch entry by entry on Admit's path);
* ``sdk-nowait``: the same with ``wait_in_gate=False`` (no ``max_wait_ms``:
  the server's columnar fast path);
* ``unary``: one grpc.aio channel, one ``Admit`` call per decision
  (``timeout`` 250 ms), the same keepalive options.

Both on the same kind of event loop (``--loop uvloop|asyncio``, default
uvloop) in this process, against one server in a spawned process: the
production ``ControlPlane`` over a temporary SQLite database, one generous
tenant, the pool gate off (nothing Completes here: the gate's fallback would
refuse after 64 in flight), sidecar auth off. Reported per mode and N:
decisions/s, latency p50/p99 (each caller's Admit, measured around the
await), the CPU per decision of the client process and of the server, and
the share admitted by the server (the rest: the SDK's offline answers or a
unary call past its deadline).
Nothing here asserts a time: the figures go to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import _harness as h
import _loadgen as lg

TENANT = "bench-sdk"
MODES = ("sdk", "sdk-nowait", "unary")
DEADLINE_S = 0.25


# ------------------------------------------------------------ server process


def server_main(conn: Connection, db_url: str) -> None:
    h.run_server(_serve(conn, db_url))


async def _serve(conn: Connection, db_url: str) -> None:
    from controlplane.server import ControlPlane
    from controlplane.settings import Settings

    settings = Settings(
        database_url=db_url, host="127.0.0.1", port=0, metrics_port=-1, admission_auth=False,
        max_open_reservations=0, max_open_reservations_per_tenant=0, ledger_enabled=False,
    )  # fmt: skip
    plane = ControlPlane(settings)
    port = await plane.start()
    conn.send(("ready", port, os.getpid()))
    await h.serve_commands(conn, {})
    await plane.stop(0)


def prepare_db(url: str) -> None:
    from decimal import Decimal

    from controlplane.domain import TenantConfig
    from controlplane.domain.policy import Policy
    from controlplane.store.config import ConfigRepository
    from controlplane.store.db import make_engine, upgrade

    with contextlib.redirect_stdout(sys.stderr):
        upgrade(url)
        engine = make_engine(url)
        try:
            repo = ConfigRepository(engine)
            repo.add_tenant(
                TenantConfig(tenant_id=TENANT, token_rate=Decimal(10**6), burst_tokens=10**12)
            )
            repo.update_policy(Policy(), {"pool_gate": False}, [])
        finally:
            engine.dispose()


# ------------------------------------------------------------------- client


@dataclass
class Result:
    mode: str
    callers: int
    decisions: int
    seconds: float
    p50_ms: float
    p99_ms: float
    client_us: float  # client CPU per decision
    server_us: float  # server CPU per decision
    admitted: float  # fraction
    batches: int = 0

    @property
    def per_s(self) -> float:
        return self.decisions / self.seconds


def pct(sorted_ms: Sequence[float], q: float) -> float:
    if not sorted_ms:
        return float("nan")
    return sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))]


async def closed_loop(
    decide: Callable[[str], Coroutine[Any, Any, bool]], callers: int, warmup_s: float,
    seconds: float, server_pid: int,
) -> tuple[list[float], int, float, float, float]:  # fmt: skip
    """Run ``callers`` closed-loop callers; return the measured window's
    latencies (ms), admitted count, wall seconds, client and server CPU."""
    loop = asyncio.get_running_loop()
    measuring = False
    stop = False
    lat: list[float] = []
    admitted = 0
    seq = 0

    async def caller(k: int) -> None:
        nonlocal admitted, seq
        while not stop:
            seq += 1
            rid = f"c{k}-{seq}"
            t0 = time.perf_counter()
            ok = await decide(rid)
            if measuring:
                lat.append((time.perf_counter() - t0) * 1000)
                admitted += ok

    tasks = [loop.create_task(caller(k)) for k in range(callers)]
    await asyncio.sleep(warmup_s)
    measuring = True
    c0, s0, w0 = time.process_time(), lg.proc_cpu_s(server_pid), time.perf_counter()
    await asyncio.sleep(seconds)
    measuring = False
    wall = time.perf_counter() - w0
    c1, s1 = time.process_time(), lg.proc_cpu_s(server_pid)
    stop = True
    await asyncio.gather(*tasks)
    return lat, admitted, wall, c1 - c0, s1 - s0


async def run_mode(
    mode: str, target: str, callers: int, warmup_s: float, seconds: float, server_pid: int
) -> Result:
    import grpc

    from controlplane._proto.burstgate.v1 import admission_pb2 as pb
    from controlplane._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
    from controlplane.client import KEEPALIVE_OPTIONS
    from controlplane.sdk import AsyncAdmissionClient

    batches = 0
    if mode.startswith("sdk"):
        wait = mode == "sdk"
        async with AsyncAdmissionClient(target, deadline_s=DEADLINE_S, wait_in_gate=wait) as c:

            async def decide(rid: str) -> bool:
                a = await c.admit(TENANT, rid, prompt_tokens=100, max_tokens=50)
                return a.admitted and not a.offline

            out = await closed_loop(decide, callers, warmup_s, seconds, server_pid)
            batches = c.counters.batches
            if c.counters.offline_admits + c.counters.offline_refusals:
                print(f"  ! {mode} N={callers}: offline answers {c.counters}", file=sys.stderr)
    else:
        async with grpc.aio.insecure_channel(target, options=KEEPALIVE_OPTIONS) as channel:
            stub = pb_grpc.AdmissionServiceStub(channel)

            async def decide(rid: str) -> bool:
                req = pb.AdmitRequest(tenant_id=TENANT, request_id=rid, prompt_tokens=100,
                                      max_tokens=50)  # fmt: skip
                try:
                    resp = await stub.Admit(req, timeout=DEADLINE_S)
                except grpc.aio.AioRpcError:
                    return False  # counted as not admitted (a deadline passed)
                return bool(resp.decision == pb.DECISION_ADMIT)

            out = await closed_loop(decide, callers, warmup_s, seconds, server_pid)
    lat, admitted, wall, client_s, server_s = out
    lat.sort()
    n = len(lat)
    return Result(
        mode, callers, n, wall, pct(lat, 0.5), pct(lat, 0.99),
        client_s / n * 1e6 if n else float("nan"), server_s / n * 1e6 if n else float("nan"),
        admitted / n if n else 0.0, batches,
    )  # fmt: skip


def run_client(coro: Coroutine[Any, Any, Result], loop_kind: str) -> Result:
    if loop_kind == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


# ------------------------------------------------------------------- report


def report(results: list[Result], argv: Sequence[str] | None, loop_kind: str) -> str:
    out = [
        "## Client SDK: micro-batched Admits vs unary (`bench/bench_sdk.py`)",
        "",
        f"`{' '.join(h.command_line(__file__, argv))}`",
        "",
        *h.machine(),
        f"- client loop: {loop_kind}; closed loop, fresh request ids, deadline "
        f"{DEADLINE_S * 1000:.0f} ms",
        "",
        "| N callers | mode | decisions/s | p50 ms | p99 ms | client µs/dec | server µs/dec "
        "| batches (mean size) | admitted |",
        "|---:|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in results:
        size = f"{r.batches} ({r.decisions / r.batches:.0f})" if r.batches else "-"
        out.append(
            f"| {r.callers} | {r.mode} | {r.per_s:,.0f} | {r.p50_ms:.2f} | {r.p99_ms:.2f} "
            f"| {r.client_us:.1f} | {r.server_us:.1f} | {size} | {r.admitted * 100:.0f} % |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--callers", type=str, default=None, help="comma-separated N values")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = ap.parse_args(argv)
    seconds = args.seconds or (1.5 if args.quick else 4.0)
    warmup = 0.5 if args.quick else 1.0
    default_callers = "1,64,1024" if args.quick else "1,16,64,256,1024"
    callers = [int(x) for x in (args.callers or default_callers).split(",")]
    ctx = mp.get_context("spawn")
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench-sdk-") as tmp:
        url = f"sqlite:///{Path(tmp) / 'bench.db'}"
        prepare_db(url)
        proc, conn = h.spawn(ctx, "bench-sdk-server", server_main, url)
        server = h.Child("server", proc, conn)
        try:
            if not conn.poll(60):
                raise TimeoutError("the server did not start within 60 s")
            _, port, pid = conn.recv()
            target = f"127.0.0.1:{port}"
            for n in callers:
                for mode in MODES:
                    h.quiesce([pid])
                    r = run_client(run_mode(mode, target, n, warmup, seconds, pid), args.loop)
                    print(f"  {mode:10} N={n:5}: {r.per_s:9,.0f}/s p50 {r.p50_ms:.2f} ms "
                          f"p99 {r.p99_ms:.2f} ms", file=sys.stderr)  # fmt: skip
                    results.append(r)
        finally:
            server.stop(("stop",))
    print(report(results, argv, args.loop))
    return 0


if __name__ == "__main__":
    sys.exit(main())
