"""This replica's shares of its tenants' limits (docs/ha.md, "Tenants that
span cells").

With one replica (SQLite, or ``AdmissionService`` in process: simulate,
replay) a tenant's fast-path slot is configured with its whole limits. When
several replicas decide for one tenant (its pools are in cells owned by
different replicas), each holds a *share*, renewed by
``controlplane/ha/grants.py``: its slot is configured with that part of the
rate and burst and with its quota *allowances* (tokens it may have spent in
the hour and the day), so the replicas' sums stay within the tenant's
limits. The fast path itself is unchanged; two things need translating:

- the fast path refuses a request larger than twice the burst or than a
  quota as ``MAX_TOKENS`` (never admissible, so never retried): under a
  share that may be the share's doing, not the tenant's. Such a refusal is
  answered with the limit that binds here (``TOKEN_RATE``, ``HOURLY_QUOTA``,
  ``DAILY_QUOTA``) and a retry after the next refresh — unless the tenant's
  whole limits would refuse it too;
- a refusal of the rate or a quota under a share that may grow at the next
  refresh is retried then, not when the share's own bucket would refill (at
  a share of 0 that is never) or at the end of the hour.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from controlplane.domain import TenantConfig
from controlplane.domain.units import NS_PER_DAY, NS_PER_HOUR
from fastpath import Reason

if TYPE_CHECKING:
    from controlplane.service.decider import Decider
    from controlplane.service.dispatcher import Dispatcher
    from controlplane.service.stats import AdmissionStats
    from controlplane.service.tenants import TenantDirectory
    from fastpath import TokenBucketTable

PPM = 1_000_000  # a whole share
MTOK = 1000  # the fast path counts milli-tokens

_OK = int(Reason.OK)
_MAX_TOKENS = int(Reason.MAX_TOKENS)
_TOKEN_RATE = int(Reason.TOKEN_RATE)
_HOURLY = int(Reason.HOURLY_QUOTA)
_DAILY = int(Reason.DAILY_QUOTA)
# The refusals explain() may rewrite.
SHARED_REASONS = frozenset({_MAX_TOKENS, _TOKEN_RATE, _HOURLY, _DAILY})


@dataclass(frozen=True, slots=True)
class Share:
    """What this replica may decide for one tenant: ``rate_ppm`` millionths of
    its rate and burst, and its quota allowances (None: no such quota, or
    none granted yet, which allows nothing)."""

    rate_ppm: int
    hour_allowance: int | None = None
    day_allowance: int | None = None


NOTHING = Share(0)  # a tenant without a grant here yet


@dataclass(frozen=True, slots=True)
class Limits:
    """A slot's fast-path configuration (TokenBucketTable.configure's args)."""

    rate_mtok_per_s: int
    burst_mtok: int
    hourly_quota: int  # 0 = unlimited
    daily_quota: int


def whole(cfg: TenantConfig) -> Limits:
    return Limits(
        cfg.rate_mtok_per_s, cfg.burst_tokens * MTOK, cfg.hourly_quota or 0, cfg.daily_quota or 0
    )


def _allowance(quota: int, allowance: int | None) -> int:
    # The fast path reads a quota of 0 as unlimited: an allowance of 0 is
    # configured as 1 token, which no request fits (a prompt and one
    # generated token cost 2), so it admits nothing.
    return 0 if not quota else max(1, min(quota, allowance or 0))


def scaled(cfg: TenantConfig, share: Share) -> Limits:
    """The slot's configuration under ``share`` (the fast path's floors: a
    rate of 1 mtok/s and a burst of one token, which admit nothing a real
    request costs for the few seconds a share is 0)."""
    w = whole(cfg)
    return Limits(
        max(1, w.rate_mtok_per_s * share.rate_ppm // PPM),
        max(MTOK, w.burst_mtok * share.rate_ppm // PPM),
        _allowance(w.hourly_quota, share.hour_allowance),
        _allowance(w.daily_quota, share.day_allowance),
    )


def explain(
    cfg: TenantConfig,
    share: Share,
    reason: int,
    retry_ns: int,
    prompt: int,
    max_tokens: int,
    global_limit: int,
    refresh_ns: int,
) -> tuple[int, int]:
    """The (reason, retry_ns) a fast-path refusal under ``share`` is answered
    with (see the module docstring); unchanged when the tenant's whole limits
    bind, or the share is whole."""
    w = whole(cfg)
    if reason == _TOKEN_RATE:
        return (reason, min(retry_ns, refresh_ns)) if share.rate_ppm < PPM else (reason, retry_ns)
    if reason in (_HOURLY, _DAILY):
        quota = w.hourly_quota if reason == _HOURLY else w.daily_quota
        allowance = share.hour_allowance if reason == _HOURLY else share.day_allowance
        if (allowance or 0) < quota:  # the allowance may grow at the next refresh
            return reason, min(retry_ns, refresh_ns) if retry_ns else refresh_ns
        return reason, retry_ns
    if reason != _MAX_TOKENS:
        return reason, retry_ns
    # The fast path's size checks, against the whole limits.
    per_request = cfg.max_tokens_per_request or 0
    estimate = min(max_tokens, per_request) if per_request else max_tokens
    cost = prompt + estimate
    if (
        (per_request and prompt > per_request)
        or cost * MTOK > 2 * w.burst_mtok
        or (w.hourly_quota and cost > w.hourly_quota)
        or (w.daily_quota and cost > w.daily_quota)
        or (global_limit and cost > global_limit)
    ):
        return reason, retry_ns  # too large for the tenant itself
    mine = scaled(cfg, share)
    if cost * MTOK > 2 * mine.burst_mtok:
        return _TOKEN_RATE, refresh_ns
    if mine.daily_quota and cost > mine.daily_quota:
        return _DAILY, refresh_ns
    if mine.hourly_quota and cost > mine.hourly_quota:
        return _HOURLY, refresh_ns
    return reason, retry_ns


class ShareControl:
    """The service's in-process API for shares (``AdmissionService.shares``),
    driven by controlplane/ha/grants.py: switch a service to shared limits,
    set a tenant's share, read what the refresh asks with. Every call on the
    service's thread (the event loop), as every other service call."""

    def __init__(self, tenants: TenantDirectory, decider: Decider, dispatcher: Dispatcher,
                 stats: AdmissionStats, table: TokenBucketTable,
                 clock: Callable[[], int]) -> None:  # fmt: skip
        self._tenants = tenants
        self._decider = decider
        self._dispatcher = dispatcher
        self._stats = stats
        self._table = table
        self._clock = clock

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
        grant store counts this replica as having used in the current UTC
        hour and day; the slot's counters are raised to it when lower (a
        restart that kept its member id). Requests waiting for the tenant
        are looked at again. False when the tenant is not configured."""
        now = self._clock()
        if not self._tenants.set_share(tenant_id, share, now):
            return False
        h, d = self.used(tenant_id, now)
        if hour_used > h or day_used > d:
            slot = self._tenants.active(tenant_id).slot
            self._table.add_usage(slot, now, max(0, hour_used - h), max(0, day_used - d))
        self._dispatcher.dispatch(now)
        return True

    def used(self, tenant_id: str, now: int) -> tuple[int, int]:
        """Tokens this replica has counted against the tenant's quotas in
        the UTC hour and day of ``now``."""
        state = self._tenants.state(tenant_id, now)
        hour = state["hour_used"] if state["hour_idx"] == now // NS_PER_HOUR else 0
        day = state["day_used"] if state["day_idx"] == now // NS_PER_DAY else 0
        return hour, day

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
        per_slot = self._dispatcher.queues.per_tenant
        return {tenants[s].config.tenant_id: n for s, n in list(per_slot.items())
                if n > 0 and 0 <= s < len(tenants)}  # fmt: skip

    def resolve(self, tenant_id: str) -> str | None:
        """The configured tenant an Admit for ``tenant_id`` is charged to
        (itself, else the default tenant); None when refused as unknown."""
        entry = self._tenants.resolve(tenant_id)
        return None if entry is None else entry.config.tenant_id

    def configured(self) -> dict[str, TenantConfig]:
        """The configured tenants (not deleted), by id."""
        return {t: self._tenants.active(t).config for t in self._tenants.ids()}
