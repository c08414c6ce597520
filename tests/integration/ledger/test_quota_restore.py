"""Quota counters survive a restart: restored from the ledger (SQLite, one
replica), or kept in the replicas' quota allowances (PostgreSQL)."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

from burstgate_client.protoclient import ProtoClient, pb

from controlplane.domain import TenantConfig
from controlplane.store.config import ConfigRepository
from controlplane.store.db import make_engine


def test_hourly_quota_used_before_a_restart_still_counts(
    migrated_url: str, make_server: Callable[..., Any], tmp_path: Any, clock: Any
) -> None:
    repo = ConfigRepository(make_engine(migrated_url))
    repo.add_tenant(
        TenantConfig(tenant_id="acme", token_rate=Decimal(10**6), burst_tokens=10**6,
                     hourly_quota=10_000, max_wait_ms=0)
    )  # fmt: skip
    repo.engine.dispose()
    spool = tmp_path / "spool"
    # the injected clock stays mid-hour: no window rollover between the two runs
    first = make_server(migrated_url, clock=clock, ledger_spool_dir=spool)
    with ProtoClient(first.target) as c:
        for i in range(3):
            assert c.admit("acme", f"r{i}", prompt_tokens=2000, max_tokens=1000).decision == (
                pb.DECISION_ADMIT
            )
            c.complete("acme", f"r{i}", prompt_tokens=2000, generated_tokens=1000)
    first.stop()
    second = make_server(migrated_url, clock=clock, ledger_spool_dir=spool)
    # On PostgreSQL the new process takes the pool's cell over from the old
    # one and its gate holds the pool for a second (docs/ha.md, "The gate
    # during a takeover"), on the injected clock: let that pass, mid-hour.
    clock.advance(2 * 10**9)
    with ProtoClient(second.target) as c:
        # 9,000 of 10,000 used before the restart: 3,000 more do not fit
        d = c.admit("acme", "after", prompt_tokens=2000, max_tokens=1000)
        assert d.reason == pb.REASON_HOURLY_QUOTA
        assert d.remaining.hourly_tokens == 1000
        assert c.admit("acme", "small", prompt_tokens=500, max_tokens=500).decision == (
            pb.DECISION_ADMIT
        )
