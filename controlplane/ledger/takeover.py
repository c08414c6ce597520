"""Rebuilding a replica's state of some pools from the database: at start
(every pool) and when it takes a cell over (the cell's pools; docs/ha.md,
"Takeover rebuild").

Two things live in memory and must continue, not restart, on the new owner:

- the pools' **pricing windows**: the open windows and the previous ones are
  read back (``pricing_windows``) and installed in the book, so the
  multiplier in force carries on instead of falling back to 1.0;
- the tenants' **hourly and daily quota usage**: the tokens the ledger holds
  for the current UTC hour and day in those pools are added to the quota
  counters, so what the old owner admitted (and was settled) still counts.

Usage is imported per (tenant, pool) as the gap between the ledger and what
this replica's counters already hold as settled records (``CountedUsage``:
settled here, or imported before). So a rebuild is idempotent: run it again
and only what the ledger gained since is added; a replica taking back a
cell it owned before does not count its own records twice. Tokens are
attributed to the hour of their settlement (``settled_ns``), as at start.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import structlog

from controlplane.domain.units import NS_PER_DAY, NS_PER_HOUR
from controlplane.ledger.fencing import WindowWriter
from controlplane.ledger.pricing import PricingBook
from controlplane.service import AdmissionService
from controlplane.store.ledger import LedgerStore

log = structlog.get_logger("burstgate.ledger")

Usage = dict[tuple[str, str], int]  # (tenant, pool) -> tokens


class CountedUsage:
    """Tokens per (tenant, pool) of the current UTC hour and day that this
    replica's quota counters hold as settled records (its own settlements
    and what rebuilds imported from the ledger)."""

    def __init__(self) -> None:
        self._hour_idx = self._day_idx = -1
        self.hour: Usage = {}
        self.day: Usage = {}

    def _roll(self, now_ns: int) -> None:
        h, d = now_ns // NS_PER_HOUR, now_ns // NS_PER_DAY
        if h != self._hour_idx:
            self.hour.clear()
            self._hour_idx = h
        if d != self._day_idx:
            self.day.clear()
            self._day_idx = d

    def settled(self, tenant: str, pool: str, tokens: int, settled_ns: int, now_ns: int) -> None:
        """A record settled here: its tokens are in this replica's counters."""
        self._roll(now_ns)
        key = (tenant, pool)
        if settled_ns // NS_PER_HOUR == self._hour_idx:
            self.hour[key] = self.hour.get(key, 0) + tokens
        if settled_ns // NS_PER_DAY == self._day_idx:
            self.day[key] = self.day.get(key, 0) + tokens

    def gaps(
        self, hour: Usage, day: Usage, read_at_ns: int, now_ns: int, known: Callable[[str], bool]
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Per tenant, what the ledger (read at ``read_at_ns``) holds beyond
        the counted tokens; marked counted. A window that rolled over since
        the read imports nothing (the figures were the previous hour's)."""
        self._roll(now_ns)
        out_h: dict[str, int] = {}
        out_d: dict[str, int] = {}
        for figures, counted, idx, unit, out in (
            (hour, self.hour, self._hour_idx, NS_PER_HOUR, out_h),
            (day, self.day, self._day_idx, NS_PER_DAY, out_d),
        ):
            if read_at_ns // unit != idx:
                continue
            for key, tokens in figures.items():
                gap = tokens - counted.get(key, 0)
                if gap > 0 and known(key[0]):
                    counted[key] = tokens
                    out[key[0]] = out.get(key[0], 0) + gap
        return out_h, out_d


class Owner(Protocol):
    """What a rebuild works on (``Metering``)."""

    @property
    def svc(self) -> AdmissionService: ...
    @property
    def store(self) -> LedgerStore: ...
    @property
    def pricing(self) -> PricingBook: ...
    @property
    def windows(self) -> WindowWriter: ...
    @property
    def usage(self) -> CountedUsage: ...
    def clock(self) -> int: ...


@dataclass(frozen=True)
class Rebuilt:
    """What a rebuild installed."""

    pools: tuple[str, ...] | None  # None: every pool (start)
    windows: int  # pricing-window rows loaded
    tenants: int  # tenants whose quota counters grew
    hour_tokens: int
    day_tokens: int


async def rebuild_usage(m: Owner, pools: Iterable[str] | None = None) -> tuple[int, int, int]:
    """Add to the quota counters what the ledger holds for the current hour
    and day (in ``pools``, or all) beyond what they hold already; (tenants,
    hour tokens, day tokens) added. Raises if the database cannot be read."""
    wanted = None if pools is None else sorted(set(pools))
    now = m.svc.clock()
    hour_start, day_start = now - now % NS_PER_HOUR, now - now % NS_PER_DAY
    hour, day = await asyncio.to_thread(m.store.usage_by_pool, hour_start, day_start, wanted)
    known = set(m.svc.views.tenant_ids())
    add_h, add_d = m.usage.gaps(hour, day, now, m.svc.clock(), known.__contains__)
    tenants = m.svc.restore_usage(add_h, add_d) if add_h or add_d else 0
    return tenants, sum(add_h.values()), sum(add_d.values())


async def take_over(m: Owner, pools: Iterable[str]) -> Rebuilt:
    """The new owner of a cell continues its pools: pricing windows from the
    database (in force before any row of those pools is written again),
    then quota usage from the ledger. Safe to call again (idempotent)."""
    wanted = tuple(sorted(set(pools)))
    w = m.windows
    w.rebuilding.update(wanted)
    try:
        index = m.pricing.window_index(m.clock())
        rows = await asyncio.to_thread(
            m.store.load_windows, m.pricing.window_start_s(index - 1), None, None, wanted
        )
        m.pricing.install(wanted, rows)
        w.installed(wanted)  # stored from now on under the lease held now
        tenants, h, d = await rebuild_usage(m, wanted)
    finally:
        w.rebuilding.difference_update(wanted)
    log.info(
        "pools taken over", pools=list(wanted), windows=len(rows), tenants=tenants,
        hour_tokens=h, day_tokens=d,
    )  # fmt: skip
    return Rebuilt(wanted, len(rows), tenants, h, d)
