# Layout of the compiled request table; bodies are in _reqlog_c.pyx.  The semantics are
# those of fastpath/_reqlog_py.py (RequestTable), which is the reference; this holds the
# same rows, versions and FIFOs in malloc'd arrays (no Python object per request).

from libc.stdint cimport int64_t, uint64_t


cdef struct Meta:
    # One per slot of the row block.
    int64_t tkey                    # the tenant's slot; while free: the next free slot, -1 = none
    uint64_t h1                     # SipHash-1-3 of the ids under key 1 (also the index hash)
    uint64_t h2                     # SipHash-1-3 of the ids under key 2
    int64_t version                 # of the row stored here; 0 = free slot


cdef struct Entry:
    # A FIFO entry: acts on the row in ``slot`` only while that row has ``version``.
    int64_t t                       # decided (admitted, rejected) or settled at, ns
    int64_t version
    int64_t slot


cdef struct Ring:
    # A growable ring buffer of entries, in insertion order.
    Entry* buf
    Py_ssize_t cap                  # a power of two (or 0 before the first push)
    Py_ssize_t head                 # index of the oldest entry
    Py_ssize_t len


cdef class RequestTable:
    cdef int64_t* _rows             # _cap x NF, row-major
    cdef Meta* _meta                # _cap entries
    cdef Py_ssize_t _cap            # slots allocated
    cdef Py_ssize_t _used           # slots ever handed out (the rest never touched)
    cdef int64_t _free              # head of the free-slot list, -1 = empty
    cdef Py_ssize_t _count          # live rows
    cdef uint64_t* _index           # open addressing, _mask + 1 entries: tag << 32 | slot + 1
    cdef uint64_t _mask
    cdef Ring _admitted             # (decided, slot, version) of OPEN rows as stored
    cdef Ring _rejected             # (decided, slot, version) of REJECTED rows
    cdef Ring _settled              # (settled at, slot, version)
    cdef int64_t _ttl_ns
    cdef int64_t _replay_ns
    cdef int64_t _settled_ns        # min(settled_ns, ttl_ns), as in the reference
    cdef int64_t _version           # last version handed out
    cdef int64_t _open              # rows stored OPEN and not settled, dropped or expired
    cdef uint64_t _k1a, _k1b, _k2a, _k2b  # the two SipHash keys, from os.urandom

    cdef int _reserve_slot(self) except -1
    cdef int _grow_index(self) except -1
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
