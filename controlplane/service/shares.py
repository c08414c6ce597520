"""This replica's shares of its tenants' limits (docs/ha.md, "Tenants that
span cells").

With one replica (SQLite, or ``AdmissionService`` in process: simulate,
replay) a tenant's fast-path slot is configured with its whole limits. When
several replicas decide for one tenant (its pools are in cells owned by
different replicas), each holds a *share*, renewed by
``controlplane/ha/shares.py``: its slot is configured with that part of the
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

from dataclasses import dataclass

from controlplane.domain import TenantConfig
from fastpath import Reason

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
    # the other replicas' use of the windows at the last refresh
    hour_others: int = 0
    day_others: int = 0


NOTHING = Share(0)  # a tenant without a share here yet


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



def remaining_offsets(cfg: TenantConfig, share: Share) -> tuple[int, int]:
    """What to add to the fast path's hourly and daily ``remaining`` under
    ``share`` (its allowance less its use) to answer what remains of the
    tenant's whole quota: ``quota - others' use - own use``."""
    w, mine = whole(cfg), scaled(cfg, share)
    return (
        w.hourly_quota - share.hour_others - mine.hourly_quota if w.hourly_quota else 0,
        w.daily_quota - share.day_others - mine.daily_quota if w.daily_quota else 0,
    )
