"""The service's in-process API for shares of tenants' limits
(``AdmissionService.shares``; the rules in service/shares.py, the driver in
controlplane/ha/shares.py)."""

from __future__ import annotations

from collections.abc import Callable

from controlplane.domain import TenantConfig
from controlplane.domain.units import NS_PER_DAY, NS_PER_HOUR
from controlplane.service.decider import Decider
from controlplane.service.queueing import WaitQueues
from controlplane.service.shares import Share
from controlplane.service.stats import AdmissionStats
from controlplane.service.tenants import TenantDirectory
from fastpath import TokenBucketTable


class ShareControl:
    """The service's in-process API for shares (``AdmissionService.shares``),
    driven by controlplane/ha/shares.py: switch a service to shared limits,
    set a tenant's share, read what the refresh asks with. Every call on the
    service's thread (the event loop), as every other service call.
    ``changed(now)``: the facade's hook that looks at waiting requests again."""

    def __init__(self, *, tenants: TenantDirectory, decider: Decider, queues: WaitQueues,
                 stats: AdmissionStats, table: TokenBucketTable, clock: Callable[[], int],
                 changed: Callable[[int], None]) -> None:  # fmt: skip
        self._tenants = tenants
        self._decider = decider
        self._queues = queues
        self._stats = stats
        self._table = table
        self._clock = clock
        self._changed = changed

    @property
    def on(self) -> bool:
        return self._tenants.shares is not None

    def start(self, refresh_ns: int) -> None:
        """Limit every tenant to the share set for it (none yet: nothing is
        admitted for it); a refusal under a share is retried ``refresh_ns``
        later, when the share may have grown."""
        if refresh_ns <= 0:
            raise ValueError(f"refresh_ns must be > 0, got {refresh_ns}")
        self._decider.share_refresh_ns = refresh_ns
        self._tenants.share_limits(self._clock())

    def set(self, tenant_id: str, share: Share, hour_used: int = 0, day_used: int = 0) -> bool:
        """A tenant's new share here. ``hour_used`` / ``day_used``: what the
        share store counts this replica as having used in the current UTC
        hour and day; the slot's counters are raised to it when lower (a
        restart that kept its member id). Requests waiting for the tenant
        are looked at again. False when the tenant is not configured."""
        return self.set_many([(tenant_id, share, hour_used, day_used)])[0]

    def set_many(self, shares: list[tuple[str, Share, int, int]]) -> list[bool]:
        """:meth:`set` for many tenants (a refresh's), the waiting requests
        looked at once after."""
        now = self._clock()
        out = []
        for tenant_id, share, hour_used, day_used in shares:
            known = self._tenants.set_share(tenant_id, share, now)
            out.append(known)
            if known and (hour_used or day_used):
                h, d = self.used(tenant_id, now)
                if hour_used > h or day_used > d:
                    slot = self._tenants.active(tenant_id).slot
                    self._table.add_usage(slot, now, max(0, hour_used - h), max(0, day_used - d))
        self._changed(now)
        return out

    def used(self, tenant_id: str, now: int) -> tuple[int, int]:
        """Tokens this replica has counted against the tenant's quotas in
        the UTC hour and day of ``now``."""
        state = self._tenants.state(tenant_id, now)
        hour = state["hour_used"] if state["hour_idx"] == now // NS_PER_HOUR else 0
        day = state["day_used"] if state["day_idx"] == now // NS_PER_DAY else 0
        return hour, day

    def slot_state(self, tenant_id: str) -> dict[str, int]:
        """The tenant's fast-path slot as configured under its share here."""
        return self._tenants.state(tenant_id, self._clock())

    def decisions(self) -> dict[str, int]:
        """Decisions made here so far per configured tenant id (its demand,
        counted however the request ended; cumulative)."""
        by_slot: dict[int, int] = {}
        for slot, _lane, _reason, n, _tokens in self._stats.outcome_cells():
            if slot >= 0:
                by_slot[slot] = by_slot.get(slot, 0) + n
        tenants = self._tenants.by_slot
        return {tenants[s].config.tenant_id: n for s, n in by_slot.items() if s < len(tenants)}

    def queued(self) -> dict[str, int]:
        """Admit calls waiting in the lane queues now, per tenant id (demand
        not decided yet: a request held for want of a share is one)."""
        tenants = self._tenants.by_slot
        per_slot = self._queues.per_tenant
        return {tenants[s].config.tenant_id: n for s, n in list(per_slot.items())
                if n > 0 and 0 <= s < len(tenants)}  # fmt: skip

    def resolve(self, tenant_id: str) -> str | None:
        """The configured tenant an Admit for ``tenant_id`` is charged to
        (itself, else the default tenant); None when refused as unknown."""
        entry = self._tenants.resolve(tenant_id)
        return None if entry is None else entry.config.tenant_id

    def home_pool(self, tenant_id: str) -> str:
        """The pool a request of the tenant that names none goes to (its
        default lane's placement): where its shares are wanted when idle."""
        entry = self._tenants.active(tenant_id)
        return self._tenants.pool_for(entry, entry.config.default_lane, "")

    def configured(self) -> dict[str, TenantConfig]:
        """The configured tenants (not deleted), by id."""
        return {t: self._tenants.active(t).config for t in self._tenants.ids()}
