"""In-process benchmark of the admission service's public API (no gRPC).

    .venv/bin/python bench/bench_service.py [--rounds 7] [--n 20000]
    valgrind --tool=callgrind .venv/bin/python bench/bench_service.py \
        --rounds 1 --n 5000 --only "admit_batch 100"    # instruction counts

Drives ``AdmissionService`` directly, as the simulator and replays do, with
a fake clock: unary ``admit`` + ``complete`` (and the same requests as
batches of one), ``admit_or_wait`` against a backlog, and ``admit_batch``
at batch sizes 100 and 1,000, each with the pool gate on (the default:
requests name a pool whose one engine reports, every 100 decisions, free
room for all of them) and off, and shaped as bench_grpc's AdmitStream load
("stream mix": a tight tenant refused on a row in ten). Prints the median
nanoseconds per decision over interleaved rounds (JSON with ``--json``).

It measures only the Python around the fast path, so two checkouts can be
compared side by side (the restructure's figures in BENCHMARKS.md come from
running this file from both trees, alternately for times and under
callgrind for instruction counts, which a shared machine cannot disturb).
Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from controlplane.domain import DEFAULT_LANES, TenantConfig
from controlplane.domain.policy import Policy
from controlplane.service import AdmissionService, ServiceLimits
from controlplane.settings import Settings

LANES = list(DEFAULT_LANES)
TENANTS = 100


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000 * 10**9

    def __call__(self) -> int:
        return self.now


POOL = "bench"


def make_service(gate: bool = True, signed: bool = True) -> tuple[AdmissionService, Clock]:
    """``signed`` False: admissions carry no token (service/signing.py), the
    cost of signing measured by difference, in the same process and rounds."""
    clock = Clock()
    svc = AdmissionService(ServiceLimits.of(Settings()), clock=clock)
    if not signed:
        signer: Any = svc.signer
        signer.sign_record = lambda key, rec: b""
        signer.sign_rows = lambda *args: None
    tenants = [
        TenantConfig(f"t{i}", token_rate=Decimal(10**6), burst_tokens=10**8) for i in range(TENANTS)
    ]
    svc.apply_config(tenants, LANES, Policy(pool_gate=gate, known_pools=[POOL]))
    report(svc)
    return svc, clock


def report(svc: AdmissionService) -> None:
    """One engine with room for everything the benchmark sends."""
    svc.report_load(POOL, "e0", 0, 10**12, 0, 0, None, 0.5,
                    requests_running=0, max_num_seqs=10**9, kv_cache_usage=0.1)  # fmt: skip


def unary(n: int, gate: bool, as_batch: bool = False, signed: bool = True) -> float:
    """``as_batch``: each request as an AdmitStream batch of one, what a
    unary Admit would cost through the batch's columns (service/batch.py)."""
    svc, clock = make_service(gate, signed)
    start = time.perf_counter_ns()
    for i in range(n):
        t = f"t{i % TENANTS}"
        rid = f"r{i}"
        if as_batch:
            svc.batches.admit([t], [rid], ["standard"], [500], [200], pool=POOL)
        else:
            svc.admit(t, rid, "standard", 500, 200, pool=POOL)
        svc.complete(t, rid, 0, 500, 100)
        clock.now += 1000
        if i % 100 == 99:
            report(svc)
    return (time.perf_counter_ns() - start) / n


def batch(
    n: int, size: int, gate: bool, spread: int = TENANTS, signed: bool = True
) -> float:
    """``spread``: distinct tenants per batch (100, the worst case for the
    per-tenant work; 4, like bench_grpc's load)."""
    svc, clock = make_service(gate, signed)
    tenants = [f"t{i % spread}" for i in range(size)]
    prompts = [500] * size
    maxt = [200] * size
    start = time.perf_counter_ns()
    for b in range(n // size):
        ids = [f"b{b}-{i}" for i in range(size)]
        svc.batches.admit(tenants, ids, [], prompts, maxt, pool=POOL)
        clock.now += 1000
        report(svc)
    return (time.perf_counter_ns() - start) / (n // size * size)


# bench_grpc's AdmitStream load (bench/_loadgen.py): three generous tenants
# and, on one row in ten, a tight one refused almost always; gate off, a model.
STREAM_CYCLE = ("t0", "t1", "t2") * 3 + ("tight",)


def stream_mix(n: int, size: int) -> float:
    """Batches shaped as bench_grpc's: refusals in every batch, so the paths
    an all-admitted batch skips (retry hints, refusals remembered) are paid."""
    svc, clock = make_service(gate=False)
    tight = TenantConfig("tight", token_rate=Decimal(1000), burst_tokens=2000)
    svc.apply_config(
        [*(TenantConfig(f"t{i}", token_rate=Decimal(10**6), burst_tokens=10**12)
           for i in range(3)), tight],
        LANES, Policy(pool_gate=False, known_pools=[POOL]),
    )  # fmt: skip
    tenants = [STREAM_CYCLE[i % len(STREAM_CYCLE)] for i in range(size)]
    prompts = [100] * size
    maxt = [50] * size
    start = time.perf_counter_ns()
    for b in range(n // size):
        ids = [f"b{b:08x}-{i:04d}" for i in range(size)]
        svc.batches.admit(tenants, ids, [], prompts, maxt, model="llama-3.1-70b", pool=POOL)
        clock.now += 1000
    return (time.perf_counter_ns() - start) / (n // size * size)


def waiting(n: int) -> float:
    """A tenant whose requests queue behind its own backlog, released by completes."""
    clock = Clock()
    svc = AdmissionService(ServiceLimits.of(Settings()), clock=clock)
    svc.apply_config(
        [TenantConfig("w", token_rate=Decimal(10**6), burst_tokens=10**8, max_concurrency=8)],
        LANES,
    )
    start = time.perf_counter_ns()
    open_ids: list[str] = []
    for i in range(n):
        out = svc.admit_or_wait("w", f"r{i}", "standard", 100, 100, deadline_ns=clock.now + 10**10)
        if not hasattr(out, "on_done"):
            open_ids.append(f"r{i}")
        if len(open_ids) >= 8:
            rid = open_ids.pop(0)
            svc.complete("w", rid, 0, 100, 50)
        clock.now += 1000
    return (time.perf_counter_ns() - start) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n", type=int, default=20_000, help="decisions per scenario and round")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", help="run one scenario (e.g. under valgrind --tool=callgrind)")
    ap.add_argument("--match", help="run the scenarios whose name contains this")
    args = ap.parse_args()
    scenarios: dict[str, Callable[[], float]] = {
        "admit+complete": lambda: unary(args.n, True),
        "admit+complete, unsigned": lambda: unary(args.n, True, signed=False),
        "admit+complete, gate off": lambda: unary(args.n, False),
        "admit_batch 1 + complete": lambda: unary(args.n, True, as_batch=True),
        "admit_or_wait (backlog)": lambda: waiting(args.n),
        "admit_batch 100": lambda: batch(args.n, 100, True),
        "admit_batch 100, unsigned": lambda: batch(args.n, 100, True, signed=False),
        "admit_batch 100, gate off": lambda: batch(args.n, 100, False),
        "admit_batch 1000": lambda: batch(args.n, 1000, True),
        "admit_batch 1000, unsigned": lambda: batch(args.n, 1000, True, signed=False),
        "admit_batch 1000, gate off": lambda: batch(args.n, 1000, False),
        "admit_batch 100, 4 tenants": lambda: batch(args.n, 100, True, 4),
        "admit_batch 1000, 4 tenants": lambda: batch(args.n, 1000, True, 4),
        "admit_batch 100, stream mix": lambda: stream_mix(args.n, 100),
        "admit_batch 1000, stream mix": lambda: stream_mix(args.n, 1000),
    }
    if args.only:
        scenarios = {args.only: scenarios[args.only]}
    if args.match:
        scenarios = {k: v for k, v in scenarios.items() if args.match in k}
    results: dict[str, list[float]] = {name: [] for name in scenarios}
    for _ in range(args.rounds):
        for name, run in scenarios.items():
            gc.collect()
            results[name].append(run())
    medians = {name: statistics.median(v) for name, v in results.items()}
    if args.json:
        print(json.dumps(medians))
        return
    print("| scenario | ns per decision (median) |\n|---|---|")
    for name, ns in medians.items():
        print(f"| {name} | {ns:,.0f} |")


if __name__ == "__main__":
    main()
