# Layout of the compiled fair queue; bodies are in _sched_c.pyx.  Field meanings and
# units are those of fastpath/_sched_py.py (FairQueue), which is the reference; this must
# hold exactly the same state.

from libc.stdint cimport int64_t


cdef struct Flow:
    int64_t weight                  # ppm, [1, PPM]; PPM for a flow never set
    int64_t vt                      # virtual time, [0, VT_MAX]
    int64_t rem                     # charge remainder, token-ppm, [0, weight)
    int64_t pos                     # index in FairQueue._active while active, else -1


cdef class FairQueue:
    cdef Flow* _flows               # _capacity entries, grown with realloc
    cdef int64_t* _active           # the active flows' indexes, in no order; _n_active used
    cdef Py_ssize_t _capacity
    cdef Py_ssize_t _n_active
    cdef int64_t _last_vt           # start tag of the last charge
    cdef int64_t _renormalize_above
    cdef int64_t _renormalizations

    cdef int _grow(self, Py_ssize_t min_capacity) except -1
    cdef int64_t _floor(self) noexcept
    cdef void _renormalize(self) noexcept
    cdef void _remove_active(self, Flow* s) noexcept
