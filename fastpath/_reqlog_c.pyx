# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
# cython: cdivision=True, autotestdict=False
#
# Compiled request table: what the plane remembers per request, in C storage.
#
# fastpath/_reqlog_py.py is the reference and documents the semantics; this file must give
# the same answers (tests/unit/fastpath drives both with the same random operation
# sequences, expiry and duplicates included).  Nothing per request is a Python object:
#
# * slots: one fixed-size record per remembered request (Slot, 121 bytes: the key, a
#   generation and the row in narrow columns, below), in blocks of 2,048 slots that are
#   allocated once and never moved (no doubling realloc, no 2x slack); freed slots go on
#   a free list (threaded through Slot.rid) and are reused first, so once as many rows
#   are live as the busiest moment needed, the table allocates nothing more.
# * the index: open addressing with linear probing over a power-of-two array, load
#   factor <= 3/4, backward-shift deletion (no tombstones); it doubles when fuller and
#   halves (at the end of a call that forgot rows) when under 1/8 full, so it follows the
#   live count.  An entry is 64 bits: the slot number + 1 (0 = empty) in the low half
#   and, in the high half, a tag: the top 32 bits of h1, which modulo the index size are
#   also the entry's home position.  A probe compares that tag before it reads the
#   slot's key, so a lookup that finds nothing (a new request, the common case) touches
#   only the index; deletion and rehashing never read a key.  The batch calls hash a run
#   of entries first, prefetching their index lines, then act on them in order, so the
#   cache misses overlap.
# * the admitted, rejected and settled FIFOs: growable ring buffers of (time, slot,
#   generation), 16 bytes an entry; an entry acts only while its slot still has that
#   generation, and the admitted ring is compacted (dead entries dropped) on the
#   reference's trigger.  A slot's generation goes up by one whenever its row is
#   replaced or forgotten, so an entry made for an earlier row of the slot is dead.  A
#   slot whose 32-bit generation is used up is retired (never reused; its entries are
#   dead by the RETIRED flag), so no (slot, generation) pair ever names two rows.
#
# Narrow columns.  A row is NF int64 values; a slot keeps each in the width its domain
# needs (_NARROW below lists the ranges): state, reason, shadow reason, freshness and
# shed in a byte each; lane, pool and model (interned name numbers) in 16 bits; token
# counts of one request (reserved, granted, actual, refunded, the degraded cap), the
# tenant's slot, the pricing window and the backpressure score in 32 bits; the wait
# (DECIDED_NS - ARRIVED_NS) in 32 unsigned bits of ns; the multiplier's float bits as a
# 16-bit number in a dictionary of the table (a few distinct values: one per pool and
# pricing window); times, the reservation id, retry_after and the remaining sums
# (bucket, hourly, daily: totals of many requests) in full 64 bits.  Nothing is rounded.
# A row with any value outside its column's range (or a 65,536th distinct multiplier) is
# kept whole instead, as NF int64 in an overflow block (its slot marked WIDE), so every
# row reads back exactly as it was stored; settling a narrow row with usage that does
# not fit moves it there.  The property tests store values at each range's edges and
# one past them in both builds.
#
# Keys.  A row is keyed by (tkey, h1, h2): tkey, the tenant's key (RequestLog's small
# number per tenant id, kept in 32 bits; a wider one, which the service never makes, is
# kept whole in the overflow row, flag WIDE_KEY), compared exactly, and two independent 64-bit SipHash-1-3 values of the ids under two 128-bit
# keys drawn from os.urandom when the table is made.  The hashed message is
# unambiguous: the 4-byte little-endian length of the tenant id's UTF-8, that UTF-8,
# then the request id's UTF-8 (a str with lone surrogates, which has no UTF-8, is hashed
# as its "surrogatepass" encoding: each surrogate's own 3-byte code, which no valid UTF-8
# contains, so distinct strs still give distinct messages).  Equal (tkey, h1, h2) is
# treated as the same request.  Two different requests are merged only if the tkeys are
# equal and both keyed hashes collide.  tkey is compared exactly and a tenant's key is
# never reused, so two configured tenants' requests can never be merged, whatever the
# hashes.  Within one tenant (and among the unconfigured tenants, which all have tkey -1
# and are told apart by the tenant id inside the message), with n rows live, some two
# colliding has probability about n^2 / 2^129 (10^-26 for a billion rows): the keys are
# secret and random, so ids cannot be chosen to collide, and a 128-bit match of two
# independent PRFs is needed.  SipHash-1-3 is implemented below from Aumasson and
# Bernstein's description (test_reqlog.py checks it against CPython's own bytes hash,
# which is SipHash-1-3).
#
# Arithmetic the reference does on unbounded ints (decided + retry_after, now - window)
# is done here without overflow: the same comparisons over int64 inputs.  boundscheck
# and wraparound are off because every index is checked by hand (slots come from the
# index or from FIFO entries whose generation matched; batch indexes from range(n)).

cimport cython
from cpython.buffer cimport (
    PyBUF_FULL_RO,
    PyBuffer_IsContiguous,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.exc cimport PyErr_Clear, PyErr_ExceptionMatches
from cpython.long cimport PyLong_AsLongLong, PyLong_AsUnsignedLongLong, PyLong_CheckExact
from cpython.ref cimport Py_INCREF, PyObject
from cpython.sequence cimport PySequence_Fast, PySequence_Fast_GET_ITEM, PySequence_Fast_GET_SIZE
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdint cimport (
    INT32_MAX,
    INT32_MIN,
    INT64_MIN,
    int8_t,
    int32_t,
    int64_t,
    uint8_t,
    uint16_t,
    uint32_t,
    uint64_t,
)
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset, strcmp

import os

cdef extern from "Python.h":
    # The same functions as the cpython cimports, on borrowed pointers and without
    # Cython's error check, for the batch loops (no reference counting per entry).
    const char* _utf8_and_size "PyUnicode_AsUTF8AndSize"(PyObject* s, Py_ssize_t* n)
    bint _is_str "PyUnicode_Check"(PyObject* o)
    bint _is_list "PyList_Check"(object o)
    bint _is_tuple "PyTuple_Check"(object o)

# SipHash-1-3 (J.-P. Aumasson and D. J. Bernstein, "SipHash: a fast short-input PRF",
# 2012), with c = 1 compression round per 8-byte word and d = 3 finalization rounds,
# computed for two keys at once over a message fed in pieces.
cdef extern from *:
    """
    #include <stdint.h>
    #include <stddef.h>

    #if defined(__GNUC__) || defined(__clang__)
    #define bg_prefetch(p) __builtin_prefetch(p)
    #else
    #define bg_prefetch(p) ((void)0)
    #endif

    typedef struct { uint64_t v0, v1, v2, v3; } bg_sip_t;
    typedef struct {
        bg_sip_t a, b;      /* one state per key */
        uint64_t tail;      /* the last (n mod 8) bytes fed, little-endian */
        uint64_t total;     /* bytes fed so far */
        unsigned ntail;
    } bg_sip2_t;

    static inline uint64_t bg_rotl(uint64_t x, unsigned b) {
        return (x << b) | (x >> (64 - b));
    }

    /* One SipRound: two ARX half-rounds over the four words. */
    static inline void bg_sipround(bg_sip_t *s) {
        s->v0 += s->v1; s->v1 = bg_rotl(s->v1, 13); s->v1 ^= s->v0; s->v0 = bg_rotl(s->v0, 32);
        s->v2 += s->v3; s->v3 = bg_rotl(s->v3, 16); s->v3 ^= s->v2;
        s->v0 += s->v3; s->v3 = bg_rotl(s->v3, 21); s->v3 ^= s->v0;
        s->v2 += s->v1; s->v1 = bg_rotl(s->v1, 17); s->v1 ^= s->v2; s->v2 = bg_rotl(s->v2, 32);
    }

    /* The state from the key (k0, k1): the constants spell "somepseudorandomlygeneratedbytes". */
    static inline void bg_sip_init(bg_sip_t *s, uint64_t k0, uint64_t k1) {
        s->v0 = k0 ^ 0x736f6d6570736575ULL;
        s->v1 = k1 ^ 0x646f72616e646f6dULL;
        s->v2 = k0 ^ 0x6c7967656e657261ULL;
        s->v3 = k1 ^ 0x7465646279746573ULL;
    }

    /* Compression of one message word m: c = 1 round. */
    static inline void bg_sip_word(bg_sip_t *s, uint64_t m) {
        s->v3 ^= m;
        bg_sipround(s);
        s->v0 ^= m;
    }

    static inline uint64_t bg_load_le64(const unsigned char *p) {
        return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16)
            | ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40)
            | ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
    }

    static inline void bg_sip2_init(bg_sip2_t *h, uint64_t k1a, uint64_t k1b,
                                    uint64_t k2a, uint64_t k2b) {
        bg_sip_init(&h->a, k1a, k1b);
        bg_sip_init(&h->b, k2a, k2b);
        h->tail = 0;
        h->total = 0;
        h->ntail = 0;
    }

    /* Append n bytes to the message: whole little-endian words are compressed as they
       complete, the rest waits in tail. */
    static void bg_sip2_feed(bg_sip2_t *h, const unsigned char *p, size_t n) {
        uint64_t m;
        h->total += n;
        if (h->ntail) {
            while (n && h->ntail < 8) {
                h->tail |= (uint64_t)*p++ << (8 * h->ntail++);
                n--;
            }
            if (h->ntail < 8)
                return;
            bg_sip_word(&h->a, h->tail);
            bg_sip_word(&h->b, h->tail);
            h->tail = 0;
            h->ntail = 0;
        }
        for (; n >= 8; p += 8, n -= 8) {
            m = bg_load_le64(p);
            bg_sip_word(&h->a, m);
            bg_sip_word(&h->b, m);
        }
        while (n) {
            h->tail |= (uint64_t)*p++ << (8 * h->ntail++);
            n--;
        }
    }

    static inline uint64_t bg_sip_final(bg_sip_t s, uint64_t last) {
        bg_sip_word(&s, last);
        s.v2 ^= 0xff;
        bg_sipround(&s);
        bg_sipround(&s);
        bg_sipround(&s);
        return s.v0 ^ s.v1 ^ s.v2 ^ s.v3;
    }

    /* The two hashes of the message fed so far (h is left as it was). The last word
       holds the remaining bytes and, in its top byte, the length mod 256. */
    static inline void bg_sip2_final(const bg_sip2_t *h, uint64_t *o1, uint64_t *o2) {
        uint64_t last = h->tail | (h->total << 56);
        *o1 = bg_sip_final(h->a, last);
        *o2 = bg_sip_final(h->b, last);
    }
    """
    ctypedef struct bg_sip2_t:
        pass
    void bg_prefetch(const void* p) noexcept nogil
    void bg_sip2_init(bg_sip2_t* h, uint64_t k1a, uint64_t k1b, uint64_t k2a,
                      uint64_t k2b) noexcept nogil
    void bg_sip2_feed(bg_sip2_t* h, const unsigned char* p, size_t n) noexcept nogil
    void bg_sip2_final(const bg_sip2_t* h, uint64_t* o1, uint64_t* o2) noexcept nogil


# Row layout and states, as in the reference (test_reqlog.py checks they agree; the
# columns the table only carries are named as in controlplane.service.records).
cdef enum:
    C_STATE = 0
    C_REASON = 1
    C_RETRY_NS = 2
    C_RESERVED = 3
    C_RID = 4
    C_GRANTED = 5
    C_BUCKET = 6
    C_HOUR = 7
    C_DAY = 8
    C_LANE = 9
    C_SLOT = 10
    C_DECIDED_NS = 11
    C_POOL = 12
    C_MODEL = 13
    C_MULTIPLIER = 14
    C_WINDOW = 15
    C_ACTUAL = 16
    C_REFUNDED = 17
    C_ARRIVED_NS = 18
    C_SHADOW = 19
    C_DEGRADED = 20
    C_SCORE = 21
    C_FRESH = 22
    C_SHED = 23
    C_NF = 24
    C_OPEN = 0
    C_SETTLED = 1
    C_REJECTED = 2
    C_COMPACT_SLACK = 4096
    CHUNK = 16  # batch entries hashed (and their index lines prefetched) ahead
    # Slot.state: the row's state in the low bits, and two flags.
    STATE_BITS = 0x03
    WIDE = 0x80  # the row is in the overflow block, at row Slot.rid
    RETIRED = 0x40  # generations used up: never reused, its FIFO entries are dead
    WIDE_KEY = 0x20  # (with WIDE) the tkey does not fit Slot.tkey: it is in the overflow row
    WIDE_NF = C_NF + 1  # an overflow row: the NF columns, then the full tkey
    BLOCK_SHIFT = 11  # 2,048 slots a block
    BLOCK_SLOTS = 1 << BLOCK_SHIFT
    MULT_MAX = 65535  # distinct multipliers the dictionary holds (numbers 0..65534)

__all__ = ["NF", "OPEN", "REJECTED", "SETTLED", "RequestTable"]

STATE = C_STATE
RETRY_NS = C_RETRY_NS
DECIDED_NS = C_DECIDED_NS
ACTUAL = C_ACTUAL
REFUNDED = C_REFUNDED
NF = C_NF
OPEN = C_OPEN
SETTLED = C_SETTLED
REJECTED = C_REJECTED
COMPACT_SLACK = C_COMPACT_SLACK

# The narrow columns: column -> the (lowest, highest) value a slot holds in place (any
# other value makes the row wide).  ARRIVED_NS: the range of DECIDED_NS - ARRIVED_NS.
# STATE is checked before (OPEN or REJECTED); DECIDED_NS, RID, RETRY_NS, BUCKET, HOUR and
# DAY are full int64; MULTIPLIER is any int64 while the dictionary has room.  For the
# tests (bounds and one past them) and the docs.
_NARROW = {
    **dict.fromkeys((C_REASON, C_SHADOW, C_FRESH, C_SHED), (-(2**7), 2**7 - 1)),
    **dict.fromkeys((C_LANE, C_POOL, C_MODEL), (0, 2**16 - 1)),
    **dict.fromkeys(
        (C_RESERVED, C_GRANTED, C_SLOT, C_WINDOW, C_ACTUAL, C_REFUNDED, C_DEGRADED, C_SCORE),
        (-(2**31), 2**31 - 1),
    ),
    C_ARRIVED_NS: (0, 2**32 - 1),
}
SLOT_BYTES = sizeof(Slot)

# Slot numbers (+ 1) take 32 bits of an index entry (and FIFO entries hold them as
# uint32), and the index, at most 3/4 full, has at most 2**32 entries.
cdef Py_ssize_t MAX_SLOTS = 2**31 - 1
cdef size_t ROW_BYTES = C_NF * sizeof(int64_t)
cdef uint32_t GEN_MAX = 0xFFFFFFFF


# --- SipHash-1-3 test helpers -----------------------------------------------------------


def _siphash13(key0, key1, bytes data not None):
    """SipHash-1-3 of ``data`` under the key (key0, key1), as an unsigned 64-bit int.

    For the tests (CPython hashes bytes with the same function); the table uses the
    same code (bg_sip2_*)."""
    cdef uint64_t k0 = PyLong_AsUnsignedLongLong(key0)
    cdef uint64_t k1 = PyLong_AsUnsignedLongLong(key1)
    cdef bg_sip2_t h
    cdef uint64_t out, unused
    bg_sip2_init(&h, k0, k1, 0, 0)
    bg_sip2_feed(&h, <const unsigned char*><const char*>data, <size_t>len(data))
    bg_sip2_final(&h, &out, &unused)
    return out


def _siphash13_chunks(key0, key1, list chunks not None):
    """``_siphash13`` of the concatenated ``chunks``, fed one at a time (the tests check
    that splitting the message changes nothing)."""
    cdef uint64_t k0 = PyLong_AsUnsignedLongLong(key0)
    cdef uint64_t k1 = PyLong_AsUnsignedLongLong(key1)
    cdef bg_sip2_t h
    cdef uint64_t out, unused
    cdef bytes chunk
    bg_sip2_init(&h, k0, k1, 0, 0)
    for chunk in chunks:
        bg_sip2_feed(&h, <const unsigned char*><const char*>chunk, <size_t>len(chunk))
    bg_sip2_final(&h, &out, &unused)
    return out


# --- argument checks (the reference's, with the same exceptions and messages) -----------


cdef inline int64_t _i64(object value) except? -1:
    # As in _buckets_c: TypeError for non-integers (no float truncation), OverflowError
    # outside int64, like the reference's operator.index plus its range check.
    if PyLong_CheckExact(value):
        return <int64_t>value
    return PyLong_AsLongLong(value)


cdef int _bad_id(str name, object value) except -1:
    raise TypeError(f"{name} must be a str, got {type(value).__name__}")


cdef int _bad_item(str name, Py_ssize_t i, PyObject* value) except -1:
    raise TypeError(f"{name}[{i}] must be a str, got {type(<object>value).__name__}")


cdef inline int _check_ids(str name, object ids) except -1:
    if not (_is_list(ids) or _is_tuple(ids)):
        raise TypeError(f"{name} must be a list of str, got {type(ids).__name__}")
    return 0


cdef inline bint _format_is(const char* fmt, bint int64) noexcept:
    # The reference's format sets: native int64 ("q", "l", optionally after "@") or a
    # 1-byte integer or bool.  NULL means "B" by the buffer protocol.
    if fmt == NULL:
        return not int64
    if fmt[0] == b"@":
        fmt += 1
    if int64:
        return strcmp(fmt, b"q") == 0 or strcmp(fmt, b"l") == 0
    return strcmp(fmt, b"b") == 0 or strcmp(fmt, b"B") == 0 or strcmp(fmt, b"?") == 0


cdef int _get_buffer(object obj, Py_buffer* view, str name, int ndim, bint int64) except -1:
    # The reference's _view: a buffer of ``ndim`` dimensions of int64 or 1-byte items.
    what = "int64" if int64 else "1-byte"
    try:
        PyObject_GetBuffer(obj, view, PyBUF_FULL_RO)
    except TypeError as exc:
        raise TypeError(f"{name} must be a {ndim}-D {what} buffer (numpy array)") from exc
    try:
        if view.ndim != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got {view.ndim} dimensions")
        if view.suboffsets != NULL:
            raise ValueError(f"{name} must not be an indirect buffer")
        if not _format_is(view.format, int64) or view.itemsize != (8 if int64 else 1):
            fmt = "B" if view.format == NULL else view.format.decode("ascii", "replace")
            raise ValueError(f"{name} must hold {what} items, got format {fmt!r}")
    except BaseException:
        PyBuffer_Release(view)
        raise
    return 0


cdef int _parse_row(object row, int64_t* out) except -1:
    # The reference's _check_row for ``add``: len, then every value, then the state.
    cdef Py_ssize_t j
    if len(row) != C_NF:
        raise ValueError(f"row: expected {C_NF} columns, got {len(row)}")
    seq = PySequence_Fast(row, b"row must be a sequence of ints")
    if PySequence_Fast_GET_SIZE(seq) != C_NF:  # an iterable whose len lied
        raise ValueError(f"row: expected {C_NF} columns, got {PySequence_Fast_GET_SIZE(seq)}")
    for j in range(C_NF):
        out[j] = _i64(<object>PySequence_Fast_GET_ITEM(seq, j))
    if out[C_STATE] != C_OPEN and out[C_STATE] != C_REJECTED:
        raise ValueError(f"row: state must be OPEN or REJECTED, got {out[C_STATE]}")
    return 0


# --- keys --------------------------------------------------------------------------------


cdef int _feed_id(bg_sip2_t* h, PyObject* s, bint prefix) except -1:
    # Append str ``s``'s UTF-8 to the message (after its 4-byte little-endian length when
    # ``prefix``).  PyUnicode_AsUTF8AndSize copies nothing for ASCII and caches the UTF-8
    # of other strs in the str itself.  Lone surrogates: the "surrogatepass" bytes.
    cdef Py_ssize_t n
    cdef const char* p = _utf8_and_size(s, &n)
    cdef unsigned char le[4]
    cdef bytes raw
    if p == NULL:
        if not PyErr_ExceptionMatches(UnicodeEncodeError):
            return -1
        PyErr_Clear()
        raw = (<str>s).encode("utf-8", "surrogatepass")
        p = raw
        n = len(raw)
    if prefix:
        if <uint64_t>n > 0xFFFFFFFFULL:
            raise ValueError("tenant_id: its UTF-8 must be shorter than 2**32 bytes")
        le[0] = n & 0xFF
        le[1] = (n >> 8) & 0xFF
        le[2] = (n >> 16) & 0xFF
        le[3] = (n >> 24) & 0xFF
        bg_sip2_feed(h, le, 4)
    bg_sip2_feed(h, <const unsigned char*>p, <size_t>n)
    return 0


cdef struct PrefixCache:
    # The message state after a tenant's prefix (its length and UTF-8), for runs of
    # entries of one tenant in a batch.
    PyObject* tenant                # borrowed from the caller's list; NULL = none yet
    bg_sip2_t state


cdef int _hash_entry(RequestTable table, PrefixCache* cache, PyObject* t, PyObject* r,
                     uint64_t* h1, uint64_t* h2) except -1:
    # The two hashes of (t, r), both strs.
    cdef bg_sip2_t h
    if t != cache.tenant:
        cache.tenant = NULL
        bg_sip2_init(&cache.state, table._k1a, table._k1b, table._k2a, table._k2b)
        _feed_id(&cache.state, t, True)
        cache.tenant = t
    h = cache.state
    _feed_id(&h, r, False)
    bg_sip2_final(&h, h1, h2)
    return 0


cdef inline bint _passed(int64_t now, int64_t decided, int64_t retry) noexcept:
    # now >= decided + retry, as over unbounded ints.
    if retry >= 0:
        if decided > <int64_t>(0x7FFFFFFFFFFFFFFF) - retry:
            return False  # the sum exceeds INT64_MAX >= now
    elif decided < INT64_MIN - retry:
        return True  # the sum is below INT64_MIN <= now
    return now >= decided + retry


cdef tuple _row_tuple(const int64_t* row):
    cdef tuple t = PyTuple_New(C_NF)
    cdef Py_ssize_t j
    cdef object v
    for j in range(C_NF):
        v = row[j]
        Py_INCREF(v)
        PyTuple_SET_ITEM(t, j, v)
    return t


# --- FIFOs -------------------------------------------------------------------------------


cdef int _ring_reserve(Ring* r) except -1:
    # Room for one more entry (doubling; the entries are laid out from 0 again).
    cdef Py_ssize_t new_cap, first
    cdef Entry* buf
    if r.len < r.cap:
        return 0
    new_cap = 2 * r.cap if r.cap else 16
    buf = <Entry*>malloc(<size_t>new_cap * sizeof(Entry))
    if buf == NULL:
        raise MemoryError()
    first = r.cap - r.head
    if first > r.len:
        first = r.len
    if first > 0:
        memcpy(buf, &r.buf[r.head], <size_t>first * sizeof(Entry))
    if r.len > first:
        memcpy(&buf[first], r.buf, <size_t>(r.len - first) * sizeof(Entry))
    free(r.buf)
    r.buf = buf
    r.cap = new_cap
    r.head = 0
    return 0


cdef inline void _ring_push(Ring* r, int64_t t, Py_ssize_t slot, uint32_t gen) noexcept:
    # After _ring_reserve.
    cdef Entry* e = &r.buf[(r.head + r.len) & (r.cap - 1)]
    e.t = t
    e.slot = <uint32_t>slot
    e.gen = gen
    r.len += 1


cdef inline void _ring_pop(Ring* r) noexcept:
    r.head = (r.head + 1) & (r.cap - 1)
    r.len -= 1


# --- the table ---------------------------------------------------------------------------


cdef inline bint _within(int64_t v, int64_t lo, int64_t hi) noexcept:
    return lo <= v <= hi


@cython.final
@cython.auto_pickle(False)
cdef class RequestTable:
    """Rows by (tkey, tenant id, request id), with exact FIFO expiry.

    Compiled twin of fastpath._reqlog_py.RequestTable (see there for the contract; the
    top of this file for the storage and the key hashing).  Not thread-safe: one event
    loop owns it; the GIL is held throughout every call.
    """

    def __cinit__(self, ttl_ns, replay_ns, settled_ns):
        cdef int64_t c_ttl = _i64(ttl_ns)
        cdef int64_t c_replay = _i64(replay_ns)
        cdef int64_t c_settled = _i64(settled_ns)
        self._blocks = NULL
        self._index = NULL
        self._wide = NULL
        self._mvals = NULL
        self._mindex = NULL
        memset(&self._admitted, 0, sizeof(Ring))
        memset(&self._rejected, 0, sizeof(Ring))
        memset(&self._settled, 0, sizeof(Ring))
        if c_ttl <= 0:
            raise ValueError(f"ttl_ns must be positive, got {c_ttl}")
        if c_replay < 0 or c_settled < 0:
            raise ValueError("replay_ns and settled_ns must not be negative")
        self._ttl_ns = c_ttl
        self._replay_ns = c_replay
        self._settled_ns = c_settled if c_settled < c_ttl else c_ttl
        self._open = 0
        self._nblocks = 0
        self._blocks_cap = 0
        self._used = 0
        self._free = -1
        self._count = 0
        self._retired = 0
        self._wcap = 0
        self._wused = 0
        self._wfree = -1
        self._wcount = 0
        self._mcount = 0
        self._mcap = 0
        self._mmask = 0
        self._mask = 15
        self._index = <uint64_t*>calloc(16, sizeof(uint64_t))  # all empty
        if self._index == NULL:
            raise MemoryError()
        keys = os.urandom(32)
        self._k1a = int.from_bytes(keys[0:8], "little")
        self._k1b = int.from_bytes(keys[8:16], "little")
        self._k2a = int.from_bytes(keys[16:24], "little")
        self._k2b = int.from_bytes(keys[24:32], "little")

    def __dealloc__(self):
        cdef Py_ssize_t b
        if self._blocks != NULL:
            for b in range(self._nblocks):
                free(self._blocks[b])
        free(self._blocks)
        free(self._index)
        free(self._wide)
        free(self._mvals)
        free(self._mindex)
        free(self._admitted.buf)
        free(self._rejected.buf)
        free(self._settled.buf)
        self._blocks = NULL
        self._nblocks = 0
        self._index = NULL
        self._wide = NULL
        self._mvals = NULL
        self._mindex = NULL
        self._admitted.buf = NULL
        self._rejected.buf = NULL
        self._settled.buf = NULL

    def __len__(self):
        return self._count

    @property
    def open_count(self):
        """Rows admitted and not settled, dropped or expired."""
        return self._open

    @property
    def remembers_rejections(self):
        return self._replay_ns > 0

    @property
    def wide_rows(self):
        """Rows kept whole in the overflow block (a value outside its narrow column)."""
        return self._wcount

    # --- slots -----------------------------------------------------------------------

    cdef inline Slot* _at(self, Py_ssize_t slot) noexcept:
        return &self._blocks[slot >> BLOCK_SHIFT][slot & (BLOCK_SLOTS - 1)]

    cdef inline bint _live(self, const Entry* e) noexcept:
        # The FIFO entry still names the row it was made for.
        cdef const Slot* s = self._at(e.slot)
        return s.gen == e.gen and not (s.state & RETIRED)

    cdef int _reserve_slot(self) except -1:
        # A free slot for one more row: the free list, an untouched one, or a new block.
        cdef Py_ssize_t new_cap
        cdef Slot** blocks
        cdef Slot* block
        if self._free >= 0 or self._used < self._nblocks * BLOCK_SLOTS:
            return 0
        if self._used >= MAX_SLOTS:
            raise MemoryError(f"the request table holds at most {MAX_SLOTS} rows")
        if self._nblocks == self._blocks_cap:
            new_cap = 2 * self._blocks_cap if self._blocks_cap else 8
            blocks = <Slot**>realloc(self._blocks, <size_t>new_cap * sizeof(Slot*))
            if blocks == NULL:
                raise MemoryError()
            self._blocks = blocks
            self._blocks_cap = new_cap
        block = <Slot*>malloc(BLOCK_SLOTS * sizeof(Slot))
        if block == NULL:
            raise MemoryError()
        self._blocks[self._nblocks] = block
        self._nblocks += 1
        return 0

    cdef Py_ssize_t _take_slot(self) noexcept:
        # After _reserve_slot.  A reused slot keeps its generation (raised when freed).
        cdef Py_ssize_t slot
        if self._free >= 0:
            slot = self._free
            self._free = self._at(slot).rid
            return slot
        slot = self._used
        self._used += 1
        self._at(slot).gen = 0
        return slot

    cdef int64_t _wide_alloc(self) except -1:
        # An overflow row for a row that does not fit its slot.
        cdef int64_t w
        cdef Py_ssize_t new_cap
        cdef int64_t* buf
        if self._wfree >= 0:
            w = self._wfree
            self._wfree = self._wide[w * WIDE_NF]
        else:
            if self._wused == self._wcap:
                new_cap = 2 * self._wcap if self._wcap else 16
                buf = <int64_t*>realloc(self._wide, <size_t>new_cap * WIDE_NF * sizeof(int64_t))
                if buf == NULL:
                    raise MemoryError()
                self._wide = buf
                self._wcap = new_cap
            w = self._wused
            self._wused += 1
        self._wcount += 1
        return w

    cdef void _wide_free(self, int64_t w) noexcept:
        self._wide[w * WIDE_NF] = self._wfree
        self._wfree = w
        self._wcount -= 1

    cdef int _mult_id(self, int64_t value) except -2:
        # The number of ``value`` in the multiplier dictionary (added if new), or -1 when
        # the dictionary is full.
        cdef uint64_t h = <uint64_t>value * 0x9E3779B97F4A7C15ULL
        cdef uint32_t i, e, size, j
        cdef uint32_t* index
        cdef int64_t* vals
        cdef Py_ssize_t n
        if self._mindex != NULL:
            i = <uint32_t>(h >> 40) & self._mmask
            while True:
                e = self._mindex[i]
                if e == 0:
                    break
                if self._mvals[e - 1] == value:
                    return <int>(e - 1)
                i = (i + 1) & self._mmask
        if self._mcount >= MULT_MAX:
            return -1
        if self._mcount == self._mcap:
            n = 2 * self._mcap if self._mcap else 8
            vals = <int64_t*>realloc(self._mvals, <size_t>n * sizeof(int64_t))
            if vals == NULL:
                raise MemoryError()
            self._mvals = vals
            self._mcap = n
        if self._mindex == NULL or (self._mcount + 1) * 2 > self._mmask + 1:
            # Twice the values' room, at most half full: rebuilt from the values.
            size = <uint32_t>(4 * self._mcap)
            index = <uint32_t*>calloc(size, sizeof(uint32_t))
            if index == NULL:
                raise MemoryError()
            for j in range(<uint32_t>self._mcount):
                i = <uint32_t>((<uint64_t>self._mvals[j] * 0x9E3779B97F4A7C15ULL) >> 40) & (size - 1)
                while index[i] != 0:
                    i = (i + 1) & (size - 1)
                index[i] = j + 1
            free(self._mindex)
            self._mindex = index
            self._mmask = size - 1
        i = <uint32_t>(h >> 40) & self._mmask
        while self._mindex[i] != 0:
            i = (i + 1) & self._mmask
        self._mvals[self._mcount] = value
        self._mcount += 1
        self._mindex[i] = <uint32_t>self._mcount
        return <int>(self._mcount - 1)

    cdef int _encode(self, const int64_t* row, Slot* s) except -1:
        # The row's columns into ``s`` (not its key nor generation): 1, or 0 when some
        # value is outside its column's range (``s`` is then partly written).  May add
        # the multiplier to the dictionary, which changes no answer.
        cdef int m
        cdef uint64_t waited
        if not (
            _within(row[C_REASON], -128, 127)
            and _within(row[C_SHADOW], -128, 127)
            and _within(row[C_FRESH], -128, 127)
            and _within(row[C_SHED], -128, 127)
            and _within(row[C_LANE], 0, 65535)
            and _within(row[C_POOL], 0, 65535)
            and _within(row[C_MODEL], 0, 65535)
            and _within(row[C_RESERVED], INT32_MIN, INT32_MAX)
            and _within(row[C_GRANTED], INT32_MIN, INT32_MAX)
            and _within(row[C_SLOT], INT32_MIN, INT32_MAX)
            and _within(row[C_WINDOW], INT32_MIN, INT32_MAX)
            and _within(row[C_ACTUAL], INT32_MIN, INT32_MAX)
            and _within(row[C_REFUNDED], INT32_MIN, INT32_MAX)
            and _within(row[C_DEGRADED], INT32_MIN, INT32_MAX)
            and _within(row[C_SCORE], INT32_MIN, INT32_MAX)
            and row[C_ARRIVED_NS] <= row[C_DECIDED_NS]
        ):
            return 0
        # decided - arrived >= 0 fits in 64 unsigned bits whatever the two int64 are
        waited = <uint64_t>row[C_DECIDED_NS] - <uint64_t>row[C_ARRIVED_NS]
        if waited > 0xFFFFFFFFULL:
            return 0
        m = self._mult_id(row[C_MULTIPLIER])
        if m < 0:
            return 0
        s.decided = row[C_DECIDED_NS]
        s.rid = row[C_RID]
        s.retry = row[C_RETRY_NS]
        s.bucket = row[C_BUCKET]
        s.hour = row[C_HOUR]
        s.day = row[C_DAY]
        s.reserved = <int32_t>row[C_RESERVED]
        s.granted = <int32_t>row[C_GRANTED]
        s.tslot = <int32_t>row[C_SLOT]
        s.window = <int32_t>row[C_WINDOW]
        s.actual = <int32_t>row[C_ACTUAL]
        s.refunded = <int32_t>row[C_REFUNDED]
        s.waited = <uint32_t>waited
        s.degraded = <int32_t>row[C_DEGRADED]
        s.score = <int32_t>row[C_SCORE]
        s.lane = <uint16_t>row[C_LANE]
        s.pool = <uint16_t>row[C_POOL]
        s.model = <uint16_t>row[C_MODEL]
        s.mult = <uint16_t>m
        s.state = <uint8_t>row[C_STATE]
        s.reason = <int8_t>row[C_REASON]
        s.shadow = <int8_t>row[C_SHADOW]
        s.fresh = <int8_t>row[C_FRESH]
        s.shed = <int8_t>row[C_SHED]
        return 1

    cdef void _decode(self, const Slot* s, int64_t* out) noexcept:
        # The row of a live slot, as it was stored.
        if s.state & WIDE:
            memcpy(out, &self._wide[s.rid * WIDE_NF], ROW_BYTES)
            return
        out[C_STATE] = s.state & STATE_BITS
        out[C_REASON] = s.reason
        out[C_RETRY_NS] = s.retry
        out[C_RESERVED] = s.reserved
        out[C_RID] = s.rid
        out[C_GRANTED] = s.granted
        out[C_BUCKET] = s.bucket
        out[C_HOUR] = s.hour
        out[C_DAY] = s.day
        out[C_LANE] = s.lane
        out[C_SLOT] = s.tslot
        out[C_DECIDED_NS] = s.decided
        out[C_POOL] = s.pool
        out[C_MODEL] = s.model
        out[C_MULTIPLIER] = self._mvals[s.mult]
        out[C_WINDOW] = s.window
        out[C_ACTUAL] = s.actual
        out[C_REFUNDED] = s.refunded
        # stored only when arrived <= decided and the difference fits: no overflow
        out[C_ARRIVED_NS] = <int64_t>(<uint64_t>s.decided - <uint64_t>s.waited)
        out[C_SHADOW] = s.shadow
        out[C_DEGRADED] = s.degraded
        out[C_SCORE] = s.score
        out[C_FRESH] = s.fresh
        out[C_SHED] = s.shed

    cdef tuple _slot_tuple(self, Py_ssize_t slot):
        cdef int64_t row[C_NF]
        self._decode(self._at(slot), row)
        return _row_tuple(row)

    # --- the index -------------------------------------------------------------------

    cdef int _resize_index(self, uint64_t size) except -1:
        # Re-insert every entry, at its home (read from its tag), into ``size`` entries.
        cdef uint64_t old_size = self._mask + 1
        cdef uint64_t new_mask = size - 1
        cdef uint64_t i, j, e
        if new_mask > 0xFFFFFFFFULL:  # homes come from 32 bits of the hash
            raise MemoryError("the request table's index is full")
        cdef uint64_t* index = <uint64_t*>calloc(<size_t>size, sizeof(uint64_t))
        if index == NULL:
            raise MemoryError()
        for i in range(old_size):
            e = self._index[i]
            if e != 0:
                j = (e >> 32) & new_mask
                while index[j] != 0:
                    j = (j + 1) & new_mask
                index[j] = e
        free(self._index)
        self._index = index
        self._mask = new_mask
        return 0

    cdef void _maybe_shrink(self) noexcept:
        # Under 1/8 full: halve (to between 1/4 and 1/2 full), so the index follows the
        # live count.  At the end of a call that forgot rows (no position is held then);
        # on a failed allocation the bigger index is simply kept.
        cdef uint64_t size = self._mask + 1
        if size <= 16 or <uint64_t>self._count * 8 >= size:
            return
        while size > 16 and <uint64_t>self._count * 4 < size:
            size >>= 1
        try:
            self._resize_index(size)
        except MemoryError:
            pass

    cdef Py_ssize_t _find(self, int64_t tkey, uint64_t h1, uint64_t h2,
                          uint64_t* pos) noexcept:
        # The slot of the key, or -1; ``pos`` gets its index position, or the empty one
        # where it would go.  The load factor keeps an empty position in every probe.
        cdef uint64_t mask = self._mask
        cdef uint64_t tag = h1 >> 32
        cdef uint64_t i = tag & mask
        cdef uint64_t e
        cdef Slot* s
        while True:
            e = self._index[i]
            if e == 0:
                pos[0] = i
                return -1
            if (e >> 32) == tag:
                s = self._at(<Py_ssize_t>(e & 0xFFFFFFFFULL) - 1)
                if s.h1 == h1 and s.h2 == h2 and s.tkey == <int32_t>tkey and (
                    self._wide[s.rid * WIDE_NF + C_NF] == tkey
                    if s.state & WIDE_KEY
                    else _within(tkey, INT32_MIN, INT32_MAX)
                ):
                    pos[0] = i
                    return <Py_ssize_t>(e & 0xFFFFFFFFULL) - 1
            i = (i + 1) & mask

    cdef void _unlink(self, uint64_t pos) noexcept:
        # Backward-shift deletion: empty ``pos``, then move back every later entry of the
        # probe run that may live there (its home is not cyclically in (hole, j]).
        cdef uint64_t mask = self._mask
        cdef uint64_t hole = pos
        cdef uint64_t j = pos
        cdef uint64_t home, e
        while True:
            j = (j + 1) & mask
            e = self._index[j]
            if e == 0:
                break
            home = (e >> 32) & mask
            if ((j - home) & mask) >= ((j - hole) & mask):
                self._index[hole] = e
                hole = j
        self._index[hole] = 0

    cdef void _release(self, Py_ssize_t slot, uint64_t pos) noexcept:
        # Forget the row in ``slot``, found at index position ``pos``: a new generation
        # kills its FIFO entries; a slot with none left is retired instead of reused.
        cdef Slot* s = self._at(slot)
        self._unlink(pos)
        if s.state & WIDE:
            self._wide_free(s.rid)
        if s.gen == GEN_MAX:
            s.state = RETIRED
            self._retired += 1
        else:
            s.gen += 1
            s.state = 0
            s.rid = self._free
            self._free = slot
        self._count -= 1

    cdef void _delete(self, Py_ssize_t slot) noexcept:
        # Forget the (live) row in ``slot``: find its index position by its hash first.
        cdef uint64_t mask = self._mask
        cdef uint64_t i = (self._at(slot).h1 >> 32) & mask
        while (self._index[i] & 0xFFFFFFFFULL) != <uint64_t>slot + 1:
            i = (i + 1) & mask
        self._release(slot, i)

    cdef int _store(self, int64_t tkey, uint64_t h1, uint64_t h2,
                    const int64_t* row) except -1:
        # The reference's _store: ``row`` is checked (state OPEN or REJECTED), ``tkey`` is
        # an int32.  Everything that may fail (allocations) happens before anything
        # changes (a new multiplier in the dictionary, a grown index or a new block of
        # slots change no answer).
        cdef Ring* fifo
        cdef uint64_t pos
        cdef Py_ssize_t slot
        cdef bint is_open = row[C_STATE] == C_OPEN
        cdef bint fits, retire, was_open
        cdef int64_t w = -1
        cdef uint32_t gen
        cdef Slot narrow
        cdef Slot* s
        if is_open:
            fifo = &self._admitted
        else:
            if self._replay_ns <= 0:
                return 0
            fifo = &self._rejected
        _ring_reserve(fifo)
        fits = _within(tkey, INT32_MIN, INT32_MAX) and self._encode(row, &narrow)
        slot = self._find(tkey, h1, h2, &pos)
        retire = slot >= 0 and self._at(slot).gen == GEN_MAX
        if slot < 0 or retire:
            if <uint64_t>(self._count + 1) * 4 > (self._mask + 1) * 3:
                self._resize_index(2 * (self._mask + 1))
                slot = self._find(tkey, h1, h2, &pos)
            self._reserve_slot()
        if not fits:
            w = self._wide_alloc()
        # Nothing fails from here on.
        if retire:
            # The slot's generations are used up: forget the row there (retiring the
            # slot), then store the key anew, as a replacement.
            was_open = (self._at(slot).state & STATE_BITS) == C_OPEN
            self._release(slot, pos)
            if was_open:
                self._open -= 1
            slot = self._find(tkey, h1, h2, &pos)
        if slot < 0:
            slot = self._take_slot()
            self._index[pos] = (h1 & 0xFFFFFFFF00000000ULL) | (<uint64_t>slot + 1)
            s = self._at(slot)
            gen = s.gen
            self._count += 1
        else:
            s = self._at(slot)
            if (s.state & STATE_BITS) == C_OPEN:
                self._open -= 1  # replaced while open: it is no longer open
            if s.state & WIDE:
                self._wide_free(s.rid)
            gen = s.gen + 1
        if fits:
            s[0] = narrow
        else:
            memcpy(&self._wide[w * WIDE_NF], row, ROW_BYTES)
            self._wide[w * WIDE_NF + C_NF] = tkey
            s.state = <uint8_t>row[C_STATE] | WIDE
            if not _within(tkey, INT32_MIN, INT32_MAX):
                s.state |= WIDE_KEY
            s.decided = row[C_DECIDED_NS]
            s.rid = w
        s.h1 = h1
        s.h2 = h2
        s.tkey = <int32_t>tkey
        s.gen = gen
        if is_open:
            self._open += 1
        _ring_push(fifo, row[C_DECIDED_NS], slot, gen)
        return 0

    cdef int _key(self, object tkey, object tenant_id, object request_id, int64_t* tk,
                  uint64_t* h1, uint64_t* h2) except -1:
        # The reference's _key: tkey, then the two ids' types; then their hashes.
        cdef bg_sip2_t h
        tk[0] = _i64(tkey)
        if not _is_str(<PyObject*>tenant_id):
            _bad_id("tenant_id", tenant_id)
        if not _is_str(<PyObject*>request_id):
            _bad_id("request_id", request_id)
        bg_sip2_init(&h, self._k1a, self._k1b, self._k2a, self._k2b)
        _feed_id(&h, <PyObject*>tenant_id, True)
        _feed_id(&h, <PyObject*>request_id, False)
        bg_sip2_final(&h, h1, h2)
        return 0

    def _set_generation(self, tkey, tenant_id, request_id, gen):
        """Set the generation of the key's slot (tests: a slot's last generation)."""
        cdef int64_t tk
        cdef uint64_t h1, h2, pos
        self._key(tkey, tenant_id, request_id, &tk, &h1, &h2)
        cdef Py_ssize_t slot = self._find(tk, h1, h2, &pos)
        if slot < 0:
            raise KeyError((tk, tenant_id, request_id))
        self._at(slot).gen = <uint32_t>PyLong_AsUnsignedLongLong(gen)

    def _generation(self, tkey, tenant_id, request_id):
        """The generation of the key's slot, or None (tests)."""
        cdef int64_t tk
        cdef uint64_t h1, h2, pos
        self._key(tkey, tenant_id, request_id, &tk, &h1, &h2)
        cdef Py_ssize_t slot = self._find(tk, h1, h2, &pos)
        return None if slot < 0 else self._at(slot).gen

    # --- lookups ---------------------------------------------------------------------

    def get(self, tkey, tenant_id, request_id):
        cdef int64_t tk
        cdef uint64_t h1, h2, pos
        self._key(tkey, tenant_id, request_id, &tk, &h1, &h2)
        cdef Py_ssize_t slot = self._find(tk, h1, h2, &pos)
        if slot < 0:
            return None
        return self._slot_tuple(slot)

    cdef object _replay_one(self, int64_t tkey, uint64_t h1, uint64_t h2, int64_t now):
        cdef uint64_t pos
        cdef Py_ssize_t slot = self._find(tkey, h1, h2, &pos)
        cdef const Slot* s
        cdef int64_t retry
        if slot < 0:
            return None
        s = self._at(slot)
        if (s.state & STATE_BITS) == C_REJECTED:
            retry = self._wide[s.rid * WIDE_NF + C_RETRY_NS] if s.state & WIDE else s.retry
            if _passed(now, s.decided, retry):
                self._release(slot, pos)
                return None
        return self._slot_tuple(slot)

    def replay(self, tkey, tenant_id, request_id, now):
        """The earlier decision if it still stands. A refusal stands until its
        retry_after has passed; then it is forgotten (decided anew)."""
        cdef int64_t tk
        cdef uint64_t h1, h2
        self._key(tkey, tenant_id, request_id, &tk, &h1, &h2)
        got = self._replay_one(tk, h1, h2, _i64(now))
        self._maybe_shrink()
        return got

    def replay_many(self, tkeys, tenant_ids, request_ids, now):
        """``replay`` for a batch: index -> earlier decision, for the entries
        whose decision still stands.  No Python object is made for an entry
        without one."""
        cdef int64_t c_now = _i64(now)
        cdef Py_buffer tview
        cdef Py_ssize_t n, i, j, k, stop, bad, stride
        cdef const char* tbuf
        cdef PyObject* t
        cdef PyObject* r
        cdef PrefixCache cache
        cdef int64_t tk[CHUNK]
        cdef uint64_t h1[CHUNK]
        cdef uint64_t h2[CHUNK]
        cdef dict out
        cache.tenant = NULL
        _get_buffer(tkeys, &tview, "tkeys", 1, True)
        try:
            _check_ids("tenant_ids", tenant_ids)
            _check_ids("request_ids", request_ids)
            n = len(request_ids)
            if tview.shape[0] != n or len(tenant_ids) != n:
                raise ValueError("tkeys, tenant_ids and request_ids must have the same length")
            out = {}
            if self._count == 0:
                return out
            tbuf = <const char*>tview.buf
            stride = tview.strides[0]
            i = 0
            while i < n:
                # Hash a run of entries and prefetch their index lines; stop short of an
                # entry that is not (str, str): the ones before it are answered first.
                stop = i + CHUNK if n - i > CHUNK else n
                bad = -1
                for j in range(i, stop):
                    t = PySequence_Fast_GET_ITEM(tenant_ids, j)
                    r = PySequence_Fast_GET_ITEM(request_ids, j)
                    if not (_is_str(t) and _is_str(r)):
                        bad = j
                        break
                    k = j - i
                    _hash_entry(self, &cache, t, r, &h1[k], &h2[k])
                    tk[k] = (<const int64_t*>(tbuf + j * stride))[0]
                    bg_prefetch(&self._index[(h1[k] >> 32) & self._mask])
                if bad >= 0:
                    stop = bad
                for j in range(i, stop):
                    k = j - i
                    row = self._replay_one(tk[k], h1[k], h2[k], c_now)
                    if row is not None:
                        out[j] = row
                if bad >= 0:
                    t = PySequence_Fast_GET_ITEM(tenant_ids, bad)
                    if not _is_str(t):
                        _bad_item("tenant_ids", bad, t)
                    _bad_item("request_ids", bad, PySequence_Fast_GET_ITEM(request_ids, bad))
                i = stop
            self._maybe_shrink()
            return out
        finally:
            PyBuffer_Release(&tview)


    # --- stores ----------------------------------------------------------------------

    def add(self, tkey, tenant_id, request_id, row):
        """Store a fresh decision (replacing any row of the key). A refusal is
        kept only with a replay window."""
        cdef int64_t tk
        cdef uint64_t h1, h2
        cdef int64_t values[C_NF]
        self._key(tkey, tenant_id, request_id, &tk, &h1, &h2)
        _parse_row(row, values)
        self._store(tk, h1, h2, values)

    def add_batch(self, tkeys, tenant_ids, request_ids, rows, fresh=None):
        """``add`` for row ``i`` of the (n, NF) array ``rows``, in order, for
        every ``i`` with ``fresh[i]`` (all when ``fresh`` is None)."""
        cdef Py_buffer tview, rview, fview
        cdef bint has_fresh = fresh is not None
        cdef Py_ssize_t n, i, j, k, m, stop, bad, tstride, fstride = 0
        cdef const char* tbuf
        cdef const char* fbuf = NULL
        cdef const int64_t* rbuf
        cdef const int64_t* row
        cdef PyObject* t
        cdef PyObject* r
        cdef PrefixCache cache
        cdef Py_ssize_t at[CHUNK]
        cdef int64_t tk[CHUNK]
        cdef uint64_t h1[CHUNK]
        cdef uint64_t h2[CHUNK]
        cache.tenant = NULL
        _get_buffer(tkeys, &tview, "tkeys", 1, True)
        try:
            _check_ids("tenant_ids", tenant_ids)
            _check_ids("request_ids", request_ids)
            _get_buffer(rows, &rview, "rows", 2, True)
            try:
                if not PyBuffer_IsContiguous(&rview, b"C"):
                    raise ValueError("rows must be C-contiguous")
                if has_fresh:
                    _get_buffer(fresh, &fview, "fresh", 1, False)
                try:
                    n = len(request_ids)
                    if (
                        tview.shape[0] != n
                        or len(tenant_ids) != n
                        or rview.shape[0] != n
                        or rview.shape[1] != C_NF
                    ):
                        raise ValueError(
                            f"rows must be ({n}, {C_NF}) and every column of length {n}"
                        )
                    if has_fresh and fview.shape[0] != n:
                        raise ValueError(f"fresh must have {n} entries")
                    tbuf = <const char*>tview.buf
                    tstride = tview.strides[0]
                    rbuf = <const int64_t*>rview.buf
                    if has_fresh:
                        fbuf = <const char*>fview.buf
                        fstride = fview.strides[0]
                    i = 0
                    while i < n:
                        # Check and hash a run of fresh entries, prefetching their index
                        # lines; stop short of a bad one: those before it are stored first.
                        stop = i + CHUNK if n - i > CHUNK else n
                        bad = -1
                        m = 0
                        for j in range(i, stop):
                            if has_fresh and fbuf[j * fstride] == 0:
                                continue
                            t = PySequence_Fast_GET_ITEM(tenant_ids, j)
                            r = PySequence_Fast_GET_ITEM(request_ids, j)
                            row = &rbuf[j * C_NF]
                            if not (
                                _is_str(t)
                                and _is_str(r)
                                and (row[C_STATE] == C_OPEN or row[C_STATE] == C_REJECTED)
                            ):
                                bad = j
                                break
                            _hash_entry(self, &cache, t, r, &h1[m], &h2[m])
                            tk[m] = (<const int64_t*>(tbuf + j * tstride))[0]
                            at[m] = j
                            bg_prefetch(&self._index[(h1[m] >> 32) & self._mask])
                            m += 1
                        for k in range(m):
                            self._store(tk[k], h1[k], h2[k], &rbuf[at[k] * C_NF])
                        if bad >= 0:
                            t = PySequence_Fast_GET_ITEM(tenant_ids, bad)
                            if not _is_str(t):
                                _bad_item("tenant_ids", bad, t)
                            r = PySequence_Fast_GET_ITEM(request_ids, bad)
                            if not _is_str(r):
                                _bad_item("request_ids", bad, r)
                            raise ValueError(
                                f"rows[{bad}]: state must be OPEN or REJECTED, "
                                f"got {rbuf[bad * C_NF + C_STATE]}"
                            )
                        i = stop
                finally:
                    if has_fresh:
                        PyBuffer_Release(&fview)
            finally:
                PyBuffer_Release(&rview)
        finally:
            PyBuffer_Release(&tview)

    def settle(self, tkey, tenant_id, request_id, actual, refunded, now):
        """Mark an open row settled with its real usage and refund; it is then
        remembered for the settled-id window (and never past the TTL)."""
        cdef int64_t tk
        cdef uint64_t h1, h2, pos
        self._key(tkey, tenant_id, request_id, &tk, &h1, &h2)
        cdef int64_t c_actual = _i64(actual)
        cdef int64_t c_refunded = _i64(refunded)
        cdef int64_t c_now = _i64(now)
        cdef Py_ssize_t slot = self._find(tk, h1, h2, &pos)
        cdef Slot* s
        cdef int64_t w
        cdef int64_t* wrow
        cdef bint remember = self._settled_ns < self._ttl_ns
        if slot < 0 or (self._at(slot).state & STATE_BITS) != C_OPEN:
            raise KeyError(f"no open reservation for {(tk, tenant_id, request_id)!r}")
        if remember:  # else the TTL's FIFO forgets it
            _ring_reserve(&self._settled)
        s = self._at(slot)
        if not (s.state & WIDE) and not (
            _within(c_actual, INT32_MIN, INT32_MAX) and _within(c_refunded, INT32_MIN, INT32_MAX)
        ):
            # Usage wider than its columns: the row moves whole to the overflow block.
            w = self._wide_alloc()
            self._decode(s, &self._wide[w * WIDE_NF])
            self._wide[w * WIDE_NF + C_NF] = s.tkey
            s.rid = w
            s.state |= WIDE
        if s.state & WIDE:
            wrow = &self._wide[s.rid * WIDE_NF]
            wrow[C_STATE] = C_SETTLED
            wrow[C_ACTUAL] = c_actual
            wrow[C_REFUNDED] = c_refunded
        else:
            s.actual = <int32_t>c_actual
            s.refunded = <int32_t>c_refunded
        s.state = (s.state & ~STATE_BITS) | C_SETTLED
        self._open -= 1
        if remember:
            _ring_push(&self._settled, c_now, slot, s.gen)
        return self._slot_tuple(slot)

    def drop_open(self, tkey, tenant_id, request_id):
        """Forget an open row (its caller never learned of it); None if the
        key has no open row."""
        cdef int64_t tk
        cdef uint64_t h1, h2, pos
        self._key(tkey, tenant_id, request_id, &tk, &h1, &h2)
        cdef Py_ssize_t slot = self._find(tk, h1, h2, &pos)
        if slot < 0 or (self._at(slot).state & STATE_BITS) != C_OPEN:
            return None
        got = self._slot_tuple(slot)
        self._release(slot, pos)
        self._open -= 1
        self._maybe_shrink()
        return got

    def drop_open_where(self, column, values):
        """Forget every open row whose ``column`` holds one of ``values``
        (the rows of pools whose cell moved to another replica); return
        them, oldest first. One pass over the admitted rows: a rare call."""
        cdef Py_ssize_t col = _i64(column)
        cdef Ring* r = &self._admitted
        cdef Py_ssize_t i, n = r.len
        cdef Entry* e
        cdef int64_t row[C_NF]
        cdef list out = []
        if not 0 <= col < C_NF:
            raise ValueError(f"column must be in [0, {C_NF}), got {col}")
        wanted = {_i64(v) for v in values}
        if not wanted:
            return out
        for i in range(n):
            e = &r.buf[(r.head + i) & (r.cap - 1)]
            if not self._live(e):
                continue
            self._decode(self._at(e.slot), row)
            if row[C_STATE] == C_OPEN and row[col] in wanted:
                out.append(_row_tuple(row))  # allocate before changing anything
                self._open -= 1
                self._delete(e.slot)
        self._maybe_shrink()
        return out

    # --- expiry ----------------------------------------------------------------------

    def expire(self, now):
        """Forget rows past their window; return the open ones among them
        (their reservations end without a Complete), in expiry order."""
        cdef int64_t c_now = _i64(now)
        cdef int64_t horizon
        cdef Ring* r
        cdef Entry* e
        cdef list released = []
        # A horizon below INT64_MIN (now - window, over unbounded ints) expires nothing.
        if c_now >= INT64_MIN + self._ttl_ns:
            horizon = c_now - self._ttl_ns
            r = &self._admitted
            while r.len > 0 and r.buf[r.head].t <= horizon:
                e = &r.buf[r.head]
                if self._live(e):
                    if (self._at(e.slot).state & STATE_BITS) == C_OPEN:
                        # allocate before changing anything
                        released.append(self._slot_tuple(e.slot))
                        self._open -= 1
                    self._delete(e.slot)
                _ring_pop(r)
        if c_now >= INT64_MIN + self._settled_ns:
            horizon = c_now - self._settled_ns
            r = &self._settled
            while r.len > 0 and r.buf[r.head].t <= horizon:
                e = &r.buf[r.head]
                if self._live(e) and (self._at(e.slot).state & STATE_BITS) == C_SETTLED:
                    self._delete(e.slot)
                _ring_pop(r)
        if self._admitted.len > 2 * self._count + C_COMPACT_SLACK:
            self._compact_admitted()
        if c_now >= INT64_MIN + self._replay_ns:
            horizon = c_now - self._replay_ns
            r = &self._rejected
            while r.len > 0 and r.buf[r.head].t <= horizon:
                e = &r.buf[r.head]
                if self._live(e):
                    self._delete(e.slot)
                _ring_pop(r)
        self._maybe_shrink()
        return released

    cdef void _compact_admitted(self) noexcept:
        # The reference's _compact_admitted, in place: keep, in order, the entries whose
        # slot still holds their row.  Runs when at least half the ring is dead.
        cdef Ring* r = &self._admitted
        cdef Py_ssize_t mask = r.cap - 1
        cdef Py_ssize_t k, w = 0
        cdef Entry* e
        for k in range(r.len):
            e = &r.buf[(r.head + k) & mask]
            if self._live(e):
                r.buf[(r.head + w) & mask] = e[0]
                w += 1
        r.len = w

    def footprint(self):
        """Sizes of the internal indexes (tests and benchmarks check for leaks).

        ``bytes`` is what the table has malloc'd: the blocks of slots, the index, the
        three rings, the overflow rows and the multiplier dictionary, at their allocated
        capacities (not the object header, nor the allocator's own overhead)."""
        cdef size_t total = (
            <size_t>self._nblocks * BLOCK_SLOTS * sizeof(Slot)
            + <size_t>self._blocks_cap * sizeof(Slot*)
            + <size_t>(self._mask + 1) * sizeof(uint64_t)
            + <size_t>(self._admitted.cap + self._settled.cap + self._rejected.cap)
            * sizeof(Entry)
            + <size_t>self._wcap * WIDE_NF * sizeof(int64_t)
            + <size_t>self._mcap * sizeof(int64_t)
            + (<size_t>self._mmask + 1 if self._mindex != NULL else 0) * sizeof(uint32_t)
        )
        return {
            "rows": self._count,
            "admitted_fifo": self._admitted.len,
            "settled_fifo": self._settled.len,
            "rejected_fifo": self._rejected.len,
            "bytes": total,
        }
