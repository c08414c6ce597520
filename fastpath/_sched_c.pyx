# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
# cython: cdivision=True, autotestdict=False
#
# Compiled scheduling primitives: backpressure score, drain wait, shed thresholds and the
# virtual-time fair queue.
#
# fastpath/_sched_py.py is the reference and documents the semantics; this file must give
# bit-identical results (tests/unit/fastpath drives both with the same inputs and random
# operation sequences).  boundscheck/wraparound are off because every index is checked by
# hand (flows against _capacity, eligible against its length); cdivision is safe because
# every // below has a non-negative dividend and a positive divisor.  The limits in
# fastpath/codes.py keep every product below 2**63.

cimport cython
from cpython.buffer cimport PyBUF_RECORDS_RO, PyBuffer_Release, PyObject_GetBuffer
from cpython.long cimport PyLong_AsLongLong, PyLong_CheckExact
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport strcmp

# C copies of fastpath/codes.py; test_fastpath_codes.py checks that they agree.
cdef extern from *:
    """
    #define BG_NS_PER_S 1000000000LL
    #define BG_PPM 1000000LL
    #define BG_MAX_REQUEST_TOKENS 10000000LL
    #define BG_MAX_BACKPRESSURE_CAPACITY 1000000000000LL
    #define BG_MAX_FLOWS 1048576LL
    #define BG_VT_MAX 2305843009213693952LL
    """
    int64_t BG_NS_PER_S
    int64_t BG_PPM
    int64_t BG_MAX_REQUEST_TOKENS
    int64_t BG_MAX_BACKPRESSURE_CAPACITY
    int64_t BG_MAX_FLOWS
    int64_t BG_VT_MAX


def _c_constants():
    """The C constants, for the test that compares them with fastpath.codes."""
    return {
        "NS_PER_S": BG_NS_PER_S,
        "PPM": BG_PPM,
        "MAX_REQUEST_TOKENS": BG_MAX_REQUEST_TOKENS,
        "MAX_BACKPRESSURE_CAPACITY": BG_MAX_BACKPRESSURE_CAPACITY,
        "MAX_FLOWS": BG_MAX_FLOWS,
        "VT_MAX": BG_VT_MAX,
    }


cdef inline int64_t _i64(object value) except? -1:
    # As in _buckets_c: TypeError for non-integers (no float truncation), OverflowError
    # outside int64, like the reference's operator.index plus its range check.
    if PyLong_CheckExact(value):
        return <int64_t>value
    return PyLong_AsLongLong(value)


cdef inline int _check_range(str name, int64_t value, int64_t low, int64_t high) except -1:
    if value < low or value > high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return 0


# --- backpressure ------------------------------------------------------------------


def backpressure_score_ppm(
    batch_tokens,
    max_batch_tokens,
    queue_depth,
    queue_capacity,
    miss_ppm,
    kv_ppm,
    alpha_ppm,
    beta_ppm,
    gamma_ppm,
    delta_ppm,
):
    """The weighted mean of the load signals present (miss/kv -1 = absent), in ppm."""
    cdef int64_t batch = _i64(batch_tokens)
    cdef int64_t max_batch = _i64(max_batch_tokens)
    cdef int64_t depth = _i64(queue_depth)
    cdef int64_t capacity = _i64(queue_capacity)
    cdef int64_t miss = _i64(miss_ppm)
    cdef int64_t kv = _i64(kv_ppm)
    cdef int64_t alpha = _i64(alpha_ppm)
    cdef int64_t beta = _i64(beta_ppm)
    cdef int64_t gamma = _i64(gamma_ppm)
    cdef int64_t delta = _i64(delta_ppm)
    cdef int64_t r_batch, r_queue, total, weights
    if batch < 0:
        raise ValueError(f"batch_tokens must be >= 0, got {batch}")
    _check_range("max_batch_tokens", max_batch, 1, BG_MAX_BACKPRESSURE_CAPACITY)
    if depth < 0:
        raise ValueError(f"queue_depth must be >= 0, got {depth}")
    _check_range("queue_capacity", capacity, 1, BG_MAX_BACKPRESSURE_CAPACITY)
    _check_range("miss_ppm", miss, -1, BG_PPM)
    _check_range("kv_ppm", kv, -1, BG_PPM)
    _check_range("alpha_ppm", alpha, 0, BG_PPM)
    _check_range("beta_ppm", beta, 0, BG_PPM)
    _check_range("gamma_ppm", gamma, 0, BG_PPM)
    _check_range("delta_ppm", delta, 0, BG_PPM)
    if batch > max_batch:
        batch = max_batch
    if depth > capacity:
        depth = capacity
    r_batch = batch * BG_PPM // max_batch  # <= 1e18
    r_queue = depth * BG_PPM // capacity
    total = alpha * r_batch + beta * r_queue  # every sum <= 4e12
    weights = alpha + beta
    if miss >= 0:
        total += gamma * miss
        weights += gamma
    if kv >= 0:
        total += delta * kv
        weights += delta
    if weights == 0:
        return 0
    return total // weights


def backpressure_retry_ns(score_ppm, target_ppm, drain_ppm_per_s, cap_ns):
    """Nanoseconds until a pool at ``score_ppm`` losing ``drain_ppm_per_s`` gets to target."""
    cdef int64_t score = _i64(score_ppm)
    cdef int64_t target = _i64(target_ppm)
    cdef int64_t drain = _i64(drain_ppm_per_s)
    cdef int64_t cap = _i64(cap_ns)
    cdef int64_t excess, wait
    _check_range("score_ppm", score, 0, BG_PPM)
    _check_range("target_ppm", target, 0, BG_PPM)
    if cap < 0:
        raise ValueError(f"cap_ns must be >= 0, got {cap}")
    if score <= target:
        return 0
    if drain <= 0:
        return cap
    excess = (score - target) * BG_NS_PER_S  # <= 1e15
    wait = excess // drain
    if wait * drain != excess:  # wait * drain <= excess: no overflow
        wait += 1
    return wait if wait < cap else cap


def shed_threshold_ppm(rank, sheddable, soft_ppm, hard_ppm):
    """Backpressure score at which sheddable lane ``rank`` (0 = lowest) starts being held."""
    cdef int64_t c_rank = _i64(rank)
    cdef int64_t c_sheddable = _i64(sheddable)
    cdef int64_t soft = _i64(soft_ppm)
    cdef int64_t hard = _i64(hard_ppm)
    _check_range("sheddable", c_sheddable, 1, BG_MAX_FLOWS)
    _check_range("rank", c_rank, 0, c_sheddable - 1)
    _check_range("soft_ppm", soft, 0, BG_PPM)
    _check_range("hard_ppm", hard, soft, BG_PPM)
    return soft + (hard - soft) * c_rank // c_sheddable  # <= 1e6 * 2**20


# --- fair queueing -----------------------------------------------------------------


cdef inline int64_t _flow_arg(object flow) except? -1:
    cdef int64_t f = _i64(flow)
    if f < 0 or f >= BG_MAX_FLOWS:
        raise ValueError(f"flow must be in [0, {BG_MAX_FLOWS}), got {f}")
    return f


cdef inline bint _byte_format(const char* fmt) noexcept:
    # 1-byte integers: "b" or "B", optionally behind a byte-order prefix (meaningless for
    # one byte).  A NULL format means "B" by the buffer protocol.
    if fmt == NULL:
        return True
    if fmt[0] in b"@=<>!":
        fmt += 1
    return strcmp(fmt, b"b") == 0 or strcmp(fmt, b"B") == 0


@cython.final
@cython.auto_pickle(False)
cdef class FairQueue:
    """Virtual-time fair queueing over small-integer flows (start-time fair queueing).

    Compiled twin of fastpath._sched_py.FairQueue (see there for the contract).  Not
    thread-safe: one event loop owns it; the GIL is held throughout every call.
    """

    def __cinit__(self, capacity=16, renormalize_above=BG_VT_MAX):
        cdef int64_t c_capacity = _i64(capacity)
        cdef int64_t c_above = _i64(renormalize_above)
        _check_range("capacity", c_capacity, 1, BG_MAX_FLOWS)
        _check_range("renormalize_above", c_above, 1, BG_VT_MAX)
        self._flows = NULL
        self._active = NULL
        self._capacity = 0
        self._n_active = 0
        self._last_vt = 0
        self._renormalize_above = c_above
        self._renormalizations = 0
        self._grow(<Py_ssize_t>c_capacity)

    def __dealloc__(self):
        free(self._flows)
        free(self._active)
        self._flows = NULL
        self._active = NULL

    @property
    def capacity(self):
        """Number of flows allocated."""
        return self._capacity

    @property
    def renormalize_above(self):
        return self._renormalize_above

    @property
    def last_vt(self):
        """Virtual time of the last service start (the start tag of the last charge)."""
        return self._last_vt

    cdef int _grow(self, Py_ssize_t min_capacity) except -1:
        # Same growth rule as the reference: max(flow + 1, min(2 * capacity, MAX_FLOWS)).
        cdef Py_ssize_t new_capacity = 2 * self._capacity
        cdef Py_ssize_t f
        if new_capacity > BG_MAX_FLOWS:
            new_capacity = <Py_ssize_t>BG_MAX_FLOWS
        if new_capacity < min_capacity:
            new_capacity = min_capacity
        cdef Flow* flows = <Flow*>realloc(self._flows, <size_t>new_capacity * sizeof(Flow))
        if flows == NULL:
            raise MemoryError()  # the old arrays are still valid and still ours
        self._flows = flows
        cdef int64_t* active = <int64_t*>realloc(
            self._active, <size_t>new_capacity * sizeof(int64_t)
        )
        if active == NULL:
            raise MemoryError()  # _flows is bigger, harmlessly; _capacity is unchanged
        self._active = active
        for f in range(self._capacity, new_capacity):
            flows[f].weight = BG_PPM
            flows[f].vt = 0
            flows[f].rem = 0
            flows[f].pos = -1
        self._capacity = new_capacity
        return 0

    cdef int64_t _floor(self) noexcept:
        # Smallest vt over active flows, or last_vt when none is active.
        cdef Py_ssize_t k
        cdef int64_t v
        cdef int64_t floor
        if self._n_active == 0:
            return self._last_vt
        floor = self._flows[self._active[0]].vt
        for k in range(1, self._n_active):
            v = self._flows[self._active[k]].vt
            if v < floor:
                floor = v
        return floor

    cdef void _renormalize(self) noexcept:
        cdef int64_t floor = self._floor()
        cdef Py_ssize_t f
        cdef int64_t v
        for f in range(self._capacity):
            v = self._flows[f].vt - floor
            if v > BG_VT_MAX:
                self._flows[f].vt = BG_VT_MAX
                self._flows[f].rem = 0
            elif v < 0:
                self._flows[f].vt = 0
                self._flows[f].rem = 0
            else:
                self._flows[f].vt = v
        v = self._last_vt - floor
        self._last_vt = v if v > 0 else 0
        self._renormalizations += 1

    def set_weight(self, flow, weight_ppm):
        """Set a flow's weight (ppm, 1..PPM); it applies to later charges."""
        cdef int64_t f = _i64(flow)
        cdef int64_t w = _i64(weight_ppm)
        if f < 0 or f >= BG_MAX_FLOWS:
            raise ValueError(f"flow must be in [0, {BG_MAX_FLOWS}), got {f}")
        _check_range("weight_ppm", w, 1, BG_PPM)
        if f >= self._capacity:
            self._grow(<Py_ssize_t>f + 1)
        if self._flows[f].weight != w:
            self._flows[f].weight = w
            self._flows[f].rem = 0  # a remainder of the old weight means nothing for the new

    def weight(self, flow):
        cdef int64_t f = _flow_arg(flow)
        return self._flows[f].weight if f < self._capacity else BG_PPM

    def vt(self, flow):
        cdef int64_t f = _flow_arg(flow)
        return self._flows[f].vt if f < self._capacity else 0

    def is_active(self, flow):
        cdef int64_t f = _flow_arg(flow)
        return f < self._capacity and self._flows[f].pos >= 0

    def active_count(self):
        return self._n_active

    def activate(self, flow):
        """``flow`` became backlogged: lift its vt to the floor; no-op if already active."""
        cdef int64_t f = _flow_arg(flow)
        cdef int64_t floor
        if f >= self._capacity:
            self._grow(<Py_ssize_t>f + 1)
        cdef Flow* s = &self._flows[f]
        if s.pos >= 0:
            return
        floor = self._floor()
        if s.vt < floor:
            s.vt = floor
            s.rem = 0
        s.pos = self._n_active
        self._active[self._n_active] = f
        self._n_active += 1

    cdef void _remove_active(self, Flow* s) noexcept:
        # Swap-remove from _active; the moved flow's pos follows it.
        cdef Py_ssize_t last = self._n_active - 1
        cdef int64_t moved = self._active[last]
        self._active[s.pos] = moved
        self._flows[moved].pos = s.pos
        s.pos = -1
        self._n_active = last

    def deactivate(self, flow):
        """``flow``'s queue emptied; no-op if not active."""
        cdef int64_t f = _flow_arg(flow)
        if f < self._capacity and self._flows[f].pos >= 0:
            self._remove_active(&self._flows[f])

    def reset(self, flow):
        """Forget ``flow`` (e.g. its tenant was removed): inactive, weight PPM, vt 0."""
        cdef int64_t f = _flow_arg(flow)
        cdef Flow* s
        if f < self._capacity:
            s = &self._flows[f]
            if s.pos >= 0:
                self._remove_active(s)
            s.weight = BG_PPM
            s.vt = 0
            s.rem = 0

    def pick(self, eligible=None):
        """The active flow with the smallest vt (ties: smallest index), or -1."""
        cdef Py_ssize_t k
        cdef int64_t f, v
        cdef int64_t best = -1
        cdef int64_t best_vt = 0
        cdef int64_t too_far = -1
        cdef Py_buffer view
        cdef const char* data
        cdef Py_ssize_t stride, n
        if eligible is None:
            for k in range(self._n_active):
                f = self._active[k]
                v = self._flows[f].vt
                if best < 0 or v < best_vt or (v == best_vt and f < best):
                    best = f
                    best_vt = v
            return best
        try:
            PyObject_GetBuffer(eligible, &view, PyBUF_RECORDS_RO)
        except TypeError as exc:
            raise TypeError("eligible must be a 1-D int8/uint8 buffer (or bytearray)") from exc
        try:
            if view.ndim != 1:
                raise ValueError(f"eligible must be 1-D, got {view.ndim} dimensions")
            if view.itemsize != 1 or not _byte_format(view.format):
                fmt = "B" if view.format == NULL else view.format.decode("ascii", "replace")
                raise ValueError(f"eligible must hold int8/uint8 items, got format {fmt!r}")
            data = <const char*>view.buf
            n = view.shape[0]
            stride = view.strides[0]
            for k in range(self._n_active):
                f = self._active[k]
                if f >= n:
                    if f > too_far:
                        too_far = f
                    continue
                if data[f * stride] != 0:
                    v = self._flows[f].vt
                    if best < 0 or v < best_vt or (v == best_vt and f < best):
                        best = f
                        best_vt = v
        finally:
            PyBuffer_Release(&view)
        if too_far >= 0:
            raise ValueError(f"eligible has {n} entries but flow {too_far} is active")
        return best

    def charge(self, flow, cost_tokens):
        """Account ``cost_tokens`` served to ``flow`` (active or not)."""
        cdef int64_t f = _i64(flow)
        cdef int64_t cost = _i64(cost_tokens)
        cdef int64_t start, vt, acc
        cdef Flow* s
        if f < 0 or f >= BG_MAX_FLOWS:
            raise ValueError(f"flow must be in [0, {BG_MAX_FLOWS}), got {f}")
        _check_range("cost_tokens", cost, 0, 2 * BG_MAX_REQUEST_TOKENS)
        if f >= self._capacity:
            self._grow(<Py_ssize_t>f + 1)
        s = &self._flows[f]
        start = s.vt
        acc = cost * BG_PPM + s.rem  # < 2e13 + 1e6
        vt = start + acc // s.weight  # <= VT_MAX + 2e13 + 1e6 < 2**62
        s.rem = acc % s.weight
        s.vt = vt
        self._last_vt = start
        if vt > self._renormalize_above:
            self._renormalize()

    def snapshot(self):
        """The queue's state and every flow that is not in its default state."""
        cdef Py_ssize_t f
        cdef Flow* s
        flows = {}
        for f in range(self._capacity):
            s = &self._flows[f]
            if s.pos >= 0 or s.vt != 0 or s.rem != 0 or s.weight != BG_PPM:
                flows[f] = {
                    "weight_ppm": s.weight, "vt": s.vt, "rem": s.rem, "active": s.pos >= 0
                }
        return {
            "capacity": self._capacity,
            "renormalize_above": self._renormalize_above,
            "last_vt": self._last_vt,
            "renormalizations": self._renormalizations,
            "active_count": self._n_active,
            "flows": flows,
        }
