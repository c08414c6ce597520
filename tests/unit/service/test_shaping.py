"""Burst shaping with an injected clock: queueing, lanes, token fairness,
length-aware placement, backpressure, degradation, shadow mode, watermark.
Order and counts only; no wall-clock time."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from controlplane.domain import AdmitDecision, Decision
from controlplane.domain.policy import Policy
from controlplane.service.queueing import Waiter
from fastpath import Reason

from .conftest import LANES, UnitPolicy, tenant

NS = 1_000_000_000
MS = 1_000_000


def decided(x: AdmitDecision | Waiter) -> AdmitDecision:
    assert isinstance(x, AdmitDecision), f"expected a decision, got a waiter for {x.key}"
    return x


def waiting(x: AdmitDecision | Waiter) -> Waiter:
    assert isinstance(x, Waiter), f"expected to wait, got {x}"
    return x


def report(svc: Any, pool: str = "p", *, batch: int = 0, depth: int = 0, miss: float = 0.0,
           gpu: float = 0.0, engine: str = "e0") -> int:  # fmt: skip
    return int(svc.report_load(pool, engine, batch, 1000, depth, 1000, miss, gpu))


# ------------------------------------------------------------------ queueing


def test_token_rate_refusal_becomes_a_wait_then_admission(make_service: Any, clock: Any) -> None:
    svc = make_service(tenant(token_rate=Decimal(1000), burst_tokens=1000))
    assert decided(svc.admit_or_wait("acme", "a", "", 1000, 0)).decision == Decision.ADMIT
    w = waiting(svc.admit_or_wait("acme", "b", "", 300, 0))  # 300 ms of refill needed
    assert svc.waiting == 1
    assert svc.next_wakeup_ns() == clock.now_ns + 300 * MS
    clock.advance(299 * MS)
    svc.tick()
    assert not w.done
    clock.advance(1 * MS)
    svc.tick()
    assert w.done and w.result.decision == Decision.ADMIT
    assert w.result.queue_wait_ns == 300 * MS
    assert svc.waiting == 0


def test_refill_beyond_the_max_wait_is_refused_at_once(make_service: Any) -> None:
    # a standard request waits at most 0.75 x its 3 s TTFT SLO = 2.25 s;
    # 3,000 tokens at 1,000/s take 3 s
    svc = make_service(tenant(token_rate=Decimal(1000), burst_tokens=3000))
    svc.admit_or_wait("acme", "a", "", 3000, 0)
    d = decided(svc.admit_or_wait("acme", "b", "", 3000, 0))
    assert d.reason == Reason.TOKEN_RATE and d.retry_after_ns == 3 * NS
    # 2,000 tokens (2 s) fit in the wait: it waits
    waiting(svc.admit_or_wait("acme", "c", "", 2000, 0))


def test_quota_refusals_never_wait(make_service: Any) -> None:
    svc = make_service(tenant(hourly_quota=1000))
    svc.admit_or_wait("acme", "a", "", 900, 0)
    assert decided(svc.admit_or_wait("acme", "b", "", 200, 0)).reason == Reason.HOURLY_QUOTA


@pytest.mark.parametrize(
    ("policy", "wait_ms"),
    [
        (UnitPolicy(), 750),  # 0.75 x premium's 1 s TTFT SLO
        (UnitPolicy(gate_release_headroom=0.5), 500),
        (UnitPolicy(lane_ttft_slo_ms={"standard": 3000}), 200),  # no SLO: the wait target
        (UnitPolicy(pool_gate=False), 200),  # without the gate: the lane's wait target
    ],
)
def test_wait_ends_at_the_lanes_bound_with_queue_timeout(
    make_service: Any, clock: Any, policy: Policy, wait_ms: int
) -> None:
    svc = make_service(tenant(max_concurrency=1), policy=policy)
    svc.admit_or_wait("acme", "a", "premium", 1, 1)
    w = waiting(svc.admit_or_wait("acme", "b", "premium", 1, 1))
    clock.advance((wait_ms - 1) * MS)
    svc.tick()
    assert not w.done
    clock.advance(1 * MS)
    svc.tick()
    assert w.result.reason == Reason.QUEUE_TIMEOUT
    assert w.result.retry_after_ns == 200 * MS  # the lane's wait target: a slot, not the pool
    assert w.result.queue_wait_ns == wait_ms * MS
    assert svc.waiting == 0


def test_tenant_max_wait_and_caller_deadline_shorten_the_wait(
    make_service: Any, clock: Any
) -> None:
    svc = make_service(tenant(max_concurrency=1, max_wait_ms=50))
    svc.admit_or_wait("acme", "a", "", 1, 1)
    w = waiting(svc.admit_or_wait("acme", "b", "", 1, 1))
    assert w.deadline_ns == clock.now_ns + 50 * MS
    w2 = waiting(svc.admit_or_wait("acme", "c", "", 1, 1, deadline_ns=clock.now_ns + 30 * MS))
    assert w2.deadline_ns < clock.now_ns + 30 * MS
    zero = svc.admit_or_wait("acme", "d", "", 1, 1, deadline_ns=clock.now_ns)
    assert decided(zero).reason == Reason.CONCURRENCY  # no time left to wait


def test_settlement_admits_the_next_waiter_at_once(make_service: Any) -> None:
    svc = make_service(tenant(max_concurrency=1))
    svc.admit_or_wait("acme", "a", "", 10, 10)
    w = waiting(svc.admit_or_wait("acme", "b", "", 10, 10))
    svc.complete("acme", "a", 0, 10, 5)
    assert w.done and w.result.decision == Decision.ADMIT


def test_queue_bounds_per_tenant_lane_and_global(make_service: Any) -> None:
    svc = make_service(
        tenant(max_concurrency=1, max_queued=2),
        tenant("beta", max_concurrency=1),
        policy=UnitPolicy(lane_queue_limit=3, queue_limit=100),
    )
    svc.admit_or_wait("acme", "a0", "", 1, 1)
    waiting(svc.admit_or_wait("acme", "a1", "", 1, 1))
    waiting(svc.admit_or_wait("acme", "a2", "", 1, 1))
    full = decided(svc.admit_or_wait("acme", "a3", "", 1, 1))
    assert full.reason == Reason.QUEUE_FULL and full.retry_after_ns == 800 * MS
    assert svc.views.tenant_queued("acme") == 2 and svc.views.tenant_queued("nobody") == 0
    svc.admit_or_wait("beta", "b0", "", 1, 1)
    waiting(svc.admit_or_wait("beta", "b1", "", 1, 1))  # standard lane: 3 waiting now
    assert decided(svc.admit_or_wait("beta", "b2", "", 1, 1)).reason == Reason.QUEUE_FULL
    assert svc.views.queue_depths()["standard"] == 3


def test_cancelled_waiter_leaves_at_once_and_leaks_nothing(make_service: Any) -> None:
    svc = make_service(tenant(max_concurrency=1))
    svc.admit_or_wait("acme", "a", "", 10, 10)
    w = waiting(svc.admit_or_wait("acme", "b", "", 10, 10))
    svc.cancel(w)
    assert svc.waiting == 0 and svc.views.queue_depths()["standard"] == 0
    svc.complete("acme", "a", 0, 10, 10)
    assert svc.views.tenant_state("acme")["inflight"] == 0  # the cancelled call took nothing
    # the id is free again: nothing was remembered for it
    assert decided(svc.admit_or_wait("acme", "b", "", 10, 10)).decision == Decision.ADMIT


def test_same_request_id_twice_while_waiting_is_refused(make_service: Any) -> None:
    from controlplane.domain.errors import AlreadyExists

    svc = make_service(tenant(max_concurrency=1))
    svc.admit_or_wait("acme", "a", "", 1, 1)
    waiting(svc.admit_or_wait("acme", "b", "", 1, 1))
    with pytest.raises(AlreadyExists, match="request_id"):
        svc.admit_or_wait("acme", "b", "", 1, 1)


def test_new_arrivals_queue_behind_a_backlog(make_service: Any) -> None:
    # Capacity (the watermark) frees one request at a time: whoever waited
    # first in fair order goes first, a newcomer does not jump the queue.
    svc = make_service(tenant(), policy=UnitPolicy(global_inflight_tokens=100))
    svc.admit_or_wait("acme", "a", "", 100, 0)
    w1 = waiting(svc.admit_or_wait("acme", "b", "", 100, 0))
    w2 = waiting(svc.admit_or_wait("acme", "c", "", 100, 0))
    svc.complete("acme", "a", 0, 100, 0)
    assert w1.done and not w2.done


# ------------------------------------------------- lanes and token fairness


def _drain_in_order(svc: Any, waiters: list[Waiter], cost: int) -> list[Waiter]:
    """Free watermark capacity one request at a time; return the admission order."""
    order: list[Waiter] = []
    pending = list(waiters)
    while pending:
        admitted = [w for w in pending if w.done]
        assert len(admitted) == 1, "capacity for exactly one request frees each time"
        w = admitted[0]
        assert w.result.decision == Decision.ADMIT
        order.append(w)
        pending.remove(w)
        svc.complete(w.key[0], w.key[1], 0, cost, 0)
    return order


def test_lanes_are_served_by_weight_over_tokens(make_service: Any) -> None:
    cost = 100
    svc = make_service(
        tenant(burst_tokens=10**9, token_rate=Decimal(10**6)),
        policy=UnitPolicy(global_inflight_tokens=cost),
    )
    svc.admit_or_wait("acme", "blocker", "", cost, 0)
    ws: list[Waiter] = []
    for i in range(60):  # the same backlog in each lane
        for lane in ("premium", "standard", "batch"):
            if lane != "premium":
                ws.append(waiting(svc.admit_or_wait("acme", f"{lane}{i}", lane, cost, 0)))
    svc.complete("acme", "blocker", 0, cost, 0)
    order = _drain_in_order(svc, ws, cost)
    first = [w.lane for w in order[:60]]
    # standard : batch = 0.45 : 0.15 = 3 : 1 while both are backlogged
    assert abs(first.count("standard") - 45) <= 1
    assert abs(first.count("batch") - 15) <= 1
    # and batch is never starved: it is served within every window of 4
    for i in range(0, 56, 4):
        assert "batch" in first[i : i + 5]


def test_flooding_tenant_cannot_take_more_than_its_fair_share(make_service: Any) -> None:
    # Two tenants backlogged in one lane; "flood" queued 10x more requests
    # first. Virtual token counters keep their service within one request.
    cost_a, cost_b = 300, 100
    svc = make_service(
        tenant("flood", burst_tokens=10**9, token_rate=Decimal(10**6), max_queued=1000),
        tenant("calm", burst_tokens=10**9, token_rate=Decimal(10**6), max_queued=1000),
        policy=UnitPolicy(global_inflight_tokens=300),
    )
    svc.admit_or_wait("flood", "blocker", "", 300, 0)
    ws = [waiting(svc.admit_or_wait("flood", f"f{i}", "", cost_a, 0)) for i in range(200)]
    ws += [waiting(svc.admit_or_wait("calm", f"c{i}", "", cost_b, 0)) for i in range(60)]
    svc.complete("flood", "blocker", 0, 300, 0)
    served = {"flood": 0, "calm": 0}
    pending = list(ws)
    max_gap = 0
    while pending:
        w = next(x for x in pending if x.done)
        pending.remove(w)
        served[w.key[0]] += w.result.reserved_tokens
        calm_backlogged = any(x.key[0] == "calm" for x in pending)
        if calm_backlogged:
            max_gap = max(max_gap, abs(served["flood"] - served["calm"]))
        svc.complete(w.key[0], w.key[1], 0, w.result.reserved_tokens, 0)
    # Bound of the virtual token counter: the gap between two backlogged
    # tenants stays within twice the largest request.
    assert max_gap <= 2 * max(cost_a, cost_b)
    assert served["calm"] == 60 * cost_b


# ------------------------------------------------- length-aware placement


def test_long_requests_are_demoted_to_the_lowest_lane(make_service: Any) -> None:
    svc = make_service(
        tenant(burst_tokens=10**6),
        tenant("keep", burst_tokens=10**6, demote_long_requests=False),
        tenant("low", burst_tokens=10**6, long_request_tokens=500),
        policy=UnitPolicy(long_request_tokens=8000),
    )
    assert decided(svc.admit_or_wait("acme", "s", "standard", 1000, 1000)).lane == "standard"
    assert decided(svc.admit_or_wait("acme", "l", "standard", 6000, 4000)).lane == "batch"
    assert decided(svc.admit_or_wait("acme", "p", "premium", 6000, 4000)).lane == "premium"
    assert decided(svc.admit_or_wait("keep", "l", "standard", 6000, 4000)).lane == "standard"
    assert decided(svc.admit_or_wait("low", "m", "standard", 400, 200)).lane == "batch"


# ------------------------------------------------------------- backpressure


def test_backpressure_score_follows_the_spec_formula(make_service: Any) -> None:
    svc = make_service()
    report(svc, batch=500, depth=250, miss=0.2)
    score, freshness, degraded = svc.views.pool_views()["p"]
    # 0.4 * 500/1000 + 0.3 * 250/1000 + 0.3 * 0.2
    assert score == pytest.approx(0.4 * 0.5 + 0.3 * 0.25 + 0.3 * 0.2, abs=1e-6)
    assert freshness == 1 and not degraded


def test_above_hard_threshold_non_premium_is_refused_premium_fails_open(
    make_service: Any, clock: Any
) -> None:
    # SPEC section 2 without the pool gate: above hard, refused outright
    svc = make_service(
        tenant(burst_tokens=10**6), policy=UnitPolicy(bp_retry_cap_s=30, pool_gate=False)
    )
    report(svc, batch=1000, depth=1000, miss=0.9)  # B = 0.97
    d = decided(svc.admit_or_wait("acme", "s", "standard", 10, 10, pool="p"))
    assert (d.decision, d.reason) == (Decision.REJECT, Reason.BACKPRESSURE)
    assert d.pressure is not None and d.pressure.score == pytest.approx(0.97)
    assert not d.pressure.shed  # above hard: refused, not held in the queue
    assert d.retry_after_ns == 30 * NS  # not draining: the cap
    prem = decided(svc.admit_or_wait("acme", "p", "premium", 10, 10, pool="p"))
    assert prem.decision == Decision.ADMIT
    # a draining pool gives a derived retry_after: B 0.97 -> 0.91 in 1 s is
    # 0.06/s, half of it through the EWMA; (0.91 - 0.775) / 0.03 = 4.5 s
    clock.advance(1 * NS)
    report(svc, batch=1000, depth=1000, miss=0.7)
    d2 = decided(svc.admit_or_wait("acme", "s2", "standard", 10, 10, pool="p"))
    assert d2.reason == Reason.BACKPRESSURE
    assert d2.retry_after_ns == 4_500_000_000


def test_soft_zone_sheds_the_lowest_lane_first(make_service: Any) -> None:
    # soft 0.70, hard 0.85, two sheddable lanes: batch sheds at 0.70,
    # standard at 0.775 (the score alone: the pool gate off)
    svc = make_service(tenant(burst_tokens=10**6), policy=UnitPolicy(pool_gate=False))
    report(svc, batch=1000, depth=500, miss=0.3)  # B = 0.4 + 0.15 + 0.09 = 0.64
    assert decided(svc.admit_or_wait("acme", "b0", "batch", 1, 1, pool="p")).reason == Reason.OK
    report(svc, batch=1000, depth=700, miss=0.3)  # B = 0.70
    w = waiting(svc.admit_or_wait("acme", "b1", "batch", 1, 1, pool="p"))
    assert decided(svc.admit_or_wait("acme", "s1", "standard", 1, 1, pool="p")).reason == Reason.OK
    report(svc, batch=1000, depth=500, miss=0.3)  # back to 0.64: the held lane goes
    assert w.done and w.result.decision == Decision.ADMIT
    nowait = decided(svc.admit("acme", "b2", "batch", 1, 1, pool="p"))
    assert nowait.decision == Decision.ADMIT


def test_stale_pool_follows_the_configured_policy(make_service: Any, clock: Any) -> None:
    closed = make_service(
        tenant(), policy=UnitPolicy(stale_policy="fail_closed"), load_report_stale_s=5
    )
    report(closed, batch=0)
    assert decided(closed.admit("acme", "a", "standard", 1, 1, pool="p")).decision == Decision.ADMIT
    clock.advance(6 * NS)
    d = decided(closed.admit("acme", "b", "standard", 1, 1, pool="p"))
    assert d.reason == Reason.BACKPRESSURE
    assert d.pressure is not None
    assert (d.pressure.freshness, d.pressure.stale_policy) == (2, "fail_closed")
    assert decided(closed.admit("acme", "c", "premium", 1, 1, pool="p")).decision == Decision.ADMIT
    opened = make_service(tenant(), policy=UnitPolicy(stale_policy="fail_open"))
    d = decided(opened.admit("acme", "a", "standard", 1, 1, pool="never-reported"))
    assert d.decision == Decision.ADMIT
    assert d.pressure is not None and (d.pressure.freshness, d.pressure.stale_policy) == (
        3,
        "fail_open",
    )


# ------------------------------------------------------------- degradation


def test_degradation_caps_the_reservation_and_names_the_fallback(make_service: Any) -> None:
    svc = make_service(
        tenant(burst_tokens=10**6, fallback_model="llama-8b"),
        policy=UnitPolicy(
            degrade_max_tokens=2000, degrade_page_tokens=512, long_request_tokens=10**6
        ),
    )
    report(svc, depth=0, gpu=0.95)
    d = decided(svc.admit("acme", "a", "standard", 100, 8000, pool="p"))
    assert d.degradation is not None
    assert (d.degradation.max_tokens_cap, d.degradation.page_after_tokens) == (2000, 512)
    assert d.degradation.fallback_model == "llama-8b"
    assert d.reserved_tokens == 2100 and d.granted_max_tokens == 2000
    prem = decided(svc.admit("acme", "p", "premium", 100, 8000, pool="p"))
    assert prem.degradation is None and prem.reserved_tokens == 8100
    report(svc, depth=0, gpu=0.5)
    assert decided(svc.admit("acme", "b", "standard", 100, 8000, pool="p")).degradation is None


# ------------------------------------------------------------ shadow mode


def test_shadow_mode_admits_and_reports_what_it_would_have_refused(make_service: Any) -> None:
    svc = make_service(
        tenant(burst_tokens=1000, shadow_mode=True), tenant("real", burst_tokens=1000)
    )
    assert decided(svc.admit("acme", "a", "", 1000, 0)).shadow_reason == 0
    d = decided(svc.admit("acme", "b", "", 500, 0))
    assert (d.decision, d.shadow_reason) == (Decision.ADMIT, Reason.TOKEN_RATE)
    assert d.reserved_tokens == 500
    assert svc.stats.shadow_counts[Reason.TOKEN_RATE] == 1
    svc.admit("real", "a", "", 1000, 0)
    assert decided(svc.admit("real", "b", "", 500, 0)).reason == Reason.TOKEN_RATE
    # global shadow mode covers backpressure too
    glob = make_service(tenant(), policy=UnitPolicy(shadow_mode=True))
    report(glob, batch=1000, depth=1000, miss=1.0)
    g = decided(glob.admit("acme", "x", "standard", 1, 1, pool="p"))
    assert (g.decision, g.shadow_reason) == (Decision.ADMIT, Reason.BACKPRESSURE)


# ---------------------------------------------------------- global watermark


def test_global_watermark_caps_all_tenants_together(make_service: Any) -> None:
    svc = make_service(
        tenant(burst_tokens=10**6), tenant("beta", burst_tokens=10**6),
        policy=UnitPolicy(global_inflight_tokens=1000),
    )  # fmt: skip
    assert decided(svc.admit("acme", "a", "", 600, 0)).decision == Decision.ADMIT
    d = decided(svc.admit("beta", "b", "", 600, 0))
    assert d.reason == Reason.GLOBAL_WATERMARK
    w = waiting(svc.admit_or_wait("beta", "c", "", 600, 0))
    svc.complete("acme", "a", 0, 600, 0)
    assert w.done and w.result.decision == Decision.ADMIT
    assert svc.views.inflight_tokens() <= 1000


# ------------------------------------------------------------------ batches


def test_batch_applies_backpressure_shadow_and_degradation(make_service: Any) -> None:
    svc = make_service(
        tenant(burst_tokens=10**6),
        tenant("shadow", burst_tokens=10**6, shadow_mode=True),
        policy=UnitPolicy(degrade_max_tokens=500, long_request_tokens=10**6, pool_gate=False),
    )
    report(svc, batch=1000, depth=1000, miss=0.5, gpu=0.99)  # B = 0.85, degraded
    r = svc.batches.admit(
        ["acme", "acme", "shadow"], ["a", "b", "c"], ["standard", "premium", "standard"],
        [10, 10, 10], [900, 900, 900], pool="p",
    )  # fmt: skip
    assert r.reason == [Reason.BACKPRESSURE, Reason.OK, Reason.OK]
    assert r.shadow_reason == [0, 0, Reason.BACKPRESSURE]
    # instructions go with admissions, as a unary answer's (a refusal has none)
    assert r.degraded == [False, False, True]
    assert r.reserved_tokens == [0, 910, 510]
    assert r.degradation is not None and r.degradation.max_tokens_cap == 500
    assert r.pressure is not None and r.pressure.score == pytest.approx(0.85)
    assert LANES  # lanes fixture in use


def test_queue_metrics_count_waits_cancellations_and_shadow(make_service: Any, clock: Any) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from controlplane.telemetry.metrics import registry_for

    svc = make_service(
        tenant(max_concurrency=1), tenant("shadow", burst_tokens=10, shadow_mode=True)
    )
    svc.admit_or_wait("acme", "a", "", 1, 1)
    w = waiting(svc.admit_or_wait("acme", "b", "", 1, 1))
    gone = waiting(svc.admit_or_wait("acme", "c", "", 1, 1))
    svc.cancel(gone)
    clock.advance(30 * MS)
    svc.complete("acme", "a", 0, 1, 1)
    assert w.done
    svc.admit("shadow", "x", "", 100, 0)

    def samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = generate_latest(registry_for(svc)).decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }

    got = samples()
    assert got[("burstgate_queue_wait_seconds_count", (("lane", "standard"),))] == 1
    assert got[("burstgate_queue_wait_seconds_sum", (("lane", "standard"),))] == pytest.approx(0.03)
    assert got[("burstgate_queue_wait_seconds_bucket", (("lane", "standard"), ("le", "0.01")))] == 0
    assert got[("burstgate_queue_wait_seconds_bucket", (("lane", "standard"), ("le", "0.05")))] == 1
    assert got[("burstgate_queue_cancelled_total", ())] == 1
    assert got[("burstgate_queue_waiting", (("lane", "standard"),))] == 0
    would = (("reason", "max_tokens"), ("tenant", "shadow"))
    assert got[("burstgate_shadow_refusals_total", would)] == 1


def test_cancel_after_admission_releases_the_reservation(make_service: Any) -> None:
    # The slot frees and the caller goes away in the same moment: the waiter
    # was admitted, but nobody will ever run or settle it.
    svc = make_service(tenant(max_concurrency=1))
    svc.admit_or_wait("acme", "a", "", 10, 10)
    w = waiting(svc.admit_or_wait("acme", "b", "", 10, 10))
    svc.complete("acme", "a", 0, 10, 5)
    assert w.done and w.result.decision == Decision.ADMIT
    svc.cancel(w)
    assert svc.views.open_reservations == 0
    assert svc.views.tenant_state("acme")["inflight"] == 0
    assert svc.stats.cancelled_total == 1
    again = decided(svc.admit_or_wait("acme", "b", "", 10, 10))
    assert again.decision == Decision.ADMIT and not again.duplicate


def test_full_queues_still_admit_what_fits_now(make_service: Any) -> None:
    svc = make_service(
        tenant("blocked", max_concurrency=1, max_queued=100),
        tenant("free"),
        policy=UnitPolicy(queue_limit=3),
    )
    svc.admit_or_wait("blocked", "r0", "batch", 10, 10)
    for i in range(1, 4):
        waiting(svc.admit_or_wait("blocked", f"r{i}", "batch", 10, 10))
    assert decided(svc.admit_or_wait("free", "f", "standard", 10, 10)).decision == Decision.ADMIT
    full = decided(svc.admit_or_wait("blocked", "r4", "batch", 10, 10))
    assert full.reason == Reason.QUEUE_FULL


def test_an_ineligible_tenant_with_a_higher_slot_does_not_block_dispatch(
    make_service: Any,
) -> None:
    # acme (slot 0) waits for a concurrency slot, beta (slot 1) for a refill
    # in the same lane: when acme's slot frees, only acme's head is eligible.
    svc = make_service(
        tenant(max_concurrency=1),
        tenant("beta", token_rate=Decimal(1000), burst_tokens=1000),
    )
    svc.admit_or_wait("acme", "a0", "", 10, 10)
    svc.admit_or_wait("beta", "b0", "", 1000, 0)
    wb = waiting(svc.admit_or_wait("beta", "b1", "", 500, 0))
    wa = waiting(svc.admit_or_wait("acme", "a1", "", 10, 10))
    svc.complete("acme", "a0", 0, 10, 10)
    assert wa.done and wa.result.decision == Decision.ADMIT
    assert not wb.done


def test_backlog_rule_queues_only_what_competes(make_service: Any) -> None:
    svc = make_service(
        tenant(token_rate=Decimal(1000), burst_tokens=1000), tenant("beta", burst_tokens=10**6)
    )
    svc.admit_or_wait("acme", "a0", "", 900, 0)  # 100 left
    big = waiting(svc.admit_or_wait("acme", "a1", "", 500, 0))  # waits 400 ms for refill
    # acme's next request would fit (50 <= 100) but must not overtake its own
    # earlier waiter: it queues behind it
    waiting(svc.admit_or_wait("acme", "a2", "", 50, 0))
    # beta competes with nothing acme waits for: decided at once
    assert decided(svc.admit_or_wait("beta", "b0", "", 50, 0)).decision == Decision.ADMIT
    assert not big.done and svc.waiting == 2
