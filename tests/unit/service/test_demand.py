"""Demand per pool (service/demand.py, AdmissionService.views.pool_demand): what
users asked of a pool counts, the tenant's own limits do not; the backlog
and its predicted wait; the engines the pool needs (issue 32)."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.domain.autoscaler import engines_for
from controlplane.service import AdmissionService, ServiceLimits
from controlplane.service.demand import (
    CAPACITY_REASONS,
    DEMAND_WINDOW_S,
    DESIRED_WINDOW_S,
    MIN_GATED_S,
    MIN_RUN_S,
    WORK_WINDOW_S,
    DemandMeter,
    WorkRate,
    counts_as_demand,
)
from controlplane.service.queueing import Waiter
from controlplane.settings import Settings
from fastpath import Reason

from .conftest import LANES, UnitPolicy, tenant

MS = 1_000_000
S = 1_000 * MS
T0 = 1_700_000_000 * S  # a whole second


# ------------------------------------------------------------ the meter


def test_the_meter_averages_the_window_and_forgets_older_seconds() -> None:
    m = DemandMeter()
    m.add(T0, 3_000, 3)
    m.add(T0 + 500 * MS, 1_000)
    tokens, requests = m.rates(T0 + 500 * MS)
    # 4,000 tokens over the window so far: 10 s before this second, and half of it
    assert tokens == pytest.approx(4_000 / (DEMAND_WINDOW_S + 0.5))
    assert requests == pytest.approx(4 / (DEMAND_WINDOW_S + 0.5))
    m.add(T0 + 5 * S, 2_000, 2)
    later = T0 + (DEMAND_WINDOW_S + 1) * S
    assert m.rates(later)[0] == pytest.approx(2_000 / DEMAND_WINDOW_S)  # T0's second gone
    assert m.rates(T0 + 60 * S) == (0.0, 0.0)


def test_the_forecast_follows_a_rising_demand_ahead_of_the_window() -> None:
    m = DemandMeter()
    for s in range(60):  # demand rises by 100 tokens/s every second
        m.add(T0 + s * S, 100 * s)
    now = T0 + 60 * S
    assert m.forecast(now, 120) > m.rates(now)[0]
    steady = DemandMeter()
    for s in range(300):
        steady.add(T0 + s * S, 1_000)
    assert steady.forecast(T0 + 300 * S, 120) == pytest.approx(1_000, rel=0.05)


@pytest.mark.parametrize("reason", list(Reason))
def test_capacity_refusals_are_demand_a_tenants_own_limits_are_not(reason: Reason) -> None:
    capacity = {
        Reason.OK, Reason.BACKPRESSURE, Reason.QUEUE_TIMEOUT, Reason.QUEUE_FULL,
        Reason.GLOBAL_WATERMARK,
    }  # fmt: skip
    assert counts_as_demand(int(reason)) == (reason in capacity)
    assert (int(reason) in CAPACITY_REASONS) == (reason in capacity and reason != Reason.OK)


def test_engines_for_rounds_up_and_is_zero_without_demand() -> None:
    assert engines_for(0.0, 1_000.0, 0.8) == 0
    assert engines_for(800.0, 1_000.0, 0.8) == 1
    assert engines_for(801.0, 1_000.0, 0.8) == 2
    assert engines_for(1.0, 1_000.0, 0.8) == 1


# ----------------------------------------------------------- the service


def report(svc: AdmissionService, running: int, pool: str = "p", engine: str = "e1") -> None:
    """One engine of 4 sequence slots, ``running`` of them taken."""
    svc.report_load(pool, engine, running, 8192, 0, 0, None, 0.0,
                    requests_running=running, max_num_seqs=4)  # fmt: skip


@pytest.fixture
def svc(clock: Any) -> AdmissionService:
    clock.now_ns = T0
    s = AdmissionService(ServiceLimits.of(Settings(policy=UnitPolicy())), clock=clock)
    s.apply_config(
        [
            tenant("acme", token_rate=10**6, burst_tokens=10**8),
            tenant("tiny", token_rate=1, burst_tokens=100, max_concurrency=1),
        ],
        LANES,
    )
    return s


def test_admitted_and_held_requests_are_demand_and_held_ones_are_backlog(
    svc: AdmissionService,
) -> None:
    report(svc, running=3)  # one free slot
    assert svc.admit("acme", "a", "standard", 1_000, 10, pool="p").reason == 0
    held = svc.admit_or_wait("acme", "b", "standard", 2_000, 10, pool="p")
    assert isinstance(held, Waiter)
    d = svc.views.pool_demand("p")
    assert d.demand_requests_per_s == pytest.approx(2 / DEMAND_WINDOW_S)
    assert d.demand_tokens_per_s == pytest.approx(3_000 / DEMAND_WINDOW_S)
    standard = {b.lane: b for b in d.lanes}["standard"]
    assert (standard.requests, standard.tokens) == (1, 2_000)
    assert d.backlog_requests == 1 and d.backlog_tokens == 2_000
    assert d.engines_reporting == 1
    # no rate learned yet: the engines reporting, and no predicted wait
    assert d.work_rate_per_engine is None and standard.predicted_wait_s is None
    assert d.desired_engines == d.desired_engines_predicted == 1


def test_a_tenants_own_limits_are_not_demand(svc: AdmissionService) -> None:
    report(svc, running=0)
    assert svc.admit("tiny", "big", "standard", 1_000, 10, pool="p").reason == Reason.MAX_TOKENS
    assert svc.admit("nobody", "x", "standard", 10, 10, pool="p").reason == Reason.UNKNOWN_TENANT
    assert svc.admit("tiny", "one", "standard", 50, 10, pool="p").reason == 0
    assert svc.admit("tiny", "two", "standard", 10, 10, pool="p").reason == Reason.CONCURRENCY
    svc.complete("tiny", "one", 0, 50, 10)
    assert svc.admit("tiny", "three", "standard", 80, 10, pool="p").reason == Reason.TOKEN_RATE
    d = svc.views.pool_demand("p")
    assert d.demand_requests_per_s == pytest.approx(1 / DEMAND_WINDOW_S)  # "one" alone
    assert d.demand_tokens_per_s == pytest.approx(50 / DEMAND_WINDOW_S)


def test_capacity_refusals_are_demand_and_a_retry_is_not_asked_twice(
    svc: AdmissionService,
) -> None:
    report(svc, running=4)  # full: the gate holds the standard lane
    out = svc.admit("acme", "r", "standard", 1_000, 10, pool="p")  # answered now: refused
    assert out.reason == Reason.BACKPRESSURE
    again = svc.admit_or_wait(
        "acme", "r2", "standard", 1_000, 10, pool="p", wait=False, retry_key="k", attempt=0
    )
    assert isinstance(again, type(out)) and again.reason == Reason.BACKPRESSURE
    # its retry: the same ask, refused again, not counted again
    retry = svc.admit_or_wait(
        "acme", "r3", "standard", 1_000, 10, pool="p", wait=False, retry_key="k", attempt=1
    )
    assert isinstance(retry, type(out)) and retry.reason == Reason.BACKPRESSURE
    d = svc.views.pool_demand("p")
    assert d.demand_requests_per_s == pytest.approx(2 / DEMAND_WINDOW_S)


def test_batches_count_as_unary_admits_do(svc: AdmissionService) -> None:
    report(svc, running=0)
    res = svc.batches.admit(
        ["acme", "acme", "tiny", "nobody"], ["b1", "b2", "b3", "b4"], ["standard"],
        [100, 200, 1_000, 5], [10, 10, 10, 10], pool="p",
    )  # fmt: skip
    assert res.reason == [0, 0, Reason.MAX_TOKENS, Reason.UNKNOWN_TENANT]
    d = svc.views.pool_demand("p")
    assert d.demand_requests_per_s == pytest.approx(2 / DEMAND_WINDOW_S)
    assert d.demand_tokens_per_s == pytest.approx(300 / DEMAND_WINDOW_S)


def learn_pace(svc: AdmissionService, clock: Any, prompt: int = 1_000) -> None:
    """Hold standard requests behind a full engine, then free one slot every
    100 ms: the gate releases one each time, and learns the pool's pace
    (``prompt`` tokens per 100 ms); the window then moves on."""
    report(svc, running=4)
    for i in range(6):
        assert isinstance(svc.admit_or_wait("acme", f"h{i}", "standard", prompt, 10, pool="p"),
                          Waiter)  # fmt: skip
    for _ in range(6):
        clock.advance(100 * MS)
        report(svc, running=3)
    clock.advance((DESIRED_WINDOW_S + 1) * S)  # their demand has left the windows
    clock.advance(S - clock() % S)  # at a whole second: ask() fills whole seconds
    report(svc, running=0)


def ask(svc: AdmissionService, clock: Any, per_s: int, prompt: int, tag: str) -> None:
    """``per_s`` premium requests a second of ``prompt`` tokens, for the
    window desired_engines averages (the longer one)."""
    for s in range(DESIRED_WINDOW_S):
        for i in range(per_s):
            rid = f"{tag}-{s}-{i}"
            report(svc, running=0)
            assert svc.admit("acme", rid, "premium", prompt, 1, pool="p").reason == 0
            svc.complete("acme", rid, 0, prompt, 1)
        clock.advance(S)


def test_desired_engines_rise_with_demand_and_with_prompt_length(
    svc: AdmissionService, clock: Any
) -> None:
    learn_pace(svc, clock)
    d = svc.views.pool_demand("p")
    assert d.work_rate_per_engine == pytest.approx(10_000)  # 1,000 tokens per 100 ms
    assert d.demand_tokens_per_s == 0 and d.desired_engines == 0
    # 8 requests/s of 1,000 tokens: 8,000 tokens/s, one engine at 80 %
    ask(svc, clock, 8, 1_000, "a")
    assert svc.views.pool_demand("p").desired_engines == 1
    # twice the requests: two engines
    ask(svc, clock, 16, 1_000, "b")
    assert svc.views.pool_demand("p").desired_engines == 2
    # the same 8 requests/s with prompts 3x longer: three engines
    ask(svc, clock, 8, 3_000, "c")
    d = svc.views.pool_demand("p")
    assert d.demand_requests_per_s == pytest.approx(8)
    assert d.desired_engines == 3
    assert d.desired_engines_predicted >= 1


def test_a_backlog_the_pool_cannot_release_in_time_asks_for_more_engines(
    svc: AdmissionService, clock: Any
) -> None:
    learn_pace(svc, clock)
    report(svc, running=4)
    # standard: 3 s SLO, 75 % of it for the wait (no first tokens measured:
    # gate_release_headroom), 2.25 s; the gate holds what one engine
    # releases in that time at 10,000 tokens/s and refuses the rest at
    # arrival (hopeless), so held: about 22,500 tokens
    for i in range(30):
        svc.admit_or_wait("acme", f"q{i}", "standard", 2_000, 10, pool="p")
    d = svc.views.pool_demand("p")
    standard = {b.lane: b for b in d.lanes}["standard"]
    assert 0 < standard.requests < 30 and standard.tokens == 2_000 * standard.requests
    assert standard.predicted_wait_s == pytest.approx(standard.tokens / 10_000)
    # held and refused alike are demand: 30 x 2,000 tokens over the window
    assert d.demand_tokens_per_s == pytest.approx(60_000 / DEMAND_WINDOW_S, rel=0.1)
    by_demand = engines_for(d.demand_tokens_per_s, 10_000, 0.8)
    by_backlog = engines_for(standard.tokens / 2.25, 10_000, 0.8)
    assert by_demand == 1 and by_backlog == 2
    assert d.desired_engines == 2


def test_an_unknown_pool_is_all_zeros(svc: AdmissionService) -> None:
    d = svc.views.pool_demand("never-reported")
    assert (d.engines_reporting, d.demand_tokens_per_s, d.desired_engines) == (0, 0.0, 0)
    assert d.backlog_requests == 0
    assert "never-reported" in svc.views.demand_pools()


# ---------------------------------------------------- the per-engine work rate


def _gated_seconds(w: WorkRate, start_s: int, n: int, tokens: int, engines: int) -> None:
    """``n`` seconds from ``start_s`` in which the gate found no room for
    held work, ``tokens`` released each second (half from the backlog, half
    straight away) to ``engines`` engines."""
    for s in range(start_s, start_s + n):
        t = T0 + s * S
        w.engines(t, engines, waiting=1)  # an engine's own queue is not empty
        w.held(t + MS)  # a held request tried again and held again
        w.released(t + 10 * MS, tokens // 2)
        w.released(t + 500 * MS, tokens - tokens // 2)


def test_the_work_rate_counts_every_release_in_seconds_the_gate_found_no_room() -> None:
    w = WorkRate()
    w.engines(T0, 2)
    w.released(T0 + 100 * MS, 5_000)  # nothing held: not a measure of the engines
    assert w.rate(T0 + 2 * S) is None
    _gated_seconds(w, 1, MIN_GATED_S, 8_000, 2)
    w.emptied(T0 + (MIN_GATED_S + 1) * S)
    assert w.rate(T0 + (MIN_GATED_S + 2) * S) == pytest.approx(4_000)


def test_held_seconds_without_a_refusal_for_room_do_not_count() -> None:
    w = WorkRate()
    _gated_seconds(w, 0, MIN_GATED_S, 8_000, 2)
    # Work stays held (a tenant's own limits, say) while the gate has room:
    # releases at the tenants' pace, not the engines'.
    for s in range(MIN_GATED_S, 3 * MIN_GATED_S):
        w.engines(T0 + s * S, 2)
        w.released(T0 + s * S + 10 * MS, 500)
    assert w.rate(T0 + 3 * MIN_GATED_S * S) == pytest.approx(4_000)


def test_too_few_gated_seconds_keep_the_last_rate_and_old_ones_are_forgotten() -> None:
    w = WorkRate()
    _gated_seconds(w, 0, MIN_GATED_S, 8_000, 2)
    w.emptied(T0 + MIN_GATED_S * S)
    first = w.rate(T0 + (MIN_GATED_S + 1) * S)
    assert first == pytest.approx(4_000)
    # much later, a run of gated seconds shorter than MIN_RUN_S (a burst's
    # tail, engines busy with what was released before it): ignored, the
    # last rate stands
    late = WORK_WINDOW_S + 100
    _gated_seconds(w, late, MIN_RUN_S - 1, 200, 2)
    w.emptied(T0 + (late + MIN_RUN_S - 1) * S)
    assert w.rate(T0 + (late + MIN_RUN_S) * S) == pytest.approx(4_000)
    # scaled out to four engines, which took 40,000 a second: per engine,
    # the best run of the window
    _gated_seconds(w, late + 10, MIN_GATED_S, 40_000, 4)
    w.emptied(T0 + (late + 10 + MIN_GATED_S) * S)
    assert w.rate(T0 + (late + 11 + MIN_GATED_S) * S) == pytest.approx(10_000)


def test_seconds_whose_engines_had_nothing_waiting_do_not_count() -> None:
    # The gate held work for a rule of its own (a long prompt that no step
    # can take yet) while every engine's queue was empty: the engines were
    # not full, so their intake says nothing of their capacity.
    w = WorkRate()
    for s in range(2 * MIN_GATED_S):
        t = T0 + s * S
        w.engines(t, 2, waiting=0)
        w.held(t + MS)
        w.released(t + 10 * MS, 300)
    assert w.rate(T0 + 2 * MIN_GATED_S * S) is None
