"""The ledger's wiring into serve (docs/ledger.md): the pricing book Admit
quotes its multiplier from, the metering every Complete is recorded by,
and the quota usage counted back from the ledger at start. Nothing here
runs per request."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from controlplane.domain.pricing import StepTable
from controlplane.ledger.metering import Metering
from controlplane.ledger.pricing import PricingBook
from controlplane.server.replicas import ReplicaWiring
from controlplane.service import AdmissionService
from controlplane.settings import Settings

log = structlog.get_logger("burstgate.server")


def pricing_book(settings: Settings) -> PricingBook | None:
    """With the ledger, the pricing windows Admit quotes from (None: off);
    the one book is given to the service and to metering."""
    if not settings.ledger_enabled:
        return None
    return PricingBook(settings.pricing_window_s, StepTable(settings.pricing_steps))


def metering_for(
    settings: Settings,
    service: AdmissionService,
    pricing: PricingBook | None,
    replicas: ReplicaWiring,
    on_health: Callable[[bool], None],
) -> Metering | None:
    """Metering over ``pricing``'s windows (None without the ledger), fenced
    by the replica wiring's cell leases and known to it for takeovers."""
    if pricing is None:
        return None
    metering = Metering(
        service, settings, pricing, on_health=on_health, fencing=replicas.fencing
    )
    if settings.ledger_unpriced == "refuse":  # docs/operating.md, "Prices"
        service.price_check = metering.check_priced
    replicas.metering = metering
    return metering


async def start_metering(metering: Metering) -> None:
    """Replay the spool, then restore the quota counters: they live in
    memory, so after a restart count what the ledger holds for the current
    UTC hour and day (by settlement time)."""
    await metering.start()
    try:  # the same rebuild a takeover runs for its cell's pools
        restored, _, _ = await metering.rebuild_usage()
    except Exception as exc:  # database down: start with empty counters
        log.warning("quota usage not restored from the ledger", error=str(exc))
        return
    if restored:
        log.info("quota usage restored from the ledger", tenants=restored)
