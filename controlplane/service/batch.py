"""The vectorised twin of ``Decider.decide`` (service/decider.py): one
AdmitStream batch decided in columns, each step of the scalar decision
taken for the whole batch. The scalar path is the reference; the twin
tests hold this one to it (tests/unit/service/test_decide_twins.py: a
unary Admit and a batch of one through random histories;
tests/unit/service/test_batch_twin.py: random batches against their
entries decided one by one).

Long because: the steps of one decision are one object's methods, in the
order they run, each beside the scalar rule it mirrors.

A batch is one :class:`BatchDecision`, its methods the steps in order:
``screen`` (the tenant screen, replays, late retries), ``place`` (lanes,
length-aware placement, pools), ``judge`` (the pool's verdict: the
degradation cap and the pressure refusal), ``gate`` (the pool gate's share,
fail-open lanes first; a batch never waits), ``fast_path`` (buckets,
quotas, concurrency and the global watermark in one call into the same
compiled function a unary request uses, then premium borrowing),
``shares`` (refusals under a share, tenant-wide quotas), ``conclude``
(the shadow reason, reservation ids, the concurrency retry hint, late
flags), then batch_answer.store (the gate release, the rows stored and
counted, the answer). Each rule is the scalar one, or its columnar form
beside it (``Deadlines.late_columns`` beside ``late_if_past``).

Why two paths: ~40 numpy calls of about a microsecond each, which a batch
of a hundred shares and a single request pays alone (21 µs against 109 µs,
docs/benchmarks-history.md "The decision written once"). Per tenant one small matrix,
per (lane, pool) pair template rows of the request table's layout; no
Python object per request beyond the answer's lists.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from controlplane.service import records as R
from controlplane.service.answers import NOT_RETRYABLE
from controlplane.service.batch_rules import Rules
from controlplane.service.deadlines import BatchRetries
from controlplane.service.demand import CAPACITY_REASONS
from controlplane.service.pools import UNKNOWN
from controlplane.service.pressure import Verdict
from controlplane.service.pricing import PriceQuote
from controlplane.service.records import RequestLog, float_bits
from controlplane.service.shares import SHARED_REASONS
from controlplane.service.tenants import Tenant, early_reason
from fastpath import Reason

_OK = int(Reason.OK)
_BACKPRESSURE = int(Reason.BACKPRESSURE)


def _reason_table(reasons: Iterable[int]) -> npt.NDArray[np.bool_]:
    """A set of reasons as a table indexed by reason: ``table[reason]`` is one
    gather, where np.isin costs ~15 µs of set-up per call on a small batch."""
    table = np.zeros(max(Reason) + 1, dtype=bool)
    table[sorted(int(r) for r in reasons)] = True
    return table


_CAPACITY = _reason_table(CAPACITY_REASONS)
_CONCURRENCY = int(Reason.CONCURRENCY)
_OPEN_RESERVATIONS = int(Reason.OPEN_RESERVATIONS)
# reason -> whether retrying may cure it (answers' ``retryable`` column)
RETRYABLE = np.array([r != _OK and r not in NOT_RETRYABLE for r in range(max(Reason) + 1)])
# What a fail-open lane's request may borrow past (Decider.borrows).
_BORROWABLE = _reason_table((Reason.TOKEN_RATE, Reason.MAX_TOKENS))
_SHARED = _reason_table(SHARED_REASONS)
# Per-tenant matrix columns.
_T_TKEY, _T_SLOT, _T_EARLY, _T_SHADOW, _T_LONG = range(5)
# Per-pair matrix columns: the verdict and the lane's facts.
_P_REASON, _P_RETRY, _P_SHED, _P_CAP, _P_POOL, _P_FAIL_OPEN = range(6)
_ONE_BITS = float_bits(1.0)
_NEVER = 2**62  # a length no request reaches (unknown tenants are never placed)


class BatchDecision:
    """The state of one batch between its steps (module docstring)."""

    # inputs
    tenant_ids: list[str]
    request_ids: list[str]
    prompt_tokens: Sequence[int]
    max_tokens: Sequence[int]
    n: int
    # screen: per distinct tenant, and spread over the entries
    order: list[str]
    t_entry: list[Tenant | None]
    t_lane: list[str]
    tmat: npt.NDArray[np.int64]
    tix: list[int]
    tix_a: npt.NDArray[np.intp]  # the same, an array (to index arrays with)
    per: npt.NDArray[np.int64]
    tkeys: npt.NDArray[np.int64]
    replayed: dict[int, tuple[int, ...]]
    slots: npt.NDArray[np.int64]
    early: npt.NDArray[np.int64]
    shadow: npt.NDArray[np.bool_]
    any_shadow: bool
    prompt: npt.NDArray[np.int64]
    maxt: npt.NDArray[np.int64]
    # place
    pair: npt.NDArray[np.intp]
    asked: npt.NDArray[np.intp]
    pair_keys: list[tuple[str, str]]
    fresh: npt.NDArray[np.int8] | None
    is_fresh: npt.NDArray[np.bool_]
    # judge
    verdicts: dict[tuple[str, str], Verdict]
    pools: list[str]
    batch_pools: list[str]
    prices: dict[str, PriceQuote]
    templates: npt.NDArray[np.int64]
    pv: npt.NDArray[np.int64]
    ok_tenant: npt.NDArray[np.bool_]
    pressed: npt.NDArray[np.bool_]
    any_pressed: bool
    any_capped: bool  # some pair's verdict caps the output (degradation)
    to_fast: npt.NDArray[np.bool_]
    # gate
    gate_refused: npt.NDArray[np.bool_] | None
    gate_retry: npt.NDArray[np.int64]
    # fast path: reason, reserved, retry, bucket, hour, day
    out: npt.NDArray[np.int64]
    # conclude
    rows: npt.NDArray[np.int64]
    admitted: npt.NDArray[np.bool_]
    all_admitted: bool
    released_pools: set[int]  # pools whose admissions conclude released

    def __init__(
        self, decider: Rules, tenant_ids: list[str], request_ids: list[str],
        prompt_tokens: Sequence[int], max_tokens: Sequence[int], model: str, pool: str,
        now: int, log: RequestLog, retries: BatchRetries | None,
    ) -> None:  # fmt: skip
        self.d = decider
        self.tenants = decider.tenants
        self.tenant_ids = tenant_ids
        self.request_ids = request_ids
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.n = len(request_ids)
        self.model = model
        self.pool = pool
        self.now = now
        self.log = log
        self.retries = retries
        self.late = retries.late if retries is not None else {}

    # ------------------------------------------------------- 1. screen

    def screen(self) -> None:
        """Resolve each distinct tenant once (a row of _T_*), spread over the
        entries; find replays; refuse late retries before anything."""
        n, tenants, log = self.n, self.tenants, self.log
        long_default = tenants.policy.long_request_tokens
        self.order = order = list(dict.fromkeys(self.tenant_ids))
        self.t_entry = t_entry = [tenants.resolve(t) for t in order]
        self.t_lane = [tenants.lane_for("lane", "", e) for e in t_entry]
        self.tmat = tmat = np.array(
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
            self.tix = [0] * n
            self.tix_a = np.zeros(n, dtype=np.intp)
        else:
            index = {t: j for j, t in enumerate(order)}
            self.tix = list(map(index.__getitem__, self.tenant_ids))
            self.tix_a = np.array(self.tix, dtype=np.intp)
        self.per = per = tmat[self.tix_a]  # (n, _T_FIELDS)
        self.tkeys = np.ascontiguousarray(per[:, _T_TKEY])
        self.replayed = log.replay_rows(self.tkeys, self.tenant_ids, self.request_ids, self.now)
        self.slots = per[:, _T_SLOT]
        early = per[:, _T_EARLY]
        if self.late:  # retries past their deadline: refused before anything is charged
            gone = list(self.late)
            early = early.copy()
            early[gone] = np.where(early[gone] == _OK, _BACKPRESSURE, early[gone])
        self.early = early
        self.shadow = per[:, _T_SHADOW].astype(bool)
        self.any_shadow = bool(tmat[:, _T_SHADOW].any())
        self.prompt = np.array(self.prompt_tokens, dtype=np.int64)
        self.maxt = np.array(self.max_tokens, dtype=np.int64)

    # -------------------------------------------------------- 2. place

    def place(self, lanes: list[str]) -> None:
        """Each entry's (lane, pool) pair: its lane (named, else its
        tenant's default; then length-aware placement), and that lane's
        pool. ``asked`` keeps the lane asked for: its SLO applies."""
        n, tenants, t_entry, tix = self.n, self.tenants, self.t_entry, self.tix
        pair_ix: dict[tuple[str, str], int] = {}

        def pair_of(entry: Tenant | None, lane: str) -> int:
            lp = (lane, tenants.pool_for(entry, lane, self.pool))
            return pair_ix.setdefault(lp, len(pair_ix))

        if len(lanes) <= 1:  # a lane per tenant: pairs per tenant
            given = lanes[0] if lanes else ""
            t_pair = [pair_of(e, given or ln) for e, ln in zip(t_entry, self.t_lane, strict=True)]
            pair = np.array(t_pair, dtype=np.intp)[self.tix_a]
        else:
            combos: dict[tuple[int, str], int] = {}
            pair_l: list[int] = []
            for j, ln in zip(tix, lanes, strict=True):
                c = combos.get((j, ln))
                if c is None:
                    c = combos[j, ln] = pair_of(t_entry[j], ln or self.t_lane[j])
                pair_l.append(c)
            pair = np.array(pair_l, dtype=np.intp)
        self.asked = pair.copy()
        long = self.prompt + self.maxt > self.per[:, _T_LONG]
        if long.any():
            keys = list(pair_ix)
            for i in np.flatnonzero(long).tolist():
                entry = t_entry[tix[i]]
                if entry is not None and i not in self.replayed:
                    lane = keys[pair[i]][0]
                    placed = tenants.place(entry, lane, self.prompt_tokens[i], self.max_tokens[i])
                    if placed != lane:
                        pair[i] = pair_of(entry, placed)
        self.pair = pair
        self.pair_keys = list(pair_ix)
        if self.replayed:
            fresh = np.ones(n, dtype=np.int8)
            fresh[list(self.replayed)] = 0
            self.fresh = fresh
            self.is_fresh = fresh.astype(bool)
        else:
            self.fresh = None
            self.is_fresh = np.ones(n, dtype=bool)

    # -------------------------------------------------------- 3. judge

    def judge(self) -> None:
        """One verdict per pair (the batch-level answer reports the first
        fresh entry's); per pair a row of _P_* and template rows for its
        entries: admitted, refused after the verdict, refused before it (an
        unknown or disabled tenant: no pool was asked). Prices are quoted
        once per pool. Degradation caps the output; backpressure refuses
        (shadow entries are only marked)."""
        d, now, pair_keys, names = self.d, self.now, self.pair_keys, self.log.names
        seen = self.pair[self.is_fresh] if self.replayed else self.pair
        if len(pair_keys) == 1:  # the common batch: one lane, one pool
            fresh_pairs = pair_keys if seen.size else []
        else:
            fresh_pairs = [pair_keys[k] for k in dict.fromkeys(seen.tolist())]
        if not fresh_pairs:
            # only replays: the batch still reports its pool's pressure now,
            # from the first replay's recorded lane and pool
            i0 = min(self.replayed)
            lane0 = names.names[self.replayed[i0][R.LANE]]
            pool0 = names.names[self.replayed[i0][R.POOL]] or self.tenants.pool_for(
                self.t_entry[self.tix[i0]], lane0, self.pool
            )
            fresh_pairs = [(lane0, pool0)]
        verdict_of = {lp: d.verdict(lp[0], lp[1], now) for lp in (*pair_keys, *fresh_pairs)}
        self.verdicts = {lp: verdict_of[lp] for lp in fresh_pairs}
        self.pools = pools = list(dict.fromkeys(p for _, p in pair_keys))
        self.batch_pools = list(dict.fromkeys(p for _, p in self.verdicts))
        self.prices = prices = {p: d.pricing.quote(p, self.model, now) for p in pools}
        lane_cfg = self.tenants.lanes
        model_id = names.id(self.model)
        pmat_rows = []
        # three template rows per pair, built as lists and made one array
        # (a dozen slice assignments per pair cost more than the batch's rows)
        trows: list[list[int]] = []
        for ln, p in pair_keys:
            v = verdict_of[ln, p]
            price = prices[p]
            pmat_rows.append(
                (
                    v.reason, v.retry_ns, int(v.shed), v.degraded_cap, pools.index(p),
                    ln in lane_cfg and lane_cfg[ln].fail_open,
                )
            )  # fmt: skip
            refused = [0] * R.FIELDS
            refused[R.STATE] = R.REJECTED
            refused[R.LANE] = names.id(ln)
            refused[R.DECIDED_NS] = refused[R.ARRIVED_NS] = now
            refused[R.MULTIPLIER] = _ONE_BITS
            refused[R.ACTUAL] = -1
            unasked = refused.copy()  # refused before any pool was asked
            unasked[R.FRESHNESS] = UNKNOWN
            refused[R.SCORE_PPM] = v.score_ppm
            refused[R.FRESHNESS] = v.freshness
            admitted = refused.copy()
            admitted[R.STATE] = R.OPEN
            admitted[R.POOL] = names.id(p)
            admitted[R.MODEL] = model_id
            admitted[R.MULTIPLIER] = float_bits(price.multiplier)
            admitted[R.WINDOW] = price.window_id
            admitted[R.DEGRADED_CAP] = v.degraded_cap
            trows += (admitted, refused, unasked)
        self.templates = np.array(trows, dtype=np.int64)
        self.pv = pv = np.array(pmat_rows, dtype=np.int64)[self.pair]  # (n, _P_FIELDS)
        self.ok_tenant = ok_tenant = self.is_fresh & (self.early == _OK)
        v_cap = pv[:, _P_CAP]
        self.any_capped = bool(v_cap.any())
        if self.any_capped:
            self.maxt = np.where(ok_tenant & (v_cap > 0) & (self.maxt > v_cap), v_cap, self.maxt)
        pressed = ok_tenant & (pv[:, _P_REASON] != _OK)
        if self.any_shadow:
            pressed &= ~self.shadow
        self.pressed = pressed
        self.any_pressed = bool(pressed.any())
        self.to_fast = ok_tenant & ~pressed if self.any_pressed else ok_tenant.copy()

    # --------------------------------------------------------- 4. gate

    def gate(self) -> None:
        """A batch never waits: what a pool has no room for is refused,
        fail-open lanes (premium) served first, then the rest in batch
        order. Each pool's share is planned for every entry sent to the
        fast path (one it then refuses took none: a small overestimate)."""
        self.gate_refused = None
        self.gate_retry = np.zeros(0, dtype=np.int64)
        gate = self.d.gate
        if not gate.enabled:
            return
        pv, pools, to_fast = self.pv, self.pools, self.to_fast
        gated = np.flatnonzero(to_fast & ~self.shadow if self.any_shadow else to_fast)
        if not gated.size:
            return
        fail_open = pv[gated, _P_FAIL_OPEN]
        if fail_open.any() and not fail_open.all():  # a mix: those first
            gated = gated[np.argsort(1 - fail_open, kind="stable")]
        pool_ix = pv[:, _P_POOL]
        ks = [0] if len(pools) == 1 else dict.fromkeys(pool_ix[gated].tolist())
        for k in ks:
            mine = gated if len(pools) == 1 else gated[pool_ix[gated] == k]
            first = pv[mine, _P_FAIL_OPEN].astype(bool).tolist()
            fits = gate.plan(pools[k], self.now, self.prompt[mine].tolist(), first)
            if not all(fits):
                refused = mine[~np.array(fits, dtype=bool)]
                if self.gate_refused is None:
                    self.gate_refused = np.zeros(self.n, dtype=bool)
                    self.gate_retry = np.zeros(self.n, dtype=np.int64)
                self.gate_refused[refused] = True
                self.gate_retry[refused] = gate.retry_ns(pools[k], self.now)
        if self.gate_refused is not None:
            self.to_fast &= ~self.gate_refused

    # ---------------------------------------------------- 5. fast path

    def fast_path(self) -> None:
        """The buckets in one call; then premium borrowing and refusals
        under a share, entry by entry where they apply (rare)."""
        d, now, n, to_fast = self.d, self.now, self.n, self.to_fast
        # the fast path writes only the entries it decides: the others keep
        # these starting values, a refused row's (bucket 0, quotas -1)
        self.out = out = np.zeros((6, n), dtype=np.int64)
        out[4:] = -1
        reason, reserved, retry, bucket, hour, day = out
        prompt, maxt, slots = self.prompt, self.maxt, self.slots
        fast_ok = d.table.admit_batch(
            now, np.where(to_fast, slots, -1), prompt, maxt, reason, reserved, retry, bucket,
            hour, day, shadow=self.per[:, _T_SHADOW] if self.any_shadow else None,
        )  # fmt: skip
        # Premium borrows what its bucket refuses while the pool has room
        # (Decider.borrows): the entries the gate let through, one by one;
        # nothing to look at when the fast path admitted all it was given.
        if fast_ok < np.count_nonzero(to_fast):
            borrowers = to_fast & _BORROWABLE[reason] & (self.pv[:, _P_FAIL_OPEN] != 0)
            if self.any_shadow:
                borrowers &= ~self.shadow
            for i in np.flatnonzero(borrowers).tolist():
                slot, lane = int(slots[i]), self.pair_keys[self.pair[i]][0]
                p, m = int(prompt[i]), int(maxt[i])
                if d.borrows(lane, slot, now, p, m, int(reason[i])):
                    out[:, i] = d.borrow(slot, now, p, m)
        if self.tenants.shares is not None:
            self.shares()

    def shares(self) -> None:
        """Refusals under a share (shares.py) explained, and the quotas'
        remaining told tenant-wide, for the entries the fast path decided
        but shadow mode's: those were charged whatever (``Decider.decide``)."""
        d, reason, retry, hour, day = self.d, self.out[0], self.out[2], self.out[4], self.out[5]
        decided = self.to_fast & ~self.shadow if self.any_shadow else self.to_fast
        t_entry, maxt = self.t_entry, self.maxt
        if any(e is not None and (e.config.hourly_quota or e.config.daily_quota)
               for e in t_entry):  # fmt: skip
            offsets = np.array(
                [(0, 0) if e is None else d.tenant_wide(e, 0, 0) for e in t_entry],
                dtype=np.int64,
            )[self.tix_a]
            for col, off in ((hour, offsets[:, 0]), (day, offsets[:, 1])):
                col[:] = np.where(decided & (col >= 0), np.maximum(0, col + off), col)
        for i in np.flatnonzero(decided & _SHARED[reason]).tolist():
            entry = t_entry[self.tix[i]]
            assert entry is not None  # decided by the fast path: a known tenant
            reason[i], retry[i] = d.explain(
                entry, int(reason[i]), int(retry[i]), self.prompt_tokens[i], int(maxt[i])
            )

    # ----------------------------------------------------- 6. conclude

    def conclude(self) -> None:
        """The reason each entry is answered with (and shadow mode's), the
        reservation ids, and the rows: the templates, then the per-entry
        columns; the retry hint and the late flags of refusals."""
        n, to_fast, pv, early = self.n, self.to_fast, self.pv, self.early
        out_reason, out_reserved, out_retry, out_bucket, out_hour, out_day = self.out
        v_reason = pv[:, _P_REASON]
        reason = np.where(to_fast, out_reason, early)
        if self.any_pressed:
            reason[self.pressed] = v_reason[self.pressed]
        gate_refused = self.gate_refused
        if gate_refused is not None:
            reason[gate_refused] = _BACKPRESSURE
        shadow_reason = None
        if self.any_shadow:
            # memory protection refuses shadow entries too (the fast path charged nothing)
            sh = to_fast & self.shadow & (out_reason != _OPEN_RESERVATIONS)
            shadow_reason = np.where(sh, np.where(v_reason != _OK, v_reason, reason), 0)
            reason[sh] = _OK
        self.admitted = admitted = to_fast & (reason == _OK)
        self.release_before_refusals()
        na = int(np.count_nonzero(admitted))
        self.all_admitted = na == n  # (so no replay either: a replay is never admitted anew)
        rid0 = self.d.take_reservation_ids(na)
        templates, pair, prompt = self.templates, self.pair, self.prompt
        if na == n:
            rows = templates[3 * pair]
            rows[:, R.RESERVED] = out_reserved
            rows[:, R.RID] = np.arange(rid0, rid0 + na, dtype=np.int64)
            rows[:, R.GRANTED] = out_reserved - prompt
        else:
            # refused after the pool's verdict (its pressure reported), or
            # before it (an unknown or disabled tenant: no pool was asked);
            # a late retry is refused for its pool's state: after
            rows = templates[3 * pair + np.where(admitted, 0, np.where(self.ok_tenant, 1, 2))]
            late = [i for i in self.late if self.is_fresh[i]]
            if late:
                rows[late] = templates[3 * pair[late] + 1]
            rows[:, R.RESERVED] = np.where(admitted, out_reserved, 0)
            rows[admitted, R.RID] = np.arange(rid0, rid0 + na, dtype=np.int64)
            rows[:, R.GRANTED] = np.where(admitted, out_reserved - prompt, 0)
            from_fast = to_fast & ~admitted  # refused by the fast path
            # nobody knows when a request ends (and frees its place): a configured hint
            hinted = (out_reason == _CONCURRENCY) | (out_reason == _OPEN_RESERVATIONS)
            retry = np.where(from_fast, np.where(hinted, self.d.concurrency_retry_ns, out_retry), 0)
            if self.any_pressed:
                retry[self.pressed] = pv[self.pressed, _P_RETRY]
                rows[self.pressed, R.SHED] = pv[self.pressed, _P_SHED]
            if gate_refused is not None:
                retry[gate_refused] = self.gate_retry[gate_refused]
                rows[gate_refused, R.SHED] = R.SHED_BIT
            rows[:, R.RETRY_NS] = retry
            for i in late:
                if reason[i] == _BACKPRESSURE:
                    rows[i, R.RETRY_NS] = self.late[i]
                    rows[i, R.SHED] = R.SHED_BIT | R.LATE_BIT
            self._flag_late(rows, reason, retry)
        rows[:, R.REASON] = reason
        rows[:, R.SLOT] = self.slots
        rows[:, R.BUCKET] = out_bucket
        rows[:, R.HOUR] = out_hour
        rows[:, R.DAY] = out_day
        if shadow_reason is not None:
            rows[:, R.SHADOW_REASON] = shadow_reason
        for i, prior in self.replayed.items():
            rows[i] = prior
        self.rows = rows

    def release_before_refusals(self) -> None:
        """A pool that refused entries for lack of room and admitted others
        releases its admissions here, in batch order, each refusal's retry
        hint the gate's after the admissions before it (as one by one);
        the other pools' are released when stored (batch_answer.store)."""
        self.released_pools = set()
        refused, admitted = self.gate_refused, self.admitted
        if refused is None:
            return
        gate, pv, pools, now = self.d.gate, self.pv, self.pools, self.now
        pool_ix = pv[:, _P_POOL]
        for k in dict.fromkeys(pool_ix[refused].tolist()):
            mine = np.flatnonzero(pool_ix == k)
            if not admitted[mine].any():
                continue  # the retry the gate step computed stands
            for i in mine.tolist():
                if admitted[i]:
                    gate.released(pools[k], now, int(self.prompt[i]), bool(pv[i, _P_FAIL_OPEN]))
                elif refused[i]:
                    self.gate_retry[i] = gate.retry_ns(pools[k], now)
            self.released_pools.add(k)

    def _flag_late(
        self, rows: npt.NDArray[np.int64], reason: npt.NDArray[np.int64],
        retry: npt.NDArray[np.int64],
    ) -> None:  # fmt: skip
        """Refusals whose retry could not be released in time for their
        deadline are late: not retryable (Deadlines.late_if_past's columns).
        A retry is due at its first attempt's arrival plus its SLO."""
        waitable = self.ok_tenant & ~self.admitted & RETRYABLE[reason]
        if not self.d.gate.enabled or not waitable.any():
            return
        waited = None
        if self.retries is not None and self.retries.first:
            waited = np.zeros(self.n, dtype=np.int64)
            for i, first in self.retries.first.items():
                waited[i] = self.now - first
        late = self.d.deadlines.late_columns(
            self.pair_keys, self.asked, self.pair, waitable, retry, self.prompt, waited
        )
        rows[late, R.SHED] |= R.LATE_BIT
