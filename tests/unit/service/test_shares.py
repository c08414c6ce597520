"""A service limited to its share of each tenant's limits (service/shares.py):
what a share admits, how refusals under a share are answered, and that the
unary and batch paths agree."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from controlplane.domain import Decision
from controlplane.service.shares import PPM, Share, explain, scaled
from fastpath import Reason

from .conftest import tenant

NS = 1_000_000_000
REFRESH = NS // 5  # the share refresh interval the service is told


def shared(make_service: Any, *tenants: Any) -> Any:
    svc = make_service(*tenants)
    svc.shares.start(REFRESH)
    return svc


def test_without_a_share_nothing_is_admitted_and_the_retry_is_the_refresh(
    make_service: Any,
) -> None:
    svc = shared(make_service, tenant(token_rate=Decimal(1000), burst_tokens=10_000))
    d = svc.admit("acme", "r1", "", 100, 100)
    assert (d.decision, d.reason) == (Decision.REJECT, Reason.TOKEN_RATE)
    assert d.retry_after_ns == REFRESH  # not the 1 mtok/s floor's hours
    # the same service without shares admits it: the share is what refused it
    assert make_service(tenant()).admit("acme", "r1", "", 100, 100).decision == Decision.ADMIT


def test_a_half_share_gives_half_the_burst_and_half_the_rate(
    make_service: Any, clock: Any
) -> None:
    svc = shared(make_service, tenant(token_rate=Decimal(1000), burst_tokens=10_000))
    assert svc.shares.set("acme", Share(PPM // 2))
    assert svc.shares.slot_state("acme")["burst_mtok"] == 5_000_000
    assert svc.views.tenant_state("acme")["burst_mtok"] == 10_000_000  # reported: the whole
    assert svc.admit("acme", "a", "", 5000, 0).decision == Decision.ADMIT
    d = svc.admit("acme", "b", "", 1000, 0)
    assert d.reason == Reason.TOKEN_RATE
    assert d.retry_after_ns == REFRESH  # the share may grow before its bucket refills (2 s)
    clock.advance(2 * NS)  # 500 tokens/s: 1,000 tokens in 2 s
    assert svc.admit("acme", "c", "", 1000, 0).decision == Decision.ADMIT
    # the whole share: back to the tenant's own refusals and retries
    svc.shares.set("acme", Share(PPM))
    svc.admit("acme", "d", "", 10_000, 0)  # empties the bucket (it goes into debt or not)
    d = svc.admit("acme", "e", "", 9000, 0)
    assert d.reason == Reason.TOKEN_RATE and d.retry_after_ns > REFRESH


def test_a_request_too_large_for_the_share_but_not_the_tenant_is_retryable(
    make_service: Any,
) -> None:
    svc = shared(make_service, tenant(token_rate=Decimal(1000), burst_tokens=1000))
    svc.shares.set("acme", Share(PPM // 4))  # a burst of 250 here
    d = svc.admit("acme", "mid", "", 800, 0)  # > 2 x 250, <= 2 x 1,000
    assert (d.decision, d.reason) == (Decision.REJECT, Reason.TOKEN_RATE)
    assert d.retryable and d.retry_after_ns == REFRESH
    d = svc.admit("acme", "huge", "", 2001, 0)  # too large for the tenant itself
    assert d.reason == Reason.MAX_TOKENS and not d.retryable
    # the batch path answers the same
    b = svc.batches.admit(["acme", "acme"], ["mid-b", "huge-b"], [], [800, 2001], [0, 0])
    assert b.reason == [Reason.TOKEN_RATE, Reason.MAX_TOKENS]
    assert b.retry_after_ms == [REFRESH // 1_000_000, 0]


def test_quota_allowances_bind_and_are_retried_at_the_refresh(
    make_service: Any, clock: Any
) -> None:
    big: dict[str, Any] = dict(token_rate=Decimal(100_000), burst_tokens=100_000)
    svc = shared(make_service, tenant(hourly_quota=10_000, daily_quota=50_000, **big))
    svc.shares.set("acme", Share(PPM, hour_allowance=3000, day_allowance=50_000))
    assert svc.admit("acme", "a", "", 2500, 0).decision == Decision.ADMIT
    d = svc.admit("acme", "b", "", 1000, 0)  # 2,500 + 1,000 > 3,000 allowed here
    assert d.reason == Reason.HOURLY_QUOTA and d.retry_after_ns == REFRESH
    d = svc.admit("acme", "c", "", 4000, 0)  # larger than the allowance, not the quota
    assert d.reason == Reason.HOURLY_QUOTA and d.retry_after_ns == REFRESH
    # the whole quota allowed here: the end of the hour, as on one replica
    svc.shares.set("acme", Share(PPM, hour_allowance=10_000, day_allowance=50_000))
    assert svc.admit("acme", "d", "", 7000, 0).decision == Decision.ADMIT
    d = svc.admit("acme", "e", "", 1000, 0)
    assert d.reason == Reason.HOURLY_QUOTA
    assert d.retry_after_ns == 3600 * NS - clock.now_ns % (3600 * NS)


def test_an_allowance_of_zero_admits_nothing(make_service: Any) -> None:
    big: dict[str, Any] = dict(token_rate=Decimal(100_000), burst_tokens=100_000)
    svc = shared(make_service, tenant(hourly_quota=10_000, **big))
    svc.shares.set("acme", Share(PPM, hour_allowance=0))
    assert svc.shares.slot_state("acme")["hourly_quota"] == 1  # 0 would read as unlimited
    d = svc.admit("acme", "a", "", 1, 1)
    assert d.reason == Reason.HOURLY_QUOTA and d.retry_after_ns == REFRESH


def test_usage_from_the_ledger_is_not_added_under_shares_but_the_store_floor_is(
    make_service: Any,
) -> None:
    big: dict[str, Any] = dict(token_rate=Decimal(100_000), burst_tokens=100_000)
    svc = shared(make_service, tenant(hourly_quota=10_000, **big))
    # others' usage lives in their allowances: a ledger import would count it twice
    assert svc.restore_usage({"acme": 4000}, {"acme": 4000}) == 0
    assert svc.shares.slot_state("acme")["hour_used"] == 0
    # the store says this member id used 1,500 already (a restart keeping its id)
    svc.shares.set("acme", Share(PPM, hour_allowance=2000), hour_used=1500, day_used=1500)
    assert svc.shares.slot_state("acme")["hour_used"] == 1500
    assert svc.admit("acme", "a", "", 600, 0).reason == Reason.HOURLY_QUOTA
    assert svc.admit("acme", "b", "", 500, 0).decision == Decision.ADMIT
    # a lower figure never takes usage back
    svc.shares.set("acme", Share(PPM, hour_allowance=2500), hour_used=100)
    assert svc.shares.slot_state("acme")["hour_used"] == 2000


def test_a_share_set_for_an_unknown_tenant_is_kept_for_when_it_is_configured(
    make_service: Any,
) -> None:
    svc = shared(make_service, tenant())
    assert not svc.shares.set("later", Share(PPM))
    svc.apply_config([tenant(), tenant("later")], svc.views.lanes.values())
    assert svc.admit("later", "a", "", 100, 0).decision == Decision.ADMIT
    assert svc.admit("acme", "a", "", 100, 0).reason == Reason.TOKEN_RATE  # still none


@pytest.mark.parametrize("ppm", [0, 1, PPM // 3, PPM - 1, PPM])
def test_scaled_limits_never_exceed_the_share(ppm: int) -> None:
    cfg = tenant(token_rate=Decimal(777), burst_tokens=12_345, hourly_quota=9999)
    lim = scaled(cfg, Share(ppm, hour_allowance=5000))
    assert lim.rate_mtok_per_s == max(1, 777_000 * ppm // PPM)
    assert lim.burst_mtok == max(1000, 12_345_000 * ppm // PPM)
    assert lim.hourly_quota == 5000 and lim.daily_quota == 0


def test_explain_leaves_other_refusals_and_whole_shares_alone() -> None:
    cfg = tenant(token_rate=Decimal(1000), burst_tokens=1000)
    for reason in (Reason.CONCURRENCY, Reason.BACKPRESSURE, Reason.GLOBAL_WATERMARK):
        assert explain(cfg, Share(0), int(reason), 7, 10, 10, 0, REFRESH) == (int(reason), 7)
    assert explain(cfg, Share(PPM), int(Reason.TOKEN_RATE), 5 * NS, 10, 10, 0, REFRESH) == (
        int(Reason.TOKEN_RATE), 5 * NS,
    )  # fmt: skip
    # too large for the global in-flight limit: stays MAX_TOKENS
    assert explain(cfg, Share(PPM // 4), int(Reason.MAX_TOKENS), 0, 800, 0, 700, REFRESH) == (
        int(Reason.MAX_TOKENS), 0,
    )  # fmt: skip


def test_limits_and_answers_report_the_whole_limits_and_tenant_wide_use(
    make_service: Any,
) -> None:
    svc = shared(make_service, tenant(token_rate=Decimal(1000), burst_tokens=10_000,
                                      hourly_quota=100_000))  # fmt: skip
    # a quarter of the rate; 30,000 allowed here; the others used 50,000
    svc.shares.set("acme", Share(PPM // 4, hour_allowance=30_000, hour_others=50_000))
    d = svc.admit("acme", "a", "", 2000, 0)
    assert d.decision == Decision.ADMIT
    assert d.hourly_remaining == 48_000  # 100,000 - 50,000 - 2,000, not 30,000 - 2,000
    b = svc.batches.admit(["acme"], ["b"], [], [500], [0])
    assert b.hourly_remaining == [47_500]
    lim = svc.views.tenant_limits("acme")
    assert (lim.token_rate, lim.burst_tokens, lim.hourly_quota) == (1000, 10_000, 100_000)
    assert lim.bucket_tokens == 0  # this replica's quarter of the burst, less 2,500
    assert lim.hourly_remaining == 47_500
    assert svc.views.tenant_state("acme")["hour_used"] == 52_500  # tenant-wide, for the admin API
