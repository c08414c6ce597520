"""The client SDK's micro-batching vs unary Admit calls, side by side.

    .venv/bin/python bench/bench_sdk.py            # ~2 minutes
    .venv/bin/python bench/bench_sdk.py --quick    # smoke run, ~40 s
    .venv/bin/python bench/bench_sdk.py --quick --seconds 0.2 --callers 8 --rates 200 \
        --quiesce 0.25                             # tiny (CI's smoke run), ~8 s

Two kinds of load, each for ``--seconds`` after a warm-up, every Admit
with a fresh request id: open loop at ``--rates`` Admits per second (evenly
spaced, sent whatever the answers; the latency a sidecar's requests see at
that rate), and closed loop with ``--callers`` N concurrent callers (each
sends its next Admit as soon as the last is answered; the most decisions
per second, latency then grows with N). Through:

* ``sdk``: one ``burstgate_client.sdk.AsyncAdmissionClient`` (its defaults: a
  200 µs window, batches of up to 256, the SDK's 250 ms deadline, so each
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
Nothing here asserts a time: the figures go to BENCHMARKS.md. The targets
table's row "Python SDK, decisions/s from one process" (bench/_summary.py)
takes the ``sdk`` mode (the defaults) at the closed-loop load where it did
most, against ``unary`` at that load in the same run; its note gives the
client CPU per decision of each, since on one machine the server shares the
cores (1e6 / client µs is what the client process alone could do).
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
from _summary import record

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
    load: str  # "N=64" (closed loop) or "5,000/s" (open loop)
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


async def open_loop(
    decide: Callable[[str], Coroutine[Any, Any, bool]], rate: float, warmup_s: float,
    seconds: float, server_pid: int,
) -> tuple[list[float], int, float, float, float]:  # fmt: skip
    """Send ``rate`` Admits per second, evenly spaced, whatever the answers
    (open loop); latency from each call's start. Returns as closed_loop."""
    loop = asyncio.get_running_loop()
    lat: list[float] = []
    admitted = 0
    tasks: set[asyncio.Task[None]] = set()

    async def one(rid: str, measured: bool) -> None:
        nonlocal admitted
        t0 = time.perf_counter()
        ok = await decide(rid)
        if measured:
            lat.append((time.perf_counter() - t0) * 1000)
            admitted += ok

    start = loop.time()
    end_warmup, end = start + warmup_s, start + warmup_s + seconds
    sent, c0, s0, w0 = 0, 0.0, 0.0, 0.0
    measuring = False
    while True:
        now = loop.time()
        if not measuring and now >= end_warmup:
            measuring = True
            c0, s0, w0 = time.process_time(), lg.proc_cpu_s(server_pid), time.perf_counter()
        if now >= end:
            break
        due = int((now - start) * rate)  # arrivals due by now: a 1 ms tick sends them
        while sent < due:
            sent += 1
            task = loop.create_task(one(f"o{sent}", measuring))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.sleep(0.001)
    wall = time.perf_counter() - w0
    c1, s1 = time.process_time(), lg.proc_cpu_s(server_pid)
    if tasks:
        await asyncio.wait(tasks)
    return lat, admitted, wall, c1 - c0, s1 - s0


async def run_mode(
    mode: str, target: str, load: tuple[str, float], warmup_s: float, seconds: float,
    server_pid: int,
) -> Result:  # fmt: skip
    """``load``: ("closed", N callers) or ("open", rate per second)."""
    import grpc
    from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
    from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
    from burstgate_client.protoclient import KEEPALIVE_OPTIONS
    from burstgate_client.sdk import AsyncAdmissionClient

    kind, amount = load

    async def drive(decide: Callable[[str], Coroutine[Any, Any, bool]]) -> Any:
        if kind == "closed":
            return await closed_loop(decide, int(amount), warmup_s, seconds, server_pid)
        return await open_loop(decide, amount, warmup_s, seconds, server_pid)

    batches = 0
    if mode.startswith("sdk"):
        wait = mode == "sdk"
        async with AsyncAdmissionClient(target, deadline_s=DEADLINE_S, wait_in_gate=wait) as c:

            async def decide(rid: str) -> bool:
                a = await c.admit(TENANT, rid, prompt_tokens=100, max_tokens=50)
                return a.admitted and not a.offline

            out = await drive(decide)
            batches = c.counters.batches
            if c.counters.offline_admits + c.counters.offline_refusals:
                print(f"  ! {mode} {load}: offline answers {c.counters}", file=sys.stderr)
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

            out = await drive(decide)
    lat, admitted, wall, client_s, server_s = out
    lat.sort()
    n = len(lat)
    label = f"N={int(amount)}" if kind == "closed" else f"{amount:,.0f}/s"
    return Result(
        mode, label, n, wall, pct(lat, 0.5), pct(lat, 0.99),
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
        f"- client loop: {loop_kind}; load: open loop at a rate (Admits/s) or closed loop "
        f"with N callers; fresh request ids; deadline {DEADLINE_S * 1000:.0f} ms",
        "",
        "| load | mode | decisions/s | p50 ms | p99 ms | client µs/dec | server µs/dec "
        "| batches (mean size) | admitted |",
        "|---:|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in results:
        size = f"{r.batches} ({r.decisions / r.batches:.0f})" if r.batches else "-"
        out.append(
            f"| {r.load} | {r.mode} | {r.per_s:,.0f} | {r.p50_ms:.2f} | {r.p99_ms:.2f} "
            f"| {r.client_us:.1f} | {r.server_us:.1f} | {size} | {r.admitted * 100:.0f} % |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--callers", type=str, default=None, help="closed loop: N values, a,b,c")
    ap.add_argument("--rates", type=str, default=None, help="open loop: Admits/s, a,b,c")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    ap.add_argument("--quiesce", type=float, default=4.0,
                    help="longest wait (s) for an idle machine before each run")  # fmt: skip
    args = ap.parse_args(argv)
    seconds = args.seconds or (1.5 if args.quick else 4.0)
    warmup = 0.5 if args.quick else 1.0
    callers = [int(x) for x in (args.callers or "1,64,1024").split(",")]
    rates = [float(x) for x in (args.rates or "1000,5000").split(",")]
    loads = [("open", r) for r in rates] + [("closed", float(n)) for n in callers]
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
            for load in loads:
                for mode in MODES:
                    h.quiesce([pid], args.quiesce)
                    r = run_client(run_mode(mode, target, load, warmup, seconds, pid), args.loop)
                    print(f"  {mode:10} {r.load:>8}: {r.per_s:9,.0f}/s p50 {r.p50_ms:.2f} ms "
                          f"p99 {r.p99_ms:.2f} ms", file=sys.stderr)  # fmt: skip
                    results.append(r)
        finally:
            server.stop(("stop",))
    print(report(results, argv, args.loop))
    record_target(results, argv)
    return 0


def record_target(results: list[Result], argv: Sequence[str] | None) -> None:
    """The targets table's SDK row: the defaults' best closed-loop load vs
    unary at the same load, this run."""
    closed = [r for r in results if r.mode == "sdk" and r.load.startswith("N=")]
    if not closed:
        return
    best = max(closed, key=lambda r: r.per_s)
    unary = next((r for r in results if r.mode == "unary" and r.load == best.load), None)
    record(
        what="Python SDK, decisions/s from one process", ours=best.per_s, unit="decisions/s",
        target=">= 100k/s, batching on by default", met=best.per_s >= 100_000,
        baseline=unary.per_s if unary else None,
        baseline_name="unary Admit calls (one grpc.aio channel)",
        note=(
            f"closed loop {best.load}; client CPU {best.client_us:.1f} µs/decision "
            f"(unary {unary.client_us if unary else float('nan'):.1f}), server "
            f"{best.server_us:.1f} µs/decision: the client alone could do "
            f"{1e6 / best.client_us:,.0f}/s"
        ),
        bench=" ".join(h.command_line(__file__, argv)),
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
