"""Tenant shares in PostgreSQL: the rows ``controlplane/domain/shares.py``'s rules
are applied to (docs/ha.md, "Tenants that span cells").

``ha_tenant_rates``  (tenant_id, member_id) -> demand, rate_ppm, expires_at
``ha_tenant_quotas`` (tenant_id, member_id, window, window_start) -> used, allowance

``refresh`` renews one member's shares for many tenants in one transaction:
it locks each tenant's anchor row (``ha_tenant_anchors``), in tenant order
so that two members refreshing overlapping tenants wait for each other
instead of deadlocking; THEN reads every member's rate rows and the quota
rows of the windows asked about, computes each share by the rules (a
member raises its share only into what the others leave free), and writes
its own rows. Every writer of a tenant's rows holds its anchor lock, and
the read is a statement that starts after the lock is held (READ
COMMITTED: a fresh snapshot per statement), so the sums read are exact.
(Locking the rate rows themselves would not do: a row another member
inserted after the locking statement's snapshot is never seen by it, even
once that member has granted itself a share. The property test in
tests/integration/ha/test_share_store.py caught exactly that.)

Expiry is judged by the database's clock, as for cell leases; a member
uses its rate share only until ``t_sent + ttl - margin`` on its own clock
(the caller's job, as in the coordinator).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Engine, text

from controlplane.domain.shares import (
    PPM,
    MemberShare,
    QuotaHolding,
    RateHolding,
    quota_allowance,
    rate_share,
)
from controlplane.store.leases import positive_ttl, require_postgres

HOUR, DAY = "hour", "day"


@dataclass(frozen=True, slots=True)
class Window:
    """One quota window as this member sees it: its start (Unix s, the
    window's UTC boundary), the tokens this member spent in it, and the
    tenant's quota for it."""

    start: int
    used: int
    limit: int


@dataclass(frozen=True, slots=True)
class Ask:
    """One tenant's refresh: this member's smoothed demand (tokens/s) and its
    quota windows (None: the tenant has no such quota)."""

    tenant: str
    demand: int
    hour: Window | None = None
    day: Window | None = None
    # Tokens the tenant could spend in one share TTL at its whole rate, plus
    # its whole burst: an allowance runs at most this times the member's
    # share ahead of its use (shares.quota_allowance's headroom); None: no cap.
    spend_bound: int | None = None
    # This process's first ask for the tenant: a row this member id holds
    # already is an earlier process's, which may have spent up to its
    # allowance after its last refresh (a kill -9 loses that count), so the
    # allowance, not the recorded use, is taken as used.
    first: bool = False


_ENSURE_ANCHORS = text(
    "INSERT INTO ha_tenant_anchors (tenant_id)"
    " SELECT t FROM unnest(CAST(:tenants AS text[])) AS t ON CONFLICT (tenant_id) DO NOTHING"
)
_ENSURE = text(
    "INSERT INTO ha_tenant_rates (tenant_id, member_id, demand, rate_ppm)"
    " SELECT t, :me, 0, 0 FROM unnest(CAST(:tenants AS text[])) AS t"
    " ON CONFLICT (tenant_id, member_id) DO NOTHING"
)
# Locked in tenant order: the lock node sits above the sort.
_LOCK = text(
    "SELECT tenant_id FROM ha_tenant_anchors WHERE tenant_id = ANY(CAST(:tenants AS text[]))"
    " ORDER BY tenant_id FOR UPDATE"
)
_RATES = text(
    "SELECT tenant_id, member_id, demand, rate_ppm,"
    " (expires_at IS NOT NULL AND expires_at > clock_timestamp())"
    " FROM ha_tenant_rates WHERE tenant_id = ANY(CAST(:tenants AS text[]))"
)
_QUOTAS = text(
    "SELECT q.tenant_id, q.member_id, q.window_kind, q.used, q.allowance"
    " FROM ha_tenant_quotas q JOIN unnest(CAST(:tenants AS text[]), CAST(:kinds AS text[]),"
    " CAST(:starts AS bigint[])) AS w(tenant_id, kind, start)"
    " ON q.tenant_id = w.tenant_id AND q.window_kind = w.kind AND q.window_start = w.start"
)
_WRITE_RATES = text(
    "UPDATE ha_tenant_rates AS r SET demand = v.demand, rate_ppm = v.rate_ppm,"
    " expires_at = clock_timestamp() + :ttl * interval '1 second'"
    " FROM unnest(CAST(:tenants AS text[]), CAST(:demands AS bigint[]),"
    " CAST(:rates AS bigint[])) AS v(tenant_id, demand, rate_ppm)"
    " WHERE r.tenant_id = v.tenant_id AND r.member_id = :me"
)
_WRITE_QUOTAS = text(
    "INSERT INTO ha_tenant_quotas (tenant_id, member_id, window_kind, window_start, used,"
    " allowance)"
    " SELECT t, :me, k, s, u, a FROM unnest(CAST(:tenants AS text[]), CAST(:kinds AS text[]),"
    " CAST(:starts AS bigint[]), CAST(:used AS bigint[]), CAST(:allowances AS bigint[]))"
    " AS v(t, k, s, u, a)"
    " ON CONFLICT (tenant_id, member_id, window_kind, window_start)"
    " DO UPDATE SET used = excluded.used, allowance = excluded.allowance"
)
_FINAL_QUOTAS = text(
    "UPDATE ha_tenant_quotas AS q SET used = greatest(q.used, v.u)"
    " FROM unnest(CAST(:tenants AS text[]), CAST(:kinds AS text[]), CAST(:starts AS bigint[]),"
    " CAST(:used AS bigint[])) AS v(t, k, s, u)"
    " WHERE q.member_id = :me AND q.tenant_id = v.t AND q.window_kind = v.k"
    " AND q.window_start = v.s"
)
_FORGET_QUOTAS = text("DELETE FROM ha_tenant_quotas WHERE window_start < :before")
_FORGET_RATES = text(
    "DELETE FROM ha_tenant_rates WHERE expires_at < clock_timestamp() - interval '1 hour'"
)


class ShareStore:
    """Share rows over the project's engine (blocking calls)."""

    def __init__(self, engine: Engine) -> None:
        require_postgres(engine.dialect.name, "ShareStore")
        self.engine = engine

    def refresh(self, me: str, asks: Sequence[Ask], ttl_s: float) -> dict[str, MemberShare]:
        """Renew this member's shares of the asked tenants for ``ttl_s``
        seconds of database time; the new share of each."""
        ttl = positive_ttl(ttl_s)
        if not asks:
            return {}
        by_tenant = {a.tenant: a for a in asks}
        if len(by_tenant) != len(asks):
            raise ValueError("refresh: a tenant asked twice")
        tenants = sorted(by_tenant)
        # The anchors and our own rows first, committed: inserting them
        # inside the locking transaction would lock them out of order.
        with self.engine.begin() as conn:
            conn.execute(_ENSURE_ANCHORS, {"tenants": tenants})
            conn.execute(_ENSURE, {"me": me, "tenants": tenants})
        with self.engine.begin() as conn:
            conn.execute(_LOCK, {"tenants": tenants}).all()
            rates: dict[str, list[RateHolding]] = defaultdict(list)
            for tenant, member, demand, rate_ppm, live in conn.execute(
                _RATES, {"tenants": tenants}
            ):
                if member != me:
                    rates[tenant].append(RateHolding(member, int(demand), int(rate_ppm), live))
            windows = [(t, kind, w) for t in tenants
                       for kind, w in ((HOUR, by_tenant[t].hour), (DAY, by_tenant[t].day))
                       if w is not None]  # fmt: skip
            quotas: dict[tuple[str, str], list[QuotaHolding]] = defaultdict(list)
            own: dict[tuple[str, str], tuple[int, int]] = {}
            if windows:
                for tenant, member, kind, used, allowance in conn.execute(_QUOTAS, {
                    "tenants": [t for t, _, _ in windows], "kinds": [k for _, k, _ in windows],
                    "starts": [w.start for _, _, w in windows],
                }):  # fmt: skip
                    if member != me:
                        quotas[(tenant, kind)].append(
                            QuotaHolding(member, int(used), int(allowance))
                        )
                    else:  # what this member id used before (a restart keeping its id)
                        own[(tenant, kind)] = (int(used), int(allowance))
            renewed: dict[str, MemberShare] = {}
            for t in tenants:
                a = by_tenant[t]
                share = rate_share(a.demand, rates[t])
                headroom = None if a.spend_bound is None else a.spend_bound * share // PPM
                # used never goes back: the row may hold more (this member id's
                # earlier process); the caller catches its counters up
                used = {kind: 0 if w is None else max(w.used, _floor(own.get((t, kind)), a.first))
                        for kind, w in ((HOUR, a.hour), (DAY, a.day))}  # fmt: skip
                allowed = {
                    kind: None if w is None else
                    quota_allowance(used[kind], w.limit, share, quotas[(t, kind)], headroom)
                    for kind, w in ((HOUR, a.hour), (DAY, a.day))
                }  # fmt: skip
                others = {kind: sum(h.used for h in quotas[(t, kind)]) for kind in (HOUR, DAY)}
                renewed[t] = MemberShare(share, allowed[HOUR], allowed[DAY], used[HOUR],
                                         used[DAY], others[HOUR], others[DAY])  # fmt: skip
            conn.execute(_WRITE_RATES, {
                "me": me, "ttl": ttl, "tenants": tenants,
                "demands": [max(0, by_tenant[t].demand) for t in tenants],
                "rates": [renewed[t].rate_ppm for t in tenants],
            })  # fmt: skip
            if windows:
                conn.execute(_WRITE_QUOTAS, {
                    "me": me, "tenants": [t for t, _, _ in windows],
                    "kinds": [k for _, k, _ in windows],
                    "starts": [w.start for _, _, w in windows],
                    "used": [_used(renewed[t], k) for t, k, _ in windows],
                    "allowances": [_allowance(renewed[t], k) for t, k, _ in windows],
                })  # fmt: skip
        return renewed

    def release(self, me: str, final: Sequence[Ask] = ()) -> None:
        """Give up every rate share of this member at once (a graceful exit):
        the others may raise theirs at their next refresh. Its quota
        allowances shrink to what it used (``final``: its last use of each
        tenant's windows, never less than the rows hold), so the others may
        be allowed the rest; what was spent stays counted until the window
        ends."""
        with self.engine.begin() as conn:
            conn.execute(
                text("UPDATE ha_tenant_rates SET rate_ppm = 0, expires_at = clock_timestamp()"
                     " WHERE member_id = :me"), {"me": me},
            )  # fmt: skip
            rows = [(a.tenant, kind, w) for a in final
                    for kind, w in ((HOUR, a.hour), (DAY, a.day)) if w is not None]  # fmt: skip
            if rows:
                conn.execute(_FINAL_QUOTAS, {
                    "me": me, "tenants": [t for t, _, _ in rows], "kinds": [k for _, k, _ in rows],
                    "starts": [w.start for _, _, w in rows], "used": [w.used for _, _, w in rows],
                })  # fmt: skip
            conn.execute(
                text("UPDATE ha_tenant_quotas SET allowance = used WHERE member_id = :me"),
                {"me": me},
            )

    def forget(self, before_unix_s: int) -> None:
        """Delete quota rows of windows that started before ``before_unix_s``
        and rate rows expired for an hour (housekeeping)."""
        with self.engine.begin() as conn:
            conn.execute(_FORGET_QUOTAS, {"before": before_unix_s})
            conn.execute(_FORGET_RATES)


def _floor(row: tuple[int, int] | None, first: bool) -> int:
    """What this member id used before, by its row: its use, or on this
    process's first ask, its whole allowance (``Ask.first``)."""
    if row is None:
        return 0
    used, allowance = row
    return max(used, allowance) if first else used


def _used(g: MemberShare, kind: str) -> int:
    return g.hour_used if kind == HOUR else g.day_used


def _allowance(g: MemberShare, kind: str) -> int:
    value = g.hour_allowance if kind == HOUR else g.day_allowance
    if value is None:  # only windows that were asked about are written
        raise AssertionError(f"no {kind} allowance computed")
    return value
