"""The one validator per domain object (controlplane.domain.validate): no I/O."""

from __future__ import annotations

import dataclasses
from decimal import Decimal
from typing import Any

import pytest

from controlplane.domain import LaneConfig, TenantConfig
from controlplane.domain.errors import InvalidArgument
from controlplane.domain.validate import INT32_MAX, MAX_TEXT, check_lane, check_tenant

LANES = ("premium", "standard", "batch")
TENANT = TenantConfig(tenant_id="acme", token_rate=Decimal("12.5"), burst_tokens=1000)
LANE = LaneConfig("bulk", 3, Decimal("0.05"), 60_000, False, True)


def test_the_bounds_themselves_are_accepted() -> None:
    check_tenant(
        dataclasses.replace(
            TENANT, max_concurrency=INT32_MAX, max_queued=INT32_MAX, max_wait_ms=INT32_MAX,
            hourly_quota=2**63 - 1, display_name="x" * MAX_TEXT, fallback_model="m" * MAX_TEXT,
            pool="p" * 128,
        ),
        LANES,
    )  # fmt: skip
    check_lane(dataclasses.replace(LANE, priority=INT32_MAX, wait_target_ms=INT32_MAX,
                                   max_queued=INT32_MAX, weight=Decimal("0.0001"),
                                   pool="p" * 128))  # fmt: skip


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tenant_id": ""}, "tenant_id"),
        ({"tenant_id": "x" * 129}, "tenant_id"),
        ({"token_rate": Decimal("0.0005")}, "token_rate"),
        ({"token_rate": Decimal("1.0001")}, "token_rate"),
        ({"burst_tokens": 0}, "burst_tokens"),
        ({"hourly_quota": 0}, "hourly_quota"),
        ({"hourly_quota": 2**63}, "hourly_quota"),
        ({"max_concurrency": INT32_MAX + 1}, "max_concurrency"),
        ({"max_queued": INT32_MAX + 1}, "max_queued"),
        ({"max_wait_ms": -1}, "max_wait_ms"),
        ({"max_wait_ms": INT32_MAX + 1}, "max_wait_ms"),
        ({"display_name": "x" * (MAX_TEXT + 1)}, "display_name"),
        ({"display_name": "a\nb"}, "display_name"),
        ({"fallback_model": "m" * (MAX_TEXT + 1)}, "fallback_model"),
        ({"default_lane": "gold"}, "default_lane"),
        # a configured pool follows a reported pool's rule; None = not configured
        ({"pool": ""}, "pool"),
        ({"pool": "p" * 129}, "pool"),
        ({"pool": "gpu\na"}, "pool"),
    ],
)
def test_check_tenant_names_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        check_tenant(dataclasses.replace(TENANT, **change), LANES)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"name": ""}, "name"),
        ({"name": "x" * 33}, "name"),
        ({"priority": -1}, "priority"),
        ({"priority": INT32_MAX + 1}, "priority"),
        ({"weight": Decimal(0)}, "weight"),
        ({"weight": Decimal("1.5")}, "weight"),
        ({"weight": Decimal("0.12345")}, "weight"),
        ({"wait_target_ms": -1}, "wait_target_ms"),
        ({"max_queued": INT32_MAX + 1}, "max_queued"),
        ({"pool": ""}, "pool"),
        ({"pool": "p" * 129}, "pool"),
        ({"pool": "gpu\ta"}, "pool"),
    ],
)
def test_check_lane_names_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        check_lane(dataclasses.replace(LANE, **change))
    assert err.value.field == field
