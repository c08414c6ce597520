"""Microbenchmark: the AdmitStream wire codec (``fastpath._wire_c``) vs. the protobuf runtime.

Run on demand (not a test; nothing here asserts anything):

    .venv/bin/python bench/bench_wire.py [--sizes 100 1000] [--rounds 7] [--round-ms 200]

For each batch size N, in one process, CPU ns per batch (process time, robust to a shared
machine; median over rounds, each round repeating the call for ``--round-ms``):

* read: an AdmitBatch of N entries as bench/_loadgen.py sends it (10 tenants' turns over
  4 tenant ids, distinct request ids, model and pool), into the columns the service takes:
  ``fastpath._wire_c.read_batch`` vs. the protobuf runtime's ``AdmitBatch.FromString``
  followed by ``list()`` of the eight columns (what AdmitStream did before);
* write: the answer (9 in 10 admitted, each with a 66-byte admission token as ours sends,
  a multiplier and a pressure) into AdmitBatchResult bytes: ``write_result`` vs. building
  the ``AdmitBatchResult`` message and ``SerializeToString`` (what AdmitStream did before).

The pure-Python reference (``fastpath._wire_py``) is timed too, for scale. The bytes the
builds give are checked equal to the runtime's before anything is timed.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb

from fastpath import _wire_c, _wire_py

TENANTS = ("bench-a", "bench-b", "bench-c") * 3 + ("bench-d",)
COLUMNS = ("tenant_id", "request_id", "lane", "prompt_tokens", "max_tokens", "max_wait_ms",
           "retry_key", "attempt")  # fmt: skip


def request_bytes(n: int) -> bytes:
    return pb.AdmitBatch(
        batch_id=123456,
        tenant_id=[TENANTS[i % len(TENANTS)] for i in range(n)],
        request_id=[f"u-00012345-{i:04d}" for i in range(n)],
        prompt_tokens=[100] * n,
        max_tokens=[50] * n,
        model="bench-model",
        pool="bench-pool",
    ).SerializeToString()


def result_columns(n: int) -> dict[str, Any]:
    admit = [(i + 1) % 10 != 0 for i in range(n)]
    return {
        "batch_id": 123456,
        "decision": [1 if a else 2 for a in admit],
        "reason": [0 if a else 1 for a in admit],
        "retry_after_ms": [0 if a else 37 for a in admit],
        "reserved_tokens": [150 if a else 0 for a in admit],
        "reservation_id": [1_000_000 + i if a else 0 for i, a in enumerate(admit)],
        "granted_max_tokens": [50 if a else 0 for a in admit],
        "bucket_remaining": [999_000_000_000 - i if a else 0 for i, a in enumerate(admit)],
        "hourly_remaining": [-1] * n,
        "daily_remaining": [-1] * n,
        "duplicate": [False] * n,
        "shadow_reason": [0] * n,
        "degraded": [False] * n,
        "retryable": [not a for a in admit],
        "admission_token": [bytes(66) if a else b"" for a in admit],
    }


PRESSURE = (0.0, 3, 1, False)


def write_ours(build: Any, c: dict[str, Any]) -> bytes:
    return bytes(build.write_result(
        c["batch_id"], c["decision"], c["reason"], c["retry_after_ms"], c["reserved_tokens"],
        c["reservation_id"], c["granted_max_tokens"], c["bucket_remaining"],
        c["hourly_remaining"], c["daily_remaining"], c["duplicate"], c["shadow_reason"],
        c["degraded"], None, PRESSURE, "1.000000", c["retryable"], (), (), (), (), (),
        c["admission_token"],
    ))  # fmt: skip


def write_runtime(c: dict[str, Any]) -> bytes:
    """As admitstream.batch_result builds the message."""
    res = pb.AdmitBatchResult(
        batch_id=c["batch_id"], decision=c["decision"], reason=c["reason"],
        retry_after_ms=c["retry_after_ms"], reserved_tokens=c["reserved_tokens"],
        reservation_id=c["reservation_id"], granted_max_tokens=c["granted_max_tokens"],
        bucket_remaining=c["bucket_remaining"], hourly_remaining=c["hourly_remaining"],
        daily_remaining=c["daily_remaining"], duplicate=c["duplicate"],
        pricing_multiplier="1.000000", retryable=c["retryable"],
        shadow_reason=c["shadow_reason"], degraded=c["degraded"], degradation=None,
        pressure=pb.Pressure(
            score=0.0, freshness=pb.POOL_FRESHNESS_UNKNOWN, stale_policy=pb.STALE_POLICY_FAIL_OPEN
        ),
    )  # fmt: skip
    res.admission_token.extend(c["admission_token"])
    return res.SerializeToString()


def read_runtime(data: bytes) -> list[Any]:
    batch = pb.AdmitBatch.FromString(data)
    return [list(getattr(batch, name)) for name in COLUMNS]


def per_call_ns(fn: Callable[[], object], rounds: int, round_ms: float) -> float:
    """Median ns per call over ``rounds`` rounds of about ``round_ms`` each."""
    calls = 1
    while True:  # calibrate
        t0 = time.process_time_ns()
        for _ in range(calls):
            fn()
        took = time.process_time_ns() - t0
        if took >= round_ms * 1e6 / 4 or calls >= 1 << 22:
            break
        calls *= 2
    calls = max(1, int(calls * round_ms * 1e6 / max(took, 1)))
    samples = []
    for _ in range(rounds):
        t0 = time.process_time_ns()
        for _ in range(calls):
            fn()
        samples.append((time.process_time_ns() - t0) / calls)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--round-ms", type=float, default=200.0)
    args = ap.parse_args(argv)
    print("# AdmitStream wire codec: compiled reader/writer vs. the protobuf runtime")
    print()
    print(f"- python {platform.python_version()}, {platform.machine()}, "
          f"load average {os.getloadavg()[0]:.2f}; {args.rounds} rounds of "
          f"~{args.round_ms:g} ms, medians; CPU ns per batch (process time; per entry "
          f"in brackets)")  # fmt: skip
    print()
    print("| batch | what | compiled | runtime (protobuf) | runtime / compiled | reference (py) |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in args.sizes:
        data = request_bytes(n)
        cols = result_columns(n)
        want = write_runtime(cols)
        assert write_ours(_wire_c, cols) == want == write_ours(_wire_py, cols)
        got = _wire_c.read_batch(data)
        assert [getattr(got, name) for name in COLUMNS] == read_runtime(data)
        rows = (
            ("read", partial(_wire_c.read_batch, data), partial(read_runtime, data),
             partial(_wire_py.read_batch, data)),
            ("write", partial(write_ours, _wire_c, cols), partial(write_runtime, cols),
             partial(write_ours, _wire_py, cols)),
        )  # fmt: skip
        for what, ours, runtime, ref in rows:
            gc.collect()
            o = per_call_ns(ours, args.rounds, args.round_ms)
            r = per_call_ns(runtime, args.rounds, args.round_ms)
            p = per_call_ns(ref, max(1, args.rounds // 3), args.round_ms)
            print(
                f"| {n:,} | {what} | {o:,.0f} ({o / n:,.1f}) | {r:,.0f} ({r / n:,.1f}) "
                f"| {r / o:.2f}x | {p:,.0f} ({p / n:,.1f}) |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
