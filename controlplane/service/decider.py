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

import numpy as np
import numpy.typing as npt

from controlplane.domain import Decision, Degradation, Pressure
from controlplane.domain.units import NS_PER_MS, PPM
from controlplane.service import records as R
from controlplane.service.answers import NOT_RETRYABLE, BatchResult
from controlplane.service.gate import PoolGate
from controlplane.service.pools import FRESH, UNKNOWN
from controlplane.service.pressure import PressureGate, Verdict
from controlplane.service.pricing import PriceQuote, Pricing
from controlplane.service.records import (
    Record,
    RequestLog,
    float_bits,
)
from controlplane.service.stats import AdmissionStats
from controlplane.service.tenants import Tenant, TenantDirectory
from fastpath import Reason, TokenBucketTable

_OK = int(Reason.OK)
_BACKPRESSURE = int(Reason.BACKPRESSURE)
# reason -> whether retrying may cure it (answers' ``retryable`` column)
_RETRYABLE = np.array([r != _OK and r not in NOT_RETRYABLE for r in range(max(Reason) + 1)])
_CONCURRENCY = int(Reason.CONCURRENCY)
_ONE_BITS = float_bits(1.0)
_NEVER = 2**62  # a length no request reaches (unknown tenants are never placed)
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
        tenant_ids: list[str],
        request_ids: list[str],
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
        and count the fresh decisions. ``lanes`` has one entry per request
        (the named lane or "" for the tenant's default), one for all, or
        none; ``pool`` is the batch's, "" = each entry's own
        (``TenantDirectory.pool_for``). Repeated keys answer their earlier
        decision.

        Columns throughout: what differs per tenant and per (lane, pool)
        *pair* is resolved once and spread over the entries as integer
        columns; every fresh decision is a row of the request table's
        layout, filled column by column and stored in one call, and the
        answer's columns are read from the same rows. No Python object is
        made per request beyond the answer's lists."""
        n = len(request_ids)
        tenants = self._tenants
        long_default = tenants.policy.long_request_tokens
        # Per distinct tenant of the batch, resolved once.
        order = list(dict.fromkeys(tenant_ids))
        t_entry = [tenants.resolve(t) for t in order]
        t_early = [early_reason(e) for e in t_entry]
        t_shadow = [e is not None and tenants.shadow(e) for e in t_entry]
        t_slot = [-1 if e is None else e.slot for e in t_entry]
        t_lane = [tenants.lane_for("lane", "", e) for e in t_entry]
        t_long = [
            _NEVER if e is None else min(long_default, e.config.long_request_tokens or long_default)
            for e in t_entry
        ]  # fmt: skip
        if len(order) == 1:
            tix_l = [0] * n
        else:
            index = {t: j for j, t in enumerate(order)}
            tix_l = [index[t] for t in tenant_ids]
        tix = np.array(tix_l, dtype=np.intp)
        tkeys = np.array(
            [log.tkey_for(t, e is not None) for t, e in zip(order, t_entry, strict=True)],
            dtype=np.int64,
        )[tix]
        replayed = log.replay_rows(tkeys, tenant_ids, request_ids, now)
        fresh = np.ones(n, dtype=np.int8)
        if replayed:
            fresh[list(replayed)] = 0
        is_fresh = fresh.astype(bool)
        slots = np.array(t_slot, dtype=np.int64)[tix]
        early = np.array(t_early, dtype=np.int64)[tix]
        shadow = np.array(t_shadow, dtype=bool)[tix]
        prompt = np.array(prompt_tokens, dtype=np.int64)
        maxt = np.array(max_tokens, dtype=np.int64)

        # Each entry's (lane, pool) pair: its lane (named, else its tenant's
        # default; then length-aware placement), and that lane's pool.
        pair_ix: dict[tuple[str, str], int] = {}

        def pair_of(entry: Tenant | None, lane: str) -> int:
            lp = (lane, tenants.pool_for(entry, lane, pool))
            return pair_ix.setdefault(lp, len(pair_ix))

        if len(lanes) <= 1:  # a lane per tenant: pairs per tenant
            given = lanes[0] if lanes else ""
            t_pair = [pair_of(e, given or ln) for e, ln in zip(t_entry, t_lane, strict=True)]
            pair = np.array(t_pair, dtype=np.intp)[tix]
        else:
            combos: dict[tuple[int, str], int] = {}
            pair_l: list[int] = []
            for j, ln in zip(tix_l, lanes, strict=True):
                c = combos.get((j, ln))
                if c is None:
                    c = combos[j, ln] = pair_of(t_entry[j], ln or t_lane[j])
                pair_l.append(c)
            pair = np.array(pair_l, dtype=np.intp)
        long_ones = np.flatnonzero(is_fresh & (prompt + maxt > np.array(t_long)[tix]))
        if long_ones.size:
            pair_keys = list(pair_ix)
            for i in long_ones.tolist():
                entry = t_entry[tix_l[i]]
                if entry is not None:
                    lane = pair_keys[pair[i]][0]
                    placed = tenants.place(entry, lane, prompt_tokens[i], max_tokens[i])
                    if placed != lane:
                        pair[i] = pair_of(entry, placed)
        pair_keys = list(pair_ix)
        # One verdict per pair of the fresh entries, in batch order (the
        # batch-level answer reports the first).
        if replayed:
            fresh_pairs = [pair_keys[k] for k in dict.fromkeys(pair[is_fresh].tolist())]
            if not fresh_pairs:
                # only replays: the batch still reports its pool's pressure
                # now, from the first replay's recorded lane and pool
                i0 = min(replayed)
                names_l = log.names.names
                lane0 = names_l[replayed[i0][R.LANE]]
                pool0 = names_l[replayed[i0][R.POOL]] or tenants.pool_for(
                    t_entry[tix_l[i0]], lane0, pool
                )
                fresh_pairs = [(lane0, pool0)]
        else:
            fresh_pairs = [pair_keys[k] for k in dict.fromkeys(pair.tolist())]
        verdict_of = {
            lp: self._pressure.verdict(lp[0], lp[1], now) for lp in (*pair_keys, *fresh_pairs)
        }
        verdicts = {lp: verdict_of[lp] for lp in fresh_pairs}
        vlist = [verdict_of[lp] for lp in pair_keys]
        v_reason = np.array([v.reason for v in vlist], dtype=np.int64)[pair]
        v_retry = np.array([v.retry_ns for v in vlist], dtype=np.int64)[pair]
        v_score = np.array([v.score_ppm for v in vlist], dtype=np.int64)[pair]
        v_fresh = np.array([v.freshness for v in vlist], dtype=np.int64)[pair]
        v_shed = np.array([int(v.shed) for v in vlist], dtype=np.int64)[pair]
        v_cap = np.array([v.degraded_cap for v in vlist], dtype=np.int64)[pair]

        ok_tenant = is_fresh & (early == _OK)
        if not ok_tenant.all():  # an early refusal saw no pool: no verdict
            v_score[~ok_tenant] = 0
            v_fresh[~ok_tenant] = UNKNOWN
        maxt = np.where(ok_tenant & (v_cap > 0) & (maxt > v_cap), v_cap, maxt)
        pressed = ok_tenant & (v_reason != _OK) & ~shadow
        to_fast = ok_tenant & ~pressed
        gate_refused = np.zeros(n, dtype=bool)
        gate_retry = np.zeros(n, dtype=np.int64)
        pools = list(dict.fromkeys(p for _, p in pair_keys))
        pair_pool = np.array([pools.index(p) for _, p in pair_keys], dtype=np.intp)
        pool_ix = pair_pool[pair]
        batch_pools = list(dict.fromkeys(p for _, p in verdicts))
        if self._gate.enabled:
            # A batch never waits: what a pool has no room for is refused,
            # fail-open lanes (premium) served first, then the rest in batch
            # order. Each pool's share is planned for every entry sent to the
            # fast path (one it then refuses took none: a small overestimate).
            gated = np.flatnonzero(to_fast & ~shadow)
            if gated.size:
                lane_cfg = tenants.lanes
                # (an unknown tenant's fallback lane may not be configured)
                pair_fo = np.array(
                    [ln in lane_cfg and lane_cfg[ln].fail_open for ln, _ in pair_keys], dtype=bool
                )[pair[gated]]
                if pair_fo.any() and not pair_fo.all():  # a mix: those first
                    gated = gated[np.argsort(~pair_fo, kind="stable")]
                for k in dict.fromkeys(pool_ix[gated].tolist()):
                    mine = gated if len(pools) == 1 else gated[pool_ix[gated] == k]
                    fits = self._gate.plan(pools[k], now, prompt[mine].tolist())
                    if not all(fits):
                        refused = mine[~np.array(fits, dtype=bool)]
                        gate_refused[refused] = True
                        gate_retry[refused] = self._gate.retry_ns(pools[k], now)
                to_fast &= ~gate_refused
        out_reason = np.zeros(n, dtype=np.int64)
        out_reserved = np.zeros(n, dtype=np.int64)
        out_retry = np.zeros(n, dtype=np.int64)
        out_bucket = np.zeros(n, dtype=np.int64)
        out_hour = np.full(n, -1, dtype=np.int64)
        out_day = np.full(n, -1, dtype=np.int64)
        any_shadow = bool(shadow.any())
        self._table.admit_batch(
            now, np.where(to_fast, slots, -1), prompt, maxt, out_reason, out_reserved,
            out_retry, out_bucket, out_hour, out_day,
            shadow=shadow.astype(np.int64) if any_shadow else None,
        )  # fmt: skip
        # The reason each entry is answered with, and shadow mode's.
        reason = np.where(to_fast, out_reason, early)
        reason[pressed] = v_reason[pressed]
        reason[gate_refused] = _BACKPRESSURE
        shadow_reason = np.zeros(n, dtype=np.int64)
        if any_shadow:
            sh = to_fast & shadow
            shadow_reason = np.where(sh, np.where(v_reason != _OK, v_reason, reason), 0)
            reason[sh] = _OK
        admitted = to_fast & (reason == _OK)
        from_fast = to_fast & ~admitted  # refused by the fast path
        na = int(np.count_nonzero(admitted))
        rid0 = self._next_reservation
        self._next_reservation = rid0 + na
        # Prices: quoted once per pool of the batch, not per entry.
        prices = {p: self.pricing.quote(p, model, now) for p in batch_pools}
        names = log.names
        rows = np.zeros((n, R.FIELDS), dtype=np.int64)
        rows[:, R.STATE] = R.REJECTED
        rows[:, R.REASON] = reason
        rows[:, R.RETRY_NS] = gate_retry
        rows[pressed, R.RETRY_NS] = v_retry[pressed]
        rows[from_fast, R.RETRY_NS] = np.where(
            reason[from_fast] == _CONCURRENCY, self._concurrency_retry_ns, out_retry[from_fast]
        )
        rows[:, R.HOUR] = -1
        rows[:, R.DAY] = -1
        decided_fast = admitted | from_fast
        rows[decided_fast, R.BUCKET] = out_bucket[decided_fast]
        rows[decided_fast, R.HOUR] = out_hour[decided_fast]
        rows[decided_fast, R.DAY] = out_day[decided_fast]
        rows[:, R.LANE] = np.array([names.id(ln) for ln, _ in pair_keys], dtype=np.int64)[pair]
        rows[:, R.SLOT] = slots
        rows[:, R.DECIDED_NS] = now
        rows[:, R.MULTIPLIER] = _ONE_BITS
        rows[:, R.ACTUAL] = -1
        rows[:, R.ARRIVED_NS] = now
        rows[:, R.SHADOW_REASON] = shadow_reason
        rows[:, R.SCORE_PPM] = v_score
        rows[:, R.FRESHNESS] = v_fresh
        rows[pressed, R.SHED] = v_shed[pressed]
        rows[gate_refused, R.SHED] = 1
        if na:
            adm_pair = pair[admitted]
            quotes = [
                prices.get(p) or self.pricing.quote(p, model, now) for _, p in pair_keys
            ]  # fmt: skip
            rows[admitted, R.STATE] = R.OPEN
            rows[admitted, R.RESERVED] = out_reserved[admitted]
            rows[admitted, R.RID] = np.arange(rid0, rid0 + na, dtype=np.int64)
            rows[admitted, R.GRANTED] = out_reserved[admitted] - prompt[admitted]
            rows[admitted, R.POOL] = np.array([names.id(p) for _, p in pair_keys], dtype=np.int64)[
                adm_pair
            ]
            rows[admitted, R.MODEL] = names.id(model)
            rows[admitted, R.MULTIPLIER] = np.array(
                [float_bits(q.multiplier) for q in quotes], dtype=np.int64
            )[adm_pair]
            rows[admitted, R.WINDOW] = np.array([q.window_id for q in quotes], dtype=np.int64)[
                adm_pair
            ]
            rows[admitted, R.DEGRADED_CAP] = v_cap[admitted]
        # A fresh entry is marked degraded when its lane is, even if it was
        # refused (the sidecar learns the pool's state); a replay as before.
        degraded = (v_cap > 0) & ok_tenant
        if replayed:
            for i, prior in replayed.items():
                rows[i] = prior
            degraded[~is_fresh] = rows[~is_fresh, R.DEGRADED_CAP] > 0
        if self._gate.enabled and na:
            adm = np.flatnonzero(admitted)
            for k in dict.fromkeys(pool_ix[adm].tolist()):
                mine = adm if len(pools) == 1 else adm[pool_ix[adm] == k]
                self._gate.released_many(pools[k], now, prompt[mine].tolist())
        log.add_rows(tkeys, tenant_ids, request_ids, rows, fresh if replayed else None)
        counted = rows[is_fresh] if replayed else rows
        stats.count_reason_columns(counted[:, R.REASON], counted[:, R.SHADOW_REASON])
        # Entries of one batch may resolve to different pools: the batch-level
        # multiplier is the first fresh entry's (each admission's record, which
        # the ledger bills, locks its own pool's).
        first = next(iter(prices.values()), None)
        return self._columns(
            rows, is_fresh, degraded, verdicts, first.multiplier if first is not None else 1.0
        )

    def _columns(
        self,
        rows: npt.NDArray[np.int64],
        is_fresh: npt.NDArray[np.bool_],
        degraded: npt.NDArray[np.bool_],
        verdicts: dict[tuple[str, str], Verdict],
        multiplier: float,
    ) -> BatchResult:
        policy = self._tenants.policy
        reason = rows[:, R.REASON]
        caps = [v.degraded_cap for v in verdicts.values() if v.degraded_cap]
        some = next(iter(verdicts.values()), None)
        return BatchResult(
            decision=np.where(reason == _OK, _ADMIT, _REJECT).tolist(),
            reason=reason.tolist(),
            retry_after_ms=(-(-rows[:, R.RETRY_NS] // NS_PER_MS)).tolist(),
            reserved_tokens=rows[:, R.RESERVED].tolist(),
            reservation_id=rows[:, R.RID].tolist(),
            granted_max_tokens=rows[:, R.GRANTED].tolist(),
            bucket_remaining=rows[:, R.BUCKET].tolist(),
            hourly_remaining=rows[:, R.HOUR].tolist(),
            daily_remaining=rows[:, R.DAY].tolist(),
            duplicate=(~is_fresh).tolist(),
            shadow_reason=rows[:, R.SHADOW_REASON].tolist(),
            degraded=degraded.tolist(),
            retryable=_RETRYABLE[reason].tolist(),
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
