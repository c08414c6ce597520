"""The admission use case: decide, settle, expire, accept load reports.

Everything here runs on the server's event-loop thread and touches only
memory: the Cython token-bucket table, the tenant map and the reservation
map. The database is read at start and when config changes (by the server,
off this path) and handed over through :meth:`AdmissionService.apply_config`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from controlplane.domain import (
    MAX_ID_LEN,
    MAX_TOKENS_PER_FIELD,
    AdmitDecision,
    Decision,
    LaneConfig,
    LoadSample,
    Settlement,
    TenantConfig,
)
from controlplane.errors import FailedPrecondition, InvalidArgument, NotFound
from controlplane.policy import Policy
from controlplane.service import records as R
from controlplane.service.pricing import FlatPricing, Pricing
from controlplane.service.records import Key, Record, RequestLog
from controlplane.service.validate import (
    check_fraction,
    check_id,
    check_optional_name,
    check_tokens,
)
from controlplane.settings import Settings
from fastpath import IMPLEMENTATION, Reason, TokenBucketTable

NS_PER_S = 1_000_000_000
NS_PER_MS = 1_000_000

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
}


def _as_decision(key: Key, rec: Record, *, duplicate: bool) -> AdmitDecision:
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
    pricing_multiplier: float = 1.0  # the batch's pool/model multiplier in force


@dataclass
class PoolLoad:
    """The latest load report of each engine of one pool."""

    engines: dict[str, LoadSample] = field(default_factory=dict)

    def fresh(self, now_ns: int, stale_ns: int) -> list[LoadSample]:
        return [s for s in self.engines.values() if now_ns - s.received_ns <= stale_ns]


def _ceil_ms(ns: int) -> int:
    return -(-ns // NS_PER_MS)


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
        self._stale_ns = int(settings.load_report_stale_s * NS_PER_S)
        self.pools: dict[str, PoolLoad] = {}
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
    ) -> Record:
        rec = (
            R.REJECTED, reason, retry_ns, 0, 0, 0, bucket, hour, day, lane, slot, now,
            "", "", 1.0, 0, -1, 0, now,
        )  # fmt: skip
        self._log.add_rejected(key, rec)
        return rec

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
        check_id("tenant_id", tenant_id)
        check_id("request_id", request_id)
        check_tokens("prompt_tokens", prompt_tokens)
        check_tokens("max_tokens", max_tokens)
        check_optional_name("model", model)
        check_optional_name("pool", pool, max_len=128)
        now = self.clock()
        key = (tenant_id, request_id)
        prior = self._log.replay(key, now)
        if prior is not None:
            return _as_decision(key, prior, duplicate=True)
        entry = self._resolve_tenant(tenant_id)
        lane = self._lane_for("lane", lane, entry)
        if entry is None:
            rec = self._refusal(key, -1, now, Reason.UNKNOWN_TENANT, 0, lane)
        elif not entry.config.enabled:
            rec = self._refusal(key, entry.slot, now, Reason.TENANT_DISABLED, 0, lane)
        else:
            reason, reserved, retry_ns, bucket, hour, day = self._table.admit(
                entry.slot, now, prompt_tokens, max_tokens
            )
            if reason == _OK:
                rid = self._next_reservation
                self._next_reservation += 1
                price = self.pricing.quote(pool, model, now)
                rec = (
                    R.OPEN, _OK, 0, reserved, rid, reserved - prompt_tokens, bucket, hour, day,
                    lane, entry.slot, now, pool, model, price.multiplier, price.window_id, -1, 0, now,
                )  # fmt: skip
                self._log.add_admitted(key, rec)
            else:
                if reason == Reason.CONCURRENCY:
                    retry_ns = self._concurrency_retry_ns
                rec = self._refusal(key, entry.slot, now, reason, retry_ns, lane, bucket, hour, day)
        self.decision_counts[(_ADMIT if rec[R.REASON] == _OK else _REJECT, rec[R.REASON])] += 1
        return _as_decision(key, rec, duplicate=False)

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
        # Per distinct tenant in the batch, resolved once:
        # (fast-path slot or -1 when refused here, tenant slot, default lane, early reason)
        resolved: dict[str, tuple[int, int, str, int]] = {}
        for tenant_id in set(tenant_ids):
            entry = self._resolve_tenant(tenant_id)
            if entry is None:
                resolved[tenant_id] = (-1, -1, "standard", Reason.UNKNOWN_TENANT)
            elif not entry.config.enabled:
                resolved[tenant_id] = (-1, entry.slot, entry.config.default_lane,
                                       Reason.TENANT_DISABLED)  # fmt: skip
            else:
                resolved[tenant_id] = (entry.slot, entry.slot, entry.config.default_lane, _OK)
        fast_slots = [-1] * n  # what the fast path decides (-1 = decided here)
        tenant_slot = [-1] * n
        early_reason = [_OK] * n
        replayed: dict[int, Record] = {}
        for i in range(n):
            key = keys[i]
            if key in records:
                prior = log.replay(key, now)
                if prior is not None:
                    replayed[i] = prior
                    continue
            fast, slot, default_lane, early = resolved[key[0]]
            fast_slots[i] = fast
            tenant_slot[i] = slot
            early_reason[i] = early
            if not lane_of[i]:
                lane_of[i] = default_lane
        prompt = np.array(prompt_tokens, dtype=np.int64)
        out_reason = np.array(early_reason, dtype=np.int64)
        out_reserved = np.zeros(n, dtype=np.int64)
        out_retry = np.zeros(n, dtype=np.int64)
        out_bucket = np.zeros(n, dtype=np.int64)
        out_hour = np.full(n, -1, dtype=np.int64)
        out_day = np.full(n, -1, dtype=np.int64)
        self._table.admit_batch(
            now, np.array(fast_slots, dtype=np.int64), prompt,
            np.array(max_tokens, dtype=np.int64), out_reason, out_reserved, out_retry,
            out_bucket, out_hour, out_day,
        )  # fmt: skip
        reasons = out_reason.tolist()
        reserved_l = out_reserved.tolist()
        retry_l = out_retry.tolist()
        bucket_l = out_bucket.tolist()
        hour_l = out_hour.tolist()
        day_l = out_day.tolist()
        granted_l = (out_reserved - prompt).tolist()
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
                    records[key] = (
                        R.OPEN, _OK, 0, reserved_l[i], rid, granted_l[i], bucket_l[i],
                        hour_l[i], day_l[i], lane_of[i], tenant_slot[i], now, pool, model,
                        mult, window, -1, 0, now,
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
                    records[key] = (
                        R.REJECTED, reason, retry_l[i], 0, 0, 0, bucket_l[i], hour_l[i],
                        day_l[i], lane_of[i], tenant_slot[i], now, "", "", 1.0, 0, -1, 0, now,
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
            dup_l[i] = True
        self._next_reservation = rid
        log.note_batch(now, admitted_keys, rejected_keys)
        fresh = [r for i, r in enumerate(reasons) if i not in replayed] if replayed else reasons
        for reason, count in Counter(fresh).items():
            self.decision_counts[(_ADMIT if reason == _OK else _REJECT, reason)] += count
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
            pricing_multiplier=mult,
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
        settlement with ``duplicate=True`` and changes nothing."""
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
        actual = prompt_tokens + generated_tokens
        refunded = self._table.settle(
            rec[R.SLOT], self.clock(), reserved, actual, rec[R.DECIDED_NS]
        )
        self._log.settle(key, rec, actual, refunded)
        return Settlement(request_id, reserved, actual, refunded)

    # ------------------------------------------------------------------ expiry

    def expire(self) -> int:
        """Release reservations older than the TTL and forget old refusals.
        Called periodically by the server; returns how many were released."""
        now = self.clock()
        released = self._log.expire(now)
        for rec in released:
            self._table.release(rec[R.SLOT], now, rec[R.RESERVED])
        self.expired_total += len(released)
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
        state = self.pools.setdefault(pool, PoolLoad())
        state.engines[engine_id] = LoadSample(
            pool, engine_id, batch_tokens, max_batch_tokens, queue_depth, queue_capacity,
            kv_cache_miss_rate, gpu_utilization, now,
        )  # fmt: skip
        return len(state.fresh(now, self._stale_ns))
