"""The admission use case: decide, settle, expire, accept load reports.

Everything here runs on the server's event-loop thread and touches only
memory: the Cython token-bucket table, the tenant map and the reservation
map. The database is read at start and when config changes (by the server,
off this path) and handed over through :meth:`AdmissionService.apply_config`.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from controlplane.domain import (
    MAX_ID_LEN,
    MAX_TOKENS_PER_FIELD,
    AdmitDecision,
    Decision,
    Degradation,
    LaneConfig,
    LoadSample,
    Pressure,
    Settlement,
    TenantConfig,
)
from controlplane.domain.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from controlplane.domain.policy import Policy
from controlplane.domain.validate import (
    check_fraction,
    check_id,
    check_optional_name,
    check_tokens,
)
from controlplane.service import records as R
from controlplane.service.pools import FRESH, PPM, UNKNOWN, PoolBook, ppm
from controlplane.service.pricing import FlatPricing, Pricing
from controlplane.service.queueing import Waiter, WaitQueues
from controlplane.service.records import Key, Record, RequestLog
from controlplane.settings import Settings
from fastpath import (
    IMPLEMENTATION,
    Reason,
    TokenBucketTable,
    backpressure_retry_ns,
    shed_threshold_ppm,
)

NS_PER_S = 1_000_000_000
NS_PER_MS = 1_000_000
# A waiting call is answered ahead of its gRPC deadline, so the answer can
# still reach the caller (see _max_wait_ns).
DEADLINE_MARGIN_MIN_NS = 5 * NS_PER_MS
# Queue-wait histogram bounds: around the default lane wait targets
# (200 ms / 800 ms / 5 s).
QUEUE_WAIT_BUCKETS_NS: tuple[int, ...] = tuple(
    int(s * NS_PER_S) for s in (0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 0.8, 1, 2, 5, 10, 30)
)
DEADLINE_MARGIN_MAX_NS = 100 * NS_PER_MS

_ADMIT = int(Decision.ADMIT)
_REJECT = int(Decision.REJECT)
_OK = int(Reason.OK)
_CONCURRENCY = int(Reason.CONCURRENCY)


class _Tenant:
    __slots__ = ("config", "deleted", "slot")

    def __init__(self, slot: int, config: TenantConfig) -> None:
        self.slot = slot
        self.config = config
        self.deleted = False


_REASON_TEXT: dict[int, str] = {
    Reason.OK: "admitted",
    Reason.TOKEN_RATE: "token bucket short; retry after it refills",
    Reason.HOURLY_QUOTA: "hourly token quota exhausted until the next UTC hour",
    Reason.DAILY_QUOTA: "daily token quota exhausted until the next UTC day",
    Reason.CONCURRENCY: "too many requests in flight for this tenant",
    Reason.MAX_TOKENS: "request exceeds the tenant's per-request, burst or quota size",
    Reason.UNKNOWN_TENANT: "tenant_id is not configured",
    Reason.TENANT_DISABLED: "tenant is disabled",
    Reason.GLOBAL_WATERMARK: "all tenants' in-flight tokens are at the global safe level",
    Reason.BACKPRESSURE: "the engine pool is overloaded",
    Reason.QUEUE_TIMEOUT: "waited in the lane's queue until the max wait passed",
    Reason.QUEUE_FULL: "the queue is full",
}
# Refusals that waiting can cure: the tenant's bucket refills, a slot frees,
# in-flight tokens drain, the pool's load drops. Quotas and sizes cannot.
WAITABLE = frozenset(
    {Reason.TOKEN_RATE, Reason.CONCURRENCY, Reason.GLOBAL_WATERMARK, Reason.BACKPRESSURE}
)
_STALE_POLICY_TEXT = {FRESH: ""}


def _as_decision(
    key: Key,
    rec: Record,
    *,
    duplicate: bool,
    page_tokens: int = 0,
    fallback_model: str = "",
    stale_policy: str = "",
) -> AdmitDecision:
    reason = rec[R.REASON]
    return AdmitDecision(
        request_id=key[1],
        decision=Decision.ADMIT if reason == _OK else Decision.REJECT,
        reason=Reason(reason),
        retry_after_ns=rec[R.RETRY_NS],
        reserved_tokens=rec[R.RESERVED],
        reservation_id=rec[R.RID],
        granted_max_tokens=rec[R.GRANTED],
        bucket_remaining=rec[R.BUCKET],
        hourly_remaining=rec[R.HOUR],
        daily_remaining=rec[R.DAY],
        lane=rec[R.LANE],
        message=_REASON_TEXT[reason],
        duplicate=duplicate,
        pricing_multiplier=rec[R.MULTIPLIER],
        queue_wait_ns=rec[R.DECIDED_NS] - rec[R.ARRIVED_NS],
        degradation=None
        if not rec[R.DEGRADED_CAP]
        else Degradation(rec[R.DEGRADED_CAP], page_tokens, fallback_model),
        shadow_reason=rec[R.SHADOW_REASON],
        pressure=Pressure(
            rec[R.SCORE_PPM] / PPM,
            rec[R.FRESHNESS],
            "" if rec[R.FRESHNESS] == FRESH else stale_policy,
            bool(rec[R.SHED]),
        ),
    )


@dataclass(slots=True)
class BatchResult:
    """Columns answering one AdmitStream message, index i answering request i."""

    decision: list[int]
    reason: list[int]
    retry_after_ms: list[int]
    reserved_tokens: list[int]
    reservation_id: list[int]
    granted_max_tokens: list[int]
    bucket_remaining: list[int]
    hourly_remaining: list[int]
    daily_remaining: list[int]
    duplicate: list[bool]
    shadow_reason: list[int]
    degraded: list[bool]
    pricing_multiplier: float = 1.0  # the batch's pool/model multiplier in force
    degradation: Degradation | None = None  # the pool's instructions, for entries degraded[i]
    pressure: Pressure | None = None  # the pool as the batch saw it


class AdmissionService:
    """Per-request admission over an in-memory token-bucket table.

    ``clock`` returns wall-clock nanoseconds (quota windows are UTC hours and
    days); tests inject a fake one.
    """

    implementation = IMPLEMENTATION

    def __init__(self, settings: Settings, clock: Callable[[], int] = time.time_ns) -> None:
        self.settings = settings
        self.clock = clock
        self._table = TokenBucketTable()
        self._tenants: dict[str, _Tenant] = {}
        self._next_slot = 0
        self._lanes: dict[str, LaneConfig] = {}
        self.policy: Policy = settings.policy
        self._log = RequestLog(
            ttl_ns=int(settings.reservation_ttl_s * NS_PER_S),
            replay_ns=int(settings.rejection_replay_s * NS_PER_S),
        )
        self._next_reservation = 1
        self._concurrency_retry_ns = settings.concurrency_retry_ms * NS_PER_MS
        self._pools = PoolBook(stale_ns=int(settings.load_report_stale_s * NS_PER_S))
        self._queues = WaitQueues()
        self._by_slot: list[_Tenant] = []
        # Why queue heads cannot go now (see _block); cleared by the event
        # that can change it (time, a settlement, a load report, new config).
        self._blocked_until: dict[int, int] = {}
        self._concurrency_blocked: set[int] = set()
        self._shed_blocked: dict[tuple[int, int], str] = {}
        self._watermark_blocked = False
        self._now = 0
        self._lowest_lane = ""
        self._shed_ppm: dict[str, int] = {}
        self._hard_ppm = PPM
        self._bp_cap_ns = 0
        self.shadow_counts: Counter[int] = Counter()
        self.cancelled_total = 0
        # Queue-wait histogram per lane (plain ints, read at scrape time):
        # lane -> [count per bucket of QUEUE_WAIT_BUCKETS_NS, +Inf], and sums.
        self.queue_wait_buckets: dict[str, list[int]] = {}
        self.queue_wait_sum_ns: Counter[str] = Counter()
        # (decision, reason) -> count; read by the metrics collector at scrape
        # time so the hot path only bumps a dict entry.
        self.decision_counts: Counter[tuple[int, int]] = Counter()
        self.pricing: Pricing = FlatPricing()
        self.expired_total = 0

    # ------------------------------------------------------------------ config

    def apply_config(
        self,
        tenants: Sequence[TenantConfig],
        lanes: Sequence[LaneConfig],
        policy: Policy | None = None,
    ) -> None:
        """Install a full config. Buckets of tenants that stay keep their level
        and counters (the fast path re-limits them to the new burst); tenants
        that disappear stop being admitted but their open reservations can
        still be settled."""
        if not lanes:
            raise InvalidArgument("lanes", "at least one lane must be configured")
        now = self.clock()
        self.policy = policy if policy is not None else self.settings.policy
        self._lanes = {lane.name: lane for lane in lanes}
        seen: set[str] = set()
        for cfg in tenants:
            if cfg.default_lane not in self._lanes:
                raise InvalidArgument(
                    f"tenants[{cfg.tenant_id}].default_lane",
                    f"unknown lane {cfg.default_lane!r}",
                )
            seen.add(cfg.tenant_id)
            entry = self._tenants.get(cfg.tenant_id)
            if entry is None:
                entry = _Tenant(self._next_slot, cfg)
                self._next_slot += 1
                self._tenants[cfg.tenant_id] = entry
                self._by_slot.append(entry)
            entry.config = cfg
            entry.deleted = False
            self._table.configure(
                entry.slot,
                now,
                cfg.rate_mtok_per_s,
                cfg.burst_tokens * 1000,
                cfg.hourly_quota or 0,
                cfg.daily_quota or 0,
                cfg.max_concurrency or 0,
                cfg.max_tokens_per_request or 0,
            )
        for tenant_id, entry in self._tenants.items():
            if tenant_id not in seen:
                entry.deleted = True
        self._apply_policy(self.policy, now)

    def _apply_policy(self, policy: Policy, now: int) -> None:
        by_priority = sorted(self._lanes.values(), key=lambda lane: (lane.priority, lane.name))
        self._lowest_lane = by_priority[-1].name
        soft, hard = ppm(policy.bp_soft_threshold), ppm(policy.bp_hard_threshold)
        sheddable = [lane for lane in reversed(by_priority) if not lane.fail_open]
        self._shed_ppm = {lane.name: PPM + 1 for lane in by_priority}  # fail-open: never
        for rank, lane in enumerate(sheddable):
            self._shed_ppm[lane.name] = shed_threshold_ppm(rank, len(sheddable), soft, hard)
        self._hard_ppm = hard
        self._bp_cap_ns = int(policy.bp_retry_cap_s * NS_PER_S)
        self._table.set_global_inflight_limit(policy.global_inflight_tokens)
        self._queues.set_lanes(by_priority)
        self._pools.rescore_all(now, policy)
        # New limits may let queue heads go: forget why they were blocked.
        self._blocked_until.clear()
        self._concurrency_blocked.clear()
        self._shed_blocked.clear()
        self._watermark_blocked = False
        self._dispatch(now)

    def restore_usage(self, hour_tokens: dict[str, int], day_tokens: dict[str, int]) -> int:
        """Add tokens already used in the current UTC hour and day (from the
        ledger, at start) to the tenants' quota counters; returns how many
        tenants were restored. Unknown tenant ids are ignored."""
        now = self.clock()
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

    @property
    def lanes(self) -> dict[str, LaneConfig]:
        return dict(self._lanes)

    def tenant_ids(self) -> list[str]:
        return sorted(t for t, e in self._tenants.items() if not e.deleted)

    def tenant_state(self, tenant_id: str) -> dict[str, int]:
        entry = self._tenants.get(tenant_id)
        if entry is None or entry.deleted:
            raise NotFound("tenant_id", f"unknown tenant {tenant_id!r}")
        now = self.clock()
        self._table.level_mtok(entry.slot, now)  # refill to now before reading
        return dict(self._table.snapshot(entry.slot))

    # ------------------------------------------------------------------- admit

    def _resolve_tenant(self, tenant_id: str) -> _Tenant | None:
        entry = self._tenants.get(tenant_id)
        if entry is not None and not entry.deleted:
            return entry
        default = self.settings.default_tenant
        if default:
            entry = self._tenants.get(default)
            if entry is not None and not entry.deleted:
                return entry
        return None

    def _lane_for(self, field: str, lane: str, entry: _Tenant | None) -> str:
        if not lane:
            return entry.config.default_lane if entry is not None else "standard"
        if lane not in self._lanes:
            raise InvalidArgument(
                field, f"unknown lane {lane!r}; configured: {', '.join(sorted(self._lanes))}"
            )
        return lane

    def _refusal(
        self,
        key: Key,
        slot: int,
        now: int,
        reason: int,
        retry_ns: int,
        lane: str,
        bucket: int = 0,
        hour: int = -1,
        day: int = -1,
        *,
        arrived: int | None = None,
        score: int = 0,
        freshness: int = UNKNOWN,
        shed: int = 0,
    ) -> Record:
        rec = (
            R.REJECTED, reason, retry_ns, 0, 0, 0, bucket, hour, day, lane, slot, now,
            "", "", 1.0, 0, -1, 0, now if arrived is None else arrived,
            0, 0, score, freshness, shed,
        )  # fmt: skip
        self._log.add_rejected(key, rec)
        return rec

    def _decision(self, key: Key, rec: Record, *, duplicate: bool) -> AdmitDecision:
        entry = self._tenants.get(key[0])
        fallback = entry.config.fallback_model if entry is not None else None
        return _as_decision(
            key,
            rec,
            duplicate=duplicate,
            page_tokens=self.policy.degrade_page_tokens,
            fallback_model=fallback or "",
            stale_policy=self.policy.stale_policy,
        )

    def _count(self, rec: Record) -> None:
        reason = rec[R.REASON]
        self.decision_counts[(_ADMIT if reason == _OK else _REJECT, reason)] += 1
        if rec[R.SHADOW_REASON]:
            self.shadow_counts[rec[R.SHADOW_REASON]] += 1

    def _place(self, entry: _Tenant, lane: str, prompt: int, max_tokens: int) -> str:
        """Length-aware placement: a long request goes to the lowest lane so
        short ones are not stuck behind it (fail-open lanes are never moved)."""
        cfg = entry.config
        if not cfg.demote_long_requests or lane == self._lowest_lane:
            return lane
        threshold = cfg.long_request_tokens or self.policy.long_request_tokens
        if prompt + max_tokens > threshold and not self._lanes[lane].fail_open:
            return self._lowest_lane
        return lane

    def _pressure(self, lane: str, pool: str, now: int) -> tuple[int, int, int, int, bool, int]:
        """(reason, retry_ns, score_ppm, freshness, shed, degraded_cap) for a
        request of ``lane`` on ``pool`` — backpressure and degradation."""
        view, freshness = self._pools.view(pool, now) if pool else (None, UNKNOWN)
        lane_cfg = self._lanes[lane]
        if freshness == FRESH:
            assert view is not None
            score = view.score_ppm
            cap = self.policy.degrade_max_tokens if view.degraded and lane_cfg.degradable else 0
        else:
            # Stale or unknown: the configured policy decides, and says so.
            score = PPM if self.policy.stale_policy == "fail_closed" else 0
            cap = 0
        if lane_cfg.fail_open or score < self._shed_ppm[lane]:
            return _OK, 0, score, freshness, False, cap
        drain = view.drain_ppm_per_s if view is not None and freshness == FRESH else 0
        retry = backpressure_retry_ns(score, self._shed_ppm[lane], drain, self._bp_cap_ns)
        # Between the lane's shed threshold and the hard one the request may
        # wait for the pool to drain; above the hard threshold it is refused.
        return Reason.BACKPRESSURE, retry, score, freshness, score < self._hard_ppm, cap

    def _decide(
        self,
        key: Key,
        entry: _Tenant,
        lane: str,
        prompt: int,
        max_tokens: int,
        model: str,
        pool: str,
        now: int,
        arrived: int,
    ) -> tuple[Record, bool]:
        """Decide one request now. Returns its record (stored by the caller
        through the log) and whether the refusal is one waiting can cure."""
        slot = entry.slot
        bp_reason, bp_retry, score, freshness, shed, cap = self._pressure(lane, pool, now)
        if cap:
            max_tokens = min(max_tokens, cap)
        shadow = entry.config.shadow_mode or self.policy.shadow_mode
        if bp_reason and not shadow:
            rec = (
                R.REJECTED, bp_reason, bp_retry, 0, 0, 0, 0, -1, -1, lane, slot, now,
                "", "", 1.0, 0, -1, 0, arrived, 0, 0, score, freshness, int(shed),
            )  # fmt: skip
            return rec, shed
        if shadow:
            reason, reserved, retry_ns, bucket, hour, day = self._table.charge(
                slot, now, prompt, max_tokens
            )
            shadow_reason = bp_reason or reason
            reason = _OK
        else:
            reason, reserved, retry_ns, bucket, hour, day = self._table.admit(
                slot, now, prompt, max_tokens
            )
            shadow_reason = 0
        if reason == _OK:
            rid = self._next_reservation
            self._next_reservation += 1
            price = self.pricing.quote(pool, model, now)
            self._queues.charge(self._queues.lane_index(lane), slot, reserved)
            rec = (
                R.OPEN, _OK, 0, reserved, rid, reserved - prompt, bucket, hour, day, lane,
                slot, now, pool, model, price.multiplier, price.window_id, -1, 0, arrived,
                shadow_reason, cap, score, freshness, 0,
            )  # fmt: skip
            return rec, False
        if reason == Reason.CONCURRENCY:
            retry_ns = self._concurrency_retry_ns
        rec = (
            R.REJECTED, reason, retry_ns, 0, 0, 0, bucket, hour, day, lane, slot, now,
            "", "", 1.0, 0, -1, 0, arrived, 0, 0, score, freshness, 0,
        )  # fmt: skip
        return rec, reason in WAITABLE

    def _store(self, key: Key, rec: Record) -> None:
        if rec[R.STATE] == R.OPEN:
            self._log.add_admitted(key, rec)
        else:
            self._log.add_rejected(key, rec)
        self._count(rec)

    def _validate_admit(
        self, tenant_id: str, request_id: str, prompt: int, max_tokens: int, model: str, pool: str
    ) -> None:
        check_id("tenant_id", tenant_id)
        check_id("request_id", request_id)
        check_tokens("prompt_tokens", prompt)
        check_tokens("max_tokens", max_tokens)
        check_optional_name("model", model)
        check_optional_name("pool", pool, max_len=128)

    def admit(
        self,
        tenant_id: str,
        request_id: str,
        lane: str,
        prompt_tokens: int,
        max_tokens: int,
        model: str = "",
        pool: str = "",
    ) -> AdmitDecision:
        """Decide now; never wait (waitable refusals are answered as refusals)."""
        out = self.admit_or_wait(
            tenant_id, request_id, lane, prompt_tokens, max_tokens, model, pool, wait=False
        )
        assert isinstance(out, AdmitDecision)
        return out

    def admit_or_wait(
        self,
        tenant_id: str,
        request_id: str,
        lane: str,
        prompt_tokens: int,
        max_tokens: int,
        model: str = "",
        pool: str = "",
        *,
        wait: bool = True,
        deadline_ns: int | None = None,
    ) -> AdmitDecision | Waiter:
        """Decide, or queue the request when only waiting stands between it
        and admission. A returned ``Waiter`` is resolved later through its
        ``on_done`` callback (or ``result`` when already decided).

        ``deadline_ns`` is the caller's own deadline (the gRPC deadline), on
        the service clock; the wait also ends at the lane's wait target and
        the tenant's max wait, whichever is earliest."""
        self._validate_admit(tenant_id, request_id, prompt_tokens, max_tokens, model, pool)
        now = self.clock()
        key = (tenant_id, request_id)
        prior = self._log.replay(key, now)
        if prior is not None:
            return self._decision(key, prior, duplicate=True)
        if key in self._queues.by_key:
            raise AlreadyExists(f"request_id: {request_id!r} is already waiting in a queue")
        entry = self._resolve_tenant(tenant_id)
        lane = self._lane_for("lane", lane, entry)
        if entry is None:
            rec = self._refusal(key, -1, now, Reason.UNKNOWN_TENANT, 0, lane)
            self._count(rec)
            return self._decision(key, rec, duplicate=False)
        if not entry.config.enabled:
            rec = self._refusal(key, entry.slot, now, Reason.TENANT_DISABLED, 0, lane)
            self._count(rec)
            return self._decision(key, rec, duplicate=False)
        lane = self._place(entry, lane, prompt_tokens, max_tokens)
        max_wait = self._max_wait_ns(entry, lane, now, deadline_ns) if wait else 0
        q = self._queues
        if (
            max_wait > 0
            and q.total
            and (q.per_tenant.get(entry.slot) or self._watermark_blocked or self._shed_blocked)
        ):
            # A backlog this request competes with: its own tenant's waiters
            # (per-tenant FIFO), or waiters held for shared capacity (the
            # watermark, a shed lane). Join it, so the fair order decides who
            # goes first; the dispatch right after admits it at once if it
            # can. Waiters blocked only on their own tenant's limits are not
            # passed over by another tenant's request: it takes nothing of
            # theirs, so that request is decided directly.
            return self._enqueue(key, entry, lane, prompt_tokens, max_tokens, model, pool, now,
                                 now + max_wait)  # fmt: skip
        rec, waitable = self._decide(
            key, entry, lane, prompt_tokens, max_tokens, model, pool, now, now
        )
        if (
            not waitable
            or max_wait <= 0
            or (rec[R.REASON] == Reason.TOKEN_RATE and rec[R.RETRY_NS] > max_wait)
        ):
            # Admitted, or refused for good, or the bucket cannot refill
            # before the wait would end: answer now.
            self._store(key, rec)
            return self._decision(key, rec, duplicate=False)
        return self._enqueue(key, entry, lane, prompt_tokens, max_tokens, model, pool, now,
                             now + max_wait, first_try=rec)  # fmt: skip

    def _max_wait_ns(self, entry: _Tenant, lane: str, now: int, deadline_ns: int | None) -> int:
        wait = self._lanes[lane].wait_target_ms * NS_PER_MS
        if entry.config.max_wait_ms is not None:
            wait = min(wait, entry.config.max_wait_ms * NS_PER_MS)
        if deadline_ns is not None:
            # Leave the answer time to travel back before the caller gives up:
            # a tenth of what is left, between 5 and 100 ms.
            left = deadline_ns - now
            margin = min(max(left // 10, DEADLINE_MARGIN_MIN_NS), DEADLINE_MARGIN_MAX_NS)
            wait = min(wait, left - margin)
        return wait

    def _enqueue(
        self,
        key: Key,
        entry: _Tenant,
        lane: str,
        prompt: int,
        max_tokens: int,
        model: str,
        pool: str,
        now: int,
        deadline: int,
        first_try: Record | None = None,
    ) -> AdmitDecision | Waiter:
        q = self._queues
        lane_cfg = self._lanes[lane]
        lane_idx = q.lane_index(lane)
        policy = self.policy
        lane_limit = (
            lane_cfg.max_queued if lane_cfg.max_queued is not None else policy.lane_queue_limit
        )
        tenant_limit = (
            entry.config.max_queued
            if entry.config.max_queued is not None
            else policy.tenant_queue_limit
        )
        if (
            q.total >= policy.queue_limit
            or q.per_lane[lane_idx] >= lane_limit
            or q.per_tenant.get(entry.slot, 0) >= tenant_limit
        ):
            if first_try is None:
                # Full queues only refuse what would have to wait: a request
                # that fits now is admitted (nobody it passes could use it).
                rec, waitable = self._decide(
                    key, entry, lane, prompt, max_tokens, model, pool, now, now
                )
                if not waitable:
                    self._store(key, rec)
                    return self._decision(key, rec, duplicate=False)
            retry = lane_cfg.wait_target_ms * NS_PER_MS
            rec = self._refusal(key, entry.slot, now, Reason.QUEUE_FULL, retry, lane)
            self._count(rec)
            return self._decision(key, rec, duplicate=False)
        w = Waiter(key, entry.slot, lane, lane_idx, prompt, max_tokens, model, pool, now, deadline,
                   q.next_seq())  # fmt: skip
        q.add(w)
        try:
            if first_try is not None:
                self._block(w, first_try, now)
            self._dispatch(now)
        except BaseException:
            # The call fails; its waiter must not stay behind in the queue.
            if not w.done:
                q.remove(w)
            raise
        if w.done:
            assert isinstance(w.result, AdmitDecision)
            return w.result
        return w

    def _block(self, w: Waiter, rec: Record, now: int) -> None:
        """Remember why the head of a tenant's queue could not go, so the
        dispatcher skips it until that changes."""
        reason = rec[R.REASON]
        if reason == Reason.TOKEN_RATE:
            # at least 1 ns, so the head is really skipped until later
            self._blocked_until[w.slot] = now + max(rec[R.RETRY_NS], 1)
        elif reason == Reason.CONCURRENCY:
            self._concurrency_blocked.add(w.slot)
        elif reason == Reason.GLOBAL_WATERMARK:
            self._watermark_blocked = True
        elif reason == Reason.BACKPRESSURE:
            self._shed_blocked[(w.lane_idx, w.slot)] = w.pool

    def _eligible(self, w: Waiter) -> bool:
        slot = w.slot
        return (
            self._blocked_until.get(slot, 0) <= self._now
            and slot not in self._concurrency_blocked
            and (w.lane_idx, slot) not in self._shed_blocked
        )

    def _observe_wait(self, lane: str, wait_ns: int) -> None:
        counts = self.queue_wait_buckets.get(lane)
        if counts is None:
            counts = self.queue_wait_buckets[lane] = [0] * (len(QUEUE_WAIT_BUCKETS_NS) + 1)
        counts[bisect.bisect_left(QUEUE_WAIT_BUCKETS_NS, wait_ns)] += 1
        self.queue_wait_sum_ns[lane] += wait_ns

    def _resolve(self, w: Waiter, rec: Record) -> None:
        self._queues.remove(w)
        self._observe_wait(w.lane, rec[R.DECIDED_NS] - w.arrived_ns)
        self._store(w.key, rec)
        w.result = self._decision(w.key, rec, duplicate=False)
        if w.on_done is not None:
            w.on_done(w.result)

    def _dispatch(self, now: int) -> None:
        """Admit waiting requests in fair order while capacity allows."""
        q = self._queues
        if not q.total or self._watermark_blocked:
            return
        self._now = now
        while True:
            w = q.pick(self._eligible)
            if w is None:
                return
            entry = self._by_slot[w.slot]
            if entry.deleted or not entry.config.enabled:
                reason = Reason.UNKNOWN_TENANT if entry.deleted else Reason.TENANT_DISABLED
                self._resolve(w, self._refusal_record(w, now, reason, 0))
                continue
            rec, waitable = self._decide(
                w.key, entry, w.lane, w.prompt, w.max_tokens, w.model, w.pool, now, w.arrived_ns
            )
            if (
                rec[R.STATE] == R.OPEN
                or not waitable
                or (rec[R.REASON] == Reason.TOKEN_RATE and now + rec[R.RETRY_NS] > w.deadline_ns)
            ):
                self._resolve(w, rec)
            else:
                self._block(w, rec, now)
                if rec[R.REASON] == Reason.GLOBAL_WATERMARK:
                    # Nobody goes before the head of the fair order: a large
                    # request is not starved by smaller ones slipping past.
                    return

    def _refusal_record(self, w: Waiter, now: int, reason: int, retry_ns: int) -> Record:
        return (
            R.REJECTED, reason, retry_ns, 0, 0, 0, 0, -1, -1, w.lane, w.slot, now,
            "", "", 1.0, 0, -1, 0, w.arrived_ns, 0, 0, 0, UNKNOWN, 0,
        )  # fmt: skip

    def _slot_freed(self, slot: int) -> None:
        """A reservation of ``slot`` ended: concurrency and watermark capacity
        may have freed."""
        self._concurrency_blocked.discard(slot)
        self._watermark_blocked = False

    def tick(self) -> None:
        """Time passed: time out waiters past their deadline, then dispatch.
        The asyncio layer calls this at ``next_wakeup_ns()``."""
        now = self.clock()
        for w in self._queues.expired(now):
            blocked = self._blocked_until.get(w.slot, 0) - now
            retry = blocked if blocked > 0 else self._lanes[w.lane].wait_target_ms * NS_PER_MS
            rec = self._refusal_record(w, now, Reason.QUEUE_TIMEOUT, retry)
            self._observe_wait(w.lane, now - w.arrived_ns)
            self._store(w.key, rec)
            w.done = True
            w.result = self._decision(w.key, rec, duplicate=False)
            if w.on_done is not None:
                w.on_done(w.result)
        self._dispatch(now)

    def cancel(self, w: Waiter) -> None:
        """The caller went away: leave the queue at once (nothing is
        remembered). If it was admitted in the same moment but never learned
        it, the reservation is released: nobody will run or settle it."""
        now = self.clock()
        if not w.done:
            self._queues.remove(w)
        elif isinstance(w.result, AdmitDecision) and w.result.decision == Decision.ADMIT:
            rec = self._log.drop_open(w.key)
            if rec is None:
                return  # settled or expired meanwhile: nothing to give back
            self._table.release(rec[R.SLOT], now, rec[R.RESERVED])
            self._slot_freed(rec[R.SLOT])
        else:
            return  # it had its answer (a refusal): nothing to undo
        self.cancelled_total += 1
        self._dispatch(now)

    def next_wakeup_ns(self) -> int | None:
        """When time alone may change something for the waiters: the next
        deadline, or the next refill of a tenant whose queue head waits."""
        q = self._queues
        if not q.total:
            return None
        now = self.clock()
        # only future refills: a passed one is either dispatched already or
        # the head is blocked for another reason, which time does not cure
        times = [t for slot, t in self._blocked_until.items() if t > now and slot in q.per_tenant]
        deadline = q.next_deadline()
        if deadline is not None:
            times.append(deadline)
        return min(times) if times else None

    @property
    def waiting(self) -> int:
        return self._queues.total

    def tenant_queued(self, tenant_id: str) -> int:
        """Admit calls of ``tenant_id`` waiting in any lane's queue."""
        entry = self._tenants.get(tenant_id)
        return 0 if entry is None else self._queues.per_tenant.get(entry.slot, 0)

    def queue_depths(self) -> dict[str, int]:
        return self._queues.lane_depths()

    def admit_batch(
        self,
        tenant_ids: Sequence[str],
        request_ids: Sequence[str],
        lanes: Sequence[str],
        prompt_tokens: Sequence[int],
        max_tokens: Sequence[int],
        model: str = "",
        pool: str = "",
    ) -> BatchResult:
        """Decide a whole batch with one call into the fast path.

        The batch is validated in full before anything is decided: a bad
        entry fails the call (naming ``field[index]``) and changes no state.
        Callers holding protobuf repeated fields should pass lists (indexing
        a repeated field costs ~6x a list index).
        """
        n = len(tenant_ids)
        if n > self.settings.max_batch:
            raise InvalidArgument(
                "tenant_id", f"batch of {n} exceeds max_batch {self.settings.max_batch}"
            )
        for name, col in (
            ("request_id", request_ids),
            ("prompt_tokens", prompt_tokens),
            ("max_tokens", max_tokens),
        ):
            if len(col) != n:
                raise InvalidArgument(name, f"has {len(col)} entries, tenant_id has {n}")
        if len(lanes) not in (0, 1, n):
            raise InvalidArgument("lane", f"must have 0, 1 or {n} entries, got {len(lanes)}")
        check_optional_name("model", model)
        check_optional_name("pool", pool, max_len=128)
        if n and (
            min(prompt_tokens) < 0
            or max(prompt_tokens) > MAX_TOKENS_PER_FIELD
            or min(max_tokens) < 0
            or max(max_tokens) > MAX_TOKENS_PER_FIELD
        ):
            for i in range(n):
                check_tokens(f"prompt_tokens[{i}]", prompt_tokens[i])
                check_tokens(f"max_tokens[{i}]", max_tokens[i])
        # One pass over ids with C-level helpers; the precise per-entry check
        # (and its message) runs only when something is off.
        if n and (
            min(map(len, tenant_ids)) == 0
            or max(map(len, tenant_ids)) > MAX_ID_LEN
            or min(map(len, request_ids)) == 0
            or max(map(len, request_ids)) > MAX_ID_LEN
        ):
            for i in range(n):
                check_id(f"tenant_id[{i}]", tenant_ids[i])
                check_id(f"request_id[{i}]", request_ids[i])
        lane_of: list[str]
        if len(lanes) == 1:
            lane_of = [lanes[0]] * n
        elif not lanes:
            lane_of = [""] * n
        else:
            lane_of = list(lanes)
        for i, ln in enumerate(lane_of if len(lanes) > 1 else lane_of[:1]):
            if ln and ln not in self._lanes:
                self._lane_for(f"lane[{i}]", ln, None)
        keys = list(zip(tenant_ids, request_ids, strict=True))
        if len(set(keys)) != n:
            # The fast path would decide a repeated id twice; refuse instead.
            seen: set[Key] = set()
            for i, k in enumerate(keys):
                if k in seen:
                    raise InvalidArgument(
                        f"request_id[{i}]", f"{k[1]!r} appears twice in the batch"
                    )
                seen.add(k)

        now = self.clock()
        log = self._log
        records = log.records
        # Per distinct tenant in the batch, resolved once.
        resolved: dict[str, tuple[int, str, int, bool, _Tenant | None]] = {}
        for tenant_id in set(tenant_ids):
            entry = self._resolve_tenant(tenant_id)
            if entry is None:
                resolved[tenant_id] = (-1, "standard", Reason.UNKNOWN_TENANT, False, None)
            else:
                cfg = entry.config
                early = _OK if cfg.enabled else Reason.TENANT_DISABLED
                shadow = cfg.shadow_mode or self.policy.shadow_mode
                resolved[tenant_id] = (entry.slot, cfg.default_lane, early, shadow, entry)
        tenant_slot = [-1] * n
        early_reason = [_OK] * n
        shadow_l = [0] * n
        replayed: dict[int, Record] = {}
        long_threshold = self.policy.long_request_tokens
        for i in range(n):
            key = keys[i]
            if key in records:
                prior = log.replay(key, now)
                if prior is not None:
                    replayed[i] = prior
                    continue
            slot, default_lane, early, shadow, entry = resolved[key[0]]
            tenant_slot[i] = slot
            early_reason[i] = early
            shadow_l[i] = shadow
            if not lane_of[i]:
                lane_of[i] = default_lane
            if entry is not None and prompt_tokens[i] + max_tokens[i] > min(
                long_threshold, entry.config.long_request_tokens or long_threshold
            ):
                lane_of[i] = self._place(entry, lane_of[i], prompt_tokens[i], max_tokens[i])
        # Backpressure and degradation per lane (the pool is batch-level).
        lane_pressure = {ln: self._pressure(ln, pool, now) for ln in set(lane_of) if ln}
        maxt_l = list(max_tokens)
        degraded_l = [False] * n
        fast_slots = [-1] * n  # what the fast path decides (-1 = decided here)
        early_retry: dict[int, int] = {}
        shed_l = [0] * n
        for i in range(n):
            if early_reason[i] != _OK or i in replayed:
                continue
            bp_reason, bp_retry, _, _, shed, cap = lane_pressure[lane_of[i]]
            if cap and maxt_l[i] > cap:
                maxt_l[i] = cap
            degraded_l[i] = cap > 0
            if bp_reason and not shadow_l[i]:
                early_reason[i] = bp_reason
                early_retry[i] = bp_retry
                shed_l[i] = int(shed)
                continue
            fast_slots[i] = tenant_slot[i]
        prompt = np.array(prompt_tokens, dtype=np.int64)
        out_reason = np.array(early_reason, dtype=np.int64)
        out_reserved = np.zeros(n, dtype=np.int64)
        out_retry = np.zeros(n, dtype=np.int64)
        for i, retry in early_retry.items():
            out_retry[i] = retry
        out_bucket = np.zeros(n, dtype=np.int64)
        out_hour = np.full(n, -1, dtype=np.int64)
        out_day = np.full(n, -1, dtype=np.int64)
        any_shadow = any(shadow_l)
        self._table.admit_batch(
            now, np.array(fast_slots, dtype=np.int64), prompt,
            np.array(maxt_l, dtype=np.int64), out_reason, out_reserved, out_retry,
            out_bucket, out_hour, out_day,
            shadow=np.array(shadow_l, dtype=np.int64) if any_shadow else None,
        )  # fmt: skip
        reasons = out_reason.tolist()
        reserved_l = out_reserved.tolist()
        retry_l = out_retry.tolist()
        bucket_l = out_bucket.tolist()
        hour_l = out_hour.tolist()
        day_l = out_day.tolist()
        granted_l = (out_reserved - prompt).tolist()
        shadow_reason_l = [0] * n
        if any_shadow:
            # Shadow entries were charged whatever the verdict: admitted, with
            # the reason they would have been refused for.
            for i in range(n):
                if shadow_l[i] and i not in replayed and early_reason[i] == _OK:
                    lp = lane_pressure[lane_of[i]]
                    would = lp[0] or reasons[i]
                    if would:
                        shadow_reason_l[i] = would
                        reasons[i] = _OK
                        retry_l[i] = 0
        decision = [_REJECT] * n
        rid_l = [0] * n
        dup_l = [False] * n
        price = self.pricing.quote(pool, model, now)
        mult, window = price.multiplier, price.window_id
        conc_retry = self._concurrency_retry_ns
        rid = self._next_reservation
        admitted_keys: list[Key] = []
        rejected_keys: list[Key] = []
        keep_rejections = log.remembers_rejections
        for i in range(n):
            reason = reasons[i]
            if reason == _OK:
                if replayed and i in replayed:
                    pass  # a replayed admission: filled in below
                else:
                    key = keys[i]
                    lp = lane_pressure[lane_of[i]]
                    records[key] = (
                        R.OPEN, _OK, 0, reserved_l[i], rid, granted_l[i], bucket_l[i],
                        hour_l[i], day_l[i], lane_of[i], tenant_slot[i], now, pool, model,
                        mult, window, -1, 0, now, shadow_reason_l[i],
                        lp[5] if degraded_l[i] else 0, lp[2], lp[3], 0,
                    )  # fmt: skip
                    admitted_keys.append(key)
                    decision[i] = _ADMIT
                    rid_l[i] = rid
                    rid += 1
                    continue
            elif not (replayed and i in replayed):
                granted_l[i] = 0
                if reason == _CONCURRENCY:
                    retry_l[i] = conc_retry
                if keep_rejections:
                    key = keys[i]
                    lp = lane_pressure.get(lane_of[i]) or (0, 0, 0, UNKNOWN, False, 0)
                    records[key] = (
                        R.REJECTED, reason, retry_l[i], 0, 0, 0, bucket_l[i], hour_l[i],
                        day_l[i], lane_of[i], tenant_slot[i], now, "", "", 1.0, 0, -1, 0, now,
                        0, 0, lp[2], lp[3], shed_l[i],
                    )  # fmt: skip
                    rejected_keys.append(key)
                continue
            prior = replayed[i]
            reasons[i] = prior[R.REASON]
            decision[i] = _ADMIT if prior[R.REASON] == _OK else _REJECT
            retry_l[i] = prior[R.RETRY_NS]
            reserved_l[i] = prior[R.RESERVED]
            rid_l[i] = prior[R.RID]
            granted_l[i] = prior[R.GRANTED]
            bucket_l[i] = prior[R.BUCKET]
            hour_l[i] = prior[R.HOUR]
            day_l[i] = prior[R.DAY]
            shadow_reason_l[i] = prior[R.SHADOW_REASON]
            degraded_l[i] = bool(prior[R.DEGRADED_CAP])
            dup_l[i] = True
        self._next_reservation = rid
        log.note_batch(now, admitted_keys, rejected_keys)
        fresh = [r for i, r in enumerate(reasons) if i not in replayed] if replayed else reasons
        for reason, count in Counter(fresh).items():
            self.decision_counts[(_ADMIT if reason == _OK else _REJECT, reason)] += count
        if any_shadow:
            for i, would in enumerate(shadow_reason_l):
                if would and i not in replayed:
                    self.shadow_counts[would] += 1
        caps = [lp[5] for lp in lane_pressure.values() if lp[5]]
        some = next(iter(lane_pressure.values()), None)
        return BatchResult(
            decision=decision,
            reason=reasons,
            retry_after_ms=[-(-x // NS_PER_MS) if x else 0 for x in retry_l],
            reserved_tokens=reserved_l,
            reservation_id=rid_l,
            granted_max_tokens=granted_l,
            bucket_remaining=bucket_l,
            hourly_remaining=hour_l,
            daily_remaining=day_l,
            duplicate=dup_l,
            shadow_reason=shadow_reason_l,
            degraded=degraded_l,
            pricing_multiplier=mult,
            # Per-tenant fallback models are only in unary answers: one batch
            # mixes tenants, and the instructions here are the pool's.
            degradation=Degradation(caps[0], self.policy.degrade_page_tokens, "") if caps else None,
            pressure=Pressure(
                some[2] / PPM,
                some[3],
                "" if some[3] == FRESH else self.policy.stale_policy,
                False,
            )
            if some is not None
            else None,
        )

    # ---------------------------------------------------------------- complete

    def complete(
        self,
        tenant_id: str,
        request_id: str,
        reservation_id: int,
        prompt_tokens: int,
        generated_tokens: int,
        cached_prompt_tokens: int = 0,
        kv_cache_miss_rate: float = 0.0,
    ) -> Settlement:
        """Settle a reservation with real usage; refund the unused part.

        Idempotent: the second report of the same request returns the first
        settlement with ``duplicate=True`` and changes nothing. This is the
        in-memory settlement alone; the server goes through
        ``controlplane.ledger.Metering``, which makes the ledger record
        durable between :meth:`prepare_complete` and :meth:`apply_complete`."""
        prepared = self.prepare_complete(
            tenant_id, request_id, reservation_id, prompt_tokens, generated_tokens,
            cached_prompt_tokens, kv_cache_miss_rate,
        )  # fmt: skip
        if isinstance(prepared, Settlement):
            return prepared
        actual = prompt_tokens + generated_tokens
        return self.apply_complete((tenant_id, request_id), prepared, actual)

    # Usage above ratio x what was admitted, plus this slack, is refused as a
    # sidecar bug rather than billed (a tokenizer mismatch stays well under).
    OVERRUN_SLACK_TOKENS = 1024

    def prepare_complete(
        self,
        tenant_id: str,
        request_id: str,
        reservation_id: int,
        prompt_tokens: int,
        generated_tokens: int,
        cached_prompt_tokens: int = 0,
        kv_cache_miss_rate: float = 0.0,
    ) -> Settlement | Record:
        """Validate a Complete against memory without changing anything.

        Returns the settlement with ``duplicate=True`` when the request is
        already settled, else the open record to pass to
        :meth:`apply_complete`. Raises InvalidArgument, NotFound (never
        admitted, or forgotten after the reservation TTL) or
        FailedPrecondition (refused)."""
        check_id("tenant_id", tenant_id)
        check_id("request_id", request_id)
        check_tokens("prompt_tokens", prompt_tokens)
        check_tokens("generated_tokens", generated_tokens)
        check_tokens("cached_prompt_tokens", cached_prompt_tokens)
        if cached_prompt_tokens > prompt_tokens:
            raise InvalidArgument(
                "cached_prompt_tokens",
                f"{cached_prompt_tokens} exceeds prompt_tokens {prompt_tokens}",
            )
        check_fraction("kv_cache_miss_rate", kv_cache_miss_rate)
        key = (tenant_id, request_id)
        rec = self._log.records.get(key)
        if rec is None:
            raise NotFound(
                "request_id",
                f"no reservation for tenant {tenant_id!r} request {request_id!r} "
                "(never admitted, or expired after reservation_ttl_s)",
            )
        if rec[R.STATE] == R.REJECTED:
            raise FailedPrecondition(
                f"request_id: request {request_id!r} was refused "
                f"({Reason(rec[R.REASON]).name}); there is nothing to settle"
            )
        if reservation_id and reservation_id != rec[R.RID]:
            raise InvalidArgument(
                "reservation_id",
                f"{reservation_id} is not the reservation of tenant {tenant_id!r} "
                f"request {request_id!r}",
            )
        reserved = rec[R.RESERVED]
        if rec[R.STATE] == R.SETTLED:
            return Settlement(request_id, reserved, rec[R.ACTUAL], rec[R.REFUNDED], duplicate=True)
        ratio = self.settings.complete_max_overrun_ratio
        slack = self.OVERRUN_SLACK_TOKENS
        granted = rec[R.GRANTED]
        for name, used, admitted in (
            ("generated_tokens", generated_tokens, granted),
            ("prompt_tokens", prompt_tokens, reserved - granted),
        ):
            if used > admitted * ratio + slack:
                raise InvalidArgument(
                    name,
                    f"{used:,} is more than {ratio:g}x the {admitted:,} admitted "
                    f"(+{slack:,}); refused as a client error, nothing was settled",
                )
        return rec

    def apply_complete(self, key: Key, rec: Record, actual: int) -> Settlement:
        """Settle the record :meth:`prepare_complete` returned: refund the
        unused reservation, free the slot. If the reservation expired in the
        meantime (it was released without a refund) only the answer is built."""
        reserved = rec[R.RESERVED]
        current = self._log.records.get(key)
        if current is None or current[R.STATE] != R.OPEN or current[R.RID] != rec[R.RID]:
            return Settlement(key[1], reserved, actual, 0)
        refunded = self._table.settle(
            rec[R.SLOT], self.clock(), reserved, actual, rec[R.DECIDED_NS]
        )
        self._log.settle(key, current, actual, refunded)
        self._slot_freed(rec[R.SLOT])
        self._dispatch(self.clock())
        return Settlement(key[1], reserved, actual, refunded)

    # ------------------------------------------------------------------ expiry

    def expire(self) -> int:
        """Release reservations older than the TTL and forget old refusals.
        Called periodically by the server; returns how many were released."""
        now = self.clock()
        released = self._log.expire(now)
        for rec in released:
            self._table.release(rec[R.SLOT], now, rec[R.RESERVED])
            self._slot_freed(rec[R.SLOT])
        self.expired_total += len(released)
        if released:
            self._dispatch(now)
        return len(released)

    @property
    def open_reservations(self) -> int:
        return self._log.open_count

    @property
    def remembered_requests(self) -> int:
        return len(self._log)

    # -------------------------------------------------------------------- load

    def report_load(
        self,
        pool: str,
        engine_id: str,
        batch_tokens: int,
        max_batch_tokens: int,
        queue_depth: int,
        queue_capacity: int,
        kv_cache_miss_rate: float,
        gpu_utilization: float,
    ) -> int:
        """Store an engine's load report; returns the pool's fresh engine count."""
        check_id("pool", pool)
        check_id("engine_id", engine_id)
        if batch_tokens < 0:
            raise InvalidArgument("batch_tokens", f"must be >= 0, got {batch_tokens}")
        if max_batch_tokens <= 0:
            raise InvalidArgument("max_batch_tokens", f"must be > 0, got {max_batch_tokens}")
        if queue_depth < 0:
            raise InvalidArgument("queue_depth", f"must be >= 0, got {queue_depth}")
        if queue_capacity <= 0:
            raise InvalidArgument("queue_capacity", f"must be > 0, got {queue_capacity}")
        check_fraction("kv_cache_miss_rate", kv_cache_miss_rate)
        check_fraction("gpu_utilization", gpu_utilization)
        now = self.clock()
        sample = LoadSample(
            pool, engine_id, batch_tokens, max_batch_tokens, queue_depth, queue_capacity,
            kv_cache_miss_rate, gpu_utilization, now,
        )  # fmt: skip
        fresh = self._pools.report(sample, self.policy)
        self.pricing.observe_load(pool, kv_cache_miss_rate, now)  # pricing windows (issue 4)
        # Lanes held back by this pool's backpressure may go now.
        if self._shed_blocked:
            for k in [k for k, p in self._shed_blocked.items() if p == pool]:
                del self._shed_blocked[k]
        self._dispatch(now)
        return fresh

    def pool_views(self) -> dict[str, tuple[float, int, bool]]:
        """pool -> (backpressure score, freshness, degraded), for operators."""
        now = self.clock()
        out: dict[str, tuple[float, int, bool]] = {}
        for name in self._pools.pools:
            view, freshness = self._pools.view(name, now)
            if view is not None:
                out[name] = (view.score_ppm / PPM, freshness, view.degraded)
        return out

    @property
    def pools(self) -> dict[str, dict[str, LoadSample]]:
        """pool -> engine id -> latest load report."""
        return {name: dict(p.engines) for name, p in self._pools.pools.items()}
