"""Margin warnings per pricing window, and the report the admin API serves.

When a pricing window has ended and every record settled in it is in the
database, the window's per-tenant sums are read once; each tenant whose
actual cost exceeds ``ratio`` x its user charge is warned: stored (the
``margin_warnings`` table), logged and counted. ``Metering`` decides when a
window is ready (nothing in flight, queued or spooled); this module does
the check.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from controlplane.domain.errors import LedgerUnavailable
from controlplane.domain.units import NS_PER_S
from controlplane.store.ledger import LedgerStore, MarginWarning, exceeds

log = structlog.get_logger("burstgate.ledger")


async def check_window(
    store: LedgerStore, window_s: int, ratio: Any, index: int, now_ns: int
) -> list[MarginWarning]:
    """The warnings of pricing window ``index`` (stored and logged); raises
    LedgerUnavailable when the database cannot be read or written."""
    start_s = index * window_s
    try:
        sums = await asyncio.to_thread(
            store.tenant_sums, start_s * NS_PER_S, (start_s + window_s) * NS_PER_S
        )
    except Exception as exc:
        raise LedgerUnavailable(f"margin check: {exc}") from exc
    warnings = [
        MarginWarning(
            s.tenant_id,
            start_s,
            window_s,
            s.currency,
            s.requests,
            s.user_charge_nanos,
            s.actual_cost_nanos,
            ratio,
            now_ns,
        )
        for s in sums
        if exceeds(s.actual_cost_nanos, s.user_charge_nanos, ratio)
    ]
    if warnings:
        try:
            await asyncio.to_thread(store.record_margin_warnings, warnings)
        except Exception as exc:
            raise LedgerUnavailable(f"margin warnings: {exc}") from exc
        for w in warnings:
            log.warning(
                "margin warning",
                tenant_id=w.tenant_id,
                window_start=w.window_start,
                currency=w.currency,
                user_charge_nanos=w.user_charge_nanos,
                actual_cost_nanos=w.actual_cost_nanos,
            )
    return warnings


def margin_report(
    store: LedgerStore, ratio: Any, start_ns: int, end_ns: int, tenants: list[str]
) -> list[Any]:
    """On demand, over any period (blocking: call in a thread): each
    tenant's sums and whether they pass the warning ratio."""
    return [
        (s, exceeds(s.actual_cost_nanos, s.user_charge_nanos, ratio))
        for s in store.tenant_sums(start_ns, end_ns, tenants)
    ]
