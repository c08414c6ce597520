"""Pure-Python reference of the per-tenant token buckets, quotas and concurrency counters.

This module defines the semantics; ``_buckets_c.pyx`` is the compiled copy and must give
bit-identical results (the property tests drive both with the same operation sequences).
All arithmetic is integer fixed point: time in nanoseconds supplied by the caller (the
table never reads a clock), bucket levels in milli-tokens (mtok), costs and quotas in
whole tokens.  Integer arguments are converted as the compiled build converts them
(``operator.index``: ``TypeError`` for floats and other non-integers, ``OverflowError``
outside int64), so both builds fail alike on bad input too.

Every helper divides only non-negative numbers, because C division truncates toward
zero where Python's floors; on non-negative operands the two agree.

It is one module of ~670 lines on purpose: it mirrors ``_buckets_c.pyx`` function for
function, and that one is a single Cython module so the decision inlines into the batch
loop.  Splitting only the reference would break the one-to-one reading that reviews and
the differential tests rely on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, cast

from fastpath._ints import I64_MAX as _I64_MAX
from fastpath._ints import check_range as _check_range
from fastpath._ints import i64 as _i64
from fastpath.codes import (
    MAX_BURST_MTOK,
    MAX_GLOBAL_INFLIGHT_TOKENS,
    MAX_NOW_NS,
    MAX_RATE_MTOK_PER_S,
    MAX_REQUEST_TOKENS,
    MAX_SLOTS,
    MAX_USAGE_TOKENS,
    MTOK_PER_TOKEN,
    NS_PER_DAY,
    NS_PER_HOUR,
    NS_PER_S,
    RETRY_AFTER_NS_MAX,
    Reason,
)

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np
    import numpy.typing as npt
    from typing_extensions import Buffer

    # What admit_batch takes: a 1-D int64 buffer (numpy's stubs only declare ndarray a
    # Buffer from Python 3.12 on, hence the union).
    Int64Array: TypeAlias = Buffer | npt.NDArray[np.int64]

__all__ = ["AdmitResult", "TokenBucketTable"]

# (reason, reserved_tokens, retry_after_ns, bucket_remaining_tokens, hour_remaining,
#  day_remaining); reason is a plain int equal to a ``Reason`` value.
AdmitResult = tuple[int, int, int, int, int, int]

# Largest whole-second part of a wait that still leaves room for the sub-second part
# (< 1e9 ns) without passing int64; beyond it the wait saturates at RETRY_AFTER_NS_MAX.
_WAIT_S_MAX: Final = (_I64_MAX - NS_PER_S) // NS_PER_S
_OK: Final = int(Reason.OK)
_TOKEN_RATE: Final = int(Reason.TOKEN_RATE)
_HOURLY_QUOTA: Final = int(Reason.HOURLY_QUOTA)
_DAILY_QUOTA: Final = int(Reason.DAILY_QUOTA)
_CONCURRENCY: Final = int(Reason.CONCURRENCY)
_MAX_TOKENS: Final = int(Reason.MAX_TOKENS)
_GLOBAL_WATERMARK: Final = int(Reason.GLOBAL_WATERMARK)
_OPEN_RESERVATIONS: Final = int(Reason.OPEN_RESERVATIONS)
# Buffer formats that are a native signed 64-bit integer (numpy int64 shows as "l").
_I64_FORMATS: Final = frozenset({"q", "@q", "=q", "l", "@l"})


def _check_now(name: str, now_ns: int) -> None:
    _check_range(name, now_ns, 0, MAX_NOW_NS)


def _check_tokens(name: str, tokens: int) -> None:
    _check_range(name, tokens, 0, MAX_REQUEST_TOKENS)


def _i64_view(obj: Int64Array, name: str, writable: bool) -> memoryview:
    try:
        view = memoryview(cast("Buffer", obj))  # ndarray is a Buffer at runtime
    except TypeError as exc:
        raise TypeError(f"{name} must be a 1-D int64 buffer (numpy int64 or array('q'))") from exc
    if view.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got {view.ndim} dimensions")
    if view.itemsize != 8 or view.format not in _I64_FORMATS:
        raise ValueError(f"{name} must hold int64 items, got format {view.format!r}")
    if writable and view.readonly:
        raise ValueError(f"{name} is read-only")
    return view


class _Slot:
    """One tenant's bucket, quota windows and in-flight counters (all ints)."""

    __slots__ = (
        "burst",
        "daily_quota",
        "day_idx",
        "day_used",
        "hour_idx",
        "hour_used",
        "hourly_quota",
        "inflight",
        "inflight_tokens",
        "last_ns",
        "level",
        "max_concurrency",
        "max_tokens_per_request",
        "rate",
        "rem",
    )

    def __init__(self, now_ns: int, rate: int, burst: int) -> None:
        self.rate = rate  # refill, mtok per second
        self.burst = burst  # capacity, mtok
        self.hourly_quota = 0  # tokens per UTC hour, 0 = unlimited
        self.daily_quota = 0  # tokens per UTC day, 0 = unlimited
        self.max_concurrency = 0  # requests in flight, 0 = unlimited
        self.max_tokens_per_request = 0  # cap on the generation estimate, 0 = none
        self.level = burst  # mtok; in [-burst, burst], negative while in debt
        self.rem = 0  # refill remainder, mtok*ns/1e9, in [0, 1e9); 0 when full
        self.last_ns = now_ns  # refilled up to here; never moves backwards
        self.hour_idx = now_ns // NS_PER_HOUR
        self.hour_used = 0
        self.day_idx = now_ns // NS_PER_DAY
        self.day_used = 0
        self.inflight = 0
        self.inflight_tokens = 0


def _refill(s: _Slot, now_ns: int) -> None:
    """Bring ``s.level`` up to ``now_ns``; exact, carrying the sub-mtok remainder.

    Path independent: refilling to t1 then to t2 gives the same state as refilling to
    t2 at once, which is what makes ``retry_after_ns`` exact.
    """
    if now_ns <= s.last_ns:
        return  # time never goes backwards; last_ns is not moved back
    dt = now_ns - s.last_ns
    s.last_ns = now_ns
    burst = s.burst
    level = s.level
    if level >= burst:
        s.rem = 0
        return
    secs = dt // NS_PER_S
    sub_ns = dt - secs * NS_PER_S
    rate = s.rate
    # burst - level > 0 and <= 2 * MAX_BURST_MTOK; past this many seconds the bucket is full
    # whatever the remainder, and stopping here keeps rate * secs below 2e15.
    if secs >= (burst - level) // rate + 1:
        s.level = burst
        s.rem = 0
        return
    acc = rate * sub_ns + s.rem  # < 1e18 + 1e9
    level += rate * secs + acc // NS_PER_S
    if level >= burst:
        s.level = burst
        s.rem = 0
    else:
        s.level = level
        s.rem = acc % NS_PER_S


def _roll_windows(s: _Slot, now_ns: int) -> None:
    """Start a new UTC hour/day quota window if ``now_ns`` is past the stored one."""
    hour_idx = now_ns // NS_PER_HOUR
    if hour_idx > s.hour_idx:
        s.hour_idx = hour_idx
        s.hour_used = 0
    day_idx = now_ns // NS_PER_DAY
    if day_idx > s.day_idx:
        s.day_idx = day_idx
        s.day_used = 0


def _token_wait_ns(s: _Slot, need_mtok: int, now_ns: int) -> int:
    """Smallest ns after ``now_ns`` at which ``_refill`` brings the level to ``need_mtok``.

    The refill adds floor((rate * t + rem) / 1e9) mtok over t ns, so the answer is
    ceil((deficit * 1e9 - rem) / rate), computed as q * 1e9 + ceil((m * 1e9 - rem) / rate)
    with q, m = divmod(deficit, rate) so no product passes int64.  When the clock went
    backwards (now < last_ns) nothing refills until last_ns, so that gap is added.
    """
    deficit = need_mtok - s.level  # > 0, <= 2 * MAX_BURST_MTOK
    rate = s.rate
    q = deficit // rate
    m = deficit - q * rate
    if q > _WAIT_S_MAX:
        return RETRY_AFTER_NS_MAX
    x = m * NS_PER_S - s.rem  # in (-1e9, 1e18); when negative, q >= 1 as deficit * 1e9 > rem
    # ceil(x / rate), dividing only non-negative numbers.
    wait = q * NS_PER_S + ((x + rate - 1) // rate if x >= 0 else -((-x) // rate))
    if s.last_ns > now_ns:
        gap = s.last_ns - now_ns
        if wait > RETRY_AFTER_NS_MAX - gap:
            return RETRY_AFTER_NS_MAX
        wait += gap
    return wait


def _decide(
    s: _Slot,
    now_ns: int,
    prompt_tokens: int,
    max_tokens: int,
    global_limit: int,
    total_inflight: int,
    shadow: bool,
    debt: bool = False,
    open_full: bool = False,
    slot_open_limit: int = 0,
) -> AdmitResult:
    """One admission decision; charges the slot when the answer is OK, or always in shadow.

    A request larger than the burst (up to twice it) waits for a full bucket and is
    admitted into debt, charged in full: the level goes down to ``burst - cost`` >=
    ``-burst``, and the tenant's next requests wait for the refill that repays it.  A
    request within the burst needs its cost in the bucket (exact buckets), or with
    ``debt`` only a non-negative level (a tenant's own burst goes up to one burst into
    debt, charged in full).

    ``global_limit`` is the global in-flight watermark in tokens (0 = off) and
    ``total_inflight`` the tokens in flight over all slots before this request.  In shadow
    mode the reason and retry are what ``admit`` would answer, but the cost is reserved
    whatever the reason (the request runs): the bucket goes at most ``burst`` into debt,
    as with a settle overrun, and quotas may pass their limits.  The cost of a request over
    the absolute ceiling is then taken as MAX_REQUEST_TOKENS, the most a reservation (and
    so a later ``settle``/``release``) can hold.

    Memory protection comes last: a request that would be charged (admitted, or any
    shadow charge) is refused with OPEN_RESERVATIONS instead, and nothing is charged,
    when ``open_full`` (the open reservations over all slots are at their cap) or the
    slot already has ``slot_open_limit`` in flight (0 = no cap).  A request refused for
    another reason keeps that reason: it would reserve nothing anyway.
    """
    _refill(s, now_ns)
    _roll_windows(s, now_ns)
    per_request = s.max_tokens_per_request
    estimate = max_tokens if per_request == 0 or max_tokens < per_request else per_request
    hourly = s.hourly_quota
    daily = s.daily_quota
    reason = _OK
    cost = 0
    retry_ns = 0
    if (
        prompt_tokens > MAX_REQUEST_TOKENS
        or estimate > MAX_REQUEST_TOKENS - prompt_tokens
        or (per_request > 0 and prompt_tokens > per_request)
    ):
        reason = _MAX_TOKENS
        over_ceiling = (
            prompt_tokens > MAX_REQUEST_TOKENS or estimate > MAX_REQUEST_TOKENS - prompt_tokens
        )
        cost = MAX_REQUEST_TOKENS if over_ceiling else prompt_tokens + estimate
    else:
        cost = prompt_tokens + estimate
        need = cost * MTOK_PER_TOKEN
        # the level a request needs: its cost (with debt 0); a full bucket for one over
        # the burst, which then goes into debt; up to one burst of debt either way
        floor = s.burst if need > s.burst else (0 if debt else need)
        largest = 2 * s.burst
        if need > largest or (0 < daily < cost) or (0 < hourly < cost) or (0 < global_limit < cost):
            reason = _MAX_TOKENS
        elif daily > 0 and s.day_used + cost > daily:
            reason = _DAILY_QUOTA
            retry_ns = (s.day_idx + 1) * NS_PER_DAY - now_ns
        elif hourly > 0 and s.hour_used + cost > hourly:
            reason = _HOURLY_QUOTA
            retry_ns = (s.hour_idx + 1) * NS_PER_HOUR - now_ns
        elif s.max_concurrency > 0 and s.inflight >= s.max_concurrency:
            reason = _CONCURRENCY
        elif s.level < floor:
            reason = _TOKEN_RATE
            retry_ns = _token_wait_ns(s, floor, now_ns)
        elif global_limit > 0 and cost > global_limit - total_inflight:
            # Written so that it cannot overflow in C: total_inflight >= 0.
            reason = _GLOBAL_WATERMARK
    if (reason == _OK or shadow) and (
        open_full or (slot_open_limit > 0 and s.inflight >= slot_open_limit)
    ):
        reason = _OPEN_RESERVATIONS
        retry_ns = 0
    if reason == _OK or (shadow and reason != _OPEN_RESERVATIONS):
        # When OK the debt stays within one burst, so the floor never binds.
        level = s.level - cost * MTOK_PER_TOKEN
        s.level = level if level > -s.burst else -s.burst
        s.hour_used += cost
        s.day_used += cost
        s.inflight += 1
        s.inflight_tokens += cost
    else:
        cost = 0
    level = s.level
    return (
        reason,
        cost,
        retry_ns,
        level // MTOK_PER_TOKEN if level > 0 else 0,
        (hourly - s.hour_used if s.hour_used < hourly else 0) if hourly > 0 else -1,
        (daily - s.day_used if s.day_used < daily else 0) if daily > 0 else -1,
    )


class TokenBucketTable:
    """Per-tenant token buckets, UTC hour/day quotas and concurrency counters.

    Tenants live in small-integer *slots* chosen by the caller.  The table grows when a
    slot at or past its capacity is configured.  A global watermark on the tokens in
    flight over all slots (``set_global_inflight_limit``, off by default) is checked after
    every per-tenant check; ``charge`` is the shadow-mode twin of ``admit``.  Not
    thread-safe: one event loop owns it.
    """

    __slots__ = (
        "_debt",
        "_global_limit",
        "_open_limit",
        "_slot_open_limit",
        "_slots",
        "_total_inflight",
        "_total_inflight_tokens",
    )

    def __init__(self, capacity: int = 64) -> None:
        capacity = _i64(capacity)
        if not 1 <= capacity <= MAX_SLOTS:
            raise ValueError(f"capacity must be in [1, {MAX_SLOTS}], got {capacity}")
        self._slots: list[_Slot | None] = [None] * capacity
        self._total_inflight_tokens = 0
        self._global_limit = 0  # tokens in flight over all slots; 0 = no watermark
        self._debt = False  # buckets may go one burst into debt (set_bucket_debt)
        self._total_inflight = 0  # requests in flight over all slots
        self._open_limit = 0  # cap on _total_inflight (set_open_limits); 0 = none
        self._slot_open_limit = 0  # cap on each slot's inflight; 0 = none

    @property
    def capacity(self) -> int:
        """Number of slots allocated (configured or not)."""
        return len(self._slots)

    def _get(self, slot: int) -> _Slot:
        if 0 <= slot < len(self._slots):
            s = self._slots[slot]
            if s is not None:
                return s
        raise KeyError(f"slot {slot} is not configured")

    def configure(
        self,
        slot: int,
        now_ns: int,
        rate_mtok_per_s: int,
        burst_mtok: int,
        hourly_quota: int,
        daily_quota: int,
        max_concurrency: int,
        max_tokens_per_request: int,
    ) -> None:
        """Create or live-reconfigure ``slot``; a new slot starts with a full bucket.

        Reconfiguring keeps the bucket (refilled to ``now_ns`` at the old rate, then
        clamped into [-new burst, new burst]), the quota counters and the in-flight counts.
        """
        slot = _i64(slot)
        now_ns = _i64(now_ns)
        rate = _i64(rate_mtok_per_s)
        burst = _i64(burst_mtok)
        hourly_quota = _i64(hourly_quota)
        daily_quota = _i64(daily_quota)
        max_concurrency = _i64(max_concurrency)
        max_tokens_per_request = _i64(max_tokens_per_request)
        if not 0 <= slot < MAX_SLOTS:
            raise ValueError(f"slot must be in [0, {MAX_SLOTS}), got {slot}")
        _check_now("now_ns", now_ns)
        if not 1 <= rate <= MAX_RATE_MTOK_PER_S:
            raise ValueError(f"rate_mtok_per_s must be in [1, {MAX_RATE_MTOK_PER_S}], got {rate}")
        if not MTOK_PER_TOKEN <= burst <= MAX_BURST_MTOK:
            raise ValueError(
                f"burst_mtok must be in [{MTOK_PER_TOKEN}, {MAX_BURST_MTOK}], got {burst}"
            )
        if hourly_quota < 0:
            raise ValueError(f"hourly_quota must be >= 0 (0 = unlimited), got {hourly_quota}")
        if daily_quota < 0:
            raise ValueError(f"daily_quota must be >= 0 (0 = unlimited), got {daily_quota}")
        if max_concurrency < 0:
            raise ValueError(f"max_concurrency must be >= 0 (0 = unlimited), got {max_concurrency}")
        if not 0 <= max_tokens_per_request <= MAX_REQUEST_TOKENS:
            raise ValueError(
                f"max_tokens_per_request must be in [0, {MAX_REQUEST_TOKENS}] (0 = no cap), "
                f"got {max_tokens_per_request}"
            )
        if slot >= len(self._slots):
            new_capacity = max(slot + 1, min(2 * len(self._slots), MAX_SLOTS))
            self._slots.extend([None] * (new_capacity - len(self._slots)))
        s = self._slots[slot]
        if s is None:
            s = _Slot(now_ns, rate, burst)
            self._slots[slot] = s
        else:
            _refill(s, now_ns)  # at the old rate, up to now
            s.rate = rate
            s.burst = burst
            if s.level >= burst:
                s.level = burst
                s.rem = 0
            elif s.level < -burst:
                s.level = -burst
        s.hourly_quota = hourly_quota
        s.daily_quota = daily_quota
        s.max_concurrency = max_concurrency
        s.max_tokens_per_request = max_tokens_per_request

    def is_configured(self, slot: int) -> bool:
        slot = _i64(slot)
        return 0 <= slot < len(self._slots) and self._slots[slot] is not None

    def remove(self, slot: int) -> None:
        """Forget ``slot``; configuring it again starts a fresh, full bucket."""
        slot = _i64(slot)
        s = self._get(slot)
        self._total_inflight_tokens -= s.inflight_tokens
        self._total_inflight -= s.inflight
        self._slots[slot] = None

    def set_global_inflight_limit(self, tokens: int) -> None:
        """Set the global safe watermark on in-flight tokens over all slots (0 = off).

        Lowering it below what is already in flight refuses new work (GLOBAL_WATERMARK)
        until enough is settled or released; nothing in flight is touched.
        """
        tokens = _i64(tokens)
        if not 0 <= tokens <= MAX_GLOBAL_INFLIGHT_TOKENS:
            raise ValueError(
                f"tokens must be in [0, {MAX_GLOBAL_INFLIGHT_TOKENS}] (0 = off), got {tokens}"
            )
        self._global_limit = tokens

    def global_inflight_limit(self) -> int:
        """The global in-flight watermark in tokens, 0 when off."""
        return self._global_limit

    def set_bucket_debt(self, enabled: bool) -> None:
        """Admit a request within the burst while its bucket is non-negative, up to one
        burst into debt (see ``admit``); off by default (exact buckets).  A request over
        the burst goes into debt either way."""
        self._debt = bool(enabled)

    def bucket_debt(self) -> bool:
        return self._debt

    def set_open_limits(self, total: int, per_slot: int) -> None:
        """Cap the open reservations (requests in flight, shadow charges included) over
        all slots and per slot; 0 = no cap (the default).  At a cap, what would be
        charged is refused with OPEN_RESERVATIONS (see ``_decide``); lowering a cap below
        what is in flight touches nothing in flight.  Memory protection: the caller
        remembers each open reservation, and this bounds how many.
        """
        total = _i64(total)
        per_slot = _i64(per_slot)
        if total < 0:
            raise ValueError(f"total must be >= 0 (0 = no cap), got {total}")
        if per_slot < 0:
            raise ValueError(f"per_slot must be >= 0 (0 = no cap), got {per_slot}")
        self._open_limit = total
        self._slot_open_limit = per_slot

    def open_limits(self) -> tuple[int, int]:
        """(total, per_slot) caps on open reservations, 0 = none."""
        return (self._open_limit, self._slot_open_limit)

    def _one(
        self, slot: int, now_ns: int, prompt_tokens: int, max_tokens: int, shadow: bool
    ) -> AdmitResult:
        slot = _i64(slot)
        now_ns = _i64(now_ns)
        prompt_tokens = _i64(prompt_tokens)
        max_tokens = _i64(max_tokens)
        _check_now("now_ns", now_ns)
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        s = self._get(slot)
        before = s.inflight
        result = _decide(
            s,
            now_ns,
            prompt_tokens,
            max_tokens,
            self._global_limit,
            self._total_inflight_tokens,
            shadow,
            self._debt,
            0 < self._open_limit <= self._total_inflight,
            self._slot_open_limit,
        )
        self._total_inflight_tokens += result[1]
        self._total_inflight += s.inflight - before
        return result

    def admit(self, slot: int, now_ns: int, prompt_tokens: int, max_tokens: int) -> AdmitResult:
        """Decide one request; on OK its cost is reserved (taken from bucket and quotas).

        Returns ``(reason, reserved_tokens, retry_after_ns, bucket_remaining_tokens,
        hour_remaining, day_remaining)``; the remaining quotas are -1 when unlimited.
        A request that passes every per-tenant check but would take the tokens in flight
        over all slots past the global watermark is refused with GLOBAL_WATERMARK (retry
        0: it depends on other tenants' completions).
        """
        return self._one(slot, now_ns, prompt_tokens, max_tokens, False)

    def charge(self, slot: int, now_ns: int, prompt_tokens: int, max_tokens: int) -> AdmitResult:
        """Shadow mode: answer what ``admit`` would, but reserve the cost whatever the answer.

        Same refill, windows, reason and retry as ``admit``; the reservation is always
        taken (the bucket floored at ``-burst``, quotas may pass their limits, the request
        counts as in flight) and ``reserved_tokens`` is the cost even when the reason is
        not OK.  Settle or release it like any admission.
        """
        return self._one(slot, now_ns, prompt_tokens, max_tokens, True)

    def admit_batch(
        self,
        now_ns: int,
        slots: Int64Array,
        prompt: Int64Array,
        max_tokens: Int64Array,
        out_reason: Int64Array,
        out_reserved: Int64Array,
        out_retry_ns: Int64Array,
        out_bucket_rem: Int64Array,
        out_hour_rem: Int64Array,
        out_day_rem: Int64Array,
        shadow: Int64Array | None = None,
    ) -> int:
        """``admit`` for each entry in order; returns how many were admitted (reason OK).

        All arrays are 1-D int64 of one length (numpy int64 or ``array('q')``).  Entries
        with a negative slot are skipped and their outputs left untouched.  Entries with
        a nonzero ``shadow[i]`` are decided as ``charge``: the reason column holds the
        would-be reason, the reserved column the cost, always reserved; they count in the
        return value only when the would-be reason is OK.  Bad input (negative tokens,
        unconfigured slot) raises before any entry is decided.
        """
        now_ns = _i64(now_ns)
        v_slots = _i64_view(slots, "slots", False)
        v_prompt = _i64_view(prompt, "prompt", False)
        v_max = _i64_view(max_tokens, "max_tokens", False)
        outs = [
            _i64_view(out_reason, "out_reason", True),
            _i64_view(out_reserved, "out_reserved", True),
            _i64_view(out_retry_ns, "out_retry_ns", True),
            _i64_view(out_bucket_rem, "out_bucket_rem", True),
            _i64_view(out_hour_rem, "out_hour_rem", True),
            _i64_view(out_day_rem, "out_day_rem", True),
        ]
        v_shadow = None if shadow is None else _i64_view(shadow, "shadow", False)
        n = len(v_slots)
        if (
            len(v_prompt) != n
            or len(v_max) != n
            or any(len(v) != n for v in outs)
            or (v_shadow is not None and len(v_shadow) != n)
        ):
            raise ValueError("admit_batch arrays must all have the same length")
        _check_now("now_ns", now_ns)
        slot_list: list[int] = v_slots.tolist()
        prompt_list: list[int] = v_prompt.tolist()
        max_list: list[int] = v_max.tolist()
        shadow_list: list[int] = [0] * n if v_shadow is None else v_shadow.tolist()
        for i in range(n):
            if slot_list[i] < 0:
                continue
            if prompt_list[i] < 0:
                raise ValueError(f"prompt[{i}] must be >= 0, got {prompt_list[i]}")
            if max_list[i] < 0:
                raise ValueError(f"max_tokens[{i}] must be >= 0, got {max_list[i]}")
            self._get(slot_list[i])
        admitted = 0
        for i in range(n):
            slot = slot_list[i]
            if slot < 0:
                continue
            s = self._get(slot)
            before = s.inflight
            result = _decide(
                s,
                now_ns,
                prompt_list[i],
                max_list[i],
                self._global_limit,
                self._total_inflight_tokens,
                shadow_list[i] != 0,
                self._debt,
                0 < self._open_limit <= self._total_inflight,
                self._slot_open_limit,
            )
            for out, value in zip(outs, result, strict=True):
                out[i] = value
            self._total_inflight_tokens += result[1]
            self._total_inflight += s.inflight - before
            if result[0] == _OK:
                admitted += 1
        return admitted

    def settle(
        self,
        slot: int,
        now_ns: int,
        reserved_tokens: int,
        actual_tokens: int,
        admitted_ns: int,
    ) -> int:
        """Report a finished request's real usage; returns the refunded tokens (>= 0).

        Unused tokens go back to the bucket and, if still in the window they were charged
        to, to the quotas.  Overuse is charged extra, the bucket going at most ``burst``
        into debt.  The request stops counting as in flight.
        """
        slot = _i64(slot)
        now_ns = _i64(now_ns)
        reserved_tokens = _i64(reserved_tokens)
        actual_tokens = _i64(actual_tokens)
        admitted_ns = _i64(admitted_ns)
        _check_now("now_ns", now_ns)
        _check_tokens("reserved_tokens", reserved_tokens)
        _check_tokens("actual_tokens", actual_tokens)
        _check_now("admitted_ns", admitted_ns)
        s = self._get(slot)
        _refill(s, now_ns)
        _roll_windows(s, now_ns)
        refund = 0
        if actual_tokens < reserved_tokens:
            refund = reserved_tokens - actual_tokens
            level = s.level + refund * MTOK_PER_TOKEN
            if level >= s.burst:
                s.level = s.burst
                s.rem = 0
            else:
                s.level = level
            if admitted_ns // NS_PER_HOUR == s.hour_idx:
                s.hour_used = s.hour_used - refund if s.hour_used > refund else 0
            if admitted_ns // NS_PER_DAY == s.day_idx:
                s.day_used = s.day_used - refund if s.day_used > refund else 0
        elif actual_tokens > reserved_tokens:
            extra = actual_tokens - reserved_tokens
            level = s.level - extra * MTOK_PER_TOKEN
            s.level = level if level > -s.burst else -s.burst
            s.hour_used += extra
            s.day_used += extra
        self._finish(s, reserved_tokens)
        return refund

    def release(self, slot: int, now_ns: int, reserved_tokens: int) -> None:
        """Drop an expired, never-settled reservation: no refund, just not in flight."""
        slot = _i64(slot)
        now_ns = _i64(now_ns)
        reserved_tokens = _i64(reserved_tokens)
        _check_now("now_ns", now_ns)
        _check_tokens("reserved_tokens", reserved_tokens)
        s = self._get(slot)
        _refill(s, now_ns)
        self._finish(s, reserved_tokens)

    def _finish(self, s: _Slot, reserved_tokens: int) -> None:
        if s.inflight > 0:
            s.inflight -= 1
            self._total_inflight -= 1
        dec = reserved_tokens if reserved_tokens < s.inflight_tokens else s.inflight_tokens
        s.inflight_tokens -= dec
        self._total_inflight_tokens -= dec

    def add_usage(self, slot: int, now_ns: int, hour_tokens: int, day_tokens: int) -> None:
        """Count tokens already used in the current UTC hour and day (restoring the
        quota counters from the ledger at start): roll the windows to ``now_ns``,
        then add. Touches nothing else."""
        slot = _i64(slot)
        now_ns = _i64(now_ns)
        hour_tokens = _i64(hour_tokens)
        day_tokens = _i64(day_tokens)
        _check_now("now_ns", now_ns)
        for name, value in (("hour_tokens", hour_tokens), ("day_tokens", day_tokens)):
            if not 0 <= value <= MAX_USAGE_TOKENS:
                raise ValueError(f"{name} must be in [0, {MAX_USAGE_TOKENS}], got {value}")
        s = self._get(slot)
        _roll_windows(s, now_ns)
        s.hour_used += hour_tokens
        s.day_used += day_tokens

    def fill(self, slot: int, now_ns: int) -> None:
        """Fill ``slot``'s bucket to its burst at ``now_ns`` (a share of the
        tenant's limits granted here afresh: controlplane/service/shares.py).
        Touches nothing else."""
        slot = _i64(slot)
        now_ns = _i64(now_ns)
        _check_now("now_ns", now_ns)
        s = self._get(slot)
        _refill(s, now_ns)
        s.level = s.burst
        s.rem = 0

    def level_mtok(self, slot: int, now_ns: int) -> int:
        """Bucket level in mtok after refilling to ``now_ns`` (negative while in debt)."""
        slot = _i64(slot)
        now_ns = _i64(now_ns)
        _check_now("now_ns", now_ns)
        s = self._get(slot)
        _refill(s, now_ns)
        return s.level

    def inflight(self, slot: int) -> int:
        return self._get(_i64(slot)).inflight

    def inflight_tokens(self, slot: int) -> int:
        return self._get(_i64(slot)).inflight_tokens

    def total_inflight_tokens(self) -> int:
        """Tokens reserved by in-flight requests over all configured slots."""
        return self._total_inflight_tokens

    def total_inflight(self) -> int:
        """Requests in flight (open reservations) over all configured slots."""
        return self._total_inflight

    def snapshot(self, slot: int) -> dict[str, int]:
        """Every state and config field of ``slot`` (no refill; a pure read)."""
        s = self._get(_i64(slot))
        return {
            "rate_mtok_per_s": s.rate,
            "burst_mtok": s.burst,
            "hourly_quota": s.hourly_quota,
            "daily_quota": s.daily_quota,
            "max_concurrency": s.max_concurrency,
            "max_tokens_per_request": s.max_tokens_per_request,
            "level_mtok": s.level,
            "rem": s.rem,
            "last_ns": s.last_ns,
            "hour_idx": s.hour_idx,
            "hour_used": s.hour_used,
            "day_idx": s.day_idx,
            "day_used": s.day_used,
            "inflight": s.inflight,
            "inflight_tokens": s.inflight_tokens,
        }
