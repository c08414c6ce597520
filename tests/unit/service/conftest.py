from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from controlplane.domain import LaneConfig, TenantConfig
from controlplane.domain.policy import Policy
from controlplane.service import AdmissionService, ServiceLimits
from controlplane.settings import Settings

LANES = [
    LaneConfig("premium", 0, Decimal("0.40"), 200, True, False),
    LaneConfig("standard", 1, Decimal("0.45"), 800, False, True),
    LaneConfig("batch", 2, Decimal("0.15"), 5000, False, True),
]


# The engine pools these tests name, declared as an operator declares them
# (the policy's known_pools): an undeclared pool is refused at every door.
UNIT_POOLS = ["p", "p1", "q", "req", "never-reported"]


def UnitPolicy(**kw: Any) -> Policy:
    """A ``Policy`` that declares ``UNIT_POOLS`` (besides its ``known_pools``)."""
    kw["known_pools"] = sorted({*UNIT_POOLS, *kw.get("known_pools", ())})
    return Policy(**kw)


def tenant(tenant_id: str = "acme", **kw: Any) -> TenantConfig:
    kw.setdefault("token_rate", Decimal(1000))
    kw.setdefault("burst_tokens", 10_000)
    return TenantConfig(tenant_id=tenant_id, **kw)


@pytest.fixture
def make_service(clock: Any) -> Any:
    def make(*tenants: TenantConfig, **settings: Any) -> AdmissionService:
        settings.setdefault("policy", UnitPolicy())
        svc = AdmissionService(ServiceLimits.of(Settings(**settings)), clock=clock)
        svc.apply_config(list(tenants) or [tenant()], LANES)
        return svc

    return make
