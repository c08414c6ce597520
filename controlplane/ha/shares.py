"""Keep this replica's shares of its tenants' limits (docs/ha.md, "Tenants
that span cells"): the loop that renews them in PostgreSQL
(``ShareStore.refresh`` in store/shares.py, the rules of domain/shares.py)
and installs them in the service (``AdmissionService.shares``,
service/shares.py).

- **Who is asked about.** Every tenant decided here since the last refresh,
  every tenant whose share here is not yet zero (so it can lower it when
  its demand moves elsewhere), every tenant with requests waiting in the
  lane queues and every tenant a request waits for a share of (``ensure``).
  Demand is the tenant's decisions per second here (an exponential
  average with a 10 s time constant; a request waiting for a share counts
  as one a second) plus its queued requests as asked in this interval, in
  thousandths.
- **When.** Once for every configured tenant before the replica serves (and
  for a tenant new in the config at the next refresh: a lone replica so has
  every tenant's whole limits from its first request); then every
  ``interval_s`` (min(1 s, TTL/5)), and at once when a request names a
  tenant with no share here (``ensure``: the request waits for that
  refresh, at most two intervals; without a share it is refused with a
  retry after one interval).
- **How long a share holds.** As a cell lease: until ``t_sent + ttl -
  margin`` on this replica's clock, ``t_sent`` read before the refresh was
  sent, so it lapses here before the database lets the others take it
  over. A share that lapses (the database is unreachable) becomes nothing:
  the replica admits nothing for that tenant, as it decides nothing for
  cells whose leases it cannot renew. The TTL is the coordinator's
  ``lease_ttl()`` (``ttl_for``): a lone member's shares last its lone TTL,
  as its leases do, so it rides through a database outage as long; before a
  refresh is sent the shares it renews are trusted no longer than it allows
  (a shorter TTL whose answer is lost may have shortened them already).
- **Quota windows** are the service clock's UTC hour and day (the fast
  path's windows). An allowance runs at most the tokens the tenant can
  spend in one TTL ahead of what this replica used (``Ask.spend_bound``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.aiotime import within
from controlplane.domain import TenantConfig
from controlplane.domain.units import NS_PER_DAY, NS_PER_HOUR, NS_PER_S
from controlplane.ha._blocking import call
from controlplane.service.shares import NOTHING, Share
from controlplane.store.shares import Ask, ShareStore, Window

if TYPE_CHECKING:
    from controlplane.service import AdmissionService

log = structlog.get_logger("burstgate.ha")

# Time constant of the demand average (s): a replica that served a tenant in
# the last minute or so keeps a proportional share of it, so a tenant's
# sporadic requests there are not each refused while shares move back.
DEMAND_TAU_S = 10.0
# Below this many decisions per second a tenant has no demand here.
IDLE_DEMAND = 0.01
LOG_EVERY_S = 10.0
# Tenants per refresh transaction (bench/bench_grants.py).
CHUNK = 500


class TenantShares:
    def __init__(
        self,
        service: AdmissionService,
        store: ShareStore,
        member_id: str,
        ttl_s: float,
        margin_s: float,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        affine: Callable[[str], bool] | None = None,
        ttl_for: Callable[[], float] | None = None,
    ) -> None:
        if not 0 <= margin_s < ttl_s:
            raise ValueError(f"margin_s must be in [0, ttl_s), got {margin_s} (ttl {ttl_s})")
        self.service = service
        self.store = store
        self.member_id = member_id
        self.ttl_s = ttl_s
        self.margin_s = margin_s
        self.interval_s = interval_s if interval_s is not None else min(1.0, ttl_s / 5)
        self.clock = clock
        # Whether this replica owns the cell of a tenant's configured pool:
        # its idle tenants' shares gather there rather than split equally.
        self.affine = affine
        # The TTL a refresh sent now asks for (the coordinator's lease_ttl:
        # longer while this member is lone); None: always ttl_s.
        self.ttl_for = ttl_for
        self._valid_until: dict[str, float] = {}  # tenant -> local deadline
        self._shares: dict[str, Share] = {}
        self._demand: dict[str, float] = {}
        self._seen: dict[str, int] = {}  # cumulative decisions at the last refresh
        self._seen_at = clock()
        self._asked: set[str] = set()
        self._primed: set[str] = set()  # tenants asked about at least once
        self._wake = asyncio.Event()
        self._done: asyncio.Future[None] | None = None  # the next refresh's end
        self._task: asyncio.Task[None] | None = None
        self.refreshes = 0
        self.failures = 0
        self._last_log = -math.inf

    # ----------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Limit the service to shares, ask for every configured tenant's
        (before the replica serves: on a lone replica every tenant then has
        its whole limits from the first request) and keep them."""
        self.service.shares.start(int(self.interval_s * NS_PER_S))
        try:
            await self.refresh()
        except Exception as exc:  # the loop retries; requests wait in ensure()
            self.failures += 1
            log.warning("tenant shares not refreshed", error=str(exc))
        self._task = asyncio.ensure_future(self._run())

    async def stop(self, release: bool) -> None:
        """Stop refreshing; ``release``: give up every rate share at once
        (a graceful exit), so the others raise theirs at their next refresh."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if release:
            final = self._asks(set(self._shares))  # this replica's last use of the windows
            try:
                await call(self.store.release, self.member_id, final, wait_s=self.ttl_s,
                           what="release")  # fmt: skip
            except Exception as exc:  # they expire after the TTL anyway
                log.warning("tenant shares not released", error=str(exc))

    # ------------------------------------------------------------- requests

    def ready(self, tenant_id: str) -> bool:
        """A share of the tenant's rate is in force here (not zero)."""
        until = self._valid_until.get(tenant_id)
        if until is None or self.clock() >= until:
            return False
        share = self._shares.get(tenant_id)
        return share is not None and share.rate_ppm > 0

    def ask_soon(self, tenant_ids: Iterable[str]) -> None:
        """Ask for a share of each tenant named that has none here at the
        next refresh, which starts now; do not wait for it (AdmitStream: a
        batch that waited would hold up every batch behind it)."""
        missing = [t for t in tenant_ids if not self.ready(t)]
        if missing and self._task is not None:
            self._asked.update(missing)
            self._wake.set()

    async def ensure(self, tenant_ids: Iterable[str], timeout_s: float | None = None) -> None:
        """Wait (at most three refresh intervals, and ``timeout_s``) until
        every tenant named has a share of its rate here, asking for one at
        once; a tenant still without one is then decided under what it has
        (nothing: refused, retry after one interval). Three intervals: the
        replica holding the tenant's rate lowers it at its next refresh,
        this one raises at the one after."""
        missing = [t for t in tenant_ids if not self.ready(t)]
        if not missing or self._task is None:
            return
        wait = 3 * self.interval_s if timeout_s is None else min(3 * self.interval_s, timeout_s)
        deadline = self.clock() + wait
        while missing and self.clock() < deadline:
            self._asked.update(missing)
            self._wake.set()
            if self._done is None or self._done.done():
                self._done = asyncio.get_running_loop().create_future()
            try:
                await within(asyncio.shield(self._done), max(0.0, deadline - self.clock()))
            except TimeoutError:
                break
            missing = [t for t in missing if not self.ready(t)]
        if missing:  # a share past its deadline is not used, even before the loop runs
            self._lapse()

    # ----------------------------------------------------------------- loop

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the database: shares lapse at their deadlines
                self.failures += 1
                now = self.clock()
                if now - self._last_log >= LOG_EVERY_S:
                    self._last_log = now
                    log.warning("tenant shares not refreshed", error=str(exc))
            finally:
                self._lapse()
                if self._done is not None and not self._done.done():
                    self._done.set_result(None)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await within(self._wake.wait(), self.interval_s)

    def _observe_demand(self) -> None:
        now = self.clock()
        dt = max(1e-3, now - self._seen_at)
        self._seen_at = now
        counts = self.service.shares.decisions()
        alpha = 1.0 - math.exp(-dt / DEMAND_TAU_S)
        for tenant, n in counts.items():
            rate = (n - self._seen.get(tenant, 0)) / dt
            old = self._demand.get(tenant, 0.0)
            self._demand[tenant] = alpha * rate + (1 - alpha) * old
        for tenant in set(self._demand) - set(counts):
            self._demand[tenant] *= 1 - alpha
        for tenant in self._asked:  # a request waits for it: one a second at least
            self._demand[tenant] = max(self._demand.get(tenant, 0.0), 1.0)
        self._seen = counts

    def share_ttl(self) -> float:
        """The TTL of the shares a refresh sent now asks for."""
        return self.ttl_s if self.ttl_for is None else max(self.ttl_s, self.ttl_for())

    def asks(self, ttl_s: float | None = None) -> list[Ask]:
        """What the next refresh asks for (see the module docstring)."""
        self._observe_demand()
        configured = self.service.shares.configured()
        queued = self.service.shares.queued()
        wanted = {t for t, d in self._demand.items() if d >= IDLE_DEMAND}
        wanted |= set(queued)
        wanted |= {t for t, s in self._shares.items() if s.rate_ppm > 0}
        wanted |= self._asked
        wanted |= set(configured) - self._primed  # new in the config: asked once
        if self.affine is not None:  # tenants at home here: where their idle shares gather
            wanted |= {t for t in configured if self.affine(t)}
        return self._asks(wanted, queued, configured, ttl_s)

    def _asks(
        self,
        wanted: set[str],
        queued: dict[str, int] | None = None,
        configured: dict[str, TenantConfig] | None = None,
        ttl_s: float | None = None,
    ) -> list[Ask]:
        if configured is None:
            configured = self.service.shares.configured()
        queued = queued or {}
        ttl = self.ttl_s if ttl_s is None else ttl_s
        now = self.service.clock()
        hour_s = now // NS_PER_HOUR * 3600
        day_s = now // NS_PER_DAY * 86400
        asks = []
        for tenant in sorted(wanted & set(configured)):
            cfg = configured[tenant]
            has_quota = bool(cfg.hourly_quota or cfg.daily_quota)
            hour_used, day_used = self.service.shares.used(tenant, now) if has_quota else (0, 0)
            # decisions per second, and the requests waiting as asked now
            rate = self._demand.get(tenant, 0.0) + queued.get(tenant, 0) / self.interval_s
            demand = int(rate * 1000)
            if tenant in self._asked:
                demand = max(demand, 1000)  # a request waits for it: one a second at least
            elif self.affine is not None and self.affine(tenant):
                demand = max(demand, 1)  # its home cell is here: idle shares gather here
            asks.append(Ask(
                tenant, demand, first=tenant not in self._primed,
                hour=Window(hour_s, hour_used, cfg.hourly_quota) if cfg.hourly_quota else None,
                day=Window(day_s, day_used, cfg.daily_quota) if cfg.daily_quota else None,
                spend_bound=cfg.burst_tokens + math.ceil(cfg.rate_mtok_per_s * ttl / 1000),
            ))  # fmt: skip
        return asks

    async def refresh(self) -> None:
        ttl = self.share_ttl()
        asks = self.asks(ttl)
        waiting = self._asked
        self._asked = set()
        if not asks:
            return
        # Tenants a request waits for first; then in chunks, each its own
        # transaction with its own deadline, so a replica holding many
        # tenants renews most of them even when one statement is slow.
        asks.sort(key=lambda a: a.tenant not in waiting)
        for i in range(0, len(asks), CHUNK):
            await self._refresh(asks[i : i + CHUNK], ttl)

    async def _refresh(self, asks: list[Ask], ttl: float) -> None:
        t_sent = self.clock()
        deadline = t_sent + ttl - self.margin_s
        for a in asks:  # this refresh may shorten them in the database, answered or not
            if self._valid_until.get(a.tenant, -math.inf) > deadline:
                self._valid_until[a.tenant] = deadline
        # Awaited at most an ordinary TTL (less the margin), even for a lone
        # member's longer shares: a refresh lost in a hung database is tried
        # again, not waited for until the shares run out. And no later than
        # the first share held here runs out: the loop lapses it then (a
        # refresh sent after the last good one must not keep it in the fast
        # path past its deadline while it waits).
        soonest = min((u for u in self._valid_until.values() if u > t_sent), default=math.inf)
        wait = min(min(ttl, self.ttl_s) - self.margin_s, soonest - t_sent)
        renewed = await call(
            self.store.refresh, self.member_id, asks, ttl,
            wait_s=max(0.0, wait), what="share refresh",
        )  # fmt: skip
        if self.clock() >= deadline:
            return  # an answer that came too late gives nothing here
        self._primed.update(a.tenant for a in asks)
        items = [(tenant, Share(g.rate_ppm, g.hour_allowance, g.day_allowance,
                                g.hour_others_used, g.day_others_used), g.hour_used, g.day_used)
                 for tenant, g in renewed.items()]  # fmt: skip
        for (tenant, share, _, _), known in zip(
            items, self.service.shares.set_many(items), strict=True
        ):
            if known:
                self._shares[tenant] = share
                self._valid_until[tenant] = deadline
        self.refreshes += 1

    def _lapse(self) -> None:
        """Shares past their deadline become nothing; an idle tenant with no
        share is forgotten (its row expires in the database)."""
        now = self.clock()
        for tenant, until in list(self._valid_until.items()):
            if now >= until:
                del self._valid_until[tenant]
                if self._shares.pop(tenant, NOTHING) != NOTHING:
                    self.service.shares.set(tenant, NOTHING)
        for tenant, d in list(self._demand.items()):
            if d < IDLE_DEMAND and tenant not in self._shares:
                del self._demand[tenant]

    def held(self) -> dict[str, Share]:
        """The shares in force here now, by tenant."""
        now = self.clock()
        return {t: s for t, s in self._shares.items() if self._valid_until.get(t, 0.0) > now}


class SharesCollector(Collector):
    def __init__(self, shares: TenantShares) -> None:
        self._g = shares

    def collect(self) -> Iterator[Metric]:
        held: Any = self._g.held()
        g = GaugeMetricFamily(
            "burstgate_ha_tenant_shares",
            "Tenants with a share of their limits in force on this replica",
        )
        g.add_metric([], len(held))
        yield g
        yield CounterMetricFamily(
            "burstgate_ha_share_refresh_failures",
            "Refreshes of this replica's tenant shares that failed (database)",
            value=self._g.failures,
        )
