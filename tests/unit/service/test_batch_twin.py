"""The batch path is the vectorised twin of the scalar decision
(service/batch.py against ``Decider.decide``): a random batch decided in
columns gets, entry for entry, the decision, reason, sizes and retry_after
that the same entries get decided one by one, in batch order, by the
scalar path - the reference - on a twin service with the same history.

Every rule the twin restates in columns is in play: shadow tenants (the
tenant's flag and the policy's), a degraded pool (its output capped) and an
overloaded one (refused for backpressure), the pool gate with a load report
(room for all, or none), shares of a tenant's limits under several replicas
(refusals explained, quotas tenant-wide), length-aware placement, quotas,
concurrency, per-request caps and the reservation ids. Within one batch the
gate is planned for all entries at once, so the reports give a pool either
room for every entry or none (what a pool has room for in the middle of a
batch is the unary path's business, tests/unit/service/test_decide_twins.py).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.domain import AdmitDecision
from controlplane.service.shares import PPM, Share

from .conftest import UnitPolicy, tenant

MS = 1_000_000
TENANTS = [
    tenant("acme", token_rate=Decimal(500), burst_tokens=6000, max_concurrency=6,
           max_tokens_per_request=2500, hourly_quota=12_000),
    tenant("shade", burst_tokens=2000, shadow_mode=True),
    tenant("long", burst_tokens=20_000, long_request_tokens=2000, pool="q"),
    tenant("quota", burst_tokens=50_000, daily_quota=9_000),
    tenant("off", enabled=False),
]  # fmt: skip
NAMES = ["acme", "acme", "shade", "long", "quota", "off", "ghost"]
SIZES = [0, 1, 100, 400, 900, 1500, 2100, 2600, 3400]

# A pool's load report: (engines waiting, running of 256 sequences, KV
# cache usage, queue depth). "roomy" leaves the gate room for any batch
# here, "full" none (KV cache past the threshold), "degraded" caps the
# output (queue depth past degrade_queue_depth), "pressed" refuses for
# backpressure (queue at its capacity).
REPORTS = {
    "roomy": dict(queue_depth=0, requests_running=0, kv_cache_usage=0.1),
    "full": dict(queue_depth=0, requests_running=0, kv_cache_usage=0.99),
    "degraded": dict(queue_depth=60, requests_running=0, kv_cache_usage=0.1),
    "pressed": dict(queue_depth=5000, requests_running=0, kv_cache_usage=0.1),
}

entry = st.tuples(
    st.sampled_from(NAMES),
    st.sampled_from(["", "", "standard", "batch"]),
    st.sampled_from(SIZES),  # prompt tokens
    st.sampled_from(SIZES),  # max tokens
)
step = st.tuples(
    st.lists(entry, min_size=1, max_size=10),
    st.sampled_from(["", "", "p", "q"]),  # the batch's pool ("" = each entry's)
    st.integers(0, 800),  # ms passed before it
    st.booleans(),  # complete the admissions after it
)
world = st.fixed_dictionaries({
    "gate": st.booleans(),
    "shadow_policy": st.booleans(),
    "reports": st.fixed_dictionaries(
        {"p": st.sampled_from([None, *REPORTS]), "q": st.sampled_from([None, *REPORTS])}
    ),
    # None: one replica; else acme's share of its limits and its hourly allowance
    "share": st.sampled_from([None, (PPM, 12_000), (PPM // 2, 3000), (PPM // 10, 500)]),
    "steps": st.lists(step, min_size=1, max_size=6),
})  # fmt: skip


def scalar(d: AdmitDecision) -> tuple[Any, ...]:
    return (
        int(d.decision), int(d.reason), -(-d.retry_after_ns // MS), d.reserved_tokens,
        d.granted_max_tokens, d.bucket_remaining, d.hourly_remaining, d.daily_remaining,
        int(d.shadow_reason), d.degradation is not None, d.reservation_id,
    )  # fmt: skip


def build(make_service: Any, w: dict[str, Any]) -> Any:
    policy = UnitPolicy(
        pool_gate=w["gate"], shadow_mode=w["shadow_policy"], degrade_queue_depth=40,
        degrade_max_tokens=300, queue_limit=10_000, gate_waiting_per_engine=1000,
        gate_fallback_inflight=1000,
    )  # fmt: skip
    svc = make_service(*TENANTS, policy=policy)
    if w["share"] is not None:
        svc.shares.start(MS * 200)
        fraction, hourly = w["share"]
        for t in TENANTS:
            svc.shares.set(t.tenant_id, Share(fraction, hour_allowance=hourly))
    for pool, kind in w["reports"].items():
        if kind is None:
            continue
        for engine in ("e1", "e2"):
            r = REPORTS[kind]
            svc.report_load(pool, engine, 0, 1 << 20, r["queue_depth"], 5000, 0.1, 0.5,
                            requests_running=r["requests_running"], max_num_seqs=256,
                            kv_cache_usage=r["kv_cache_usage"])  # fmt: skip
    return svc


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(w=world)
def test_a_batch_is_decided_as_its_entries_one_by_one(
    make_service: Any, clock: Any, w: dict[str, Any]
) -> None:
    one_by_one, batched = build(make_service, w), build(make_service, w)
    n = 0
    for entries, pool, ms, complete in w["steps"]:
        clock.advance(ms * MS)
        ids = [f"r{n + i}" for i in range(len(entries))]
        n += len(entries)
        tenants = [e[0] for e in entries]
        lanes = [e[1] for e in entries]
        prompts = [e[2] for e in entries]
        maxt = [e[3] for e in entries]
        want = [
            one_by_one.admit(t, rid, lane, p, m, pool=pool)
            for t, rid, lane, p, m in zip(tenants, ids, lanes, prompts, maxt, strict=True)
        ]
        got = batched.batches.admit(tenants, ids, lanes, prompts, maxt, pool=pool)
        for i, d in enumerate(want):
            mine = (
                got.decision[i], got.reason[i], got.retry_after_ms[i], got.reserved_tokens[i],
                got.granted_max_tokens[i], got.bucket_remaining[i], got.hourly_remaining[i],
                got.daily_remaining[i], got.shadow_reason[i], got.degraded[i],
                got.reservation_id[i],
            )  # fmt: skip
            assert mine == scalar(d), (i, entries[i], pool, w)
            assert one_by_one.views.record(tenants[i], ids[i]) == batched.views.record(
                tenants[i], ids[i]
            ), (i, entries[i], pool)
        if complete:
            for t, rid, d in zip(tenants, ids, want, strict=True):
                if d.reservation_id:
                    a = one_by_one.complete(t, rid, d.reservation_id, 0, 50)
                    assert a == batched.complete(t, rid, d.reservation_id, 0, 50)
    for t in ("acme", "shade", "long", "quota"):
        assert one_by_one.views.tenant_state(t) == batched.views.tenant_state(t)
