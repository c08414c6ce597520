"""The decision assembly: one request, or a whole batch, decided now.

A request goes through the same steps on either path:

1. the tenant screen (``early_reason``): unknown or disabled tenants are
   refused before anything is charged; a retry that can no longer meet its
   first attempt's deadline is refused too (service/deadlines.py);
2. its lane (length-aware placement) and that lane's pool;
3. the pool's verdict (``PressureGate.verdict``): backpressure may refuse
   (or shed) the request, degradation may cap its output;
4. the pool gate (``PoolGate.has_room``, a batch's share ``plan``);
5. the fast path: the tenant's bucket, quotas, concurrency and the global
   watermark (the compiled ``TokenBucketTable.admit`` / ``charge`` for one
   request, ``admit_batch`` for many: the same C function), then premium
   borrowing (:meth:`Decider.borrows`) and refusals under a share
   (:meth:`Decider.explain`);
6. ``conclude``: shadow mode, the reservation id, the price locked at
   admission, the retry hint, the record.

:meth:`Decider.decide` takes them for one request with scalars; a batch
takes each for all its entries at once in columns
(service/batch.py, its vectorised twin, one method per step). The rules are the
helpers here, called by both; where a batch needs a rule in columns, its
columnar form sits beside the scalar one (``Deadlines.late_columns`` beside
``late_if_past``). tests/unit/service/test_decide_twins.py holds the two
paths to the same answers and records through random histories. Why two
paths and not a batch of one: batch.py's docstring (measured).
Nothing here waits or dispatches: the dispatcher and the façade decide
what happens to a refusal that waiting could cure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from controlplane.domain import Decision, Degradation, Pressure
from controlplane.domain.scope import KeyScope
from controlplane.domain.units import MTOK_PER_TOKEN, NS_PER_MS, PPM
from controlplane.service import records as R
from controlplane.service.answers import BatchResult
from controlplane.service.batch import RETRYABLE, BatchDecision
from controlplane.service.batch_answer import store
from controlplane.service.deadlines import BatchRetries, Deadlines
from controlplane.service.gate import PoolGate
from controlplane.service.keyscope import check_batch_scope
from controlplane.service.pools import FRESH
from controlplane.service.pressure import PressureGate, Verdict
from controlplane.service.pricing import PriceQuote, Pricing
from controlplane.service.records import Record, RequestLog
from controlplane.service.shares import SHARED_REASONS, explain, remaining_offsets
from controlplane.service.signing import AdmissionSigner
from controlplane.service.stats import AdmissionStats
from controlplane.service.tenants import Tenant, TenantDirectory, early_reason
from fastpath import Reason, TokenBucketTable
from fastpath.codes import MAX_REQUEST_TOKENS

__all__ = ["WAITABLE", "Decider", "early_reason"]

_OK = int(Reason.OK)
_ADMIT = int(Decision.ADMIT)
_REJECT = int(Decision.REJECT)
_CONCURRENCY = int(Reason.CONCURRENCY)
_TOKEN_RATE = int(Reason.TOKEN_RATE)
_MAX_TOKENS = int(Reason.MAX_TOKENS)
# What a fail-open lane's request may borrow past (Decider.borrows).
_BORROWABLE = frozenset({_TOKEN_RATE, _MAX_TOKENS})
_OPEN_RESERVATIONS = int(Reason.OPEN_RESERVATIONS)
# reason -> the answer's decision enum
_DECISION = np.array([_ADMIT if r == _OK else _REJECT for r in range(max(Reason) + 1)])
# The answer's integer columns, in the order columns() unpacks them.
_ANSWER_COLS = [
    R.REASON, R.RETRY_NS, R.RESERVED, R.RID, R.GRANTED, R.BUCKET, R.HOUR, R.DAY, R.SHADOW_REASON,
]  # fmt: skip

# Refusals that waiting can cure: the tenant's bucket refills, a slot frees,
# in-flight tokens drain, the pool's load drops. Quotas and sizes cannot.
WAITABLE = frozenset(
    {Reason.TOKEN_RATE, Reason.CONCURRENCY, Reason.GLOBAL_WATERMARK, Reason.BACKPRESSURE}
)


class Charge(NamedTuple):
    """What the fast path answered for one request (``TokenBucketTable.admit``)."""

    reason: int
    reserved: int
    retry_ns: int
    bucket: int
    hour: int
    day: int


class Asked(NamedTuple):
    """The request a verdict is concluded for, where it goes and when it came."""

    lane: str
    slot: int
    pool: str
    model: str
    prompt: int
    arrived: int


class Decider:
    def __init__(
        self,
        *,
        table: TokenBucketTable,
        tenants: TenantDirectory,
        pressure: PressureGate,
        gate: PoolGate,
        pricing: Pricing,
        concurrency_retry_ns: int,
        deadlines: Deadlines,
        signer: AdmissionSigner,
        first_reservation: int = 1,
    ) -> None:
        self.deadlines = deadlines
        self.signer = signer
        self.table = table
        self.tenants = tenants
        self._pressure = pressure
        self.gate = gate
        self.pricing = pricing
        self.concurrency_retry_ns = concurrency_retry_ns
        # Reservation ids count up from ``first_reservation``: the service
        # starts them at its clock's microseconds, so that an id is not
        # given again after a restart or by another replica (the ledger
        # tells two admissions of one request id apart by it, docs/ledger.md).
        self._next_reservation = first_reservation
        # Under shares (several replicas): when a refused share may have grown.
        self.share_refresh_ns = 0

    def take_reservation_ids(self, count: int) -> int:
        """The first of ``count`` consecutive new reservation ids."""
        first = self._next_reservation
        self._next_reservation = first + count
        return first

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
        shadow = self.tenants.shadow(entry)
        if v.reason and not shadow:
            return self.pressure_refusal(v, lane, slot, now, arrived)
        if not shadow and not self.gate.has_room(
            pool, now, prompt, self.tenants.lanes[lane].fail_open
        ):
            return self.gate_refusal(v, lane, slot, pool, now, arrived)
        if shadow:
            charge = Charge(*self.table.charge(slot, now, prompt, max_tokens))
        else:
            reason, reserved, retry, bucket, hour, day = self.table.admit(
                slot, now, prompt, max_tokens
            )
            if reason in _BORROWABLE and self.borrows(lane, slot, now, prompt, max_tokens, reason):
                reason, reserved, retry, bucket, hour, day = self.borrow(
                    slot, now, prompt, max_tokens
                )
            if self.tenants.shares is not None:
                if reason in SHARED_REASONS:
                    reason, retry = self.explain(entry, reason, retry, prompt, max_tokens)
                hour, day = self.tenant_wide(entry, hour, day)
            charge = Charge(reason, reserved, retry, bucket, hour, day)
        ask = Asked(lane, slot, pool, model, prompt, arrived)
        rec = self.conclude(charge, ask, v, shadow=shadow, now=now, rid=self._next_reservation)
        if rec[R.STATE] == R.OPEN:
            self._next_reservation += 1
        return rec

    def borrows(
        self, lane: str, slot: int, now: int, prompt: int, max_tokens: int, reason: int
    ) -> bool:
        """Premium is protected by priority, not by refusal: a fail-open
        lane's request its tenant's bucket refuses (TOKEN_RATE, or MAX_TOKENS
        for a request larger than the bucket takes, twice its burst) while
        the pool gate has room for it (it let the request this far) is
        admitted, charged into debt: the bucket's level stays at one burst of
        debt at most, so once the burst passes the tenant's next requests
        wait one burst's refill, never longer. The tenant's rate binds its
        premium traffic where it matters, when the pool is full: then the
        gate holds or refuses it like anyone's, and other lanes' capacity is
        never taken by borrowing. Measured against borrowing within one
        burst (docs/gate.md, rule 8): premium 97.9 -> 99.0 % at 2x slower
        prefill, long prompts 78.5 -> 82.5 %, the other lanes within 0.6
        point.

        Not with the gate off (no pool room is known), and not past what a
        forced charge does not check: the global watermark, the tenant's
        concurrency and quotas, an operator's per-request cap and the
        absolute ceiling."""
        if not self.gate.enabled or not self.tenants.lanes[lane].fail_open:
            return False
        cfg = self.tenants.by_slot[slot].config
        per = cfg.max_tokens_per_request or 0
        cost = prompt + (min(max_tokens, per) if per else max_tokens)
        if reason == _MAX_TOKENS:
            if (per and prompt > per) or cost > MAX_REQUEST_TOKENS:
                return False
            if cost * MTOK_PER_TOKEN <= 2 * cfg.burst_tokens * MTOK_PER_TOKEN:
                return False  # within the bucket's size: another limit refused it
            state = self.table.snapshot(slot)
            for quota, used in ((cfg.hourly_quota, state["hour_used"]),
                                (cfg.daily_quota, state["day_used"])):  # fmt: skip
                if quota and used + cost > quota:
                    return False
            if cfg.max_concurrency and state["inflight"] >= cfg.max_concurrency:
                return False
        elif reason != _TOKEN_RATE:
            return False
        limit = self.tenants.policy.global_inflight_tokens
        return not limit or self.table.total_inflight_tokens() + cost <= limit

    def borrow(self, slot: int, now: int, prompt: int, max_tokens: int) -> tuple[int, ...]:
        """Charge a request the bucket refused (``borrows``): the cost is
        reserved whatever the level (floored at one burst of debt); refused
        only by the cap on open reservations, which charges nothing."""
        reason, reserved, _, bucket, hour, day = self.table.charge(
            slot, now, prompt, max_tokens
        )
        if reason == _OPEN_RESERVATIONS:
            return reason, 0, 0, bucket, hour, day
        return _OK, reserved, 0, bucket, hour, day

    def explain(
        self, entry: Tenant, reason: int, retry: int, prompt: int, max_tokens: int
    ) -> tuple[int, int]:
        """A refusal under this replica's share of the tenant's limits, as
        service/shares.py answers it."""
        share = self.tenants.share_of(entry)
        if share is None:
            return reason, retry
        return explain(
            entry.config, share, reason, retry, prompt, max_tokens,
            self.tenants.policy.global_inflight_tokens, self.share_refresh_ns,
        )  # fmt: skip

    def tenant_wide(self, entry: Tenant, hour: int, day: int) -> tuple[int, int]:
        """The fast path's quota ``remaining`` under a share (this replica's
        allowance less its use) as what remains of the tenant's whole quota."""
        cfg = entry.config
        share = self.tenants.share_of(entry)
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
        reason, reserved, _, bucket, hour, day = self.table.charge(
            entry.slot, now, prompt, generated
        )
        if reason == _OPEN_RESERVATIONS:
            return None
        v = self._pressure.verdict(lane, pool, now)
        charge = Charge(_OK, reserved, 0, bucket, hour, day)
        ask = Asked(lane, entry.slot, pool, model, prompt, now)
        rec = self.conclude(charge, ask, v, shadow=False, now=now, rid=self._next_reservation)
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
        reason, reserved, _, bucket, hour, day = self.table.charge(
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
            Reason.BACKPRESSURE, self.gate.retry_ns(pool, now), lane, slot, now, arrived,
            score_ppm=v.score_ppm, freshness=v.freshness, shed=1,
        )  # fmt: skip

    @staticmethod
    def pressure_refusal(v: Verdict, lane: str, slot: int, now: int, arrived: int) -> Record:
        return R.refused(
            v.reason, v.retry_ns, lane, slot, now, arrived,
            score_ppm=v.score_ppm, freshness=v.freshness, shed=int(v.shed),
        )  # fmt: skip

    def conclude(
        self, charge: Charge, ask: Asked, v: Verdict, *, shadow: bool, now: int, rid: int,
        price: PriceQuote | None = None, release: bool = True,
    ) -> Record:  # fmt: skip
        """The record of a fast-path verdict (``charge``) on the request
        ``ask``; an admission takes reservation id ``rid`` and the price in
        force (``price``, or quoted here), and is counted by the pool gate
        unless ``release`` is false (a batch counts its admissions at once).
        In shadow mode the request was charged whatever the verdict and is
        admitted with the reason it would have been refused for, except past
        the memory cap (OPEN_RESERVATIONS): the fast path charged nothing and
        the refusal is real."""
        reason, reserved, retry_ns, bucket, hour, day = charge
        lane, slot, pool, model, prompt, arrived = ask
        shadow_reason = 0
        if shadow and reason != _OPEN_RESERVATIONS:  # memory protection binds shadow too
            shadow_reason = v.reason or reason
            reason = _OK
        if reason == _OK:
            if release and self.gate.enabled:
                self.gate.released(pool, now, prompt, self.tenants.lanes[lane].fail_open)
            if price is None:
                price = self.pricing.quote(pool, model, now)
            return R.admitted(
                reserved, rid, reserved - prompt, bucket, hour, day, lane, slot, now, pool,
                model, price.multiplier, price.window_id, arrived, shadow_reason,
                v.degraded_cap, v.score_ppm, v.freshness,
            )  # fmt: skip
        if reason in (_CONCURRENCY, _OPEN_RESERVATIONS):
            # Nobody knows when a request ends (and frees its place): a configured hint.
            retry_ns = self.concurrency_retry_ns
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
        retries: BatchRetries | None = None,
    ) -> BatchResult:
        """Decide a validated batch with one call into the fast path; store
        and count the fresh decisions (the steps: service/batch.py).
        ``lanes`` has one entry per request (the named lane or "" for the
        tenant's default), one for all, or none; ``pool`` is the batch's,
        "" = each entry's own (``TenantDirectory.pool_for``). Repeated keys
        answer their earlier decision. ``scope``: a scoped sidecar key's; an
        entry it does not cover (``keyscope.check_scope``) fails the batch
        before anything is decided. ``retries``: the batch's retries
        (Deadlines.batch_retries): those that can no longer meet their first
        attempt's deadline are refused BACKPRESSURE, flagged late, before
        anything is charged; the others are due at their first attempt's
        arrival plus their SLO."""
        if not request_ids:  # a valid batch (N may be 0); the matrices need a row
            return BatchResult([], [], [], [], [], [], [], [], [], [], [], [], retryable=[])
        b = BatchDecision(self, tenant_ids, request_ids, prompt_tokens, max_tokens, model, pool,
                          now, log, retries)  # fmt: skip
        b.screen()  # 1. the tenant screen; replays; late retries
        b.place(lanes)  # 2. lanes (length-aware placement) and their pools
        if scope is not None:
            check_batch_scope(b, scope)  # before anything changes
        b.judge()  # 3. the pools' verdicts: backpressure, degradation
        b.gate()  # 4. the pool gate's share, premium first
        b.fast_path()  # 5. buckets, quotas, concurrency; borrowing; shares
        b.conclude()  # 6. shadow mode, reservations, retry hints, late flags
        return store(b, stats)  # 7. stored, counted, released; the answer

    def columns(
        self,
        rows: npt.NDArray[np.int64],
        is_fresh: npt.NDArray[np.bool_],
        degraded: npt.NDArray[np.bool_] | None,
        verdicts: dict[tuple[str, str], Verdict],
        multiplier: float,
        *,
        plain: bool = False,
    ) -> BatchResult:
        """The answer's columns from the batch's rows. ``degraded`` None: no
        entry is; ``plain``: every entry is a fresh admission (the columns
        that then hold one value are made without numpy)."""
        policy = self.tenants.policy
        n = len(rows)
        cols = rows[:, _ANSWER_COLS].T  # one copy, one row per answer column
        reason = cols[0]
        cols[1] = -(-cols[1] // NS_PER_MS)  # retry_after in whole ms, rounded up
        (
            reason_l, retry_ms, reserved, rid, granted, bucket, hour, day, shadow_l
        ) = cols.tolist()  # fmt: skip
        caps = [v.degraded_cap for v in verdicts.values() if v.degraded_cap]
        some = next(iter(verdicts.values()), None)
        return BatchResult(
            decision=[_ADMIT] * n if plain else _DECISION[reason].tolist(),
            reason=reason_l,
            retry_after_ms=retry_ms,
            reserved_tokens=reserved,
            reservation_id=rid,
            granted_max_tokens=granted,
            bucket_remaining=bucket,
            hourly_remaining=hour,
            daily_remaining=day,
            duplicate=[False] * n if plain else (~is_fresh).tolist(),
            shadow_reason=shadow_l,
            degraded=[False] * n if degraded is None else degraded.tolist(),
            # an admission is not retryable
            retryable=[False] * n
            if plain
            else (RETRYABLE[reason] & ((rows[:, R.SHED] & R.LATE_BIT) == 0)).tolist(),
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
