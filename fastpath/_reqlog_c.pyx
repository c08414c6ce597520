# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
# cython: cdivision=True, autotestdict=False
#
# Compiled request table: what the plane remembers per request, in C storage.
#
# fastpath/_reqlog_py.py is the reference and documents the semantics; this file must give
# the same answers (tests/unit/fastpath drives both with the same random operation
# sequences, expiry and duplicates included).  Nothing per request is a Python object:
#
# * rows: one malloc'd int64 block of _cap x NF (row-major) with a Meta per slot (tkey,
#   the two id hashes, the version of the row stored there, 0 when free); freed slots go
#   on a free list threaded through Meta.tkey.  Every store takes a new version from the
#   table's counter, exactly as the reference does.
# * the index: open addressing with linear probing over a power-of-two array, load
#   factor <= 0.5, backward-shift deletion (no tombstones), doubling with a rehash.  An
#   entry is 64 bits: the slot number + 1 (0 = empty) in the low half and, in the high
#   half, a tag: the top 32 bits of h1, which modulo the index size are also the entry's
#   home position.  A probe
#   compares that tag before it reads the slot's key, so a lookup that finds nothing (a
#   new request, the common case) touches only the index; deletion and rehashing never
#   read a key.  The batch calls hash a run of entries first, prefetching their index
#   lines, then act on them in order, so the cache misses overlap.
# * the admitted, rejected and settled FIFOs: growable ring buffers of (time, slot,
#   version); an entry acts only while its slot still holds that version, and the
#   admitted ring is compacted (dead entries dropped) on the reference's trigger.
#
# Keys.  A row is keyed by (tkey, h1, h2): tkey, the tenant's slot in the bucket table,
# compared exactly, and two independent 64-bit SipHash-1-3 values of the ids under two
# 128-bit keys drawn from os.urandom when the table is made.  The hashed message is
# unambiguous: the 4-byte little-endian length of the tenant id's UTF-8, that UTF-8, then
# the request id's UTF-8 (a str with lone surrogates, which has no UTF-8, is hashed as its
# "surrogatepass" encoding: each surrogate's own 3-byte code, which no valid UTF-8
# contains, so distinct strs still give distinct messages).  Equal (tkey, h1, h2) is
# treated as the same request.  Two different requests are merged only if the tkeys are
# equal and both keyed hashes collide.  tkey is compared exactly and a tenant's slot is
# never reused, so two configured tenants' requests can never be merged.  Within one
# tenant (and among the unconfigured tenants, which all have tkey -1 and are told apart
# by the tenant id inside the message), with n rows live, some two colliding has
# probability about n^2 / 2^129: the keys are secret and random, so ids cannot be chosen
# to collide, and a 128-bit match of two independent PRFs is needed.  SipHash-1-3 is
# implemented below from Aumasson and Bernstein's description (test_reqlog.py checks it
# against CPython's own bytes hash, which is SipHash-1-3).
#
# Arithmetic the reference does on unbounded ints (decided + retry_after, now - window)
# is done here without overflow: the same comparisons over int64 inputs.  boundscheck
# and wraparound are off because every index is checked by hand (slots come from the
# index or from FIFO entries whose version matched; batch indexes from range(n)).

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
from libc.stdint cimport INT64_MIN, int64_t, uint64_t
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


# Row layout and states, as in the reference (test_reqlog.py checks they agree).
cdef enum:
    C_STATE = 0
    C_RETRY_NS = 2
    C_DECIDED_NS = 11
    C_ACTUAL = 16
    C_REFUNDED = 17
    C_NF = 24
    C_OPEN = 0
    C_SETTLED = 1
    C_REJECTED = 2
    C_COMPACT_SLACK = 4096
    CHUNK = 16  # batch entries hashed (and their index lines prefetched) ahead

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

# Slot numbers (+ 1) take 32 bits of an index entry, and the index, at most half full,
# has at most 2**32 entries.
cdef Py_ssize_t MAX_SLOTS = 2**31 - 1
cdef size_t ROW_BYTES = C_NF * sizeof(int64_t)


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


cdef inline void _ring_push(Ring* r, int64_t t, Py_ssize_t slot, int64_t version) noexcept:
    # After _ring_reserve.
    cdef Entry* e = &r.buf[(r.head + r.len) & (r.cap - 1)]
    e.t = t
    e.version = version
    e.slot = slot
    r.len += 1


cdef inline void _ring_pop(Ring* r) noexcept:
    r.head = (r.head + 1) & (r.cap - 1)
    r.len -= 1


# --- the table ---------------------------------------------------------------------------


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
        self._rows = NULL
        self._meta = NULL
        self._index = NULL
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
        self._version = 0
        self._open = 0
        self._cap = 0
        self._used = 0
        self._free = -1
        self._count = 0
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
        free(self._rows)
        free(self._meta)
        free(self._index)
        free(self._admitted.buf)
        free(self._rejected.buf)
        free(self._settled.buf)
        self._rows = NULL
        self._meta = NULL
        self._index = NULL
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

    # --- storage ---------------------------------------------------------------------

    cdef int _reserve_slot(self) except -1:
        # A free slot for one more row (the free list, or an untouched one, or a doubling).
        cdef Py_ssize_t new_cap
        cdef int64_t* rows
        cdef Meta* meta
        if self._free >= 0 or self._used < self._cap:
            return 0
        if self._cap >= MAX_SLOTS:
            raise MemoryError(f"the request table holds at most {MAX_SLOTS} rows")
        new_cap = 2 * self._cap if self._cap else 8
        if new_cap > MAX_SLOTS:
            new_cap = MAX_SLOTS
        rows = <int64_t*>realloc(self._rows, <size_t>new_cap * ROW_BYTES)
        if rows == NULL:
            raise MemoryError()  # the old block is still valid and still ours
        self._rows = rows
        meta = <Meta*>realloc(self._meta, <size_t>new_cap * sizeof(Meta))
        if meta == NULL:
            raise MemoryError()  # _rows is bigger, harmlessly; _cap is unchanged
        self._meta = meta
        self._cap = new_cap
        return 0

    cdef int _grow_index(self) except -1:
        # Double the index and re-insert every entry at its home (read from its tag).
        cdef uint64_t old_size = self._mask + 1
        cdef uint64_t new_mask = 2 * old_size - 1
        cdef uint64_t i, j, e
        if new_mask > 0xFFFFFFFFULL:  # homes come from 32 bits of the hash
            raise MemoryError("the request table's index is full")
        cdef uint64_t* index = <uint64_t*>calloc(<size_t>(new_mask + 1), sizeof(uint64_t))
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

    cdef Py_ssize_t _find(self, int64_t tkey, uint64_t h1, uint64_t h2,
                          uint64_t* pos) noexcept:
        # The slot of the key, or -1; ``pos`` gets its index position, or the empty one
        # where it would go.  The load factor keeps an empty position in every probe.
        cdef uint64_t mask = self._mask
        cdef uint64_t tag = h1 >> 32
        cdef uint64_t i = tag & mask
        cdef uint64_t e
        cdef Meta* m
        while True:
            e = self._index[i]
            if e == 0:
                pos[0] = i
                return -1
            if (e >> 32) == tag:
                m = &self._meta[(e & 0xFFFFFFFFULL) - 1]
                if m.h1 == h1 and m.h2 == h2 and m.tkey == tkey:
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
        # Forget the row in ``slot``, found at index position ``pos``.
        self._unlink(pos)
        self._meta[slot].version = 0
        self._meta[slot].tkey = self._free
        self._free = slot
        self._count -= 1

    cdef void _delete(self, Py_ssize_t slot) noexcept:
        # Forget the (live) row in ``slot``: find its index position by its hash first.
        cdef uint64_t mask = self._mask
        cdef uint64_t i = (self._meta[slot].h1 >> 32) & mask
        while (self._index[i] & 0xFFFFFFFFULL) != <uint64_t>slot + 1:
            i = (i + 1) & mask
        self._release(slot, i)

    cdef int _store(self, int64_t tkey, uint64_t h1, uint64_t h2,
                    const int64_t* row) except -1:
        # The reference's _store: ``row`` is checked (state OPEN or REJECTED).  Everything
        # that may fail (allocations) happens before anything changes.
        cdef Ring* fifo
        cdef uint64_t pos
        cdef Py_ssize_t slot
        cdef bint is_open = row[C_STATE] == C_OPEN
        cdef Meta* m
        if is_open:
            fifo = &self._admitted
        else:
            if self._replay_ns <= 0:
                return 0
            fifo = &self._rejected
        _ring_reserve(fifo)
        slot = self._find(tkey, h1, h2, &pos)
        if slot < 0:
            if <uint64_t>(self._count + 1) * 2 > self._mask + 1:
                self._grow_index()
                self._find(tkey, h1, h2, &pos)
            self._reserve_slot()
            if self._free >= 0:
                slot = self._free
                self._free = self._meta[slot].tkey
            else:
                slot = self._used
                self._used += 1
            self._index[pos] = (h1 & 0xFFFFFFFF00000000ULL) | (<uint64_t>slot + 1)
            m = &self._meta[slot]
            m.tkey = tkey
            m.h1 = h1
            m.h2 = h2
            self._count += 1
        elif self._rows[slot * C_NF + C_STATE] == C_OPEN:
            self._open -= 1  # replaced while open: it is no longer open
        if is_open:
            self._open += 1
        self._version += 1
        self._meta[slot].version = self._version
        memcpy(&self._rows[slot * C_NF], row, ROW_BYTES)
        _ring_push(fifo, row[C_DECIDED_NS], slot, self._version)
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

    # --- lookups ---------------------------------------------------------------------

    def get(self, tkey, tenant_id, request_id):
        cdef int64_t tk
        cdef uint64_t h1, h2, pos
        self._key(tkey, tenant_id, request_id, &tk, &h1, &h2)
        cdef Py_ssize_t slot = self._find(tk, h1, h2, &pos)
        if slot < 0:
            return None
        return _row_tuple(&self._rows[slot * C_NF])

    cdef object _replay_one(self, int64_t tkey, uint64_t h1, uint64_t h2, int64_t now):
        cdef uint64_t pos
        cdef Py_ssize_t slot = self._find(tkey, h1, h2, &pos)
        cdef const int64_t* row
        if slot < 0:
            return None
        row = &self._rows[slot * C_NF]
        if row[C_STATE] == C_REJECTED and _passed(now, row[C_DECIDED_NS], row[C_RETRY_NS]):
            self._release(slot, pos)
            return None
        return _row_tuple(row)

    def replay(self, tkey, tenant_id, request_id, now):
        """The earlier decision if it still stands. A refusal stands until its
        retry_after has passed; then it is forgotten (decided anew)."""
        cdef int64_t tk
        cdef uint64_t h1, h2
        self._key(tkey, tenant_id, request_id, &tk, &h1, &h2)
        return self._replay_one(tk, h1, h2, _i64(now))

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
        cdef int64_t* row
        cdef bint remember = self._settled_ns < self._ttl_ns
        if slot < 0 or self._rows[slot * C_NF + C_STATE] != C_OPEN:
            raise KeyError(f"no open reservation for {(tk, tenant_id, request_id)!r}")
        if remember:  # else the TTL's FIFO forgets it
            _ring_reserve(&self._settled)
        row = &self._rows[slot * C_NF]
        row[C_STATE] = C_SETTLED
        row[C_ACTUAL] = c_actual
        row[C_REFUNDED] = c_refunded
        self._open -= 1
        if remember:
            _ring_push(&self._settled, c_now, slot, self._meta[slot].version)
        return _row_tuple(row)

    def drop_open(self, tkey, tenant_id, request_id):
        """Forget an open row (its caller never learned of it); None if the
        key has no open row."""
        cdef int64_t tk
        cdef uint64_t h1, h2, pos
        self._key(tkey, tenant_id, request_id, &tk, &h1, &h2)
        cdef Py_ssize_t slot = self._find(tk, h1, h2, &pos)
        if slot < 0 or self._rows[slot * C_NF + C_STATE] != C_OPEN:
            return None
        got = _row_tuple(&self._rows[slot * C_NF])
        self._release(slot, pos)
        self._open -= 1
        return got

    def drop_open_where(self, column, values):
        """Forget every open row whose ``column`` holds one of ``values``
        (the rows of pools whose cell moved to another replica); return
        them, oldest first. One pass over the admitted rows: a rare call."""
        cdef Py_ssize_t col = _i64(column)
        cdef Ring* r = &self._admitted
        cdef Py_ssize_t i, n = r.len
        cdef Entry e
        cdef int64_t* row
        cdef list out = []
        if not 0 <= col < C_NF:
            raise ValueError(f"column must be in [0, {C_NF}), got {col}")
        wanted = {_i64(v) for v in values}
        if not wanted:
            return out
        for i in range(n):
            e = r.buf[(r.head + i) & (r.cap - 1)]
            if self._meta[e.slot].version != e.version:
                continue
            row = &self._rows[e.slot * C_NF]
            if row[C_STATE] == C_OPEN and row[col] in wanted:
                out.append(_row_tuple(row))  # allocate before changing anything
                self._open -= 1
                self._delete(e.slot)
        return out

    # --- expiry ----------------------------------------------------------------------

    def expire(self, now):
        """Forget rows past their window; return the open ones among them
        (their reservations end without a Complete), in expiry order."""
        cdef int64_t c_now = _i64(now)
        cdef int64_t horizon
        cdef Ring* r
        cdef Entry e
        cdef list released = []
        # A horizon below INT64_MIN (now - window, over unbounded ints) expires nothing.
        if c_now >= INT64_MIN + self._ttl_ns:
            horizon = c_now - self._ttl_ns
            r = &self._admitted
            while r.len > 0 and r.buf[r.head].t <= horizon:
                e = r.buf[r.head]
                if self._meta[e.slot].version == e.version:
                    if self._rows[e.slot * C_NF + C_STATE] == C_OPEN:
                        # allocate before changing anything
                        released.append(_row_tuple(&self._rows[e.slot * C_NF]))
                        self._open -= 1
                    self._delete(e.slot)
                _ring_pop(r)
        if c_now >= INT64_MIN + self._settled_ns:
            horizon = c_now - self._settled_ns
            r = &self._settled
            while r.len > 0 and r.buf[r.head].t <= horizon:
                e = r.buf[r.head]
                if (
                    self._meta[e.slot].version == e.version
                    and self._rows[e.slot * C_NF + C_STATE] == C_SETTLED
                ):
                    self._delete(e.slot)
                _ring_pop(r)
        if self._admitted.len > 2 * self._count + C_COMPACT_SLACK:
            self._compact_admitted()
        if c_now >= INT64_MIN + self._replay_ns:
            horizon = c_now - self._replay_ns
            r = &self._rejected
            while r.len > 0 and r.buf[r.head].t <= horizon:
                e = r.buf[r.head]
                if self._meta[e.slot].version == e.version:
                    self._delete(e.slot)
                _ring_pop(r)
        return released

    cdef void _compact_admitted(self) noexcept:
        # The reference's _compact_admitted, in place: keep, in order, the entries whose
        # slot still holds their version.  Runs when at least half the ring is dead.
        cdef Ring* r = &self._admitted
        cdef Py_ssize_t mask = r.cap - 1
        cdef Py_ssize_t k, w = 0
        cdef Entry* e
        for k in range(r.len):
            e = &r.buf[(r.head + k) & mask]
            if self._meta[e.slot].version == e.version:
                r.buf[(r.head + w) & mask] = e[0]
                w += 1
        r.len = w

    def footprint(self):
        """Sizes of the internal indexes (tests and benchmarks check for leaks).

        ``bytes`` is what the table has malloc'd: the row block, the slot metadata, the
        index and the three rings, at their allocated capacities (not the object
        header, nor the allocator's own overhead)."""
        cdef size_t total = (
            <size_t>self._cap * (ROW_BYTES + sizeof(Meta))
            + <size_t>(self._mask + 1) * sizeof(uint64_t)
            + <size_t>(self._admitted.cap + self._settled.cap + self._rejected.cap)
            * sizeof(Entry)
        )
        return {
            "rows": self._count,
            "admitted_fifo": self._admitted.len,
            "settled_fifo": self._settled.len,
            "rejected_fifo": self._rejected.len,
            "bytes": total,
        }
