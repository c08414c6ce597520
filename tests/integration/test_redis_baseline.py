"""The Redis+Lua baseline of bench/bench_grpc.py decides correctly: a
tenant's bucket of N requests' worth of tokens, with no refill, admits
exactly N, whether the requests come one by one (one EVALSHA each) or in a
batch (one pipelined EVALSHA per row). Against a private redis-server on a
free port, never the machine's shared instance; no time is asserted."""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb

# redis-py comes with the test extras; redis-server is on every machine of
# this kind (Debian's redis-server): a missing one fails here, loudly.
if shutil.which("redis-server") is None:  # pragma: no cover - the machine's fault
    raise RuntimeError("redis-server is not installed (Debian package redis-server)")

BENCH = Path(__file__).resolve().parents[2] / "bench"
COST = 150  # prompt 100 + max_tokens 50
N = 7


def _load() -> ModuleType:
    if "_grpc_redis" in sys.modules:
        return sys.modules["_grpc_redis"]
    spec = importlib.util.spec_from_file_location("_grpc_redis", BENCH / "_grpc_redis.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["_grpc_redis"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gr = _load()


async def _decide(port: int) -> tuple[list[int], list[pb.AdmitResponse], pb.AdmitBatchResult]:
    limits = {
        "unary": gr.Limit(0, N * COST),  # rate 0: the burst is all there is
        "batch": gr.Limit(0, N * COST),
        "rich": gr.Limit(1_000_000, 10**12),
    }
    servicer = await gr.RedisAdmissionServicer.connect("127.0.0.1", port, limits)
    try:
        unary = [
            await servicer.Admit(
                pb.AdmitRequest(
                    tenant_id="unary", request_id=f"u{i}", prompt_tokens=100, max_tokens=50
                ),
                None,
            )
            for i in range(N + 3)
        ]
        n = N + 5
        tenants = ["batch"] * n + ["rich", "nobody"]
        batch = await servicer.decide_batch(
            pb.AdmitBatch(
                batch_id=42,
                tenant_id=tenants,
                request_id=[f"b{i}" for i in range(len(tenants))],
                prompt_tokens=[100] * len(tenants),
                max_tokens=[50] * len(tenants),
            )
        )
        left = [r.remaining.bucket_tokens for r in unary]
        return left, unary, batch
    finally:
        await servicer.aclose()


@pytest.mark.slow
def test_a_bucket_of_n_admits_exactly_n(tmp_path: Path) -> None:
    with gr.redis_server(str(tmp_path)) as proc:
        left, unary, batch = asyncio.run(_decide(proc.port))

    decisions = [r.decision for r in unary]
    assert decisions == [pb.DECISION_ADMIT] * N + [pb.DECISION_REJECT] * 3
    assert left[:N] == [COST * (N - 1 - i) for i in range(N)]
    assert all(r.reason == pb.REASON_TOKEN_RATE for r in unary[N:])
    assert all(not r.retryable for r in unary[N:])  # rate 0: retrying cannot help
    assert [r.reserved_tokens for r in unary[:N]] == [COST] * N

    assert batch.batch_id == 42
    n = N + 5
    assert list(batch.decision[:n]) == [pb.DECISION_ADMIT] * N + [pb.DECISION_REJECT] * 5
    assert list(batch.bucket_remaining[:N]) == [COST * (N - 1 - i) for i in range(N)]
    assert batch.decision[n] == pb.DECISION_ADMIT  # another tenant's bucket
    assert batch.reason[n + 1] == pb.REASON_UNKNOWN_TENANT
    assert sum(d == pb.DECISION_ADMIT for d in batch.decision) == N + 1
