"""The tenant directory: who is configured, in which lanes, under which policy.

It owns the configuration the other parts read live (tenants, lanes, the
policy in force) and the mapping from a tenant id to its slot in the fast
path's ``TokenBucketTable``. A slot is never reused: a tenant that leaves the
config keeps its slot (marked deleted) so its open reservations can still be
settled, and comes back to the same slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from controlplane.domain import LaneConfig, TenantConfig
from controlplane.domain.errors import InvalidArgument, NotFound, excerpt
from controlplane.domain.policy import Policy
from controlplane.domain.units import NS_PER_DAY, NS_PER_HOUR
from controlplane.domain.validate import MAX_LANE_NAME
from controlplane.service.gate import DEFAULT_POOL
from controlplane.service.shares import NOTHING, Share, scaled, whole
from fastpath import Reason, TokenBucketTable

# Lane of a request whose tenant is unknown and that named no lane (only the
# refusal's record carries it).
FALLBACK_LANE = "standard"


class Tenant:
    """One configured tenant and its fast-path slot."""

    __slots__ = ("config", "deleted", "slot")

    def __init__(self, slot: int, config: TenantConfig) -> None:
        self.slot = slot
        self.config = config
        self.deleted = False


class Route(NamedTuple):
    """Where a request goes: the tenant charged, the lane it asked for (its
    SLO applies), the lane it was placed in and the pool it belongs to.
    ``generation``: the config it was computed under (``TenantDirectory.generation``)."""

    entry: Tenant | None
    asked: str
    lane: str
    pool: str
    generation: int


def early_reason(entry: Tenant | None) -> int:
    """Refusals that need no bucket: the tenant is unknown or disabled."""
    if entry is None:
        return Reason.UNKNOWN_TENANT
    if not entry.config.enabled:
        return Reason.TENANT_DISABLED
    return int(Reason.OK)


class TenantDirectory:
    def __init__(self, table: TokenBucketTable, policy: Policy, default_tenant: str | None) -> None:
        self._table = table
        self.policy = policy
        self.lanes: dict[str, LaneConfig] = {}
        # Lanes from highest priority to lowest (priority, then name).
        self.by_priority: list[LaneConfig] = []
        self.lowest_lane = ""
        self._tenants: dict[str, Tenant] = {}
        self.by_slot: list[Tenant] = []
        self._default_tenant = default_tenant
        # Several replicas: this one's share of each tenant's limits, by
        # tenant id (service/shares.py); None: one replica, whole limits.
        self.shares: dict[str, Share] | None = None
        # The pools an operator declared (``declared_pools``); no other pool
        # name is accepted at any door, so no request creates pool state.
        self.declared: frozenset[str] = frozenset({DEFAULT_POOL})
        # Bumped by every install: a route computed before it may be stale.
        self.generation = 0

    def install(
        self,
        tenants: Sequence[TenantConfig],
        lanes: Sequence[LaneConfig],
        policy: Policy,
        now: int,
    ) -> None:
        """Install a full config. Buckets of tenants that stay keep their level
        and counters (the fast path re-limits them to the new burst); tenants
        that disappear stop being admitted but keep their slot."""
        if not lanes:
            raise InvalidArgument("lanes", "at least one lane must be configured")
        by_name = {lane.name: lane for lane in lanes}
        for cfg in tenants:
            if cfg.default_lane not in by_name:
                raise InvalidArgument(
                    f"tenants[{cfg.tenant_id}].default_lane",
                    f"unknown lane {excerpt(cfg.default_lane)}",
                )
        self.policy = policy
        self.lanes = by_name
        self.by_priority = sorted(lanes, key=lambda lane: (lane.priority, lane.name))
        self.lowest_lane = self.by_priority[-1].name
        seen: set[str] = set()
        for cfg in tenants:
            seen.add(cfg.tenant_id)
            entry = self._tenants.get(cfg.tenant_id)
            if entry is None:
                entry = Tenant(len(self.by_slot), cfg)
                self._tenants[cfg.tenant_id] = entry
                self.by_slot.append(entry)
            entry.config = cfg
            entry.deleted = False
            self._configure(entry, now)
        for tenant_id, entry in self._tenants.items():
            if tenant_id not in seen:
                entry.deleted = True
        self.declared = declared_pools(tenants, lanes, policy)
        self.generation += 1

    def _configure(self, entry: Tenant, now: int) -> None:
        cfg = entry.config
        shares = self.shares
        lim = whole(cfg) if shares is None else scaled(cfg, shares.get(cfg.tenant_id, NOTHING))
        self._table.configure(
            entry.slot,
            now,
            lim.rate_mtok_per_s,
            lim.burst_mtok,
            lim.hourly_quota,
            lim.daily_quota,
            cfg.max_concurrency or 0,
            cfg.max_tokens_per_request or 0,
        )

    def share_limits(self, now: int) -> None:
        """From now on each tenant is limited to the share ``set_share`` gives
        it (none yet: nothing admitted), not its whole limits."""
        if self.shares is None:
            self.shares = {}
            for entry in self.by_slot:
                if not entry.deleted:
                    self._configure(entry, now)

    def set_share(self, tenant_id: str, share: Share, now: int) -> bool:
        """This replica's new share of a tenant's limits; False when the
        tenant is not configured (the share is kept for when it is)."""
        if self.shares is None:
            raise RuntimeError("set_share before share_limits")
        before = self.shares.get(tenant_id, NOTHING)
        self.shares[tenant_id] = share
        if share == before:
            return tenant_id in self._tenants and not self._tenants[tenant_id].deleted
        entry = self._tenants.get(tenant_id)
        if entry is None or entry.deleted:
            return False
        self._configure(entry, now)
        if before.rate_ppm == 0 < share.rate_ppm:
            # A share granted afresh starts full, as a new bucket does: what
            # it was granted, the others gave up (their levels are capped to
            # their lowered bursts). Between non-zero shares the level
            # carries over (docs/ha.md, "Tenants that span cells").
            self._table.fill(entry.slot, now)
        return True

    def share_of(self, entry: Tenant) -> Share | None:
        """The share ``entry`` is limited to here; None: its whole limits."""
        shares = self.shares
        return None if shares is None else shares.get(entry.config.tenant_id, NOTHING)

    def restore_usage(
        self, hour_tokens: dict[str, int], day_tokens: dict[str, int], now: int
    ) -> int:
        """Add tokens already used this UTC hour and day to the tenants' quota
        counters; returns how many tenants were restored."""
        if self.shares is not None:
            # Several replicas: what the others used is in their quota
            # allowances (controlplane/ha/shares.py); counting it here too
            # would count it twice against this replica's own allowance.
            return 0
        restored = 0
        for tenant_id in set(hour_tokens) | set(day_tokens):
            entry = self._tenants.get(tenant_id)
            if entry is None:
                continue
            self._table.add_usage(
                entry.slot, now, hour_tokens.get(tenant_id, 0), day_tokens.get(tenant_id, 0)
            )
            restored += 1
        return restored

    def state(self, tenant_id: str, now: int) -> dict[str, int]:
        """A configured tenant's bucket, quotas and in-flight counts at ``now``."""
        entry = self.active(tenant_id)
        self._table.level_mtok(entry.slot, now)  # refill to now before reading
        return dict(self._table.snapshot(entry.slot))

    def reported_state(self, tenant_id: str, now: int) -> dict[str, int]:
        """``state`` as GetLimits and the admin API report it: under a share
        (several replicas), the tenant's whole rate, burst and quotas; its
        bucket here; its use of the quotas tenant-wide (the other replicas'
        as of the last refresh, and this one's)."""
        state = self.state(tenant_id, now)
        shares = self.shares
        if shares is None:
            return state
        cfg = self.active(tenant_id).config
        share = shares.get(tenant_id, NOTHING)
        w = whole(cfg)
        state["rate_mtok_per_s"], state["burst_mtok"] = w.rate_mtok_per_s, w.burst_mtok
        for kind, quota, others, per in (
            ("hour", w.hourly_quota, share.hour_others, NS_PER_HOUR),
            ("day", w.daily_quota, share.day_others, NS_PER_DAY),
        ):
            if quota:  # tenant-wide use: the others' (at the last refresh) and ours
                used = state[f"{kind}_used"] if state[f"{kind}_idx"] == now // per else 0
                state[f"{kind}_idx"], state[f"{kind}_used"] = now // per, used + others
            state[f"{'hourly' if kind == 'hour' else 'daily'}_quota"] = quota
        return state

    def get(self, tenant_id: str) -> Tenant | None:
        """The tenant itself, deleted or not (settlement needs the deleted)."""
        return self._tenants.get(tenant_id)

    def resolve(self, tenant_id: str) -> Tenant | None:
        """The tenant whose limits apply to an Admit: the tenant itself, else
        the configured default tenant, else None (refused as unknown)."""
        entry = self._tenants.get(tenant_id)
        if entry is not None and not entry.deleted:
            return entry
        if self._default_tenant:
            entry = self._tenants.get(self._default_tenant)
            if entry is not None and not entry.deleted:
                return entry
        return None

    def active(self, tenant_id: str) -> Tenant:
        entry = self._tenants.get(tenant_id)
        if entry is None or entry.deleted:
            raise NotFound("tenant_id", f"unknown tenant {excerpt(tenant_id)}")
        return entry

    def ids(self) -> list[str]:
        return sorted(t for t, e in self._tenants.items() if not e.deleted)

    def lane_for(self, field: str, lane: str, entry: Tenant | None) -> str:
        """The lane a request goes to: the one it names (which must exist),
        else its tenant's default."""
        if not lane:
            return entry.config.default_lane if entry is not None else FALLBACK_LANE
        if lane not in self.lanes:
            if len(lane) > MAX_LANE_NAME:  # (the error path: a known lane is never this long)
                raise InvalidArgument(
                    field, f"longer than {MAX_LANE_NAME} characters ({len(lane)})"
                )
            raise InvalidArgument(
                field, f"unknown lane {excerpt(lane)}; configured: {', '.join(sorted(self.lanes))}"
            )
        return lane

    def check_lane(self, field: str, lane: str) -> None:
        if lane and lane not in self.lanes:
            self.lane_for(field, lane, None)

    def place(self, entry: Tenant, lane: str, prompt: int, max_tokens: int) -> str:
        """Length-aware placement: a long request goes to the lowest lane so
        short ones are not stuck behind it (fail-open lanes are never moved)."""
        cfg = entry.config
        if not cfg.demote_long_requests or lane == self.lowest_lane:
            return lane
        threshold = cfg.long_request_tokens or self.policy.long_request_tokens
        if prompt + max_tokens > threshold and not self.lanes[lane].fail_open:
            return self.lowest_lane
        return lane

    def check_pool(self, pool: str) -> None:
        """A pool named at the edge (an Admit, a batch, a load report, a
        re-announced reservation, an offline booking) must be declared
        (``declared_pools``): anything else is refused INVALID_ARGUMENT
        naming ``pool`` and listing the declared ones, before any state -
        a pool view, a gate, a pricing window, a cell lease - is made for it.
        Pools resolved from a tenant or a lane are declared by definition."""
        if pool and pool not in self.declared:
            raise InvalidArgument("pool", undeclared_message(pool, self.declared))

    def pool_for(self, entry: Tenant | None, lane: str, requested: str) -> str:
        """The engine pool an Admit belongs to: the request's ``pool`` if it
        names one; else its tenant's configured pool; else the configured
        pool of ``lane``, the lane it was finally placed in (after
        length-aware placement); else, with the pool gate on,
        ``DEFAULT_POOL`` — never none (with the gate off, none: no
        backpressure, as before the gate). The one place this rule lives:
        the unary and the batch paths both call it."""
        if requested:
            return requested
        if entry is not None and entry.config.pool:
            return entry.config.pool
        # .get: an unknown tenant's lane may be FALLBACK_LANE, configured or not
        placed = self.lanes.get(lane)
        configured = placed.pool if placed is not None else None
        return configured or (DEFAULT_POOL if self.policy.pool_gate else "")

    def route(
        self, tenant_id: str, lane: str, prompt: int, max_tokens: int, pool: str = "",
        field: str = "lane",
    ) -> Route:  # fmt: skip
        """The one route of a request: resolve its tenant (``resolve``), its
        lane (``lane_for``; ``field`` names it in an error), length-aware
        placement (``place``), then its pool (``pool_for``, after placement:
        the final lane's). Every door that needs to know where a request
        goes asks this: Admit, a batch's scope and retries, the owner check
        under several replicas, a re-announced reservation. Changes nothing."""
        entry = self.resolve(tenant_id)
        asked = self.lane_for(field, lane, entry)
        placed = asked if entry is None else self.place(entry, asked, prompt, max_tokens)
        return Route(entry, asked, placed, self.pool_for(entry, placed, pool), self.generation)

    def shadow(self, entry: Tenant) -> bool:
        """Shadow mode: decide and charge as usual, but admit whatever the verdict."""
        return entry.config.shadow_mode or self.policy.shadow_mode

    def fallback_model(self, tenant_id: str) -> str:
        entry = self._tenants.get(tenant_id)
        return (entry.config.fallback_model or "") if entry is not None else ""


# At most this many declared pools are listed in an undeclared pool's error.
MAX_LISTED_POOLS = 20


def declared_pools(
    tenants: Sequence[TenantConfig], lanes: Sequence[LaneConfig], policy: Policy
) -> frozenset[str]:
    """The pools an operator declared (docs/operating.md, "Declaring pools"):
    the policy's ``known_pools``, every configured tenant's and lane's
    ``pool``, and ``default`` (the pool of a request that names none).
    Nothing else: a request naming another pool is refused, so a client
    cannot create per-pool state (and, with several replicas, a cell lease)
    by making names up."""
    names = {DEFAULT_POOL, *policy.known_pools}
    names.update(t.pool for t in tenants if t.pool)
    names.update(lane.pool for lane in lanes if lane.pool)
    return frozenset(names)


def undeclared_message(pool: str, declared: frozenset[str]) -> str:
    listed = sorted(declared)
    more = len(listed) - MAX_LISTED_POOLS
    names = ", ".join(listed[:MAX_LISTED_POOLS]) + (f" and {more} more" if more > 0 else "")
    return (
        f"unknown pool {excerpt(pool)}: not declared (declared pools: {names}); "
        "declare it in the policy's known_pools or as a tenant's or lane's pool"
    )
