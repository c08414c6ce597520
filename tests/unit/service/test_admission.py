"""AdmissionService with an injected clock: no I/O, no gRPC."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.domain import Decision
from controlplane.domain.errors import FailedPrecondition, InvalidArgument, NotFound
from fastpath import Reason

from .conftest import LANES, tenant

NS = 1_000_000_000
MS = 1_000_000


def test_admit_reserves_prompt_plus_max_tokens(make_service: Any) -> None:
    svc = make_service(tenant(burst_tokens=10_000))
    d = svc.admit("acme", "r1", "", 1000, 500)
    assert d.decision == Decision.ADMIT
    assert d.reason == Reason.OK
    assert d.reserved_tokens == 1500
    assert d.granted_max_tokens == 500
    assert d.bucket_remaining == 8500
    assert d.lane == "standard"  # tenant default
    assert d.reservation_id > 0
    assert d.hourly_remaining == -1 and d.daily_remaining == -1


def test_token_rate_refusal_has_exact_refill_retry_after(make_service: Any, clock: Any) -> None:
    svc = make_service(tenant(token_rate=Decimal(1000), burst_tokens=10_000))
    assert svc.admit("acme", "r1", "", 9000, 0).decision == Decision.ADMIT
    d = svc.admit("acme", "r2", "", 3000, 0)  # 1,000 left, 2,000 short at 1,000 tokens/s
    assert (d.decision, d.reason) == (Decision.REJECT, Reason.TOKEN_RATE)
    assert d.retry_after_ns == 2 * NS
    assert d.reserved_tokens == 0 and d.reservation_id == 0
    clock.advance(2 * NS - 1)
    assert svc.admit("acme", "r3", "", 3000, 0).reason == Reason.TOKEN_RATE
    clock.advance(1)
    assert svc.admit("acme", "r4", "", 3000, 0).decision == Decision.ADMIT


def test_max_tokens_capped_by_tenant_per_request_limit(make_service: Any) -> None:
    svc = make_service(tenant(max_tokens_per_request=2000))
    d = svc.admit("acme", "r1", "", 100, 8000)
    assert d.decision == Decision.ADMIT
    assert d.granted_max_tokens == 2000
    assert d.reserved_tokens == 2100
    refused = svc.admit("acme", "r2", "", 2500, 10)
    assert refused.reason == Reason.MAX_TOKENS
    assert refused.retry_after_ns == 0


def test_duplicate_admit_replays_and_takes_nothing(make_service: Any) -> None:
    svc = make_service()
    first = svc.admit("acme", "r1", "", 1000, 1000)
    again = svc.admit("acme", "r1", "", 1000, 1000)
    assert again.duplicate and not first.duplicate
    assert again.reservation_id == first.reservation_id
    assert again.bucket_remaining == first.bucket_remaining
    assert svc.views.tenant_state("acme")["inflight"] == 1
    # the same request id of another tenant is another request
    svc.apply_config([tenant(), tenant("beta")], LANES)
    assert not svc.admit("beta", "r1", "", 1000, 1000).duplicate


def test_refusal_replays_until_retry_after_then_is_decided_again(
    make_service: Any, clock: Any
) -> None:
    svc = make_service(tenant(token_rate=Decimal(1000), burst_tokens=2000))
    svc.admit("acme", "big", "", 2000, 0)
    refused = svc.admit("acme", "r1", "", 500, 0)
    assert refused.reason == Reason.TOKEN_RATE and refused.retry_after_ns == 500 * MS
    clock.advance(100 * MS)
    replay = svc.admit("acme", "r1", "", 500, 0)
    assert replay.duplicate and replay.reason == Reason.TOKEN_RATE
    clock.advance(400 * MS)
    fresh = svc.admit("acme", "r1", "", 500, 0)
    assert not fresh.duplicate and fresh.decision == Decision.ADMIT


def test_complete_refunds_unused_reservation(make_service: Any) -> None:
    svc = make_service(tenant(burst_tokens=10_000, hourly_quota=100_000))
    d = svc.admit("acme", "r1", "", 1000, 4000)
    assert d.bucket_remaining == 5000 and d.hourly_remaining == 95_000
    s = svc.complete("acme", "r1", 0, 1000, 1200)
    assert (s.reserved_tokens, s.actual_tokens, s.refunded_tokens) == (5000, 2200, 2800)
    state = svc.views.tenant_state("acme")
    assert state["level_mtok"] == (10_000 - 2200) * 1000
    assert state["hour_used"] == 2200
    assert state["inflight"] == 0


def test_complete_is_idempotent(make_service: Any) -> None:
    svc = make_service()
    svc.admit("acme", "r1", "", 1000, 4000)
    first = svc.complete("acme", "r1", 0, 1000, 100)
    level = svc.views.tenant_state("acme")["level_mtok"]
    second = svc.complete("acme", "r1", 0, 1000, 100)
    assert second.duplicate and not first.duplicate
    assert second.refunded_tokens == first.refunded_tokens
    assert svc.views.tenant_state("acme")["level_mtok"] == level


def test_complete_errors(make_service: Any) -> None:
    svc = make_service(tenant(burst_tokens=1000))
    with pytest.raises(NotFound, match="request_id"):
        svc.complete("acme", "never", 0, 1, 1)
    svc.admit("acme", "too-big", "", 5000, 0)
    with pytest.raises(FailedPrecondition, match="refused"):
        svc.complete("acme", "too-big", 0, 1, 1)
    d = svc.admit("acme", "ok", "", 10, 10)
    svc.admit("acme", "ok2", "", 10, 10)
    with pytest.raises(InvalidArgument, match="reservation_id"):
        svc.complete("acme", "ok2", d.reservation_id, 1, 1)
    with pytest.raises(InvalidArgument, match="cached_prompt_tokens"):
        svc.complete("acme", "ok", 0, 10, 1, cached_prompt_tokens=11)
    with pytest.raises(InvalidArgument, match="kv_cache_miss_rate"):
        svc.complete("acme", "ok", 0, 10, 1, kv_cache_miss_rate=float("nan"))
    # none of the failed calls settled anything
    assert svc.views.tenant_state("acme")["inflight"] == 2
    # settling by reservation id alone works
    assert svc.complete("acme", "ok", d.reservation_id, 10, 5).refunded_tokens == 5


def test_concurrency_limit_and_release_on_complete(make_service: Any) -> None:
    svc = make_service(tenant(max_concurrency=2), concurrency_retry_ms=250)
    assert svc.admit("acme", "a", "", 10, 10).decision == Decision.ADMIT
    assert svc.admit("acme", "b", "", 10, 10).decision == Decision.ADMIT
    refused = svc.admit("acme", "c", "", 10, 10)
    assert refused.reason == Reason.CONCURRENCY and refused.retry_after_ns == 250 * MS
    svc.complete("acme", "a", 0, 10, 10)
    assert svc.admit("acme", "d", "", 10, 10).decision == Decision.ADMIT


def test_unsettled_reservations_expire_and_free_their_slot(make_service: Any, clock: Any) -> None:
    svc = make_service(tenant(max_concurrency=1), reservation_ttl_s=60)
    svc.admit("acme", "a", "", 10, 10)
    assert svc.admit("acme", "b", "", 10, 10).reason == Reason.CONCURRENCY
    clock.advance(59 * NS)
    assert svc.expire() == 0
    clock.advance(1 * NS)
    assert svc.expire() == 1
    assert svc.views.open_reservations == 0
    assert svc.admit("acme", "c", "", 10, 10).decision == Decision.ADMIT
    with pytest.raises(NotFound, match="expired"):
        svc.complete("acme", "a", 0, 10, 10)


def test_a_settled_id_is_remembered_for_its_window_not_the_ttl(
    make_service: Any, clock: Any
) -> None:
    svc = make_service(reservation_ttl_s=600, settled_id_window_s=60)
    first = svc.admit("acme", "a", "", 10, 10)
    svc.admit("acme", "open", "", 10, 10)  # never settled: kept for the TTL
    clock.advance(10 * NS)
    svc.complete("acme", "a", first.reservation_id, 10, 5)
    clock.advance(59 * NS)
    svc.expire()
    # inside the window: replays, for Admit and Complete alike
    again = svc.admit("acme", "a", "", 999, 999)
    assert again.duplicate and again.reservation_id == first.reservation_id
    assert svc.complete("acme", "a", 0, 10, 5).duplicate
    clock.advance(1 * NS)
    svc.expire()
    assert svc.views.remembered_requests == 1  # only the unsettled one
    with pytest.raises(NotFound):
        svc.complete("acme", "a", 0, 10, 5)
    fresh = svc.admit("acme", "a", "", 10, 10)  # decided anew
    assert not fresh.duplicate and fresh.reservation_id != first.reservation_id
    # the old admission's TTL entry does not forget the new one
    clock.advance(600 * NS)
    assert svc.expire() == 2  # "open" and the new "a", both unsettled
    # a window of 0 forgets at the next expiry pass; it never outlives the TTL
    short = make_service(settled_id_window_s=0)
    d = short.admit("acme", "x", "", 10, 10)
    short.complete("acme", "x", d.reservation_id, 10, 5)
    short.expire()
    assert short.views.remembered_requests == 0


def test_hourly_quota_refusal_retries_at_next_hour(make_service: Any, clock: Any) -> None:
    svc = make_service(tenant(burst_tokens=100_000, token_rate=Decimal(100_000), hourly_quota=5000))
    assert svc.admit("acme", "a", "", 4000, 0).decision == Decision.ADMIT
    d = svc.admit("acme", "b", "", 2000, 0)
    assert d.reason == Reason.HOURLY_QUOTA
    hour = 3600 * NS
    assert d.retry_after_ns == hour - clock.now_ns % hour
    # a refund inside the same hour gives quota back
    svc.complete("acme", "a", 0, 2000, 0)
    assert svc.admit("acme", "c", "", 2000, 0).decision == Decision.ADMIT


def test_unknown_and_disabled_tenants(make_service: Any) -> None:
    svc = make_service(tenant(), tenant("off", enabled=False))
    unknown = svc.admit("nobody", "r", "", 1, 1)
    assert (unknown.decision, unknown.reason) == (Decision.REJECT, Reason.UNKNOWN_TENANT)
    assert svc.admit("off", "r", "", 1, 1).reason == Reason.TENANT_DISABLED


def test_default_tenant_policy_admits_unknown_ids_on_one_shared_bucket(make_service: Any) -> None:
    svc = make_service(tenant(), tenant("anon", burst_tokens=1000), default_tenant="anon")
    assert svc.admit("stranger-1", "r", "", 600, 0).decision == Decision.ADMIT
    assert svc.admit("stranger-2", "r", "", 600, 0).reason == Reason.TOKEN_RATE


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tenant_id": ""}, "tenant_id"),
        ({"tenant_id": "x" * 129}, "tenant_id"),
        ({"request_id": ""}, "request_id"),
        ({"request_id": "bad\x00id"}, "request_id"),
        ({"prompt_tokens": -1}, "prompt_tokens"),
        ({"max_tokens": 10_000_001}, "max_tokens"),
        ({"lane": "gold"}, "lane"),
        ({"model": "m" * 257}, "model"),
    ],
)
def test_bad_input_names_the_field_and_changes_nothing(
    make_service: Any, kwargs: dict[str, Any], field: str
) -> None:
    svc = make_service()
    before = svc.views.tenant_state("acme")
    args = {
        "tenant_id": "acme",
        "request_id": "r",
        "lane": "",
        "prompt_tokens": 1,
        "max_tokens": 1,
    } | kwargs
    with pytest.raises(InvalidArgument) as err:
        svc.admit(**args)
    assert err.value.field == field
    assert svc.views.tenant_state("acme") == before


def test_reconfigure_keeps_bucket_level(make_service: Any, clock: Any) -> None:
    svc = make_service(tenant(burst_tokens=10_000))
    svc.admit("acme", "a", "", 6000, 0)
    svc.apply_config([tenant(burst_tokens=20_000, max_concurrency=5)], LANES)
    assert svc.views.tenant_state("acme")["level_mtok"] == 4000 * 1000
    svc.apply_config([tenant(burst_tokens=3000)], LANES)  # shrink: clamp to the new burst
    assert svc.views.tenant_state("acme")["level_mtok"] == 3000 * 1000


def test_removed_tenant_is_unknown_but_can_still_settle(make_service: Any) -> None:
    svc = make_service(tenant(), tenant("beta"))
    svc.admit("beta", "r", "", 10, 10)
    svc.apply_config([tenant()], LANES)
    assert svc.admit("beta", "r2", "", 1, 1).reason == Reason.UNKNOWN_TENANT
    assert svc.complete("beta", "r", 0, 10, 0).refunded_tokens == 10


# ------------------------------------------------------------------ batches


def test_batch_validation_rejects_whole_batch_without_state_change(make_service: Any) -> None:
    svc = make_service()
    before = svc.views.tenant_state("acme")
    cases = [
        (["acme", "acme"], ["a"], [], [1, 1], [1, 1], "request_id"),
        (["acme", "acme"], ["a", "b"], [], [1, -5], [1, 1], "prompt_tokens[1]"),
        (["acme", "acme"], ["a", "a"], [], [1, 1], [1, 1], "request_id[1]"),
        (["acme", ""], ["a", "b"], [], [1, 1], [1, 1], "tenant_id[1]"),
        (["acme", "acme"], ["a", "b"], ["standard", "gold"], [1, 1], [1, 1], "lane[1]"),
        (["acme", "acme"], ["a", "b"], ["x", "y", "z"], [1, 1], [1, 1], "lane"),
    ]
    for tenants, rids, lanes, prompt, maxt, field in cases:
        with pytest.raises(InvalidArgument) as err:
            svc.batches.admit(tenants, rids, lanes, prompt, maxt)
        assert err.value.field == field
    assert svc.views.tenant_state("acme") == before
    assert svc.views.open_reservations == 0


def test_batch_with_duplicates_unknown_and_disabled(make_service: Any) -> None:
    svc = make_service(tenant(), tenant("off", enabled=False))
    svc.admit("acme", "seen", "", 10, 10)
    r = svc.batches.admit(
        ["acme", "nobody", "off", "acme"],
        ["seen", "x", "y", "new"],
        ["batch"],
        [10, 10, 10, 10],
        [10, 10, 10, 10],
    )
    assert r.duplicate == [True, False, False, False]
    assert r.reason == [Reason.OK, Reason.UNKNOWN_TENANT, Reason.TENANT_DISABLED, Reason.OK]
    assert r.decision == [Decision.ADMIT, Decision.REJECT, Decision.REJECT, Decision.ADMIT]
    assert len(set(r.reservation_id)) == 4 - 1  # two refusals share id 0


ops = st.lists(
    st.tuples(
        st.sampled_from(["acme", "beta", "ghost"]),
        st.integers(0, 12),  # request id (small range: duplicates happen)
        st.integers(0, 3000),  # prompt tokens
        st.integers(0, 3000),  # max tokens
    ),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(requests=ops, split=st.integers(1, 40))
def test_batch_decides_exactly_like_unary_calls_in_order(
    make_service: Any, requests: list[tuple[str, int, int, int]], split: int
) -> None:
    tenants = [tenant(burst_tokens=8000, max_concurrency=6), tenant("beta", burst_tokens=5000)]
    unary = make_service(*tenants)
    batched = make_service(*tenants)
    expected = [unary.admit(t, f"r{i}", "", p, m) for t, i, p, m in requests]
    got: list[tuple[Any, ...]] = []
    # deduplicate inside each chunk the way a sidecar must (duplicates in one batch are refused)
    chunk: list[tuple[str, int, int, int]] = []

    def flush() -> None:
        if chunk:
            r = batched.batches.admit(
                [c[0] for c in chunk],
                [f"r{c[1]}" for c in chunk],
                [],
                [c[2] for c in chunk],
                [c[3] for c in chunk],
            )
            got.extend(
                zip(
                    r.reason, r.reserved_tokens, r.bucket_remaining, r.duplicate,
                    r.retry_after_ms, r.reservation_id, r.granted_max_tokens,
                    r.hourly_remaining, r.daily_remaining, r.retryable or [], r.degraded,
                    strict=True,
                )
            )  # fmt: skip
            chunk.clear()

    for req in requests:
        if len(chunk) >= split or any((c[0], c[1]) == (req[0], req[1]) for c in chunk):
            flush()
        chunk.append(req)
    flush()
    assert got == [
        (
            int(d.reason), d.reserved_tokens, d.bucket_remaining, d.duplicate,
            -(-d.retry_after_ns // 10**6), d.reservation_id, d.granted_max_tokens,
            d.hourly_remaining, d.daily_remaining, d.retryable, d.degradation is not None,
        )
        for d in expected
    ]  # fmt: skip
    for t in ("acme", "beta"):
        assert unary.views.tenant_state(t) == batched.views.tenant_state(t)
    # and what each path remembers is the same record, field for field
    for t, i, _, _ in requests:
        assert unary.views.record(t, f"r{i}") == batched.views.record(t, f"r{i}")


def test_report_load_validates_and_counts_fresh_engines(make_service: Any, clock: Any) -> None:
    svc = make_service(load_report_stale_s=10)
    assert svc.report_load("p1", "e1", 100, 1000, 5, 100, 0.1, 0.5) == 1
    assert svc.report_load("p1", "e2", 100, 1000, 5, 100, 0.1, 0.5) == 2
    clock.advance(11 * NS)
    assert svc.report_load("p1", "e2", 100, 1000, 5, 100, 0.1, 0.5) == 1
    for args, field in [
        (("p1", "e1", -1, 1000, 0, 1, 0.0, 0.0), "batch_tokens"),
        (("p1", "e1", 1, 0, 0, 1, 0.0, 0.0), "max_batch_tokens"),
        (("p1", "e1", 1, 1, -3, 1, 0.0, 0.0), "queue_depth"),
        (("p1", "e1", 1, 1, 0, -1, 0.0, 0.0), "queue_capacity"),
        # values the proto allows but no engine has: refused, not scored
        (("p1", "e1", 1, 1, 0, 2**63 - 1, 0.0, 0.0), "queue_capacity"),
        (("p1", "e1", 10**12 + 1, 1, 0, 1, 0.0, 0.0), "batch_tokens"),
        (("p1", "e1", 1, 1, 0, 1, 1.5, 0.0), "kv_cache_miss_rate"),
        (("p1", "e1", 1, 1, 0, 1, 0.0, -0.1), "gpu_utilization"),
        (("", "e1", 1, 1, 0, 1, 0.0, 0.0), "pool"),
    ]:
        with pytest.raises(InvalidArgument) as err:
            svc.report_load(*args)
        assert err.value.field == field
    # nothing was stored by the refused reports: still one fresh engine
    assert {e: s.queue_capacity for e, s in svc.views.pools["p1"].items()} == {"e1": 100, "e2": 100}
    # an unbounded queue (0) and an unmeasured miss rate (None) are valid
    assert svc.report_load("p1", "e3", 1, 1, 0, 0, None, 0.0) == 2


def test_every_record_has_every_field(make_service: Any) -> None:
    from controlplane.service import records as R

    svc = make_service(tenant(burst_tokens=1000))
    svc.admit("acme", "ok", "", 10, 10)
    svc.admit("acme", "refused", "", 5000, 0)
    svc.batches.admit(["acme", "acme"], ["b-ok", "b-refused"], [], [10, 5000], [10, 0])
    svc.complete("acme", "ok", 0, 10, 5)
    recs = {rid: svc.views.record("acme", rid) for rid in ("ok", "refused", "b-ok", "b-refused")}
    assert {len(r.raw) for r in recs.values() if r is not None} == {R.FIELDS}
    assert None not in recs.values()
    ok = recs["ok"]
    assert ok is not None and ok.state == R.SETTLED
    assert ok.arrived_ns == ok.decided_ns
    assert [r.state for r in recs.values() if r is not None] == [
        R.SETTLED, R.REJECTED, R.OPEN, R.REJECTED
    ]  # fmt: skip


def test_refusals_say_whether_retrying_can_help(make_service: Any) -> None:
    """``retryable`` is its own field: retry_after == 0 is not the signal."""
    svc = make_service(
        tenant(burst_tokens=1_000, max_tokens_per_request=2_000), tenant("off", enabled=False)
    )
    ok = svc.admit("acme", "ok", "", 900, 0)
    short = svc.admit("acme", "short", "", 900, 0)  # bucket short: wait for the refill
    huge = svc.admit("acme", "huge", "", 2_500, 0)  # over the per-request cap: never
    unknown = svc.admit("nobody", "x", "", 1, 1)
    off = svc.admit("off", "y", "", 1, 1)
    assert [d.retryable for d in (ok, short, huge, unknown, off)] == [
        False, True, False, False, False
    ]  # fmt: skip
    assert short.retry_after_ns > 0 and huge.retry_after_ns == 0
    # over the burst, within twice it: waits for a full bucket, then into debt
    big = svc.admit("acme", "big", "", 1_500, 0)
    assert (big.reason, big.retryable) == (Reason.TOKEN_RATE, True)
    assert big.retry_after_ns == 900 * 1_000_000  # 900 tokens at 1,000/s: a full bucket
    batch = svc.batches.admit(["acme", "acme", "nobody"], ["b1", "b2", "b3"], [],
                            [500, 2_500, 1], [0, 0, 1])  # fmt: skip
    assert batch.reason[0] == Reason.TOKEN_RATE  # b1: the bucket is still short
    assert batch.retryable == [True, False, False]


@pytest.mark.parametrize("window_s", [600, 120])
def test_settled_ids_are_forgotten_and_their_keys_released(
    make_service: Any, clock: Any, window_s: int
) -> None:
    # 20 settled per second for 15 simulated minutes: what stays remembered
    # is the last window's (or TTL's) settlements, and the expiry queue of
    # admissions does not keep the settled ones' keys alive until the TTL
    svc = make_service(tenant(burst_tokens=10**9, token_rate=Decimal(10**6)),
                       reservation_ttl_s=600, settled_id_window_s=window_s)  # fmt: skip
    for sec in range(900):
        for j in range(20):
            d = svc.admit("acme", f"r{sec}-{j}", "", 10, 10)
            svc.complete("acme", f"r{sec}-{j}", d.reservation_id, 10, 5)
        clock.advance(NS)
        svc.expire()
    # (an id settled exactly one window ago is forgotten at that instant)
    assert svc.views.remembered_requests == 20 * (window_s - 1)
    # the admissions' expiry queue is compacted: its entries for ids settled
    # and forgotten do not pile up until the TTL
    assert svc._log.table.footprint()["admitted_fifo"] <= 2 * svc.views.remembered_requests + 4096


def test_remembered_requests_are_no_objects_for_the_garbage_collector(
    make_service: Any,
) -> None:
    import gc

    svc = make_service(tenant(burst_tokens=10**9, token_rate=Decimal(10**6)))
    log = svc._log
    for i in range(5100):
        if i == 100:  # every name and tenant key interned by now
            gc.collect()
            tracked = len(gc.get_objects())
        d = svc.admit("acme", f"r{i}", "", 10, 10)
        svc.complete("acme", f"r{i}", d.reservation_id, 10, 5)
    gc.collect()
    assert svc.views.remembered_requests == 5100
    # nothing per request stays tracked (the reference build's tuples are
    # untracked by the first collection they survive; the compiled build
    # makes none)
    assert len(gc.get_objects()) - tracked < 100
    # the interning dicts are tracked once prepared, so a freeze takes them
    # out of the collector's sight for good
    svc.prepare_gc_freeze()
    assert gc.is_tracked(log.names.ids)
    gc.freeze()
    try:
        svc.admit("other-tenant", "a", "", 10, 10)
        gc.collect()
        assert all(o is not log.names.ids for o in gc.get_objects())
    finally:
        gc.unfreeze()
