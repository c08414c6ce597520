"""The decision assembly: one request, or a whole batch, decided now.

Both paths take the same steps, through the same functions here:

1. the tenant screen (``early_reason``): unknown or disabled tenants are
   refused before anything is charged;
2. the pool's verdict (``PressureGate.verdict``): backpressure may refuse
   (or shed) the request, degradation may cap its output;
3. the fast path: the tenant's bucket, quotas, concurrency and the global
   watermark (``TokenBucketTable.admit`` / ``charge`` for one request,
   ``admit_batch`` for many in one call);
4. ``conclude``: shadow mode, the reservation id, the price locked at
   admission, and the record.

Only step 3 differs between the paths (scalar or vectorised), so a unary
Admit and the same request inside an AdmitStream batch are decided alike by
construction. Nothing here waits or dispatches: the dispatcher and the
façade decide what happens to a refusal that waiting could cure.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter

import numpy as np

from controlplane.domain import Decision, Degradation, Pressure
from controlplane.domain.units import NS_PER_MS, PPM
from controlplane.service import records as R
from controlplane.service.answers import BatchResult, retryable
from controlplane.service.gate import PoolGate
from controlplane.service.pools import FRESH, UNKNOWN
from controlplane.service.pressure import PressureGate, Verdict
from controlplane.service.pricing import PriceQuote, Pricing
from controlplane.service.records import (
    BUCKET,
    DAY,
    GRANTED,
    HOUR,
    OPEN,
    REASON,
    RESERVED,
    RETRY_NS,
    RID,
    SHADOW_REASON,
    STATE,
    Key,
    Record,
    RequestLog,
)
from controlplane.service.stats import AdmissionStats
from controlplane.service.tenants import Tenant, TenantDirectory
from fastpath import Reason, TokenBucketTable

_OK = int(Reason.OK)
_CONCURRENCY = int(Reason.CONCURRENCY)
_ADMIT = int(Decision.ADMIT)
_REJECT = int(Decision.REJECT)

# Refusals that waiting can cure: the tenant's bucket refills, a slot frees,
# in-flight tokens drain, the pool's load drops. Quotas and sizes cannot.
WAITABLE = frozenset(
    {Reason.TOKEN_RATE, Reason.CONCURRENCY, Reason.GLOBAL_WATERMARK, Reason.BACKPRESSURE}
)
# A batch entry's verdict when its tenant was refused before the pool mattered.
_NO_VERDICT = Verdict(_OK, 0, 0, UNKNOWN, False, 0)


def early_reason(entry: Tenant | None) -> int:
    """Refusals that need no bucket: the tenant is unknown or disabled."""
    if entry is None:
        return Reason.UNKNOWN_TENANT
    if not entry.config.enabled:
        return Reason.TENANT_DISABLED
    return _OK


class Decider:
    def __init__(
        self,
        table: TokenBucketTable,
        tenants: TenantDirectory,
        pressure: PressureGate,
        gate: PoolGate,
        pricing: Pricing,
        concurrency_retry_ns: int,
    ) -> None:
        self._table = table
        self._tenants = tenants
        self._pressure = pressure
        self._gate = gate
        self.pricing = pricing
        self._concurrency_retry_ns = concurrency_retry_ns
        self._next_reservation = 1

    def verdict(self, lane: str, pool: str, now: int) -> Verdict:
        """The pool's load for a request of ``lane`` now (what every answer
        reports as its pressure)."""
        return self._pressure.verdict(lane, pool, now)

    # ------------------------------------------------------------ one request

    def decide(
        self,
        entry: Tenant,
        lane: str,
        prompt: int,
        max_tokens: int,
        model: str,
        pool: str,
        now: int,
        arrived: int,
    ) -> Record:
        """Decide one request of an enabled tenant now; the record is not
        stored (the caller stores it, or keeps the request waiting)."""
        slot = entry.slot
        v = self._pressure.verdict(lane, pool, now)
        if v.degraded_cap:
            max_tokens = min(max_tokens, v.degraded_cap)
        shadow = self._tenants.shadow(entry)
        if v.reason and not shadow:
            return self.pressure_refusal(v, lane, slot, now, arrived)
        if not shadow and not self._gate.has_room(pool, now):
            return self.gate_refusal(v, lane, slot, pool, now, arrived)
        if shadow:
            reason, reserved, retry, bucket, hour, day = self._table.charge(
                slot, now, prompt, max_tokens
            )
        else:
            reason, reserved, retry, bucket, hour, day = self._table.admit(
                slot, now, prompt, max_tokens
            )
        rec = self.conclude(
            reason, reserved, retry, bucket, hour, day, prompt, shadow, v, lane, slot,
            pool, model, now, arrived, self._next_reservation, None,
        )  # fmt: skip
        if rec[R.STATE] == R.OPEN:
            self._next_reservation += 1
        return rec

    def gate_refusal(
        self, v: Verdict, lane: str, slot: int, pool: str, now: int, arrived: int
    ) -> Record:
        """The pool has no room: held by backpressure, a refusal waiting can
        cure (every lane, premium included, waits for the gate); retry_after
        is when the pool is predicted to take it."""
        return R.refused(
            Reason.BACKPRESSURE, self._gate.retry_ns(pool, now), lane, slot, now, arrived,
            score_ppm=v.score_ppm, freshness=v.freshness, shed=1,
        )  # fmt: skip

    @staticmethod
    def pressure_refusal(v: Verdict, lane: str, slot: int, now: int, arrived: int) -> Record:
        return R.refused(
            v.reason, v.retry_ns, lane, slot, now, arrived,
            score_ppm=v.score_ppm, freshness=v.freshness, shed=int(v.shed),
        )  # fmt: skip

    def conclude(
        self,
        reason: int,
        reserved: int,
        retry_ns: int,
        bucket: int,
        hour: int,
        day: int,
        prompt: int,
        shadow: bool,
        v: Verdict,
        lane: str,
        slot: int,
        pool: str,
        model: str,
        now: int,
        arrived: int,
        rid: int,
        price: PriceQuote | None,
        release: bool = True,
    ) -> Record:
        """The record of a fast-path verdict; an admission takes reservation
        id ``rid`` and the price in force (``price``, or quoted here), and is
        counted by the pool gate unless ``release`` is false (a batch counts
        its admissions at once). In shadow mode the request was charged
        whatever the verdict and is admitted with the reason it would have
        been refused for."""
        shadow_reason = 0
        if shadow:
            shadow_reason = v.reason or reason
            reason = _OK
        if reason == _OK:
            if release and self._gate.enabled:
                self._gate.released(pool, now, prompt)
            if price is None:
                price = self.pricing.quote(pool, model, now)
            return R.admitted(
                reserved, rid, reserved - prompt, bucket, hour, day, lane, slot, now, pool,
                model, price.multiplier, price.window_id, arrived, shadow_reason,
                v.degraded_cap, v.score_ppm, v.freshness,
            )  # fmt: skip
        if reason == _CONCURRENCY:
            # Nobody knows when a request ends: a configured hint.
            retry_ns = self._concurrency_retry_ns
        return R.refused(
            reason, retry_ns, lane, slot, now, arrived, bucket, hour, day,
            v.score_ppm, v.freshness,
        )  # fmt: skip

    # ------------------------------------------------------------- a batch

    def decide_batch(
        self,
        keys: list[Key],
        lanes: list[str],
        prompt_tokens: Sequence[int],
        max_tokens: Sequence[int],
        model: str,
        pool: str,
        now: int,
        log: RequestLog,
        stats: AdmissionStats,
    ) -> BatchResult:
        """Decide a validated batch with one call into the fast path; store
        and count the fresh decisions. ``lanes[i]`` is the named lane or ""
        (the tenant's default); ``pool`` is the batch's, "" = each entry's
        own (``TenantDirectory.pool_for``). Repeated keys answer their
        earlier decision."""
        n = len(keys)
        tenants = self._tenants
        policy = tenants.policy
        # Per distinct tenant in the batch, resolved once.
        resolved: dict[str, tuple[Tenant | None, int, bool]] = {}
        for tenant_id in {k[0] for k in keys}:
            entry = tenants.resolve(tenant_id)
            shadow = entry is not None and tenants.shadow(entry)
            resolved[tenant_id] = (entry, early_reason(entry), shadow)
        slots = [-1] * n
        early = [_OK] * n
        pools = [""] * n  # each fresh entry's pool, once its lane is final
        shadow_l = [False] * n
        replayed = log.replay_many(keys, now)
        long_threshold = policy.long_request_tokens
        pool_for = tenants.pool_for
        for i in range(n):
            if replayed and i in replayed:
                continue
            entry, early[i], shadow_l[i] = resolved[keys[i][0]]
            if entry is None:
                lanes[i] = tenants.lane_for("lane", lanes[i], None)
                pools[i] = pool_for(None, lanes[i], pool)
                continue
            slots[i] = entry.slot
            if not lanes[i]:
                lanes[i] = entry.config.default_lane
            # placement only matters for long requests: skip the call otherwise
            if prompt_tokens[i] + max_tokens[i] > min(
                long_threshold, entry.config.long_request_tokens or long_threshold
            ):
                lanes[i] = tenants.place(entry, lanes[i], prompt_tokens[i], max_tokens[i])
            pools[i] = pool_for(entry, lanes[i], pool)
        # One verdict per (lane, pool) of the fresh entries, in batch order
        # (the batch-level answer reports the first), and one gate count per pool.
        if replayed:
            pairs = dict.fromkeys((lanes[i], pools[i]) for i in range(n) if i not in replayed)
            if not pairs:
                # only replays: the batch still reports its pool's pressure
                # now, from the first replay's recorded lane and pool
                i = min(replayed)
                lane = replayed[i][R.LANE]
                first_pool = replayed[i][R.POOL] or pool_for(resolved[keys[i][0]][0], lane, pool)
                pairs = {(lane, first_pool): None}
        else:
            pairs = dict.fromkeys(zip(lanes, pools, strict=True))
        verdicts = {lp: self._pressure.verdict(*lp, now) for lp in pairs}
        maxt_l = list(max_tokens)
        batch_pools = list(dict.fromkeys(p for _, p in pairs))
        verdict_l = [_NO_VERDICT] * n
        fast_slots = [-1] * n  # what the fast path decides (-1 = decided here)
        pre: dict[int, Record] = {}  # refused before the fast path
        for i in range(n):
            if i in replayed:
                continue
            if early[i] != _OK:
                pre[i] = R.refused(early[i], 0, lanes[i], slots[i], now, now)
                continue
            v = verdict_l[i] = verdicts[lanes[i], pools[i]]
            if v.degraded_cap and maxt_l[i] > v.degraded_cap:
                maxt_l[i] = v.degraded_cap
            if v.reason and not shadow_l[i]:
                pre[i] = self.pressure_refusal(v, lanes[i], slots[i], now, now)
                continue
            fast_slots[i] = slots[i]
        if self._gate.enabled:
            # A batch never waits: what a pool has no room for is refused,
            # fail-open lanes (premium) served first, then the rest in batch
            # order. Each pool's share is planned for every entry sent to the
            # fast path (one it then refuses took none: a small overestimate).
            lane_cfg = self._tenants.lanes
            gated = [i for i in range(n) if fast_slots[i] >= 0 and not shadow_l[i]]
            batch_lanes = {ln for ln, _ in verdicts}
            # (an unknown tenant's fallback lane may not be configured)
            fail_open = {ln for ln in batch_lanes if ln in lane_cfg and lane_cfg[ln].fail_open}
            if fail_open and len(fail_open) < len(batch_lanes):  # a mix: those first
                gated.sort(key=lambda i: lanes[i] not in fail_open)  # stable
            for p in batch_pools:
                mine = gated if len(batch_pools) == 1 else [i for i in gated if pools[i] == p]
                fits = self._gate.plan(p, now, [prompt_tokens[i] for i in mine])
                for i, ok in zip(mine, fits, strict=True):
                    if not ok:
                        pre[i] = self.gate_refusal(verdict_l[i], lanes[i], slots[i], p, now, now)
                        fast_slots[i] = -1
        out_reason = np.zeros(n, dtype=np.int64)
        out_reserved = np.zeros(n, dtype=np.int64)
        out_retry = np.zeros(n, dtype=np.int64)
        out_bucket = np.zeros(n, dtype=np.int64)
        out_hour = np.full(n, -1, dtype=np.int64)
        out_day = np.full(n, -1, dtype=np.int64)
        any_shadow = any(shadow_l)
        self._table.admit_batch(
            now, np.array(fast_slots, dtype=np.int64), np.array(prompt_tokens, dtype=np.int64),
            np.array(maxt_l, dtype=np.int64), out_reason, out_reserved, out_retry,
            out_bucket, out_hour, out_day,
            shadow=np.array(shadow_l, dtype=np.int64) if any_shadow else None,
        )  # fmt: skip
        reason_l = out_reason.tolist()
        reserved_l = out_reserved.tolist()
        retry_l = out_retry.tolist()
        bucket_l = out_bucket.tolist()
        hour_l = out_hour.tolist()
        day_l = out_day.tolist()
        recs: list[Record] = []
        admitted_keys: list[Key] = []
        admitted_recs: list[Record] = []
        admitted: list[int] = []  # indexes, for the pool gate's count
        rejected_keys: list[Key] = []
        rejected_recs: list[Record] = []
        conclude = self.conclude
        # Quoted once per pool of the batch, not per entry.
        prices = {p: self.pricing.quote(p, model, now) for p in batch_pools}
        rid = self._next_reservation
        # entries not decided by the fast path: replays and early refusals
        special = replayed.keys() | pre.keys() if replayed or pre else ()
        # zip, not indexing: this loop runs once per request of every batch
        for i, (key, reason, reserved, retry, bucket, hour, day, prompt, shadow, v, lane, slot,
                pool_i) in (
            enumerate(zip(keys, reason_l, reserved_l, retry_l, bucket_l, hour_l, day_l,
                          prompt_tokens, shadow_l, verdict_l, lanes, slots, pools, strict=True))
        ):  # fmt: skip
            if special and i in special:
                rec = replayed.get(i) or pre[i]
                recs.append(rec)
                if i in replayed:
                    continue
            else:
                rec = conclude(
                    reason, reserved, retry, bucket, hour, day, prompt, shadow, v, lane, slot,
                    pool_i, model, now, now, rid, prices[pool_i], False,
                )  # fmt: skip
                recs.append(rec)
            if rec[STATE] == OPEN:
                rid += 1
                admitted_keys.append(key)
                admitted_recs.append(rec)
                admitted.append(i)
            else:
                rejected_keys.append(key)
                rejected_recs.append(rec)
        self._next_reservation = rid
        if admitted and self._gate.enabled:
            for p in batch_pools:
                mine = admitted if len(batch_pools) == 1 else [i for i in admitted if pools[i] == p]
                if mine:
                    self._gate.released_many(p, now, [prompt_tokens[i] for i in mine])
        log.add_batch(now, admitted_keys, admitted_recs, rejected_keys, rejected_recs)
        fresh = [r for i, r in enumerate(recs) if i not in replayed] if replayed else recs
        stats.count_reasons(
            list(map(itemgetter(REASON), fresh)),
            list(map(itemgetter(SHADOW_REASON), fresh)) if any_shadow else [],
        )
        # A fresh entry is marked degraded when its lane is, even if it was
        # refused (the sidecar learns the pool's state); a replay as before.
        degraded = [v.degraded_cap > 0 for v in verdict_l]
        for i, prior in replayed.items():
            degraded[i] = bool(prior[R.DEGRADED_CAP])
        # Entries of one batch may resolve to different pools: the batch-level
        # multiplier is the first fresh entry's (each admission's record, which
        # the ledger bills, locks its own pool's).
        first = next(iter(prices.values()), None)
        return self._columns(
            recs, replayed, degraded, verdicts, first.multiplier if first is not None else 1.0
        )

    def _columns(
        self,
        recs: list[Record],
        replayed: dict[int, Record],
        degraded: list[bool],
        verdicts: dict[tuple[str, str], Verdict],
        multiplier: float,
    ) -> BatchResult:
        policy = self._tenants.policy
        n = len(recs)
        reasons = list(map(itemgetter(REASON), recs))
        caps = [v.degraded_cap for v in verdicts.values() if v.degraded_cap]
        some = next(iter(verdicts.values()), None)
        return BatchResult(
            decision=[_ADMIT if x == _OK else _REJECT for x in reasons],
            reason=reasons,
            retry_after_ms=[-(-x // NS_PER_MS) for x in map(itemgetter(RETRY_NS), recs)],
            reserved_tokens=list(map(itemgetter(RESERVED), recs)),
            reservation_id=list(map(itemgetter(RID), recs)),
            granted_max_tokens=list(map(itemgetter(GRANTED), recs)),
            bucket_remaining=list(map(itemgetter(BUCKET), recs)),
            hourly_remaining=list(map(itemgetter(HOUR), recs)),
            daily_remaining=list(map(itemgetter(DAY), recs)),
            duplicate=[i in replayed for i in range(n)] if replayed else [False] * n,
            shadow_reason=list(map(itemgetter(SHADOW_REASON), recs)),
            degraded=degraded,
            retryable=[retryable(x) for x in reasons],
            pricing_multiplier=multiplier,
            # Per-tenant fallback models are only in unary answers: one batch
            # mixes tenants, and the instructions here are the pool's.
            degradation=Degradation(caps[0], policy.degrade_page_tokens, "") if caps else None,
            pressure=Pressure(
                some.score_ppm / PPM,
                some.freshness,
                "" if some.freshness == FRESH else policy.stale_policy,
                False,
            )
            if some is not None
            else None,
        )
