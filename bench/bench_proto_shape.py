"""Why AdmitBatch is columnar: protobuf-python cost per decision of a
row-shaped batch (repeated AdmitRequest-like submessages) against packed
columns, for parse + field access + building and serialising the answer.
No gRPC, no deciding: only the message handling the server must do.

    .venv/bin/python bench/bench_proto_shape.py
"""

from __future__ import annotations

import statistics
import time

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb

N = 100  # requests per batch
ROUNDS = 7
REPS = 200


ROW_DATA = [
    pb.AdmitRequest(
        tenant_id="acme",
        request_id=f"req-{i:08d}",
        lane="standard",
        prompt_tokens=1000 + i,
        max_tokens=256,
        model="llama",
        pool="p1",
    ).SerializeToString()
    for i in range(N)
]
COL_DATA = pb.AdmitBatch(
    batch_id=1,
    tenant_id=["acme"] * N,
    request_id=[f"req-{i:08d}" for i in range(N)],
    lane=["standard"],
    prompt_tokens=[1000 + i for i in range(N)],
    max_tokens=[256] * N,
    model="llama",
    pool="p1",
).SerializeToString()


def rows() -> int:
    out = []
    for data in ROW_DATA:
        r = pb.AdmitRequest.FromString(data)
        out.append((r.tenant_id, r.request_id, r.lane, r.prompt_tokens, r.max_tokens))
    size = 0
    for t in out:
        size += len(
            pb.AdmitResponse(
                request_id=t[1],
                decision=pb.DECISION_ADMIT,
                reserved_tokens=t[3] + t[4],
                reservation_id=7,
                granted_max_tokens=t[4],
                remaining=pb.Remaining(bucket_tokens=5, hourly_tokens=-1, daily_tokens=-1),
                lane=t[2],
            ).SerializeToString()
        )
    return size


def columns() -> int:
    b = pb.AdmitBatch.FromString(COL_DATA)
    tenants, rids = list(b.tenant_id), list(b.request_id)
    prompt, maxt = list(b.prompt_tokens), list(b.max_tokens)
    n = len(tenants)
    reserved = [p + m for p, m in zip(prompt, maxt, strict=True)]
    res = pb.AdmitBatchResult(
        batch_id=b.batch_id,
        decision=[pb.DECISION_ADMIT] * n,
        reason=[pb.REASON_UNSPECIFIED] * n,
        retry_after_ms=[0] * n,
        reserved_tokens=reserved,
        reservation_id=range(1, n + 1),
        granted_max_tokens=maxt,
        bucket_remaining=reserved,
        hourly_remaining=[-1] * n,
        daily_remaining=[-1] * n,
        duplicate=[False] * n,
    )
    return len(res.SerializeToString()) + len(rids)


def main() -> None:
    results: dict[str, list[float]] = {"rows": [], "columns": []}
    for _ in range(ROUNDS):  # interleaved rounds: noise hits both alike
        for name, fn in (("rows", rows), ("columns", columns)):
            t0 = time.perf_counter()
            for _ in range(REPS):
                fn()
            results[name].append((time.perf_counter() - t0) / REPS / N * 1e9)
    r, c = statistics.median(results["rows"]), statistics.median(results["columns"])
    print(f"| shape (batch of {N}) | ns per decision (median of {ROUNDS}) |")
    print("|---|---|")
    print(f"| row-shaped submessages | {r:,.0f} |")
    print(f"| packed columns (AdmitBatch) | {c:,.0f} |")
    print(f"| ratio rows/columns | {r / c:.1f}x |")


if __name__ == "__main__":
    main()
