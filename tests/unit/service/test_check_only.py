"""AdmissionService.views.check_only: Envoy's hits_addend 0, a check that spends
nothing."""

from __future__ import annotations

from typing import Any

from fastpath import Reason
from tests.conftest import FakeClock
from tests.unit.service.conftest import tenant

NS = 1_000_000_000


def test_refusals_the_tenant_alone_gives_and_nothing_spent(make_service: Any,
                                                           clock: FakeClock) -> None:  # fmt: skip
    svc = make_service(tenant("acme", burst_tokens=1000, hourly_quota=5000),
                       tenant("off", enabled=False), default_tenant=None)  # fmt: skip
    reason, retry, limits = svc.views.check_only("acme")
    assert (reason, retry) == (0, 0) and limits is not None and limits.bucket_tokens == 1000
    assert svc.views.tenant_limits("acme").bucket_tokens == 1000  # nothing reserved
    d = svc.admit("acme", "r1", "", 0, 1000)  # empty the bucket
    assert d.reserved_tokens == 1000
    reason, retry, _ = svc.views.check_only("acme")
    assert reason == Reason.TOKEN_RATE and retry == NS // 1000  # one token at 1,000/s
    assert svc.views.check_only("off")[0] == Reason.TENANT_DISABLED
    assert svc.views.check_only("nobody")[:2] == (Reason.UNKNOWN_TENANT, 0)


def test_a_used_up_quota_until_its_hour_ends(make_service: Any, clock: FakeClock) -> None:
    svc = make_service(tenant("acme", burst_tokens=10_000, hourly_quota=500))
    svc.complete("acme", svc.admit("acme", "r1", "", 0, 500).request_id, 0, 0, 500)
    reason, retry, limits = svc.views.check_only("acme")
    assert reason == Reason.HOURLY_QUOTA and limits is not None
    assert retry == limits.hour_resets_in_ms * 1_000_000
