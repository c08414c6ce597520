"""The pool gate (Policy.pool_gate): release a request to a pool only while
it has room, hold the rest in burstgate's queues, premium first."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.domain import AdmitDecision, Decision
from controlplane.domain.errors import InvalidArgument, NotFound
from controlplane.domain.policy import Policy
from controlplane.service.queueing import Waiter
from fastpath import Reason

from .conftest import LANES, UnitPolicy, tenant

GATE = UnitPolicy(gate_waiting_per_engine=2, gate_fallback_inflight=2)  # the gate is on by default
MS = 1_000_000


def report(
    svc: Any,
    engine: str = "e1",
    *,
    waiting: int = 0,
    running: int | None = None,
    max_seqs: int | None = None,
    kv: float | None = None,
) -> None:
    svc.report_load("p", engine, 0, 8192, waiting, 256, 0.0, 0.0,
                    requests_running=running, max_num_seqs=max_seqs, kv_cache_usage=kv)  # fmt: skip


def gated(make_service: Any, **policy: Any) -> Any:
    svc = make_service(tenant(), tenant("vip", default_lane="premium"))
    svc.apply_config([tenant(), tenant("vip", default_lane="premium")], LANES,
                     GATE.model_copy(update=policy))  # fmt: skip
    return svc


def test_gate_holds_what_exceeds_the_engines_target_and_counts_its_own_releases(
    make_service: Any,
) -> None:
    svc = gated(make_service)
    report(svc, waiting=0, running=256, max_seqs=256)  # no free slot: releases will wait
    a = svc.admit("vip", "a", "", 10, 10, pool="p")
    b = svc.admit("vip", "b", "", 10, 10, pool="p")
    c = svc.admit("vip", "c", "", 10, 10, pool="p")
    assert [x.decision for x in (a, b)] == [Decision.ADMIT, Decision.ADMIT]
    # two premium released since the report reach the target of 2 per engine
    assert (c.decision, c.reason, c.pressure is not None and c.pressure.shed) == (
        Decision.REJECT, Reason.BACKPRESSURE, True
    )  # fmt: skip
    assert c.retry_after_ns > 0


def test_other_lanes_go_only_where_they_start_at_the_next_step(make_service: Any) -> None:
    # premium may wait in an engine's queue up to the target; the other lanes
    # only take free slots, so the engines' queues hold nothing premium waits behind
    svc = gated(make_service)
    report(svc, waiting=0, running=256, max_seqs=256)
    assert svc.admit("acme", "std", "", 10, 10, pool="p").reason == Reason.BACKPRESSURE
    assert svc.admit("vip", "prem", "", 10, 10, pool="p").reason == Reason.OK


def test_free_sequence_slots_absorb_releases(make_service: Any) -> None:
    svc = gated(make_service)
    report(svc, waiting=0, running=250, max_seqs=256)  # 6 free slots + 2 waiting allowed
    out = [svc.admit("acme", f"r{i}", "", 10, 10, pool="p").decision for i in range(10)]
    assert out == [Decision.ADMIT] * 6 + [Decision.REJECT] * 4  # standard: the slots only
    svc = gated(make_service)
    report(svc, waiting=0, running=250, max_seqs=256)
    out = [svc.admit("vip", f"r{i}", "", 10, 10, pool="p").decision for i in range(10)]
    assert out == [Decision.ADMIT] * 8 + [Decision.REJECT] * 2  # premium: and the target


def test_free_slots_take_only_what_the_next_steps_token_budget_starts(make_service: Any) -> None:
    # 6 free slots, but a step of 8,192 tokens less 250 running decodes starts
    # one 4,000-token prompt and the first chunk of a second: a third would wait
    svc = gated(make_service)
    big = tenant("big", burst_tokens=10**6)
    svc.apply_config([big], LANES, GATE)
    report(svc, waiting=0, running=250, max_seqs=256)
    out = [svc.admit("big", f"r{i}", "", 4_000, 10, pool="p").reason for i in range(5)]
    assert out == [Reason.OK] * 2 + [Reason.BACKPRESSURE] * 3


def test_the_budget_left_is_what_the_last_step_did_not_use(make_service: Any) -> None:
    # the last step carried 8,000 tokens (prefill chunks still running: vLLM
    # schedules running requests first), so the next one has 192 left: one
    # release starts there (with a partial chunk), the next would wait
    svc = gated(make_service)
    svc.report_load("p", "e1", 8_000, 8192, 0, 256, 0.0, 0.0, requests_running=10,
                    max_num_seqs=256)  # fmt: skip
    out = [svc.admit("acme", f"r{i}", "", 1_000, 10, pool="p").reason for i in range(3)]
    assert out == [Reason.OK, Reason.BACKPRESSURE, Reason.BACKPRESSURE]


def test_without_running_counts_every_lane_goes_by_the_waiting_target(
    make_service: Any,
) -> None:
    # an engine that reports no running requests or max_num_seqs: whether a
    # release starts at once cannot be told, so no lane is held to it
    svc = gated(make_service)
    report(svc, waiting=0)
    out = [svc.admit("acme", f"r{i}", "", 10, 10, pool="p").decision for i in range(3)]
    assert out == [Decision.ADMIT, Decision.ADMIT, Decision.REJECT]


def test_free_slots_count_only_while_the_pool_is_under_its_target(make_service: Any) -> None:
    # one engine has free slots, the other a queue at the target: a router may
    # send the release to the busy one, so the free slots do not open the gate
    svc = gated(make_service)
    report(svc, "e1", waiting=0, running=100, max_seqs=256)
    report(svc, "e2", waiting=4, running=256, max_seqs=256)
    assert svc.admit("acme", "a", "", 10, 10, pool="p").reason == Reason.BACKPRESSURE


def test_a_held_request_is_released_by_the_next_report(make_service: Any, clock: Any) -> None:
    svc = gated(make_service)
    report(svc, waiting=5)
    w = svc.admit_or_wait("acme", "held", "", 10, 10, pool="p")
    assert isinstance(w, Waiter)
    got: list[AdmitDecision] = []
    w.on_done = got.append
    clock.advance(100 * MS)
    report(svc, waiting=0)
    assert [d.decision for d in got] == [Decision.ADMIT]
    assert got[0].queue_wait_ns == 100 * MS


def test_premium_goes_first_when_the_gate_opens(make_service: Any, clock: Any) -> None:
    svc = gated(make_service, gate_waiting_per_engine=1)
    # premium has had far more service than standard: weighted fair queueing
    # alone would now pick standard; the gate serves premium first anyway
    report(svc, waiting=0, running=0, max_seqs=256)
    for i in range(5):
        assert svc.admit("vip", f"early-{i}", "", 500, 500, pool="p").decision == Decision.ADMIT
    clock.advance(10 * MS)
    report(svc, waiting=3)
    order: list[str] = []
    for tenant_id, rid in (("acme", "std-1"), ("acme", "std-2"), ("vip", "prem-1")):
        w = svc.admit_or_wait(tenant_id, rid, "", 10, 10, pool="p")
        assert isinstance(w, Waiter)
        w.on_done = lambda d, rid=rid: order.append(rid) if d.decision == Decision.ADMIT else None
    clock.advance(10 * MS)
    report(svc, waiting=0)  # room for one
    assert order == ["prem-1"]
    clock.advance(10 * MS)
    report(svc, waiting=0)
    assert order == ["prem-1", "std-1"]


def test_a_held_request_waits_up_to_its_slo_less_headroom(make_service: Any, clock: Any) -> None:
    svc = gated(make_service)
    report(svc, waiting=5)
    w = svc.admit_or_wait("vip", "p1", "", 10, 10, pool="p")
    assert isinstance(w, Waiter)
    # the premium lane's wait target is 200 ms; its TTFT SLO (1 s) less the
    # engine's headroom (25 %) bounds the wait: released by 750 ms or refused
    assert svc.next_wakeup_ns() == clock() + 750 * MS
    got: list[AdmitDecision] = []
    w.on_done = got.append
    clock.advance(750 * MS)
    svc.tick()
    assert [(d.decision, d.reason) for d in got] == [(Decision.REJECT, Reason.QUEUE_TIMEOUT)]


def test_without_reports_a_fallback_concurrency_applies(make_service: Any) -> None:
    svc = gated(make_service)  # gate_fallback_inflight=2, no report for pool p
    a, b, c = (svc.admit("acme", r, "", 10, 10, pool="p") for r in ("a", "b", "c"))
    assert [x.decision for x in (a, b, c)] == [Decision.ADMIT, Decision.ADMIT, Decision.REJECT]
    svc.complete("acme", "a", 0, 10, 5)
    assert svc.admit("acme", "d", "", 10, 10, pool="p").decision == Decision.ADMIT


def test_a_pool_handed_to_another_replica_is_forgotten_here(make_service: Any) -> None:
    svc = gated(make_service)  # gate_fallback_inflight=2
    for r in ("a", "b"):
        assert svc.admit("acme", r, "", 10, 10, pool="p").decision == Decision.ADMIT
    assert svc.admit("acme", "x", "", 10, 10, pool="q").decision == Decision.ADMIT
    assert svc.admit("acme", "c", "", 10, 10, pool="p").reason == Reason.BACKPRESSURE
    before = svc.views.tenant_state("acme")
    # the cell of p moved to another replica (which counts a and b now,
    # re-announced): they end here as at expiry, and the gate forgets p
    assert svc.replicas.forget_pools(["p"]) == 2
    after = svc.views.tenant_state("acme")
    assert (before["inflight"], after["inflight"]) == (3, 1)  # x, of pool q, stays
    assert after["level_mtok"] == before["level_mtok"]  # no refund: what was reserved is spent
    assert svc.views.gate_inflight("p") == 0 and svc.views.open_reservations == 1
    with pytest.raises(NotFound):
        svc.complete("acme", "a", 0, 10, 5)  # a late Complete here: booked offline instead
    # the cell came back: it is not refused for what the other replica runs
    assert svc.admit("acme", "d", "", 10, 10, pool="p").decision == Decision.ADMIT
    assert svc.replicas.forget_pools(["nowhere"]) == 0


def test_every_admit_belongs_to_a_pool(make_service: Any) -> None:
    svc = gated(make_service)  # no pool named: the default pool's fallback applies
    out = [svc.admit("acme", r, "", 10, 10).decision for r in ("a", "b", "c")]
    assert out == [Decision.ADMIT, Decision.ADMIT, Decision.REJECT]


def test_a_full_kv_cache_closes_the_gate(make_service: Any) -> None:
    svc = gated(make_service, gate_kv_usage_threshold=0.9)
    report(svc, waiting=0, running=10, max_seqs=256, kv=0.95)
    assert svc.admit("acme", "a", "", 10, 10, pool="p").reason == Reason.BACKPRESSURE


def test_a_batch_gets_only_the_room_there_is(make_service: Any) -> None:
    svc = gated(make_service)
    report(svc, waiting=0, running=256, max_seqs=256)  # no slot: premium may wait, 2 of them
    r = svc.batches.admit(["vip"] * 4, ["a", "b", "c", "d"], [], [10] * 4, [10] * 4, pool="p")
    assert r.reason == [Reason.OK, Reason.OK, Reason.BACKPRESSURE, Reason.BACKPRESSURE]
    # the pool takes more within premium's SLO: a retry may pass
    assert r.retryable is not None and all(r.retryable[2:]) and min(r.retry_after_ms[2:]) > 0
    r = svc.batches.admit(["acme"] * 2, ["s0", "s1"], [], [10] * 2, [10] * 2, pool="p")
    assert r.reason == [Reason.BACKPRESSURE] * 2  # other lanes only where they start


def test_a_batch_gives_the_room_to_premium_first(make_service: Any, clock: Any) -> None:
    svc = gated(make_service)
    report(svc, waiting=0, running=256, max_seqs=256)  # room for 2 premium
    lanes = ["standard", "batch", "premium", "standard", "premium"]
    r = svc.batches.admit(["acme"] * 5, [f"r{i}" for i in range(5)], lanes, [10] * 5, [10] * 5,
                        pool="p")  # fmt: skip
    ok = [lane for lane, reason in zip(lanes, r.reason, strict=True) if reason == Reason.OK]
    assert ok == ["premium", "premium"]
    clock.advance(100 * MS)
    report(svc, waiting=0, running=254, max_seqs=256)  # 2 free slots: then batch order
    r = svc.batches.admit(["acme"] * 3, ["s0", "s1", "s2"], ["standard", "batch", "standard"],
                        [10] * 3, [10] * 3, pool="p")  # fmt: skip
    assert r.reason == [Reason.OK, Reason.OK, Reason.BACKPRESSURE]


def test_the_gate_is_on_by_default_and_off_lets_everything_through(make_service: Any) -> None:
    assert Policy().pool_gate
    on = make_service(tenant())
    report(on, waiting=1_000, running=256, max_seqs=256, kv=0.99)
    assert on.admit("acme", "a", "", 10, 10, pool="p").reason == Reason.BACKPRESSURE
    off = make_service(tenant(), policy=UnitPolicy(pool_gate=False))
    report(off, waiting=1_000, running=256, max_seqs=256, kv=0.99)
    assert all(
        off.admit("acme", f"r{i}", "", 10, 10, pool="p").decision == Decision.ADMIT
        for i in range(20)
    )


def test_above_the_hard_threshold_the_gate_holds_rather_than_refuses(
    make_service: Any, clock: Any
) -> None:
    # B = 1.0 (full batch, queue far over the target, KV full): without the
    # gate standard would be refused outright; with it, it waits like
    # premium, and premium goes first when the pool has room again
    svc = gated(make_service)
    svc.report_load("p", "e1", 8192, 8192, 50, 0, None, 1.0, requests_running=256,
                    max_num_seqs=256, kv_cache_usage=1.0)  # fmt: skip
    std = svc.admit_or_wait("acme", "s", "standard", 10, 10, pool="p")
    prem = svc.admit_or_wait("vip", "p", "premium", 10, 10, pool="p")
    assert isinstance(std, Waiter) and isinstance(prem, Waiter)
    clock.advance(100 * MS)
    svc.report_load(
        "p",
        "e1",
        100,
        8192,
        1,
        0,
        None,
        0.5,
        requests_running=256,
        max_num_seqs=256,
        kv_cache_usage=0.5,
    )  # one place below the target
    assert prem.done and prem.result.decision == Decision.ADMIT
    assert not std.done


def test_the_score_is_renormalised_over_the_signals_present(make_service: Any) -> None:
    svc = make_service(tenant())
    # vLLM: no queue bound (measured against the gate's target of 2), no miss
    # rate; (0.4 * 4096/8192 + 0.3 * 1/2 + 0.4 * 0.8) / (0.4 + 0.3 + 0.4)
    svc.report_load("p", "e1", 4096, 8192, 1, 0, None, 0.5, kv_cache_usage=0.8)
    assert svc.views.pool_views()["p"][0] == pytest.approx((0.2 + 0.15 + 0.32) / 1.1, abs=1e-6)
    # a second engine without KV usage: its batch and queue count, the KV term
    # is the first engine's; its miss rate enters with gamma
    svc.report_load("p", "e2", 0, 8192, 3, 0, 0.5, 0.5)
    expected = (0.4 * 4096 / 16384 + 0.3 * 1.0 + 0.3 * 0.5 + 0.4 * 0.8) / 1.4
    assert svc.views.pool_views()["p"][0] == pytest.approx(expected, abs=1e-6)
    # everything full reaches 1.0 without a miss rate (SPEC weights alone: 0.7)
    svc.report_load("q", "e1", 8192, 8192, 9, 0, None, 1.0, kv_cache_usage=1.0)
    assert svc.views.pool_views()["q"][0] == pytest.approx(1.0)


def test_new_load_fields_are_validated(make_service: Any) -> None:
    svc = make_service(tenant())
    for kwargs, field in (
        ({"running": -1}, "requests_running"),
        ({"max_seqs": 0}, "max_num_seqs"),
        ({"kv": 1.5}, "kv_cache_usage"),
    ):
        with pytest.raises(InvalidArgument) as err:
            report(svc, **kwargs)
        assert err.value.field == field


def test_bucket_debt_admits_a_tenants_own_burst(make_service: Any) -> None:
    exact = make_service(tenant(burst_tokens=1_000))
    debt = make_service(tenant(burst_tokens=1_000))
    debt.apply_config([tenant(burst_tokens=1_000)], LANES, UnitPolicy(bucket_debt=True))
    for svc, expected in ((exact, [Reason.OK, Reason.TOKEN_RATE]), (debt, [Reason.OK, Reason.OK])):
        got = [svc.admit("acme", r, "", 300, 300).reason for r in ("a", "b")]
        assert got == expected
    # over the burst, with or without debt: waits for a full bucket, then into debt
    assert exact.admit("acme", "big", "", 1_500, 0).reason == Reason.TOKEN_RATE
    for policy in (UnitPolicy(), UnitPolicy(bucket_debt=True)):
        fresh = make_service(tenant(burst_tokens=1_000))
        fresh.apply_config([tenant(burst_tokens=1_000)], LANES, policy)
        assert fresh.admit("acme", "big", "", 1_500, 0).reason == Reason.OK
        assert fresh.views.tenant_state("acme")["level_mtok"] == -500_000


def test_gate_retry_after_is_predicted_from_the_pools_drain_rate(
    make_service: Any, clock: Any
) -> None:
    svc = gated(make_service)  # fallback: 2 in flight per pool, no reports
    assert all(svc.admit("acme", r, "", 10, 10, pool="p").decision == Decision.ADMIT
               for r in ("a", "b"))  # fmt: skip
    first = svc.admit("acme", "early", "", 10, 10, pool="p")
    assert first.reason == Reason.BACKPRESSURE and first.retryable
    assert first.retry_after_ns == 100 * MS  # nothing measured yet: a report interval
    for done, new in (("a", "c"), ("b", "d")):
        clock.advance(250 * MS)
        svc.complete("acme", done, 0, 10, 5)
        assert svc.admit("acme", new, "", 10, 10, pool="p").decision == Decision.ADMIT
    # the pool completed one request every 250 ms: that is when it takes the next
    late = svc.admit("acme", "late", "", 10, 10, pool="p")
    assert (late.reason, late.retry_after_ns) == (Reason.BACKPRESSURE, 250 * MS)


def test_a_gate_timeout_predicts_when_the_pool_takes_more(make_service: Any, clock: Any) -> None:
    svc = gated(make_service)  # fallback: 2 in flight, no reports
    for r in ("a", "b"):
        assert svc.admit("acme", r, "", 10, 10, pool="p").decision == Decision.ADMIT
    clock.advance(400 * MS)
    svc.complete("acme", "a", 0, 10, 5)
    svc.admit("acme", "c", "", 10, 10, pool="p")
    clock.advance(400 * MS)
    svc.complete("acme", "b", 0, 10, 5)
    svc.admit("acme", "d", "", 10, 10, pool="p")  # full again; drain: one per 400 ms
    w = svc.admit_or_wait("acme", "held", "", 10, 10, pool="p")
    assert isinstance(w, Waiter)
    got: list[AdmitDecision] = []
    w.on_done = got.append
    clock.advance(2_250 * MS)  # the standard lane's SLO (3 s) less headroom passes
    svc.tick()
    # late: released now it could no longer meet its deadline, so a retry of
    # it cannot either; retry_after is when the pool takes more (one per 400 ms)
    assert [(d.reason, d.retry_after_ns, d.retryable) for d in got] == [
        (Reason.QUEUE_TIMEOUT, 400 * MS, False)
    ]


def test_eviction_advice_steps_with_load() -> None:
    from controlplane.service.pressure import eviction_advice

    assert [eviction_advice(x) for x in (0.0, 0.5, 0.51, 0.85, 0.86, 1.0)] == [
        0.30, 0.30, 0.15, 0.15, 0.05, 0.05
    ]  # fmt: skip


# ------------------------------------------------ dispatch order behind the gate


def _release_one_at_a_time(svc: Any, clock: Any, waiters: list[Waiter]) -> list[Waiter]:
    """Open the gate for one request per report; return the release order."""
    order: list[Waiter] = []
    pending = list(waiters)
    while pending:
        clock.advance(MS)
        report(svc, waiting=0)  # room for exactly one (target 1 per engine)
        released = [w for w in pending if w.done]
        assert len(released) == 1, "one place opens each time"
        w = released[0]
        assert w.result.decision == Decision.ADMIT
        order.append(w)
        pending.remove(w)
        svc.complete(w.key[0], w.key[1], 0, w.result.reserved_tokens, 0)
    return order


# make_service builds a fresh service per example; the shared clock only moves on
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(lanes=st.lists(st.sampled_from(["premium", "standard", "batch"]), min_size=2, max_size=30))
def test_premium_is_never_released_behind_a_lower_lane(
    make_service: Any, clock: Any, lanes: list[str]
) -> None:
    svc = make_service(tenant(burst_tokens=10**9, token_rate=Decimal(10**6), max_queued=100))
    svc.apply_config([tenant(burst_tokens=10**9, token_rate=Decimal(10**6), max_queued=100)],
                     LANES, GATE.model_copy(update={"gate_waiting_per_engine": 1}))  # fmt: skip
    report(svc, waiting=1)  # closed
    ws = []
    for i, lane in enumerate(lanes):
        w = svc.admit_or_wait("acme", f"r{i}", lane, 10, 10, pool="p")
        assert isinstance(w, Waiter)
        ws.append(w)
    order = [w.lane for w in _release_one_at_a_time(svc, clock, ws)]
    premium = order.count("premium")
    assert order[:premium] == ["premium"] * premium


def test_tenants_of_a_lane_share_the_gate_by_virtual_token_counters(
    make_service: Any, clock: Any
) -> None:
    # "flood" queued 100 requests of 300 tokens before "calm" queued 30 of 100:
    # behind the gate their service stays within two requests of each other
    svc = gated(make_service, gate_waiting_per_engine=1)
    cfg = [tenant(t, burst_tokens=10**9, token_rate=Decimal(10**6), max_queued=1000)
           for t in ("flood", "calm")]  # fmt: skip
    svc.apply_config(cfg, LANES, GATE.model_copy(update={"gate_waiting_per_engine": 1}))
    report(svc, waiting=1)
    ws = [svc.admit_or_wait("flood", f"f{i}", "", 150, 150, pool="p") for i in range(100)]
    ws += [svc.admit_or_wait("calm", f"c{i}", "", 50, 50, pool="p") for i in range(30)]
    assert all(isinstance(w, Waiter) for w in ws)
    served = {"flood": 0, "calm": 0}
    max_gap = 0
    for w in _release_one_at_a_time(svc, clock, ws):
        served[w.key[0]] += w.result.reserved_tokens
        if served["calm"] < 30 * 100:  # both still backlogged
            max_gap = max(max_gap, abs(served["flood"] - served["calm"]))
    assert max_gap <= 2 * 300
    assert served == {"flood": 100 * 300, "calm": 30 * 100}


def test_a_tenant_at_its_own_limit_blocks_nobody_behind_the_gate(
    make_service: Any, clock: Any
) -> None:
    # "solo" may run one request at a time; its second waits for its own slot
    # while the gate opens for the others: no head-of-line blocking, and a
    # large request is not passed over for ever by small ones
    svc = gated(make_service, gate_waiting_per_engine=1)
    cfg = [tenant("solo", max_concurrency=1), tenant(), tenant("big", burst_tokens=10**6)]
    svc.apply_config(cfg, LANES, GATE.model_copy(update={"gate_waiting_per_engine": 1}))
    report(svc, waiting=0, running=0, max_seqs=1)
    assert svc.admit("solo", "s0", "", 10, 10, pool="p").decision == Decision.ADMIT
    report(svc, waiting=1)  # closed
    solo = svc.admit_or_wait("solo", "s1", "", 10, 10, pool="p")
    large = svc.admit_or_wait("big", "L", "", 50_000, 50_000, pool="p")
    small = [svc.admit_or_wait("acme", f"a{i}", "", 10, 10, pool="p") for i in range(3)]
    assert all(isinstance(w, Waiter) for w in (solo, large, *small))
    opened = 0
    while not large.done:
        clock.advance(MS)
        report(svc, waiting=0)
        opened += 1
    assert large.result.decision == Decision.ADMIT and opened <= 2  # fair share: not last
    clock.advance(MS)
    report(svc, waiting=0)
    assert not solo.done  # still behind its own limit, and nobody waits for it
    assert sum(w.done for w in small) >= 1
