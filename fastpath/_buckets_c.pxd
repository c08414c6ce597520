# Layout of the compiled token-bucket table; bodies are in _buckets_c.pyx.
# Field meanings and units are those of fastpath/_buckets_py.py (_Slot), which is the
# reference; this struct must hold exactly the same state.

from libc.stdint cimport int64_t


cdef struct BucketSlot:
    # config
    int64_t rate                    # refill, mtok per second, [1, MAX_RATE_MTOK_PER_S]
    int64_t burst                   # capacity, mtok, [1000, MAX_BURST_MTOK]
    int64_t hourly_quota            # tokens per UTC hour, 0 = unlimited
    int64_t daily_quota             # tokens per UTC day, 0 = unlimited
    int64_t max_concurrency         # requests in flight, 0 = unlimited
    int64_t max_tokens_per_request  # cap on the generation estimate, 0 = none
    # state
    int64_t level                   # mtok, in [-burst, burst]; negative while in debt
    int64_t rem                     # refill remainder, mtok*ns/1e9, [0, 1e9); 0 when full
    int64_t last_ns                 # refilled up to here; never moves backwards
    int64_t hour_idx                # now_ns // NS_PER_HOUR of the current quota hour
    int64_t hour_used
    int64_t day_idx                 # now_ns // NS_PER_DAY of the current quota day
    int64_t day_used
    int64_t inflight
    int64_t inflight_tokens
    int64_t configured              # 0 = free slot (calloc/memset leave new slots free)


cdef struct Decision:
    int64_t reason                  # a fastpath.codes.Reason value
    int64_t reserved                # tokens charged (0 unless reason == OK, or shadow)
    int64_t retry_ns
    int64_t bucket_rem              # whole tokens left in the bucket, >= 0
    int64_t hour_rem                # -1 when unlimited
    int64_t day_rem                 # -1 when unlimited


cdef class TokenBucketTable:
    cdef BucketSlot* _slots         # _capacity entries, grown with realloc
    cdef Py_ssize_t _capacity
    cdef int64_t _total_inflight_tokens
    cdef int64_t _global_limit      # watermark on _total_inflight_tokens; 0 = off
    cdef bint _debt                 # buckets may go one burst into debt
    cdef int64_t _total_inflight    # requests in flight over all slots
    cdef int64_t _open_limit        # cap on _total_inflight; 0 = none
    cdef int64_t _slot_open_limit   # cap on each slot's inflight; 0 = none

    cdef int _grow(self, Py_ssize_t min_capacity) except -1
    cdef BucketSlot* _get(self, int64_t slot) except NULL
    cdef void _finish(self, BucketSlot* s, int64_t reserved_tokens) noexcept
    cdef tuple _one(self, object slot, object now_ns, object prompt_tokens,
                    object max_tokens, bint shadow)
