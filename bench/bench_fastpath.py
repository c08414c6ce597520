"""Microbenchmark: cost of one admission decision, fastpath vs. common Python limiters.

Run on demand (not a test; nothing here asserts on time):

    .venv/bin/python bench/bench_fastpath.py [--rounds 9] [--tenants 1000] [--only admit|sched]
    .venv/bin/python bench/bench_fastpath.py --round-ms 1 --cap 20000   # tiny (CI's smoke run)

Every contender decides the same pre-generated stream of requests (tenant, prompt
tokens, max_tokens) over ``--tenants`` tenants, each request costing prompt + max_tokens
tokens, with limits high enough that every request is admitted (the admit path does the
most work).  Contenders run in interleaved rounds (order rotated each round) on fresh
state, each round sized to take roughly ``--round-ms``; the table reports the median
per-decision time over the rounds and the ratio to the compiled single-call ``admit``.
Times include the Python loop that feeds the calls; the "loop only" row shows that share.

Contenders:
* fastpath compiled ``admit`` (one call per decision) and ``admit_batch`` (100, 1000);
* fastpath pure-Python reference ``admit``;
* ``limits`` (MemoryStorage; FixedWindow and MovingWindow strategies, ``hit(cost=N)``);
* ``pyrate-limiter`` (in-memory ``StateBucket`` with the ``TokenBucket`` algorithm, one
  bucket per tenant behind one ``Limiter``, ``try_acquire(weight=N, blocking=False)``).

A second, smaller table times the scheduling primitives the service calls when capacity
frees: ``FairQueue.pick`` (all flows backlogged; with and without an eligibility mask),
``FairQueue.charge``, the pick-then-charge step, and ``backpressure_score_ppm``, for
8 and 32 flows, compiled and pure-Python reference, measured the same way.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time
from collections.abc import Callable
from importlib.metadata import version
from itertools import repeat
from typing import Any

import numpy as np

from fastpath import _buckets_c, _buckets_py, _sched_c, _sched_py
from fastpath.codes import MAX_BURST_MTOK, MAX_RATE_MTOK_PER_S, NS_PER_S

T0 = 1_750_000_000 * NS_PER_S  # a fixed wall-clock start, so runs are repeatable
STEP_NS = 1_000  # the clock advances 1 us per decision (per batch for admit_batch)

Request = tuple[int, int, int, int, str]  # slot, now_ns, prompt, max_tokens, tenant key
Runner = Callable[[int], int]  # run(n) decides n requests and returns elapsed ns
Setup = Callable[[], Runner]  # builds fresh state (not timed) and returns the runner


def make_requests(n: int, tenants: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    slots = rng.integers(0, tenants, n)
    prompt = rng.integers(50, 2_000, n)
    max_tokens = rng.integers(16, 1_000, n)
    return [
        (int(s), T0 + i * STEP_NS, int(p), int(m), f"tenant-{s}")
        for i, (s, p, m) in enumerate(zip(slots, prompt, max_tokens, strict=True))
    ]


def fastpath_table(module: Any, tenants: int) -> Any:
    table = module.TokenBucketTable(tenants)
    for slot in range(tenants):
        # Top rate, huge burst and quotas, no concurrency cap: never refuses, but every
        # check still runs and the bucket refills through the exact fixed-point path.
        table.configure(slot, T0, MAX_RATE_MTOK_PER_S, MAX_BURST_MTOK, 10**15, 10**15, 0, 0)
    return table


def setup_single(module: Any, tenants: int, requests: list[Request]) -> Setup:
    def setup() -> Runner:
        admit = fastpath_table(module, tenants).admit

        def run(n: int) -> int:
            work = requests[:n]
            start = time.perf_counter_ns()
            for slot, now, prompt, max_tokens, _ in work:
                admit(slot, now, prompt, max_tokens)
            return time.perf_counter_ns() - start

        return run

    return setup


def setup_batch(tenants: int, requests: list[Request], batch: int) -> Setup:
    slots = np.array([r[0] for r in requests], dtype=np.int64)
    prompt = np.array([r[2] for r in requests], dtype=np.int64)
    max_tokens = np.array([r[3] for r in requests], dtype=np.int64)
    chunks = [
        (T0 + i * STEP_NS, slots[i : i + batch], prompt[i : i + batch], max_tokens[i : i + batch])
        for i in range(0, len(requests) - batch + 1, batch)
    ]
    outs = [np.zeros(batch, dtype=np.int64) for _ in range(6)]

    def setup() -> Runner:
        admit_batch = fastpath_table(_buckets_c, tenants).admit_batch

        def run(n: int) -> int:
            work = chunks[: n // batch]
            o1, o2, o3, o4, o5, o6 = outs
            start = time.perf_counter_ns()
            for now, s, p, m in work:
                admit_batch(now, s, p, m, o1, o2, o3, o4, o5, o6)
            return time.perf_counter_ns() - start

        return run

    return setup


def setup_loop_only(requests: list[Request]) -> Setup:
    def setup() -> Runner:
        def run(n: int) -> int:
            work = requests[:n]
            start = time.perf_counter_ns()
            for _slot, _now, _prompt, _max_tokens, _ in work:
                pass
            return time.perf_counter_ns() - start

        return run

    return setup


def setup_limits(requests: list[Request], strategy: str) -> Setup:
    from limits import RateLimitItemPerSecond
    from limits.storage import MemoryStorage
    from limits.strategies import FixedWindowRateLimiter, MovingWindowRateLimiter

    # Moving window keeps one entry per unit of cost, so it gets a smaller (still never
    # reached) limit to keep its per-key list bounded.
    item = RateLimitItemPerSecond(10**12 if strategy == "fixed" else 10**7)
    cls = FixedWindowRateLimiter if strategy == "fixed" else MovingWindowRateLimiter

    def setup() -> Runner:
        hit = cls(MemoryStorage()).hit

        def run(n: int) -> int:
            work = requests[:n]
            start = time.perf_counter_ns()
            for _slot, _now, prompt, max_tokens, key in work:
                hit(item, key, cost=prompt + max_tokens)
            return time.perf_counter_ns() - start

        return run

    return setup


def setup_pyrate(tenants: int, requests: list[Request]) -> Setup:
    from pyrate_limiter import (
        BucketFactory,
        Duration,
        Limiter,
        MonotonicClock,
        Rate,
        RateItem,
        StateBucket,
        TokenBucket,
    )

    class PerTenantFactory(BucketFactory):
        """One in-memory token bucket per tenant (pyrate's multi-key pattern)."""

        def __init__(self) -> None:
            self.clock = MonotonicClock()
            rate = Rate(MAX_RATE_MTOK_PER_S // 1_000, Duration.SECOND, burst=10**12)
            self.buckets = {
                f"tenant-{t}": StateBucket([rate], algorithm=TokenBucket(), clock=self.clock)
                for t in range(tenants)
            }

        def wrap_item(self, name: str, weight: int = 1) -> Any:
            return RateItem(name, self.clock.now(), weight=weight)

        def get(self, item: Any) -> Any:
            return self.buckets[item.name]

    def setup() -> Runner:
        try_acquire = Limiter(PerTenantFactory()).try_acquire

        def run(n: int) -> int:
            work = requests[:n]
            start = time.perf_counter_ns()
            for _slot, _now, prompt, max_tokens, key in work:
                try_acquire(key, weight=prompt + max_tokens, blocking=False)
            return time.perf_counter_ns() - start

        return run

    return setup


# --- scheduling primitives -----------------------------------------------------------


def fair_queue(module: Any, flows: int, seed: int) -> Any:
    """``flows`` backlogged flows with assorted weights and some service history."""
    rng = np.random.default_rng(seed)
    queue = module.FairQueue(flows)
    for flow, weight in enumerate(rng.integers(50_000, 1_000_001, flows).tolist()):
        queue.set_weight(flow, weight)
        queue.activate(flow)
    for cost in rng.integers(16, 3_000, 10 * flows).tolist():
        queue.charge(queue.pick(), cost)
    return queue


def setup_sched(module: Any, op: str, flows: int, seed: int, cap: int) -> Setup:
    rng = np.random.default_rng(seed + 1)
    work = list(
        zip(
            rng.integers(0, flows, cap).tolist(),
            rng.integers(16, 3_000, cap).tolist(),
            strict=True,
        )
    )
    mask = bytearray(rng.integers(0, 2, flows).astype(np.uint8).tobytes())
    mask[0] = 1  # at least one flow eligible

    def setup() -> Runner:
        queue = fair_queue(module, flows, seed)
        pick, charge = queue.pick, queue.charge
        score = module.backpressure_score_ppm
        weights = (400_000, 300_000, 300_000, 400_000)  # alpha, beta, gamma, delta

        def run(n: int) -> int:
            items = work[:n]
            start = time.perf_counter_ns()
            if op == "pick":
                for _ in repeat(None, n):
                    pick()
            elif op == "pick(mask)":
                for _ in repeat(None, n):
                    pick(mask)
            elif op == "charge":
                for flow, cost in items:
                    charge(flow, cost)
            elif op == "pick+charge":
                for _, cost in items:
                    charge(pick(), cost)
            elif op == "score":
                for batch, depth in items:
                    score(batch, 4_096, depth, 1_000, 250_000, 600_000, *weights)
            else:  # loop only: the cost of iterating the (flow, cost) pairs
                for _flow, _cost in items:
                    pass
            return time.perf_counter_ns() - start

        return run

    return setup


def calibrate(setup: Setup, round_ms: float, quantum: int, cap: int) -> int:
    """Decisions per round so that a round takes about ``round_ms``."""
    run = setup()
    run(quantum)  # warm up
    probe = max(quantum, 2_000 // quantum * quantum)
    per_decision = run(probe) / probe
    n = int(round_ms * 1e6 / per_decision) // quantum * quantum
    return max(quantum, min(n, cap // quantum * quantum))


def interleaved(
    contenders: list[tuple[str, Setup, int]], rounds: int, round_ms: float, cap: int
) -> tuple[list[int], list[list[float]]]:
    """Decisions per round and ns per decision of every round, for each contender."""
    sizes = [calibrate(setup, round_ms, quantum, cap) for _, setup, quantum in contenders]
    samples: list[list[float]] = [[] for _ in contenders]
    gc_was_enabled = gc.isenabled()
    for r in range(rounds):
        order = list(range(len(contenders)))
        order = order[r % len(order) :] + order[: r % len(order)]  # rotate who goes first
        for i in order:
            run = contenders[i][1]()
            gc.collect()
            gc.disable()
            try:
                elapsed = run(sizes[i])
            finally:
                if gc_was_enabled:
                    gc.enable()
            samples[i].append(elapsed / sizes[i])
    return sizes, samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (>= 7)")
    parser.add_argument("--tenants", type=int, default=1_000)
    parser.add_argument("--round-ms", type=float, default=40.0, help="target time per round")
    parser.add_argument("--seed", type=int, default=20240601)
    parser.add_argument("--only", choices=["admit", "sched"], help="run one table only")
    parser.add_argument("--cap", type=int, help="most calls per round, and the pre-generated "
                        "stream's length (default 400,000 admit, 200,000 sched)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.rounds < 7:
        parser.error("--rounds must be >= 7")
    if args.cap is not None and args.cap < 2_000:
        parser.error("--cap must be >= 2000")

    print(f"Python {platform.python_version()} on {platform.machine()} ({_cpu()}), "
          f"numpy {np.__version__}, Cython-built fastpath")  # fmt: skip
    if args.only != "sched":
        admit_table(args)
    if args.only != "admit":
        sched_table(args)


def sched_table(args: argparse.Namespace) -> None:
    cap = args.cap or 200_000
    ops = ["pick", "pick(mask)", "charge", "pick+charge", "score"]
    contenders: list[tuple[str, Setup, int]] = []
    for flows in (8, 32):
        for op in [*ops, "loop"]:
            for build, module in (("compiled", _sched_c), ("reference", _sched_py)):
                if op == "loop" and build == "reference":
                    continue
                setup = setup_sched(module, op, flows, args.seed, cap)
                contenders.append((f"{op}|{flows}|{build}", setup, 1))
    _, samples = interleaved(contenders, args.rounds, args.round_ms, cap)
    median = {name: statistics.median(s) for (name, _, _), s in zip(contenders, samples,
                                                                      strict=True)}  # fmt: skip
    print()
    print(f"Scheduling primitives: {args.rounds} interleaved rounds, all flows backlogged, "
          f"GC off while timing; ns per call, median over rounds (loop overhead included: "
          f"see the last row)")  # fmt: skip
    print()
    print("| operation | flows | compiled ns/call | reference ns/call | reference/compiled |")
    print("|---|---:|---:|---:|---:|")
    labels = {
        "pick": "`FairQueue.pick()`",
        "pick(mask)": "`FairQueue.pick(eligible)` (bytearray mask)",
        "charge": "`FairQueue.charge(flow, cost)`",
        "pick+charge": "`charge(pick(), cost)`",
        "score": "`backpressure_score_ppm(...)`",
    }
    for flows in (8, 32):
        for op in ops:
            c, py = median[f"{op}|{flows}|compiled"], median[f"{op}|{flows}|reference"]
            print(f"| {labels[op]} | {flows} | {c:,.1f} | {py:,.1f} | {py / c:.1f}x |")
        loop = median[f"loop|{flows}|compiled"]
        print(f"| (loop only: iterating (flow, cost) pairs) | {flows} | {loop:,.1f} | | |")


def admit_table(args: argparse.Namespace) -> None:
    cap = args.cap or 400_000
    requests = make_requests(cap, args.tenants, args.seed)
    tenants = args.tenants
    contenders: list[tuple[str, Setup, int]] = [
        ("fastpath compiled `admit`", setup_single(_buckets_c, tenants, requests), 1),
        ("fastpath compiled `admit_batch`, batch 100", setup_batch(tenants, requests, 100), 100),
        ("fastpath compiled `admit_batch`, batch 1000", setup_batch(tenants, requests, 1000), 1000),
        ("fastpath pure-Python reference `admit`", setup_single(_buckets_py, tenants, requests), 1),
        ("limits FixedWindow + MemoryStorage, `hit(cost=N)`", setup_limits(requests, "fixed"), 1),
        ("limits MovingWindow + MemoryStorage, `hit(cost=N)`", setup_limits(requests, "moving"), 1),
        ("pyrate-limiter StateBucket(TokenBucket), `try_acquire(weight=N)`",
         setup_pyrate(tenants, requests), 1),
        ("(loop only: iterating the request list)", setup_loop_only(requests), 1),
    ]  # fmt: skip
    sizes, samples = interleaved(contenders, args.rounds, args.round_ms, cap)

    medians = [statistics.median(s) for s in samples]
    base = medians[0]
    print()
    print(f"Admission: limits {version('limits')}, pyrate-limiter {version('pyrate-limiter')}, "
          f"{args.tenants} tenants, {args.rounds} interleaved rounds, fresh state per round, "
          f"GC off while timing; ns per decision, median (min-max) over rounds")  # fmt: skip
    print()
    print("| implementation | decisions/round | ns/decision | min-max | vs compiled `admit` |")
    print("|---|---:|---:|---:|---:|")
    for (name, _, _), n, med, s in zip(contenders, sizes, medians, samples, strict=True):
        ratio = f"{med / base:.2f}x"
        print(f"| {name} | {n:,} | {med:,.1f} | {min(s):,.1f}-{max(s):,.1f} | {ratio} |")


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
