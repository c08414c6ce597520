# Layout of the compiled request table; bodies are in _reqlog_c.pyx.  The semantics are
# those of fastpath/_reqlog_py.py (RequestTable), which is the reference; this holds the
# same rows and FIFOs in malloc'd arrays (no Python object per request), each row in one
# fixed-size slot of narrow columns (the top of _reqlog_c.pyx explains the layout).

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t


cdef packed struct Slot:
    # One remembered request: its key, its generation and its row in narrow columns.
    # Packed: 121 bytes, no padding (x86-64 and arm64 read unaligned words at full speed).
    uint64_t h1                     # SipHash-1-3 of the ids under key 1 (also the index hash)
    uint64_t h2                     # SipHash-1-3 of the ids under key 2
    int64_t decided                 # DECIDED_NS, in every row (wide ones too)
    int64_t rid                     # RID; a wide row: its row in the overflow block;
                                    # a free slot: the next free slot (-1 = none)
    int64_t retry                   # RETRY_NS
    int64_t bucket                  # BUCKET, HOUR, DAY: remaining tokens, sums of many
    int64_t hour
    int64_t day
    int32_t tkey                    # the tenant's key, compared exactly
    uint32_t gen                    # generation: a FIFO entry acts only while it matches
    int32_t reserved
    int32_t granted
    int32_t tslot                   # SLOT
    int32_t window
    int32_t actual
    int32_t refunded
    uint32_t waited                 # DECIDED_NS - ARRIVED_NS
    int32_t degraded                # DEGRADED_CAP
    int32_t score                   # SCORE_PPM
    uint16_t lane
    uint16_t pool
    uint16_t model
    uint16_t mult                   # MULTIPLIER: its number in the table's dictionary
    uint8_t state                   # STATE (low 2 bits) | WIDE | RETIRED
    int8_t reason
    int8_t shadow                   # SHADOW_REASON
    int8_t fresh                    # FRESHNESS
    int8_t shed                     # SHED


cdef struct Entry:
    # A FIFO entry: acts on the row in ``slot`` only while that slot has generation ``gen``.
    int64_t t                       # decided (admitted, rejected) or settled at, ns
    uint32_t slot
    uint32_t gen


cdef struct Ring:
    # A growable ring buffer of entries, in insertion order.
    Entry* buf
    Py_ssize_t cap                  # a power of two (or 0 before the first push)
    Py_ssize_t head                 # index of the oldest entry
    Py_ssize_t len


cdef class RequestTable:
    cdef Slot** _blocks             # fixed-size blocks of slots, never moved nor freed early
    cdef Py_ssize_t _nblocks
    cdef Py_ssize_t _blocks_cap     # entries of the _blocks array
    cdef Py_ssize_t _used           # slots ever handed out (the rest never touched)
    cdef int64_t _free              # head of the free-slot list, -1 = empty
    cdef Py_ssize_t _count          # live rows
    cdef Py_ssize_t _retired        # slots whose generations ran out (never reused)
    cdef uint64_t* _index           # open addressing, _mask + 1 entries: tag << 32 | slot + 1
    cdef uint64_t _mask
    cdef int64_t* _wide             # overflow rows (NF int64 each) of the rows that do not fit
    cdef Py_ssize_t _wcap
    cdef Py_ssize_t _wused
    cdef int64_t _wfree             # head of the free overflow rows, -1 = empty
    cdef Py_ssize_t _wcount         # overflow rows in use
    cdef int64_t* _mvals            # the multiplier dictionary: value by number
    cdef uint32_t* _mindex          # open addressing over _mvals: number + 1, 0 = empty
    cdef Py_ssize_t _mcount
    cdef Py_ssize_t _mcap           # entries of _mvals
    cdef uint32_t _mmask            # _mindex has _mmask + 1 entries
    cdef Ring _admitted             # (decided, slot, gen) of OPEN rows as stored
    cdef Ring _rejected             # (decided, slot, gen) of REJECTED rows
    cdef Ring _settled              # (settled at, slot, gen)
    cdef int64_t _ttl_ns
    cdef int64_t _replay_ns
    cdef int64_t _settled_ns        # min(settled_ns, ttl_ns), as in the reference
    cdef int64_t _open              # rows stored OPEN and not settled, dropped or expired
    cdef uint64_t _k1a, _k1b, _k2a, _k2b  # the two SipHash keys, from os.urandom

    cdef Slot* _at(self, Py_ssize_t slot) noexcept
    cdef bint _live(self, const Entry* e) noexcept
    cdef int _reserve_slot(self) except -1
    cdef Py_ssize_t _take_slot(self) noexcept
    cdef int _resize_index(self, uint64_t size) except -1
    cdef void _maybe_shrink(self) noexcept
    cdef int64_t _wide_alloc(self) except -1
    cdef void _wide_free(self, int64_t w) noexcept
    cdef int _mult_id(self, int64_t value) except -2
    cdef int _encode(self, const int64_t* row, Slot* s) except -1
    cdef void _decode(self, const Slot* s, int64_t* out) noexcept
    cdef tuple _slot_tuple(self, Py_ssize_t slot)
    cdef Py_ssize_t _find(self, int64_t tkey, uint64_t h1, uint64_t h2,
                          uint64_t* pos) noexcept
    cdef void _unlink(self, uint64_t pos) noexcept
    cdef void _release(self, Py_ssize_t slot, uint64_t pos) noexcept
    cdef void _delete(self, Py_ssize_t slot) noexcept
    cdef int _store(self, int64_t tkey, uint64_t h1, uint64_t h2,
                    const int64_t* row) except -1
    cdef int _key(self, object tkey, object tenant_id, object request_id, int64_t* tk,
                  uint64_t* h1, uint64_t* h2) except -1
    cdef object _replay_one(self, int64_t tkey, uint64_t h1, uint64_t h2, int64_t now)
    cdef void _compact_admitted(self) noexcept
