"""Booking a request that a sidecar admitted while the control plane was
unreachable (a fail-open lane), from its Complete (CompleteRequest.offline).

The request ran already: it is admitted now by force, charged its real usage
whatever the bucket's level, quotas and concurrency (as shadow mode charges),
so that the Complete which follows settles and bills it like any other. A
request known here (reserved or settled) is left to the Complete's usual
path, which makes a repeated delivery a duplicate; the server's caller
first asks the ledger, which remembers longer than memory does."""

from __future__ import annotations

from controlplane.domain.errors import InvalidArgument, NotFound, Overloaded, excerpt
from controlplane.domain.scope import KeyScope
from controlplane.domain.validate import MAX_POOL_LEN, check_optional_name
from controlplane.service import records as R
from controlplane.service.answers import Outcomes
from controlplane.service.decider import Decider
from controlplane.service.dispatcher import Dispatcher
from controlplane.service.keyscope import check_scope
from controlplane.service.records import RequestLog
from controlplane.service.settlement import OVERRUN_SLACK_TOKENS, check_usage
from controlplane.service.stats import AdmissionStats
from controlplane.service.tenants import TenantDirectory


class Booking:
    def __init__(
        self,
        *,
        tenants: TenantDirectory,
        log: RequestLog,
        dispatcher: Dispatcher,
        decider: Decider,
        outcomes: Outcomes,
        stats: AdmissionStats,
        max_overrun_ratio: float,
    ) -> None:
        self._tenants, self._log, self._dispatcher = tenants, log, dispatcher
        self._decider, self._outcomes, self.stats = decider, outcomes, stats
        self._ratio = max_overrun_ratio

    def check(
        self,
        tenant_id: str,
        request_id: str,
        lane: str,
        model: str,
        pool: str,
        prompt_tokens: int,
        generated_tokens: int,
        cached_prompt_tokens: int = 0,
        kv_cache_miss_rate: float = 0.0,
        reservation_id: int = 0,
    ) -> None:
        """The input checks of :meth:`book`, alone (nothing is read)."""
        check_usage(
            tenant_id, request_id, prompt_tokens, generated_tokens, cached_prompt_tokens,
            kv_cache_miss_rate,
        )  # fmt: skip
        self._tenants.check_lane("lane", lane)
        check_optional_name("model", model)
        check_optional_name("pool", pool, max_len=MAX_POOL_LEN)

    def book(
        self,
        tenant_id: str,
        request_id: str,
        lane: str,
        model: str,
        pool: str,
        prompt_tokens: int,
        generated_tokens: int,
        cached_prompt_tokens: int = 0,
        kv_cache_miss_rate: float = 0.0,
        reservation_id: int = 0,
        *,
        now: int,
        scope: KeyScope | None = None,
    ) -> bool:
        """Before the Complete of a request a sidecar admitted offline
        (CompleteRequest.offline): when nothing is known of it, admit it now
        by force, charged its real usage, so the Complete that follows
        settles and bills it. False (nothing done) when the request is known
        here (a reservation or a settlement: the Complete goes its
        usual way) or waits in a queue. The caller checked that the ledger
        has no record of it. Raises InvalidArgument naming the field (of
        ``offline``: ``lane``, ``model``, ``pool``, as the edge's string
        checks name them), NotFound for an unknown tenant, PermissionDenied
        outside ``scope``, Overloaded when the cap on open reservations
        binds."""
        self.check(
            tenant_id, request_id, lane, model, pool, prompt_tokens, generated_tokens,
            cached_prompt_tokens, kv_cache_miss_rate,
        )  # fmt: skip
        key = (tenant_id, request_id)
        known = self._log.get(key)
        if known is not None and known[R.STATE] != R.REJECTED:
            return False  # reserved or settled here: the Complete's usual path
        # (a remembered refusal is replaced: its answer never reached the
        # sidecar, which let the request run under its fail-open policy)
        if reservation_id or key in self._dispatcher.queues.by_key:
            return False  # (an admission offline has no reservation id)
        entry = self._tenants.get(tenant_id)
        if entry is None or entry.deleted:
            raise NotFound("tenant_id", f"unknown tenant {excerpt(tenant_id)}")
        per_request = entry.config.max_tokens_per_request
        if per_request and generated_tokens > per_request * self._ratio + OVERRUN_SLACK_TOKENS:
            # booked at the tenant's cap, the Complete would be refused as an
            # overrun after the booking: refuse before it
            raise InvalidArgument(
                "generated_tokens", f"{generated_tokens:,} is more than "
                f"{self._ratio:g}x the tenant's max_tokens_per_request "
                f"{per_request:,}; refused as a client error, nothing was booked",
            )  # fmt: skip
        lane = self._tenants.lane_for("lane", lane, entry)
        if pool:
            self._tenants.check_pool(pool)
        pool = self._tenants.pool_for(entry, lane, pool)
        if scope is not None:
            check_scope(scope, tenant_id, entry, pool, "this request's")
        rec = self._decider.book(entry, lane, prompt_tokens, generated_tokens, model, pool, now)
        if rec is None:
            raise Overloaded("open reservations are at their cap; retry the Complete later")
        self._dispatcher.admitted(lane, entry.slot, rec[R.RESERVED])
        self._outcomes.record(key, rec)
        self.stats.offline_booked_total += 1
        return True

