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
from controlplane.domain.scope import KeyScope
from controlplane.domain.units import MTOK_PER_TOKEN, NS_PER_MS, PPM
from controlplane.service import records as R
from controlplane.service.answers import NOT_RETRYABLE, BatchResult
from controlplane.service.deadlines import Deadlines
from controlplane.service.gate import PoolGate
from controlplane.service.keyscope import check_scope
from controlplane.service.pools import FRESH, UNKNOWN
from controlplane.service.pressure import PressureGate, Verdict
from controlplane.service.pricing import PriceQuote, Pricing
from controlplane.service.records import (
    Record,
    RequestLog,
    float_bits,
)
from controlplane.service.shares import SHARED_REASONS, explain, remaining_offsets
from controlplane.service.stats import AdmissionStats
from controlplane.service.tenants import Tenant, TenantDirectory
from fastpath import Reason, TokenBucketTable
from fastpath.codes import MAX_REQUEST_TOKENS

_OK = int(Reason.OK)
_ADMIT = int(Decision.ADMIT)
_REJECT = int(Decision.REJECT)
_BACKPRESSURE = int(Reason.BACKPRESSURE)
# reason -> whether retrying may cure it (answers' ``retryable`` column)
_RETRYABLE = np.array([r != _OK and r not in NOT_RETRYABLE for r in range(max(Reason) + 1)])
_CONCURRENCY = int(Reason.CONCURRENCY)
_TOKEN_RATE = int(Reason.TOKEN_RATE)
_MAX_TOKENS = int(Reason.MAX_TOKENS)
# What a fail-open lane's request may borrow past (Decider._borrows).
_BORROWABLE = frozenset({_TOKEN_RATE, _MAX_TOKENS})
_BORROWABLE_A = np.array(sorted(_BORROWABLE), dtype=np.int64)
_OPEN_RESERVATIONS = int(Reason.OPEN_RESERVATIONS)
_SHARED = np.array(sorted(SHARED_REASONS), dtype=np.int64)
# reason -> the answer's decision enum
_DECISION = np.array([_ADMIT if r == _OK else _REJECT for r in range(max(Reason) + 1)])
# The answer's integer columns, in the order _columns unpacks them.
_ANSWER_COLS = [
    R.REASON, R.RETRY_NS, R.RESERVED, R.RID, R.GRANTED, R.BUCKET, R.HOUR, R.DAY, R.SHADOW_REASON,
]  # fmt: skip
# Per-tenant matrix columns (decide_batch).
_T_TKEY, _T_SLOT, _T_EARLY, _T_SHADOW, _T_LONG = range(5)
# Per-pair matrix columns: the verdict and the lane's facts.
_P_REASON, _P_RETRY, _P_SHED, _P_CAP, _P_POOL, _P_FAIL_OPEN = range(6)
_ONE_BITS = float_bits(1.0)
_NEVER = 2**62  # a length no request reaches (unknown tenants are never placed)

# Refusals that waiting can cure: the tenant's bucket refills, a slot frees,
# in-flight tokens drain, the pool's load drops. Quotas and sizes cannot.
WAITABLE = frozenset(
    {Reason.TOKEN_RATE, Reason.CONCURRENCY, Reason.GLOBAL_WATERMARK, Reason.BACKPRESSURE}
)


def early_reason(entry: Tenant | None) -> int:
    """Refusals that need no bucket: the tenant is unknown or disabled."""
    if entry is None:
        return Reason.UNKNOWN_TENANT
    if not entry.config.enabled:
        return Reason.TENANT_DISABLED
    return _OK


def _check_batch_scope(
    scope: KeyScope,
    order: list[str],
    t_entry: list[Tenant | None],
    tix_l: list[int],
    tenant_ids: list[str],
    pair: npt.NDArray[np.intp],
    pair_keys: list[tuple[str, str]],
    decided: npt.NDArray[np.bool_],
) -> None:
    """A scoped key's batch: the pools its entries go to and the tenants
    they are charged to, per (lane, pool) pair and per tenant (a handful);
    entries are walked only when one of those is outside the scope, to
    name the first entry that would be decided with it."""
    bad_pairs = {k for k, (_, p) in enumerate(pair_keys) if p and p not in scope.pools}
    bad_tenants = {
        j for j, (t, e) in enumerate(zip(order, t_entry, strict=True))
        if e is not None and e.config.tenant_id != t and e.config.tenant_id not in scope.tenants
    }  # fmt: skip
    if not bad_pairs and not bad_tenants:
        return
    for i in np.flatnonzero(decided).tolist():
        j, k = tix_l[i], int(pair[i])
        entry = t_entry[j]
        if (j in bad_tenants or k in bad_pairs) and entry is not None:
            check_scope(scope, tenant_ids[i], entry, pair_keys[k][1], f"entry {i}'s",
                        f"tenant_id[{i}]")  # fmt: skip


class Decider:
    def __init__(
        self,
        table: TokenBucketTable,
        tenants: TenantDirectory,
        pressure: PressureGate,
        gate: PoolGate,
        pricing: Pricing,
        concurrency_retry_ns: int,
        deadlines: Deadlines,
    ) -> None:
        self._deadlines = deadlines
        self._table = table
        self._tenants = tenants
        self._pressure = pressure
        self._gate = gate
        self.pricing = pricing
        self._concurrency_retry_ns = concurrency_retry_ns
        self._next_reservation = 1
        # Under shares (several replicas): when a refused share may have grown.
        self.share_refresh_ns = 0

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
        if not shadow and not self._gate.has_room(
            pool, now, prompt, self._tenants.lanes[lane].fail_open
        ):
            return self.gate_refusal(v, lane, slot, pool, now, arrived)
        if shadow:
            reason, reserved, retry, bucket, hour, day = self._table.charge(
                slot, now, prompt, max_tokens
            )
        else:
            reason, reserved, retry, bucket, hour, day = self._table.admit(
                slot, now, prompt, max_tokens
            )
            if reason in _BORROWABLE and self._borrows(lane, slot, now, prompt, max_tokens, reason):
                reason, reserved, retry, bucket, hour, day = self._borrow(
                    slot, now, prompt, max_tokens
                )
            if self._tenants.shares is not None:
                if reason in SHARED_REASONS:
                    reason, retry = self._explain(entry, reason, retry, prompt, max_tokens)
                hour, day = self._tenant_wide(entry, hour, day)
        rec = self.conclude(
            reason, reserved, retry, bucket, hour, day, prompt, shadow, v, lane, slot,
            pool, model, now, arrived, self._next_reservation, None,
        )  # fmt: skip
        if rec[R.STATE] == R.OPEN:
            self._next_reservation += 1
        return rec

    def _borrows(
        self, lane: str, slot: int, now: int, prompt: int, max_tokens: int, reason: int
    ) -> bool:
        """Premium is protected by priority, not by refusal: a fail-open
        lane's request its tenant's bucket refuses while the pool has room
        (the gate let it this far) borrows from the bucket instead.

        - TOKEN_RATE: when the debt stays within one burst, so the tenant's
          rate still bounds it over time (the next requests wait for the
          refill that repays it);
        - MAX_TOKENS for a request larger than twice the burst, the largest
          the bucket takes, and nothing else (not a per-request cap, a
          quota, the watermark or the absolute ceiling): when the bucket is
          full, which it then leaves one burst into debt.

        Not past the global watermark, the tenant's concurrency or its
        quotas, which a forced charge does not check."""
        if not self._tenants.lanes[lane].fail_open:
            return False
        cfg = self._tenants.by_slot[slot].config
        per = cfg.max_tokens_per_request or 0
        cost = prompt + (min(max_tokens, per) if per else max_tokens)
        burst = cfg.burst_tokens * MTOK_PER_TOKEN
        level = self._table.level_mtok(slot, now)
        if reason == _TOKEN_RATE:
            if level - cost * MTOK_PER_TOKEN < -burst:
                return False
        elif reason == _MAX_TOKENS:
            if (per and prompt > per) or cost > MAX_REQUEST_TOKENS or level < burst:
                return False
            if cost * MTOK_PER_TOKEN <= 2 * burst:
                return False  # within the bucket's size: another limit refused it
            state = self._table.snapshot(slot)
            for quota, used in ((cfg.hourly_quota, state["hour_used"]),
                                (cfg.daily_quota, state["day_used"])):  # fmt: skip
                if quota and used + cost > quota:
                    return False
            if cfg.max_concurrency and state["inflight"] >= cfg.max_concurrency:
                return False
        else:
            return False
        limit = self._tenants.policy.global_inflight_tokens
        return not limit or self._table.total_inflight_tokens() + cost <= limit

    def _borrow(self, slot: int, now: int, prompt: int, max_tokens: int) -> tuple[int, ...]:
        """Charge a request the bucket refused (``_borrows``): the cost is
        reserved whatever the level (floored at one burst of debt); refused
        only by the cap on open reservations, which charges nothing."""
        reason, reserved, _, bucket, hour, day = self._table.charge(
            slot, now, prompt, max_tokens
        )
        if reason == _OPEN_RESERVATIONS:
            return reason, 0, 0, bucket, hour, day
        return _OK, reserved, 0, bucket, hour, day

    def _explain(
        self, entry: Tenant, reason: int, retry: int, prompt: int, max_tokens: int
    ) -> tuple[int, int]:
        """A refusal under this replica's share of the tenant's limits, as
        service/shares.py answers it."""
        share = self._tenants.share_of(entry)
        if share is None:
            return reason, retry
        return explain(
            entry.config, share, reason, retry, prompt, max_tokens,
            self._tenants.policy.global_inflight_tokens, self.share_refresh_ns,
        )  # fmt: skip

    def _tenant_wide(self, entry: Tenant, hour: int, day: int) -> tuple[int, int]:
        """The fast path's quota ``remaining`` under a share (this replica's
        allowance less its use) as what remains of the tenant's whole quota."""
        cfg = entry.config
        share = self._tenants.share_of(entry)
        if share is None or not (cfg.hourly_quota or cfg.daily_quota):
            return hour, day
        dh, dd = remaining_offsets(cfg, share)
        return (max(0, hour + dh) if hour >= 0 else hour, max(0, day + dd) if day >= 0 else day)

    def book(
        self, entry: Tenant, lane: str, prompt: int, generated: int, model: str, pool: str,
        now: int,
    ) -> Record | None:
        """The open record of a request a sidecar admitted while this server
        was unreachable (CompleteRequest.offline): it ran already, so it is
        charged whatever the bucket's level, quotas and concurrency (as shadow
        mode charges), priced now. None when the memory cap on open
        reservations binds (the fast path charged nothing)."""
        reason, reserved, _, bucket, hour, day = self._table.charge(
            entry.slot, now, prompt, generated
        )
        if reason == _OPEN_RESERVATIONS:
            return None
        v = self._pressure.verdict(lane, pool, now)
        rec = self.conclude(
            _OK, reserved, 0, bucket, hour, day, prompt, False, v, lane, entry.slot, pool, model,
            now, now, self._next_reservation, None,
        )  # fmt: skip
        self._next_reservation += 1
        return rec

    def restore(
        self, entry: Tenant, lane: str, prompt: int, granted: int, model: str, pool: str,
        multiplier: float, window: int, rid: int, arrived: int, now: int,
    ) -> Record | None:  # fmt: skip
        """The open record of a reservation another replica admitted
        (restore.py): charged by force, as :meth:`book` charges, at the
        multiplier and window locked at its admission; ``rid`` kept (0: a
        new one). None when the memory cap on open reservations binds."""
        reason, reserved, _, bucket, hour, day = self._table.charge(
            entry.slot, now, prompt, granted
        )
        if reason == _OPEN_RESERVATIONS:
            return None
        if not rid:
            rid = self._next_reservation
            self._next_reservation += 1
        v = self._pressure.verdict(lane, pool, now)
        return R.admitted(
            reserved, rid, reserved - prompt, bucket, hour, day, lane, entry.slot, now, pool,
            model, multiplier, window, arrived, 0, 0, v.score_ppm, v.freshness,
        )  # fmt: skip

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
        been refused for, except past the memory cap (OPEN_RESERVATIONS):
        the fast path charged nothing and the refusal is real."""
        shadow_reason = 0
        if shadow and reason != _OPEN_RESERVATIONS:  # memory protection binds shadow too
            shadow_reason = v.reason or reason
            reason = _OK
        if reason == _OK:
            if release and self._gate.enabled:
                self._gate.released(pool, now, prompt, self._tenants.lanes[lane].fail_open)
            if price is None:
                price = self.pricing.quote(pool, model, now)
            return R.admitted(
                reserved, rid, reserved - prompt, bucket, hour, day, lane, slot, now, pool,
                model, price.multiplier, price.window_id, arrived, shadow_reason,
                v.degraded_cap, v.score_ppm, v.freshness,
            )  # fmt: skip
        if reason in (_CONCURRENCY, _OPEN_RESERVATIONS):
            # Nobody knows when a request ends (and frees its place): a configured hint.
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
        scope: KeyScope | None = None,
        late_retries: dict[int, int] | None = None,
    ) -> BatchResult:
        """Decide a validated batch with one call into the fast path; store
        and count the fresh decisions. ``lanes`` has one entry per request
        (the named lane or "" for the tenant's default), one for all, or
        none; ``pool`` is the batch's, "" = each entry's own
        (``TenantDirectory.pool_for``). Repeated keys answer their earlier
        decision. ``scope``: a scoped sidecar key's; an entry it does not
        cover (``keyscope.check_scope``) fails the batch before anything is
        decided. ``late_retries``: entry -> retry_after of retries that can
        no longer meet their first attempt's deadline (deadlines.py),
        refused BACKPRESSURE, flagged late, before anything is charged.

        Columns throughout, with as few numpy calls as possible (each costs
        about a microsecond whatever its length): what differs per tenant
        is one small matrix, spread over the entries with one index; each
        (lane, pool) *pair* gets template rows of the request table's layout
        (admitted, refused after its verdict, refused before any), and an
        entry's row starts as its template, indexed in one call, before the
        few per-entry columns are written. The rows are stored in one call
        and the answer's columns read from them in one. No Python object is
        made per request beyond the answer's lists."""
        n = len(request_ids)
        if n == 0:  # a valid batch (N may be 0); the matrices below need a row
            return BatchResult([], [], [], [], [], [], [], [], [], [], [], [], retryable=[])
        tenants = self._tenants
        long_default = tenants.policy.long_request_tokens
        # Per distinct tenant of the batch, resolved once: a row of _T_*.
        order = list(dict.fromkeys(tenant_ids))
        t_entry = [tenants.resolve(t) for t in order]
        t_lane = [tenants.lane_for("lane", "", e) for e in t_entry]
        tmat = np.array(
            [
                (
                    log.tkey_for(t, e is not None), -1, early_reason(e), 0, _NEVER
                ) if e is None else (
                    log.tkey_for(t, True), e.slot, early_reason(e), tenants.shadow(e),
                    min(long_default, e.config.long_request_tokens or long_default),
                )
                for t, e in zip(order, t_entry, strict=True)
            ],
            dtype=np.int64,
        )  # fmt: skip
        if len(order) == 1:
            tix_l = [0] * n
        else:
            index = {t: j for j, t in enumerate(order)}
            tix_l = [index[t] for t in tenant_ids]
        per = tmat[tix_l]  # (n, _T_FIELDS)
        tkeys = np.ascontiguousarray(per[:, _T_TKEY])
        replayed = log.replay_rows(tkeys, tenant_ids, request_ids, now)
        slots = per[:, _T_SLOT]
        early = per[:, _T_EARLY]
        if late_retries:
            gone = list(late_retries)
            early = early.copy()
            early[gone] = np.where(early[gone] == _OK, _BACKPRESSURE, early[gone])
        shadow = per[:, _T_SHADOW].astype(bool)
        any_shadow = bool(tmat[:, _T_SHADOW].any())
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
            pair = np.array(t_pair, dtype=np.intp)[tix_l]
        else:
            combos: dict[tuple[int, str], int] = {}
            pair_l: list[int] = []
            for j, ln in zip(tix_l, lanes, strict=True):
                c = combos.get((j, ln))
                if c is None:
                    c = combos[j, ln] = pair_of(t_entry[j], ln or t_lane[j])
                pair_l.append(c)
            pair = np.array(pair_l, dtype=np.intp)
        asked = pair.copy()  # the lanes asked for, before placement: their SLOs apply
        if (prompt + maxt > per[:, _T_LONG]).any():
            pair_keys = list(pair_ix)
            for i in np.flatnonzero(prompt + maxt > per[:, _T_LONG]).tolist():
                entry = t_entry[tix_l[i]]
                if entry is not None and i not in replayed:
                    lane = pair_keys[pair[i]][0]
                    placed = tenants.place(entry, lane, prompt_tokens[i], max_tokens[i])
                    if placed != lane:
                        pair[i] = pair_of(entry, placed)
        pair_keys = list(pair_ix)
        if replayed:
            fresh = np.ones(n, dtype=np.int8)
            fresh[list(replayed)] = 0
            is_fresh = fresh.astype(bool)
            pairs_seen = pair[is_fresh]
        else:
            is_fresh = np.ones(n, dtype=bool)
            pairs_seen = pair
        if scope is not None:  # before anything changes
            _check_batch_scope(
                scope, order, t_entry, tix_l, tenant_ids, pair, pair_keys, is_fresh & (early == _OK)
            )
        # One verdict per pair of the fresh entries, in batch order (the
        # batch-level answer reports the first).
        fresh_pairs = [pair_keys[k] for k in dict.fromkeys(pairs_seen.tolist())]
        if not fresh_pairs:
            # only replays: the batch still reports its pool's pressure now,
            # from the first replay's recorded lane and pool
            i0 = min(replayed)
            names_l = log.names.names
            lane0 = names_l[replayed[i0][R.LANE]]
            pool0 = names_l[replayed[i0][R.POOL]] or tenants.pool_for(
                t_entry[tix_l[i0]], lane0, pool
            )
            fresh_pairs = [(lane0, pool0)]
        verdict_of = {
            lp: self._pressure.verdict(lp[0], lp[1], now) for lp in (*pair_keys, *fresh_pairs)
        }
        verdicts = {lp: verdict_of[lp] for lp in fresh_pairs}
        pools = list(dict.fromkeys(p for _, p in pair_keys))
        batch_pools = list(dict.fromkeys(p for _, p in verdicts))
        # Prices: quoted once per pool of the batch, not per entry.
        prices = {p: self.pricing.quote(p, model, now) for p in pools}
        lane_cfg = tenants.lanes
        names = log.names
        model_id = names.id(model)
        # Per pair: its verdict and lane facts (a row of _P_*), and template
        # rows for its entries: admitted, refused after the verdict, refused
        # before it (an unknown or disabled tenant: no pool was asked).
        pmat_rows = []
        templates = np.zeros((3 * len(pair_keys), R.FIELDS), dtype=np.int64)
        for k, (ln, p) in enumerate(pair_keys):
            v = verdict_of[ln, p]
            price = prices[p]
            pmat_rows.append(
                (
                    v.reason, v.retry_ns, int(v.shed), v.degraded_cap, pools.index(p),
                    ln in lane_cfg and lane_cfg[ln].fail_open,
                )
            )  # fmt: skip
            t = templates[3 * k : 3 * k + 3]
            t[:, R.STATE] = R.REJECTED
            t[:, R.LANE] = names.id(ln)
            t[:, R.DECIDED_NS] = now
            t[:, R.ARRIVED_NS] = now
            t[:, R.MULTIPLIER] = _ONE_BITS
            t[:, R.ACTUAL] = -1
            t[:2, R.SCORE_PPM] = v.score_ppm
            t[:2, R.FRESHNESS] = v.freshness
            t[2, R.FRESHNESS] = UNKNOWN
            t[0, R.STATE] = R.OPEN
            t[0, R.POOL] = names.id(p)
            t[0, R.MODEL] = model_id
            t[0, R.MULTIPLIER] = float_bits(price.multiplier)
            t[0, R.WINDOW] = price.window_id
            t[0, R.DEGRADED_CAP] = v.degraded_cap
        pv = np.array(pmat_rows, dtype=np.int64)[pair]  # (n, _P_FIELDS)
        v_reason = pv[:, _P_REASON]
        v_cap = pv[:, _P_CAP]
        pool_ix = pv[:, _P_POOL]

        ok_tenant = is_fresh & (early == _OK)
        if v_cap.any():
            maxt = np.where(ok_tenant & (v_cap > 0) & (maxt > v_cap), v_cap, maxt)
        pressed = ok_tenant & (v_reason != _OK)
        if any_shadow:
            pressed &= ~shadow
        any_pressed = bool(pressed.any())
        to_fast = ok_tenant & ~pressed if any_pressed else ok_tenant.copy()
        gate_refused: npt.NDArray[np.bool_] | None = None
        gate_retry = np.zeros(0, dtype=np.int64)
        if self._gate.enabled:
            # A batch never waits: what a pool has no room for is refused,
            # fail-open lanes (premium) served first, then the rest in batch
            # order. Each pool's share is planned for every entry sent to the
            # fast path (one it then refuses took none: a small overestimate).
            gated = np.flatnonzero(to_fast & ~shadow if any_shadow else to_fast)
            if gated.size:
                fail_open = pv[gated, _P_FAIL_OPEN]
                if fail_open.any() and not fail_open.all():  # a mix: those first
                    gated = gated[np.argsort(1 - fail_open, kind="stable")]
                for k in dict.fromkeys(pool_ix[gated].tolist()):
                    mine = gated if len(pools) == 1 else gated[pool_ix[gated] == k]
                    first = pv[mine, _P_FAIL_OPEN].astype(bool).tolist()
                    fits = self._gate.plan(pools[k], now, prompt[mine].tolist(), first)
                    if not all(fits):
                        refused = mine[~np.array(fits, dtype=bool)]
                        if gate_refused is None:
                            gate_refused = np.zeros(n, dtype=bool)
                            gate_retry = np.zeros(n, dtype=np.int64)
                        gate_refused[refused] = True
                        gate_retry[refused] = self._gate.retry_ns(pools[k], now)
                if gate_refused is not None:
                    to_fast &= ~gate_refused
        # the fast path writes only the entries it decides: the others keep
        # these starting values, a refused row's (bucket 0, quotas -1)
        out = np.zeros((6, n), dtype=np.int64)
        out[4:] = -1
        out_reason, out_reserved, out_retry, out_bucket, out_hour, out_day = out
        fast_ok = self._table.admit_batch(
            now, np.where(to_fast, slots, -1), prompt, maxt, out_reason, out_reserved,
            out_retry, out_bucket, out_hour, out_day,
            shadow=per[:, _T_SHADOW] if any_shadow else None,
        )  # fmt: skip
        # Premium borrows what its bucket refuses while the pool has room
        # (_borrows): the entries the gate let through, one by one (rare);
        # nothing to look at when the fast path admitted all it was given.
        borrowers = (
            to_fast & np.isin(out_reason, _BORROWABLE_A) & (pv[:, _P_FAIL_OPEN] != 0)
            if fast_ok < np.count_nonzero(to_fast)
            else np.zeros(0, dtype=bool)
        )
        if any_shadow and borrowers.size:
            borrowers &= ~shadow
        for i in np.flatnonzero(borrowers).tolist():
            slot = int(slots[i])
            lane = pair_keys[pair[i]][0]
            if self._borrows(lane, slot, now, int(prompt[i]), int(maxt[i]), int(out_reason[i])):
                (out_reason[i], out_reserved[i], out_retry[i], out_bucket[i], out_hour[i],
                 out_day[i]) = self._borrow(slot, now, int(prompt[i]), int(maxt[i]))  # fmt: skip
        if self._tenants.shares is not None:  # refusals under a share (shares.py)
            if any(e is not None and (e.config.hourly_quota or e.config.daily_quota)
                   for e in t_entry):  # fmt: skip
                offsets = np.array(
                    [(0, 0) if e is None else self._tenant_wide(e, 0, 0) for e in t_entry],
                    dtype=np.int64,
                )[tix_l]
                for col, off in ((out_hour, offsets[:, 0]), (out_day, offsets[:, 1])):
                    col[:] = np.where(to_fast & (col >= 0), np.maximum(0, col + off), col)
            shared = np.flatnonzero(to_fast & np.isin(out_reason, _SHARED))
            for i in shared.tolist():
                entry = t_entry[tix_l[i]]
                assert entry is not None  # decided by the fast path: a known tenant
                out_reason[i], out_retry[i] = self._explain(
                    entry, int(out_reason[i]), int(out_retry[i]), prompt_tokens[i], int(maxt[i])
                )
        # The reason each entry is answered with, and shadow mode's.
        reason = np.where(to_fast, out_reason, early)
        if any_pressed:
            reason[pressed] = v_reason[pressed]
        if gate_refused is not None:
            reason[gate_refused] = _BACKPRESSURE
        shadow_reason = None
        if any_shadow:
            # memory protection refuses shadow entries too (the fast path charged nothing)
            sh = to_fast & shadow & (out_reason != _OPEN_RESERVATIONS)
            shadow_reason = np.where(sh, np.where(v_reason != _OK, v_reason, reason), 0)
            reason[sh] = _OK
        admitted = to_fast & (reason == _OK)
        na = int(np.count_nonzero(admitted))
        rid0 = self._next_reservation
        self._next_reservation = rid0 + na

        # Rows: the templates, then the per-entry columns.
        all_admitted = na == n
        if all_admitted:
            rows = templates[3 * pair]
        else:
            rows = templates[3 * pair + np.where(admitted, 0, np.where(ok_tenant, 1, 2))]
        rows[:, R.REASON] = reason
        rows[:, R.SLOT] = slots
        if all_admitted:
            rows[:, R.RESERVED] = out_reserved
            rows[:, R.RID] = np.arange(rid0, rid0 + na, dtype=np.int64)
            rows[:, R.GRANTED] = out_reserved - prompt
        else:
            rows[:, R.RESERVED] = np.where(admitted, out_reserved, 0)
            rows[admitted, R.RID] = np.arange(rid0, rid0 + na, dtype=np.int64)
            rows[:, R.GRANTED] = np.where(admitted, out_reserved - prompt, 0)
            from_fast = to_fast & ~admitted  # refused by the fast path
            hinted = (out_reason == _CONCURRENCY) | (out_reason == _OPEN_RESERVATIONS)
            retry = np.where(from_fast, np.where(hinted, self._concurrency_retry_ns, out_retry), 0)
            if any_pressed:
                retry[pressed] = pv[pressed, _P_RETRY]
                rows[pressed, R.SHED] = pv[pressed, _P_SHED]
            if gate_refused is not None:
                retry[gate_refused] = gate_retry[gate_refused]
                rows[gate_refused, R.SHED] = 1
            rows[:, R.RETRY_NS] = retry
            for i, retry_ns in (late_retries or {}).items():
                if rows[i, R.REASON] == _BACKPRESSURE and is_fresh[i]:
                    rows[i, R.RETRY_NS] = retry_ns
                    rows[i, R.SHED] = R.SHED_BIT | R.LATE_BIT
            # refusals whose retry could not be released in time for their
            # deadline are late: not retryable (service/deadlines.py)
            waitable = ok_tenant & ~admitted & _RETRYABLE[reason]
            if self._gate.enabled and waitable.any():
                late = self._deadlines.late_columns(pair_keys, asked, pair, waitable, retry, prompt)
                rows[late, R.SHED] |= R.LATE_BIT
        rows[:, R.BUCKET] = out_bucket
        rows[:, R.HOUR] = out_hour
        rows[:, R.DAY] = out_day
        if shadow_reason is not None:
            rows[:, R.SHADOW_REASON] = shadow_reason
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
                first = pv[mine, _P_FAIL_OPEN].astype(bool).tolist()
                self._gate.released_many(pools[k], now, prompt[mine].tolist(), first)
        log.add_rows(tkeys, tenant_ids, request_ids, rows, fresh if replayed else None)
        stats.count_rows(
            rows[is_fresh] if replayed else rows, names.names, len(tenants.by_slot), any_shadow
        )
        # Entries of one batch may resolve to different pools: the batch-level
        # multiplier is the first fresh entry's (each admission's record, which
        # the ledger bills, locks its own pool's).
        first = prices.get(batch_pools[0]) if batch_pools else None
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
        cols = rows[:, _ANSWER_COLS].T  # one copy, one row per answer column
        reason = cols[0]
        cols[1] = -(-cols[1] // NS_PER_MS)  # retry_after in whole ms, rounded up
        (
            reason_l, retry_ms, reserved, rid, granted, bucket, hour, day, shadow_l
        ) = cols.tolist()  # fmt: skip
        caps = [v.degraded_cap for v in verdicts.values() if v.degraded_cap]
        some = next(iter(verdicts.values()), None)
        return BatchResult(
            decision=_DECISION[reason].tolist(),
            reason=reason_l,
            retry_after_ms=retry_ms,
            reserved_tokens=reserved,
            reservation_id=rid,
            granted_max_tokens=granted,
            bucket_remaining=bucket,
            hourly_remaining=hour,
            daily_remaining=day,
            duplicate=(~is_fresh).tolist(),
            shadow_reason=shadow_l,
            degraded=degraded.tolist(),
            retryable=(_RETRYABLE[reason] & ((rows[:, R.SHED] & R.LATE_BIT) == 0)).tolist(),
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
