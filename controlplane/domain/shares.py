"""Shares of one tenant's limits among the replicas that decide for it
(docs/ha.md, "Tenants that span cells"): the rules, pure and exact (integers).

One concept, one name: a **share**. How a tenant's limits are split among
replicas is called its shares in every layer: the rules here, the rows
(``controlplane/store/shares.py``, ``ShareStore``), the loop that renews this
replica's shares (``controlplane/ha/shares.py``, ``TenantShares``) and the
service's slot limited to one (``controlplane/service/shares.py``, ``Share``).
A share has two parts: ``rate_ppm``, millionths of the tenant's rate and
burst, and one quota *allowance* per window (the tokens the member may have
spent in the hour, the day); an allowance is a part of a share, not another
word for it. "Share" rather than "grant", which named the same thing in
three modules: the service, its metrics (``burstgate_ha_tenant_shares``) and
the docs already said share, and "granted" already means something else
(``granted_max_tokens``, what one admission allows). "Grant" stays a verb.

A tenant whose requests go to pools in cells owned by different replicas is
decided by each of them, from a bucket of its own. Each replica (member)
therefore holds a share of the tenant's rate and burst, and an allowance of
each quota window (hour, day). Shares are rows in PostgreSQL, changed only
under a lock on all of the tenant's rows, by two rules that keep the sum
within the tenant's limits at every moment:

- a member may LOWER its own share at will;
- a member may RAISE its own share only into what the others do not hold:
  ``mine <= whole - sum(others' live shares)``.

Each member aims at a demand-weighted target (its tokens asked per second
over all members'), so after a member lowers towards its target the others
can raise towards theirs: shares converge in two refreshes, and a member
whose rate share expired (it died, or lost the database) frees its rate for
the others after the lease TTL. Quota allowances are cumulative (tokens
already spent stay spent), so they never expire inside their window: a dead
member's allowance stays counted until the window ends. That can leave part
of a quota unused after a failover, never overshoot it; to keep that part
small an allowance runs at most ``headroom`` tokens ahead of what the member
has used (what it can spend before its next refresh: its share of the burst
plus its share of the rate over the share's TTL), so a dead member strands at
most its headroom, not its whole share of the unused quota. The store
applies these rules under the lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PPM = 1_000_000  # a whole rate: the tenant's token_rate and burst_tokens


@dataclass(frozen=True, slots=True)
class RateHolding:
    """Another member's rate share of the tenant, as read under the lock."""

    member: str
    demand: int  # tokens/s it asked for, smoothed
    rate_ppm: int  # its share, in millionths of the tenant's rate and burst
    live: bool  # unexpired by the database's clock


@dataclass(frozen=True, slots=True)
class QuotaHolding:
    """A member's allowance in one quota window (hour or day)."""

    member: str
    used: int  # tokens it has spent in the window
    allowance: int  # tokens it may spend in the window (>= used, but for overruns)


def rate_target(demand: int, others: Sequence[RateHolding]) -> int:
    """The demand-weighted share (ppm) a member aims at: its demand over the
    live members' total; equal parts when nobody asks for anything."""
    live = [h for h in others if h.live]
    total = max(0, demand) + sum(max(0, h.demand) for h in live)
    if total == 0:
        return PPM // (len(live) + 1)
    return max(0, demand) * PPM // total


def rate_share(demand: int, others: Sequence[RateHolding]) -> int:
    """This member's new rate share (ppm): its target, but never more than
    the live others leave free."""
    free = PPM - sum(h.rate_ppm for h in others if h.live)
    return max(0, min(rate_target(demand, others), free))


def quota_allowance(
    used: int,
    limit: int,
    share_ppm: int,
    others: Sequence[QuotaHolding],
    headroom: int | None = None,
) -> int:
    """This member's new allowance in a quota window of ``limit`` tokens: what
    it has used plus its share of what nobody has used yet (at most
    ``headroom`` of it; None: no cap), but never more than the others'
    allowances leave; never less than what it has used (spent tokens are
    not taken back)."""
    if limit < 0 or used < 0 or not 0 <= share_ppm <= PPM or (headroom or 0) < 0:
        raise ValueError(
            f"quota_allowance: used={used}, limit={limit}, share_ppm={share_ppm},"
            f" headroom={headroom}"
        )
    held = sum(h.allowance for h in others)
    unused = max(0, limit - used - sum(h.used for h in others))
    ahead = unused * share_ppm // PPM
    target = used + (ahead if headroom is None else min(ahead, headroom))
    return max(used, min(target, limit - held))


@dataclass(frozen=True, slots=True)
class MemberShare:
    """One member's share of one tenant as a refresh left it: what the member
    may decide for the tenant until the share is renewed."""

    rate_ppm: int
    hour_allowance: int | None  # None: the tenant has no hourly quota
    day_allowance: int | None
    # What this member has used in the windows, as the store counts it: at
    # least what it asked with (a restarted member keeping its id resumes
    # from its row); the caller adds any difference to its counters.
    hour_used: int = 0
    day_used: int = 0
    # What the other members had used of the windows when this was computed
    # (what is left of the tenant's quota, tenant-wide, is quota - those -
    # this member's own use).
    hour_others_used: int = 0
    day_others_used: int = 0

    def scale(self, whole: int) -> int:
        """``whole`` (a rate or a burst) times this share, rounded down."""
        return whole * self.rate_ppm // PPM
