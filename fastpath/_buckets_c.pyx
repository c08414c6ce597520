# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
# cython: cdivision=True, autotestdict=False
#
# Compiled token-bucket table: the admission hot path.
#
# fastpath/_buckets_py.py is the reference and documents the semantics; this file must
# give bit-identical results (tests/unit/fastpath drives both with the same random
# operation sequences).  boundscheck/wraparound are off because every index is checked
# by hand (slots against _capacity, batch indexes by range(n)); cdivision is safe because
# every // and % below has a non-negative dividend and a positive divisor, where C's
# truncating division equals Python's flooring one.  The limits in fastpath/codes.py keep
# every product below 2**63.

cimport cython
from cpython.long cimport PyLong_AsLongLong, PyLong_CheckExact
from libc.stdint cimport int64_t
from libc.stdlib cimport calloc, free, realloc
from libc.string cimport memset

# C copies of fastpath/codes.py; test_fastpath_codes.py checks that they agree.
cdef extern from *:
    """
    #define BG_NS_PER_S 1000000000LL
    #define BG_NS_PER_HOUR (3600LL * BG_NS_PER_S)
    #define BG_NS_PER_DAY (86400LL * BG_NS_PER_S)
    #define BG_MTOK_PER_TOKEN 1000LL
    #define BG_MAX_RATE_MTOK_PER_S 1000000000LL
    #define BG_MAX_BURST_MTOK 1000000000000000LL
    #define BG_MAX_REQUEST_TOKENS 10000000LL
    #define BG_MAX_NOW_NS 4611686018427387904LL
    #define BG_MAX_SLOTS 1048576LL
    #define BG_RETRY_AFTER_NS_MAX 9223372036854775807LL
    #define BG_MAX_GLOBAL_INFLIGHT_TOKENS 1000000000000000LL
    #define BG_MAX_USAGE_TOKENS 1000000000000000LL
    /* whole seconds of a wait that still fit in int64 with the sub-second part added */
    #define BG_WAIT_S_MAX ((BG_RETRY_AFTER_NS_MAX - BG_NS_PER_S) / BG_NS_PER_S)
    """
    int64_t BG_NS_PER_S
    int64_t BG_NS_PER_HOUR
    int64_t BG_NS_PER_DAY
    int64_t BG_MTOK_PER_TOKEN
    int64_t BG_MAX_RATE_MTOK_PER_S
    int64_t BG_MAX_BURST_MTOK
    int64_t BG_MAX_REQUEST_TOKENS
    int64_t BG_MAX_NOW_NS
    int64_t BG_MAX_SLOTS
    int64_t BG_RETRY_AFTER_NS_MAX
    int64_t BG_MAX_GLOBAL_INFLIGHT_TOKENS
    int64_t BG_MAX_USAGE_TOKENS
    int64_t BG_WAIT_S_MAX

# fastpath.codes.Reason values the fastpath can return.
cdef enum:
    R_OK = 0
    R_TOKEN_RATE = 1
    R_HOURLY_QUOTA = 2
    R_DAILY_QUOTA = 3
    R_CONCURRENCY = 4
    R_MAX_TOKENS = 5
    R_GLOBAL_WATERMARK = 8
    R_OPEN_RESERVATIONS = 12


def _c_constants():
    """The C constants, for the test that compares them with fastpath.codes."""
    return {
        "NS_PER_S": BG_NS_PER_S,
        "NS_PER_HOUR": BG_NS_PER_HOUR,
        "NS_PER_DAY": BG_NS_PER_DAY,
        "MTOK_PER_TOKEN": BG_MTOK_PER_TOKEN,
        "MAX_RATE_MTOK_PER_S": BG_MAX_RATE_MTOK_PER_S,
        "MAX_BURST_MTOK": BG_MAX_BURST_MTOK,
        "MAX_REQUEST_TOKENS": BG_MAX_REQUEST_TOKENS,
        "MAX_NOW_NS": BG_MAX_NOW_NS,
        "MAX_SLOTS": BG_MAX_SLOTS,
        "RETRY_AFTER_NS_MAX": BG_RETRY_AFTER_NS_MAX,
        "MAX_GLOBAL_INFLIGHT_TOKENS": BG_MAX_GLOBAL_INFLIGHT_TOKENS,
        "MAX_USAGE_TOKENS": BG_MAX_USAGE_TOKENS,
        "OK": R_OK,
        "TOKEN_RATE": R_TOKEN_RATE,
        "HOURLY_QUOTA": R_HOURLY_QUOTA,
        "DAILY_QUOTA": R_DAILY_QUOTA,
        "CONCURRENCY": R_CONCURRENCY,
        "MAX_TOKENS": R_MAX_TOKENS,
        "GLOBAL_WATERMARK": R_GLOBAL_WATERMARK,
        "OPEN_RESERVATIONS": R_OPEN_RESERVATIONS,
    }


cdef inline void _refill(BucketSlot* s, int64_t now_ns) noexcept nogil:
    # Mirrors _buckets_py._refill: exact and path independent.
    cdef int64_t dt, secs, sub_ns, acc, level
    if now_ns <= s.last_ns:
        return
    dt = now_ns - s.last_ns
    s.last_ns = now_ns
    if s.level >= s.burst:
        s.rem = 0
        return
    secs = dt // BG_NS_PER_S
    sub_ns = dt - secs * BG_NS_PER_S
    # The reference's `secs >= (burst - level) // rate + 1`, without the division (the one
    # by a non-constant on this path): for integers, secs > floor(D / rate) <=> secs * rate
    # > D.  secs * rate <= dt <= MAX_NOW_NS since rate <= 1e9 mtok/s, so no overflow.
    if secs * s.rate > s.burst - s.level:
        s.level = s.burst
        s.rem = 0
        return
    acc = s.rate * sub_ns + s.rem
    level = s.level + s.rate * secs + acc // BG_NS_PER_S
    if level >= s.burst:
        s.level = s.burst
        s.rem = 0
    else:
        s.level = level
        s.rem = acc % BG_NS_PER_S


cdef inline void _roll_windows(BucketSlot* s, int64_t now_ns) noexcept nogil:
    cdef int64_t idx = now_ns // BG_NS_PER_HOUR  # now_ns >= 0, checked by every caller
    if idx > s.hour_idx:
        s.hour_idx = idx
        s.hour_used = 0
    idx = now_ns // BG_NS_PER_DAY
    if idx > s.day_idx:
        s.day_idx = idx
        s.day_used = 0


cdef inline int64_t _token_wait_ns(
    const BucketSlot* s, int64_t need_mtok, int64_t now_ns
) noexcept nogil:
    # Mirrors _buckets_py._token_wait_ns.
    cdef int64_t deficit = need_mtok - s.level  # > 0
    cdef int64_t q = deficit // s.rate
    cdef int64_t m = deficit - q * s.rate
    cdef int64_t x, wait, gap
    if q > BG_WAIT_S_MAX:
        return BG_RETRY_AFTER_NS_MAX
    x = m * BG_NS_PER_S - s.rem
    # ceil(x / rate), dividing only non-negative numbers.
    wait = q * BG_NS_PER_S + ((x + s.rate - 1) // s.rate if x >= 0 else -((-x) // s.rate))
    if s.last_ns > now_ns:
        gap = s.last_ns - now_ns
        if wait > BG_RETRY_AFTER_NS_MAX - gap:
            return BG_RETRY_AFTER_NS_MAX
        wait += gap
    return wait


cdef inline void _decide(
    BucketSlot* s,
    int64_t now_ns,
    int64_t prompt,
    int64_t max_tokens,
    int64_t global_limit,
    int64_t total_inflight,
    bint shadow,
    bint debt,
    bint open_full,
    int64_t slot_open_limit,
    Decision* d,
) noexcept nogil:
    # Mirrors _buckets_py._decide.  Inputs are validated: now_ns in [0, MAX_NOW_NS],
    # prompt and max_tokens >= 0, global_limit in [0, MAX_GLOBAL_INFLIGHT_TOKENS],
    # total_inflight >= 0, slot_open_limit >= 0.
    cdef int64_t per_request = s.max_tokens_per_request
    cdef int64_t estimate = max_tokens
    cdef int64_t hourly = s.hourly_quota
    cdef int64_t daily = s.daily_quota
    cdef int64_t cost = 0
    cdef int64_t need, level, floor, largest
    cdef int64_t reason = R_OK
    cdef int64_t retry_ns = 0
    _refill(s, now_ns)
    _roll_windows(s, now_ns)
    if per_request != 0 and max_tokens > per_request:
        estimate = per_request
    if (
        prompt > BG_MAX_REQUEST_TOKENS
        or estimate > BG_MAX_REQUEST_TOKENS - prompt
        or (per_request > 0 and prompt > per_request)
    ):
        reason = R_MAX_TOKENS
        # Only a shadow charge uses it: capped at the largest reservation settle accepts.
        if prompt > BG_MAX_REQUEST_TOKENS or estimate > BG_MAX_REQUEST_TOKENS - prompt:
            cost = BG_MAX_REQUEST_TOKENS
        else:
            cost = prompt + estimate
    else:
        cost = prompt + estimate
        need = cost * BG_MTOK_PER_TOKEN
        # the level a request needs: its cost (with debt 0); a full bucket for one over
        # the burst, which then goes into debt; up to one burst of debt either way
        if need > s.burst:
            floor = s.burst
        elif debt:
            floor = 0
        else:
            floor = need
        largest = 2 * s.burst  # burst <= 1e15 mtok: no overflow
        if (
            need > largest
            or (daily > 0 and cost > daily)
            or (hourly > 0 and cost > hourly)
            or (global_limit > 0 and cost > global_limit)
        ):
            reason = R_MAX_TOKENS
        elif daily > 0 and s.day_used + cost > daily:
            reason = R_DAILY_QUOTA
            retry_ns = (s.day_idx + 1) * BG_NS_PER_DAY - now_ns
        elif hourly > 0 and s.hour_used + cost > hourly:
            reason = R_HOURLY_QUOTA
            retry_ns = (s.hour_idx + 1) * BG_NS_PER_HOUR - now_ns
        elif s.max_concurrency > 0 and s.inflight >= s.max_concurrency:
            reason = R_CONCURRENCY
        elif s.level < floor:
            reason = R_TOKEN_RATE
            retry_ns = _token_wait_ns(s, floor, now_ns)
        elif global_limit > 0 and cost > global_limit - total_inflight:
            # limit - total cannot overflow: both are in [0, 2**63).
            reason = R_GLOBAL_WATERMARK
    # Memory protection, last: only what would be charged (shadow included) is refused.
    if (reason == R_OK or shadow) and (
        open_full or (slot_open_limit > 0 and s.inflight >= slot_open_limit)
    ):
        reason = R_OPEN_RESERVATIONS
        retry_ns = 0
    if reason == R_OK or (shadow and reason != R_OPEN_RESERVATIONS):
        # level >= -burst >= -1e15 and cost * 1000 <= 1e10: no overflow; when OK the
        # debt stays within one burst and the floor never binds.
        level = s.level - cost * BG_MTOK_PER_TOKEN
        s.level = level if level > -s.burst else -s.burst
        s.hour_used += cost
        s.day_used += cost
        s.inflight += 1
        s.inflight_tokens += cost
    else:
        cost = 0
    d.reason = reason
    d.reserved = cost
    d.retry_ns = retry_ns
    d.bucket_rem = s.level // BG_MTOK_PER_TOKEN if s.level > 0 else 0
    if hourly > 0:
        d.hour_rem = hourly - s.hour_used if s.hour_used < hourly else 0
    else:
        d.hour_rem = -1
    if daily > 0:
        d.day_rem = daily - s.day_used if s.day_used < daily else 0
    else:
        d.day_rem = -1


cdef inline int _check_now(str name, int64_t now_ns) except -1:
    if now_ns < 0 or now_ns > BG_MAX_NOW_NS:
        raise ValueError(f"{name} must be in [0, {BG_MAX_NOW_NS}], got {now_ns}")
    return 0


cdef inline int _check_tokens(str name, int64_t tokens) except -1:
    if tokens < 0 or tokens > BG_MAX_REQUEST_TOKENS:
        raise ValueError(f"{name} must be in [0, {BG_MAX_REQUEST_TOKENS}], got {tokens}")
    return 0


cdef inline int64_t _i64(object value) except? -1:
    # Integer arguments are converted here rather than by typed ``int64_t`` parameters:
    # Cython's conversion accepts anything with __int__ and so truncates floats, while
    # this (like the reference's operator.index) raises TypeError for non-integers and
    # OverflowError outside int64.  Exact ints take Cython's fast digit path.
    if PyLong_CheckExact(value):
        return <int64_t>value
    return PyLong_AsLongLong(value)


@cython.final
@cython.auto_pickle(False)
cdef class TokenBucketTable:
    """Per-tenant token buckets, UTC hour/day quotas and concurrency counters.

    Compiled twin of fastpath._buckets_py.TokenBucketTable (see there for the contract).
    Not thread-safe: one event loop owns it; the GIL is held throughout every call.
    Public methods take plain ``object`` parameters (named as in the reference, so
    keyword calls work alike) and convert them with _i64 into ``c_*`` locals.
    """

    def __cinit__(self, capacity=64):
        cdef int64_t c_capacity = _i64(capacity)
        if c_capacity < 1 or c_capacity > BG_MAX_SLOTS:
            raise ValueError(f"capacity must be in [1, {BG_MAX_SLOTS}], got {c_capacity}")
        self._slots = <BucketSlot*>calloc(<size_t>c_capacity, sizeof(BucketSlot))
        if self._slots == NULL:
            raise MemoryError()
        self._capacity = <Py_ssize_t>c_capacity
        self._total_inflight_tokens = 0
        self._global_limit = 0
        self._debt = False
        self._total_inflight = 0
        self._open_limit = 0
        self._slot_open_limit = 0

    def __dealloc__(self):
        free(self._slots)
        self._slots = NULL

    @property
    def capacity(self):
        """Number of slots allocated (configured or not)."""
        return self._capacity

    cdef int _grow(self, Py_ssize_t min_capacity) except -1:
        cdef Py_ssize_t new_capacity = 2 * self._capacity
        if new_capacity > BG_MAX_SLOTS:
            new_capacity = <Py_ssize_t>BG_MAX_SLOTS
        if new_capacity < min_capacity:
            new_capacity = min_capacity
        cdef BucketSlot* grown = <BucketSlot*>realloc(
            self._slots, <size_t>new_capacity * sizeof(BucketSlot)
        )
        if grown == NULL:
            raise MemoryError()  # the old array is still valid and still ours
        memset(
            &grown[self._capacity], 0,
            <size_t>(new_capacity - self._capacity) * sizeof(BucketSlot),
        )
        self._slots = grown
        self._capacity = new_capacity
        return 0

    cdef BucketSlot* _get(self, int64_t slot) except NULL:
        if slot < 0 or slot >= self._capacity or not self._slots[slot].configured:
            raise KeyError(f"slot {slot} is not configured")
        return &self._slots[slot]

    cdef void _finish(self, BucketSlot* s, int64_t reserved_tokens) noexcept:
        cdef int64_t dec = reserved_tokens
        if s.inflight > 0:
            s.inflight -= 1
            self._total_inflight -= 1
        if dec > s.inflight_tokens:
            dec = s.inflight_tokens
        s.inflight_tokens -= dec
        self._total_inflight_tokens -= dec

    def configure(
        self,
        slot,
        now_ns,
        rate_mtok_per_s,
        burst_mtok,
        hourly_quota,
        daily_quota,
        max_concurrency,
        max_tokens_per_request,
    ):
        """Create or live-reconfigure ``slot``; a new slot starts with a full bucket."""
        cdef int64_t c_slot = _i64(slot)
        cdef int64_t c_now = _i64(now_ns)
        cdef int64_t c_rate = _i64(rate_mtok_per_s)
        cdef int64_t c_burst = _i64(burst_mtok)
        cdef int64_t c_hourly = _i64(hourly_quota)
        cdef int64_t c_daily = _i64(daily_quota)
        cdef int64_t c_max_conc = _i64(max_concurrency)
        cdef int64_t c_per_request = _i64(max_tokens_per_request)
        cdef BucketSlot* s
        if c_slot < 0 or c_slot >= BG_MAX_SLOTS:
            raise ValueError(f"slot must be in [0, {BG_MAX_SLOTS}), got {c_slot}")
        _check_now("now_ns", c_now)
        if c_rate < 1 or c_rate > BG_MAX_RATE_MTOK_PER_S:
            raise ValueError(
                f"rate_mtok_per_s must be in [1, {BG_MAX_RATE_MTOK_PER_S}], got {c_rate}"
            )
        if c_burst < BG_MTOK_PER_TOKEN or c_burst > BG_MAX_BURST_MTOK:
            raise ValueError(
                f"burst_mtok must be in [{BG_MTOK_PER_TOKEN}, {BG_MAX_BURST_MTOK}], "
                f"got {c_burst}"
            )
        if c_hourly < 0:
            raise ValueError(f"hourly_quota must be >= 0 (0 = unlimited), got {c_hourly}")
        if c_daily < 0:
            raise ValueError(f"daily_quota must be >= 0 (0 = unlimited), got {c_daily}")
        if c_max_conc < 0:
            raise ValueError(f"max_concurrency must be >= 0 (0 = unlimited), got {c_max_conc}")
        if c_per_request < 0 or c_per_request > BG_MAX_REQUEST_TOKENS:
            raise ValueError(
                f"max_tokens_per_request must be in [0, {BG_MAX_REQUEST_TOKENS}] (0 = no cap), "
                f"got {c_per_request}"
            )
        if c_slot >= self._capacity:
            self._grow(<Py_ssize_t>c_slot + 1)
        s = &self._slots[c_slot]
        if not s.configured:
            memset(s, 0, sizeof(BucketSlot))
            s.configured = 1
            s.rate = c_rate
            s.burst = c_burst
            s.level = c_burst
            s.last_ns = c_now
            s.hour_idx = c_now // BG_NS_PER_HOUR
            s.day_idx = c_now // BG_NS_PER_DAY
        else:
            _refill(s, c_now)  # at the old rate, up to now
            s.rate = c_rate
            s.burst = c_burst
            if s.level >= c_burst:
                s.level = c_burst
                s.rem = 0
            elif s.level < -c_burst:
                s.level = -c_burst
        s.hourly_quota = c_hourly
        s.daily_quota = c_daily
        s.max_concurrency = c_max_conc
        s.max_tokens_per_request = c_per_request

    def is_configured(self, slot):
        cdef int64_t c_slot = _i64(slot)
        return 0 <= c_slot < self._capacity and self._slots[c_slot].configured != 0

    def remove(self, slot):
        """Forget ``slot``; configuring it again starts a fresh, full bucket."""
        cdef BucketSlot* s = self._get(_i64(slot))
        self._total_inflight_tokens -= s.inflight_tokens
        self._total_inflight -= s.inflight
        memset(s, 0, sizeof(BucketSlot))

    def set_global_inflight_limit(self, tokens):
        """Set the global safe watermark on in-flight tokens over all slots (0 = off)."""
        cdef int64_t c_tokens = _i64(tokens)
        if c_tokens < 0 or c_tokens > BG_MAX_GLOBAL_INFLIGHT_TOKENS:
            raise ValueError(
                f"tokens must be in [0, {BG_MAX_GLOBAL_INFLIGHT_TOKENS}] (0 = off), "
                f"got {c_tokens}"
            )
        self._global_limit = c_tokens

    def global_inflight_limit(self):
        """The global in-flight watermark in tokens, 0 when off."""
        return self._global_limit

    def set_bucket_debt(self, enabled):
        """Let every bucket go one burst into debt (see ``admit``); off by default."""
        self._debt = bool(enabled)

    def bucket_debt(self):
        return bool(self._debt)

    def set_open_limits(self, total, per_slot):
        """Cap open reservations over all slots and per slot (0 = no cap); see the reference."""
        cdef int64_t c_total = _i64(total)
        cdef int64_t c_per_slot = _i64(per_slot)
        if c_total < 0:
            raise ValueError(f"total must be >= 0 (0 = no cap), got {c_total}")
        if c_per_slot < 0:
            raise ValueError(f"per_slot must be >= 0 (0 = no cap), got {c_per_slot}")
        self._open_limit = c_total
        self._slot_open_limit = c_per_slot

    def open_limits(self):
        """(total, per_slot) caps on open reservations, 0 = none."""
        return (self._open_limit, self._slot_open_limit)

    cdef tuple _one(self, object slot, object now_ns, object prompt_tokens,
                    object max_tokens, bint shadow):
        cdef int64_t c_slot = _i64(slot)
        cdef int64_t c_now = _i64(now_ns)
        cdef int64_t c_prompt = _i64(prompt_tokens)
        cdef int64_t c_max = _i64(max_tokens)
        cdef Decision d
        cdef BucketSlot* s
        cdef int64_t before
        _check_now("now_ns", c_now)
        if c_prompt < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {c_prompt}")
        if c_max < 0:
            raise ValueError(f"max_tokens must be >= 0, got {c_max}")
        s = self._get(c_slot)
        before = s.inflight
        _decide(
            s, c_now, c_prompt, c_max,
            self._global_limit, self._total_inflight_tokens, shadow, self._debt,
            0 < self._open_limit <= self._total_inflight, self._slot_open_limit, &d,
        )
        self._total_inflight_tokens += d.reserved
        self._total_inflight += s.inflight - before
        return (d.reason, d.reserved, d.retry_ns, d.bucket_rem, d.hour_rem, d.day_rem)

    def admit(self, slot, now_ns, prompt_tokens, max_tokens):
        """Decide one request; see _buckets_py.TokenBucketTable.admit."""
        return self._one(slot, now_ns, prompt_tokens, max_tokens, False)

    def charge(self, slot, now_ns, prompt_tokens, max_tokens):
        """Shadow mode: ``admit``'s answer, the cost always reserved; see the reference."""
        return self._one(slot, now_ns, prompt_tokens, max_tokens, True)

    def admit_batch(
        self,
        now_ns,
        const long long[:] slots not None,
        const long long[:] prompt not None,
        const long long[:] max_tokens not None,
        long long[:] out_reason not None,
        long long[:] out_reserved not None,
        long long[:] out_retry_ns not None,
        long long[:] out_bucket_rem not None,
        long long[:] out_hour_rem not None,
        long long[:] out_day_rem not None,
        const long long[:] shadow=None,
    ):
        """``admit`` (or ``charge`` where ``shadow[i]`` is nonzero) for each entry in order.

        Returns how many entries got reason OK.  No Python object is created per entry.
        Bad input raises before any entry is decided, so a failed call changes nothing.
        """
        cdef int64_t c_now = _i64(now_ns)
        cdef Py_ssize_t n = slots.shape[0]
        cdef Py_ssize_t i
        cdef int64_t slot
        cdef Py_ssize_t admitted = 0
        cdef bint has_shadow = shadow is not None
        cdef Decision d
        cdef BucketSlot* s
        cdef int64_t before
        if (
            prompt.shape[0] != n
            or max_tokens.shape[0] != n
            or out_reason.shape[0] != n
            or out_reserved.shape[0] != n
            or out_retry_ns.shape[0] != n
            or out_bucket_rem.shape[0] != n
            or out_hour_rem.shape[0] != n
            or out_day_rem.shape[0] != n
            or (has_shadow and shadow.shape[0] != n)
        ):
            raise ValueError("admit_batch arrays must all have the same length")
        _check_now("now_ns", c_now)
        for i in range(n):
            slot = slots[i]
            if slot < 0:
                continue
            if prompt[i] < 0:
                raise ValueError(f"prompt[{i}] must be >= 0, got {prompt[i]}")
            if max_tokens[i] < 0:
                raise ValueError(f"max_tokens[{i}] must be >= 0, got {max_tokens[i]}")
            if slot >= self._capacity or not self._slots[slot].configured:
                raise KeyError(f"slot {slot} is not configured")
        for i in range(n):
            slot = slots[i]
            if slot < 0:
                continue
            s = &self._slots[slot]
            before = s.inflight
            _decide(
                s, c_now, prompt[i], max_tokens[i],
                self._global_limit, self._total_inflight_tokens,
                has_shadow and shadow[i] != 0, self._debt,
                0 < self._open_limit <= self._total_inflight, self._slot_open_limit, &d,
            )
            self._total_inflight += s.inflight - before
            out_reason[i] = d.reason
            out_reserved[i] = d.reserved
            out_retry_ns[i] = d.retry_ns
            out_bucket_rem[i] = d.bucket_rem
            out_hour_rem[i] = d.hour_rem
            out_day_rem[i] = d.day_rem
            self._total_inflight_tokens += d.reserved
            if d.reason == R_OK:
                admitted += 1
        return admitted

    def settle(self, slot, now_ns, reserved_tokens, actual_tokens, admitted_ns):
        """Report a finished request's real usage; returns the refunded tokens (>= 0)."""
        cdef int64_t c_slot = _i64(slot)
        cdef int64_t c_now = _i64(now_ns)
        cdef int64_t c_reserved = _i64(reserved_tokens)
        cdef int64_t c_actual = _i64(actual_tokens)
        cdef int64_t c_admitted = _i64(admitted_ns)
        cdef BucketSlot* s
        cdef int64_t refund = 0
        cdef int64_t extra, level
        _check_now("now_ns", c_now)
        _check_tokens("reserved_tokens", c_reserved)
        _check_tokens("actual_tokens", c_actual)
        _check_now("admitted_ns", c_admitted)
        s = self._get(c_slot)
        _refill(s, c_now)
        _roll_windows(s, c_now)
        if c_actual < c_reserved:
            refund = c_reserved - c_actual
            level = s.level + refund * BG_MTOK_PER_TOKEN
            if level >= s.burst:
                s.level = s.burst
                s.rem = 0
            else:
                s.level = level
            # Give quota back only to the window the tokens were charged to.
            if c_admitted // BG_NS_PER_HOUR == s.hour_idx:
                s.hour_used = s.hour_used - refund if s.hour_used > refund else 0
            if c_admitted // BG_NS_PER_DAY == s.day_idx:
                s.day_used = s.day_used - refund if s.day_used > refund else 0
        elif c_actual > c_reserved:
            extra = c_actual - c_reserved
            level = s.level - extra * BG_MTOK_PER_TOKEN
            s.level = level if level > -s.burst else -s.burst
            s.hour_used += extra
            s.day_used += extra
        self._finish(s, c_reserved)
        return refund

    def release(self, slot, now_ns, reserved_tokens):
        """Drop an expired, never-settled reservation: no refund, just not in flight."""
        cdef int64_t c_slot = _i64(slot)
        cdef int64_t c_now = _i64(now_ns)
        cdef int64_t c_reserved = _i64(reserved_tokens)
        cdef BucketSlot* s
        _check_now("now_ns", c_now)
        _check_tokens("reserved_tokens", c_reserved)
        s = self._get(c_slot)
        _refill(s, c_now)
        self._finish(s, c_reserved)

    def add_usage(self, slot, now_ns, hour_tokens, day_tokens):
        """Count tokens already used in the current UTC hour and day (restoring the
        quota counters from the ledger at start): roll the windows to ``now_ns``,
        then add. Touches nothing else."""
        cdef int64_t c_slot = _i64(slot)
        cdef int64_t c_now = _i64(now_ns)
        cdef int64_t c_hour = _i64(hour_tokens)
        cdef int64_t c_day = _i64(day_tokens)
        cdef BucketSlot* s
        _check_now("now_ns", c_now)
        if not 0 <= c_hour <= BG_MAX_USAGE_TOKENS:
            raise ValueError(f"hour_tokens must be in [0, {BG_MAX_USAGE_TOKENS}], got {c_hour}")
        if not 0 <= c_day <= BG_MAX_USAGE_TOKENS:
            raise ValueError(f"day_tokens must be in [0, {BG_MAX_USAGE_TOKENS}], got {c_day}")
        s = self._get(c_slot)
        _roll_windows(s, c_now)
        s.hour_used += c_hour
        s.day_used += c_day

    def fill(self, slot, now_ns):
        """Fill ``slot``'s bucket to its burst at ``now_ns`` (a share of the
        tenant's limits granted here afresh: controlplane/service/shares.py).
        Touches nothing else."""
        cdef int64_t c_slot = _i64(slot)
        cdef int64_t c_now = _i64(now_ns)
        cdef BucketSlot* s
        _check_now("now_ns", c_now)
        s = self._get(c_slot)
        _refill(s, c_now)
        s.level = s.burst
        s.rem = 0

    def level_mtok(self, slot, now_ns):
        """Bucket level in mtok after refilling to ``now_ns`` (negative while in debt)."""
        cdef int64_t c_slot = _i64(slot)
        cdef int64_t c_now = _i64(now_ns)
        cdef BucketSlot* s
        _check_now("now_ns", c_now)
        s = self._get(c_slot)
        _refill(s, c_now)
        return s.level

    def inflight(self, slot):
        return self._get(_i64(slot)).inflight

    def inflight_tokens(self, slot):
        return self._get(_i64(slot)).inflight_tokens

    def total_inflight_tokens(self):
        """Tokens reserved by in-flight requests over all configured slots."""
        return self._total_inflight_tokens

    def total_inflight(self):
        """Requests in flight (open reservations) over all configured slots."""
        return self._total_inflight

    def snapshot(self, slot):
        """Every state and config field of ``slot`` (no refill; a pure read)."""
        cdef BucketSlot* s = self._get(_i64(slot))
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
