# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
# cython: cdivision=True, autotestdict=False
#
# Compiled AdmitStream wire codec: AdmitBatch bytes in, as columns; AdmitBatchResult
# columns out, as bytes.
#
# Long because: the reader and the writer of the two messages share the varint code and
# are tested as one module against one reference.
#
# fastpath/_wire_py.py is the reference and documents the semantics (upb's, to the byte);
# this file must give the same answers, which tests/unit/fastpath checks against the
# reference and against the protobuf runtime on random messages and random bytes.  What
# is compiled:
#
# * reading walks the bytes once with C pointers; a string is decoded straight from the
#   input buffer (CPython's strict UTF-8 decoder rejects what upb's validator rejects);
#   a tenant id or lane equal to one seen in the last few entries is compared with
#   memcmp against that entry's bytes and answered with the same str object, so a batch
#   of few tenants decodes each tenant once and the service's dict lookups hit on
#   identity.
# * writing converts each column's values once into a scratch array of 64-bit wire
#   values, sums their varint sizes for the packed length, then writes the varints into
#   one growable C buffer, copied once into the bytes object.

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.bytes cimport PyBytes_Check
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_AsUnsignedLongLong
from cpython.long cimport PyLong_CheckExact, PyLong_FromLongLong, PyLong_FromUnsignedLongLong
from cpython.object cimport PyObject
from cpython.unicode cimport PyUnicode_Check, PyUnicode_DecodeUTF8
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy

import operator


cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL


__all__ = ["AdmitBatchColumns", "WireError", "read_batch", "write_result"]

cdef enum:
    MAX_DEPTH = 100  # upb's default nesting limit for the Python runtime
    MAX_SIZE = 2147483647
    CACHE = 8  # recent distinct tenant ids (lanes) compared by bytes

cdef object _index = operator.index


class WireError(ValueError):
    """The bytes are not a valid AdmitBatch."""


@cython.final
@cython.auto_pickle(False)
cdef class AdmitBatchColumns:
    """One AdmitBatch as columns, named as the message's fields. Equal
    ``tenant_id`` (and ``lane``) entries are one and the same ``str``."""

    cdef public object batch_id
    cdef public list tenant_id
    cdef public list request_id
    cdef public list lane
    cdef public list prompt_tokens
    cdef public list max_tokens
    cdef public str model
    cdef public str pool
    cdef public list max_wait_ms
    cdef public list retry_key
    cdef public list attempt

    def __cinit__(self):
        self.batch_id = 0
        self.tenant_id = []
        self.request_id = []
        self.lane = []
        self.prompt_tokens = []
        self.max_tokens = []
        self.model = ""
        self.pool = ""
        self.max_wait_ms = []
        self.retry_key = []
        self.attempt = []


# ------------------------------------------------------------------ reading

cdef int _fail(str why) except -1:
    raise WireError(why)


cdef inline int _varint(const unsigned char* p, Py_ssize_t* pos, Py_ssize_t end,
                        uint64_t* out) except -1:
    """A varint of at most 10 bytes, bits past the 64th dropped."""
    cdef Py_ssize_t i = pos[0]
    cdef uint64_t v = 0, b
    cdef int shift = 0
    if i < end and p[i] < 0x80:
        out[0] = p[i]
        pos[0] = i + 1
        return 0
    while True:
        if i >= end or shift >= 70:
            return _fail("truncated or overlong varint")
        b = p[i]
        i += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            break
        shift += 7
    out[0] = v
    pos[0] = i
    return 0


cdef inline int _small(const unsigned char* p, Py_ssize_t* pos, Py_ssize_t end,
                       uint64_t* out) except -1:
    """A tag or a length: at most 5 bytes."""
    cdef Py_ssize_t i = pos[0]
    cdef uint64_t v = 0, b
    cdef int k
    for k in range(5):
        if i >= end:
            return _fail("truncated tag or length")
        b = p[i]
        i += 1
        v |= (b & 0x7F) << (7 * k)
        if b < 0x80:
            out[0] = v
            pos[0] = i
            return 0
    return _fail("overlong tag or length")


cdef inline int _tag(const unsigned char* p, Py_ssize_t* pos, Py_ssize_t end,
                     uint64_t* field, int* wire) except -1:
    cdef uint64_t t
    _small(p, pos, end, &t)
    if (t >> 32) != 0 or (t >> 3) == 0:
        return _fail("bad tag")
    field[0] = t >> 3
    wire[0] = <int>(t & 7)
    return 0


cdef inline int _length(const unsigned char* p, Py_ssize_t* pos, Py_ssize_t end,
                        Py_ssize_t* stop) except -1:
    cdef uint64_t size
    _small(p, pos, end, &size)
    if size >= MAX_SIZE or <Py_ssize_t>size > end - pos[0]:
        return _fail("length past the end")
    stop[0] = pos[0] + <Py_ssize_t>size
    return 0


cdef int _skip(const unsigned char* p, Py_ssize_t* pos, Py_ssize_t end, uint64_t field,
               int wire, int depth) except -1:
    """Past an unknown field whose tag was just read."""
    cdef uint64_t v, inner
    cdef int inner_wire
    cdef Py_ssize_t stop
    if wire == 0:
        return _varint(p, pos, end, &v)
    if wire == 1 or wire == 5:
        stop = pos[0] + (8 if wire == 1 else 4)
        if stop > end:
            return _fail("truncated fixed-size field")
        pos[0] = stop
        return 0
    if wire == 2:
        _length(p, pos, end, &stop)
        pos[0] = stop
        return 0
    if wire == 3:
        if depth >= MAX_DEPTH:
            return _fail("groups nested too deep")
        while True:
            _tag(p, pos, end, &inner, &inner_wire)
            if inner_wire == 4:
                if inner != field:
                    return _fail("mismatched end group")
                return 0
            _skip(p, pos, end, inner, inner_wire, depth + 1)
    return _fail("unexpected end group" if wire == 4 else "bad wire type")


cdef inline str _text(const unsigned char* p, Py_ssize_t start, Py_ssize_t stop):
    try:
        return PyUnicode_DecodeUTF8(<const char*>p + start, stop - start, NULL)
    except UnicodeDecodeError:
        raise WireError("string field is not valid UTF-8") from None


cdef struct Seen:
    Py_ssize_t start[CACHE]
    Py_ssize_t size[CACHE]
    PyObject* text[CACHE]  # borrowed: the column list holds it
    int count
    int next


cdef inline object _interned(const unsigned char* p, Py_ssize_t start, Py_ssize_t stop,
                             Seen* seen, dict interned):
    """The str of bytes [start, stop), the same object as an equal one met before."""
    cdef Py_ssize_t size = stop - start
    cdef int k
    cdef object text
    for k in range(seen.count):
        if seen.size[k] == size and memcmp(p + seen.start[k], p + start, size) == 0:
            return <object>seen.text[k]
    text = _text(p, start, stop)
    text = interned.setdefault(text, text)
    k = seen.next
    seen.start[k] = start
    seen.size[k] = size
    seen.text[k] = <PyObject*>text
    seen.next = (k + 1) % CACHE
    if seen.count < CACHE:
        seen.count += 1
    return text


cdef inline object _int_of(uint64_t v, bint u32):
    if u32:
        return PyLong_FromLongLong(<int64_t>(v & 0xFFFFFFFF))
    return PyLong_FromLongLong(<int64_t>v)


def read_batch(data):
    """An AdmitBatch's wire bytes as columns; :class:`WireError` when the
    protobuf runtime would refuse them."""
    if not PyBytes_Check(data):
        data = bytes(data)
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(data)
    cdef Py_ssize_t end = PyBytes_GET_SIZE(data)
    cdef Py_ssize_t pos = 0, stop
    cdef uint64_t field, v
    cdef int wire
    cdef bint u32
    cdef list column
    cdef Seen tenants, lanes
    tenants.count = tenants.next = 0
    lanes.count = lanes.next = 0
    cdef dict interned = {}
    cdef AdmitBatchColumns out = AdmitBatchColumns.__new__(AdmitBatchColumns)
    while pos < end:
        _tag(p, &pos, end, &field, &wire)
        if wire == 2 and (field == 2 or field == 3 or field == 4 or field == 10):
            _length(p, &pos, end, &stop)
            if field == 2:
                out.tenant_id.append(_interned(p, pos, stop, &tenants, interned))
            elif field == 3:
                out.request_id.append(_text(p, pos, stop))
            elif field == 4:
                out.lane.append(_interned(p, pos, stop, &lanes, interned))
            else:
                out.retry_key.append(_text(p, pos, stop))
            pos = stop
        elif (wire == 0 or wire == 2) and (field == 5 or field == 6 or field == 9
                                           or field == 11):
            if field == 5:
                column = out.prompt_tokens
            elif field == 6:
                column = out.max_tokens
            elif field == 9:
                column = out.max_wait_ms
            else:
                column = out.attempt
            u32 = field == 11
            if wire == 0:
                _varint(p, &pos, end, &v)
                column.append(_int_of(v, u32))
                continue
            _length(p, &pos, end, &stop)
            while pos < stop:
                _varint(p, &pos, stop, &v)
                column.append(_int_of(v, u32))
        elif field == 1 and wire == 0:
            _varint(p, &pos, end, &v)
            out.batch_id = PyLong_FromUnsignedLongLong(v)
        elif (field == 7 or field == 8) and wire == 2:
            _length(p, &pos, end, &stop)
            if field == 7:
                out.model = _text(p, pos, stop)
            else:
                out.pool = _text(p, pos, stop)
            pos = stop
        else:
            _skip(p, &pos, end, field, wire, 0)
    return out


# ------------------------------------------------------------------ writing

cdef enum:
    K_INT64 = 0
    K_UINT64 = 1
    K_INT32 = 2
    K_UINT32 = 3


cdef struct Buf:
    unsigned char* data
    Py_ssize_t size
    Py_ssize_t cap
    uint64_t* scratch  # a column's wire values
    Py_ssize_t scratch_cap


cdef int _reserve(Buf* b, Py_ssize_t more) except -1:
    cdef Py_ssize_t cap
    cdef unsigned char* grown
    if b.size + more <= b.cap:
        return 0
    cap = b.cap * 2 if b.cap else 256
    while cap < b.size + more:
        cap *= 2
    grown = <unsigned char*>realloc(b.data, cap)
    if grown == NULL:
        raise MemoryError()
    b.data = grown
    b.cap = cap
    return 0


cdef inline void _put(Buf* b, uint64_t v) noexcept:
    """A varint; room for 10 bytes reserved by the caller."""
    cdef unsigned char* q = b.data + b.size
    while v >= 0x80:
        q[0] = <unsigned char>((v & 0x7F) | 0x80)
        q += 1
        v >>= 7
    q[0] = <unsigned char>v
    b.size = q + 1 - b.data


cdef inline int _size(uint64_t v) noexcept:
    cdef int n = 1
    while v >= 0x80:
        v >>= 7
        n += 1
    return n


cdef int _put_tag(Buf* b, int field, int wire) except -1:
    _reserve(b, 10)
    _put(b, <uint64_t>(field << 3 | wire))
    return 0


cdef int _wire_value(object value, int kind, uint64_t* out) except -1:
    """``value`` as the runtime takes an integer field's: an integer (not a
    float) in the field's range; negative values as their 64-bit pattern."""
    cdef int overflow = 0
    cdef long long x
    cdef unsigned long long u
    if not PyLong_CheckExact(value):
        if isinstance(value, float):
            raise TypeError(f"an integer is required, got {value!r}")
        value = int(_index(value))
    if kind == K_UINT64:
        if value < 0:
            raise ValueError(f"value out of range: {value}")
        try:
            u = PyLong_AsUnsignedLongLong(value)
        except OverflowError:
            raise ValueError(f"value out of range: {value}") from None
        out[0] = u
        return 0
    x = PyLong_AsLongLongAndOverflow(value, &overflow)
    if overflow != 0:
        raise ValueError(f"value out of range: {value}")
    if kind == K_INT32 and not (-2147483648 <= x <= 2147483647):
        raise ValueError(f"value out of range: {value}")
    if kind == K_UINT32 and not (0 <= x <= 4294967295):
        raise ValueError(f"value out of range: {value}")
    out[0] = <uint64_t>x
    return 0


cdef int _scratch(Buf* b, Py_ssize_t n) except -1:
    cdef uint64_t* grown
    if n <= b.scratch_cap:
        return 0
    grown = <uint64_t*>realloc(b.scratch, n * sizeof(uint64_t))
    if grown == NULL:
        raise MemoryError()
    b.scratch = grown
    b.scratch_cap = n
    return 0


cdef int _packed(Buf* b, int field, object values, int kind) except -1:
    cdef Py_ssize_t n = len(values), i, body = 0
    cdef uint64_t* w
    cdef object item
    if n == 0:
        return 0
    _scratch(b, n)
    w = b.scratch
    if type(values) is list:
        for i in range(n):
            item = (<list>values)[i]
            _wire_value(item, kind, &w[i])
            body += _size(w[i])
    else:
        i = 0
        for item in values:
            _wire_value(item, kind, &w[i])
            body += _size(w[i])
            i += 1
    _reserve(b, 20 + body)
    _put(b, <uint64_t>(field << 3 | 2))
    _put(b, <uint64_t>body)
    for i in range(n):
        _put(b, w[i])
    return 0


cdef int _packed_bool(Buf* b, int field, object values) except -1:
    cdef Py_ssize_t n = len(values), i = 0
    cdef object item
    if n == 0:
        return 0
    _reserve(b, 20 + n)
    _put(b, <uint64_t>(field << 3 | 2))
    _put(b, <uint64_t>n)
    for item in values:
        b.data[b.size + i] = 1 if item else 0
        i += 1
    b.size += n
    return 0


cdef int _put_bytes(Buf* b, int field, const char* s, Py_ssize_t n) except -1:
    _reserve(b, 20 + n)
    _put(b, <uint64_t>(field << 3 | 2))
    _put(b, <uint64_t>n)
    memcpy(b.data + b.size, s, n)
    b.size += n
    return 0


cdef int _put_text(Buf* b, int field, object text, bint skip_empty) except -1:
    cdef Py_ssize_t n
    cdef const char* s
    if not PyUnicode_Check(text):
        raise TypeError(f"a str is required, got {type(text).__name__}")
    s = PyUnicode_AsUTF8AndSize(text, &n)
    if n or not skip_empty:
        _put_bytes(b, field, s, n)
    return 0


cdef int _strings(Buf* b, int field, object values) except -1:
    for text in values:
        _put_text(b, field, text, False)
    return 0


cdef int _raw(Buf* b, int field, object values) except -1:
    for item in values:
        if not PyBytes_Check(item):
            raise TypeError(f"bytes are required, got {type(item).__name__}")
        _put_bytes(b, field, PyBytes_AS_STRING(item), PyBytes_GET_SIZE(item))
    return 0


cdef int _submessage(Buf* b, int field, Buf* body) except -1:
    _put_bytes(b, field, <const char*>body.data, body.size)
    return 0


cdef int _degradation(Buf* b, object degradation) except -1:
    cdef Buf body
    cdef uint64_t v
    body.data = NULL
    body.size = body.cap = body.scratch_cap = 0
    body.scratch = NULL
    active, cap, page, fallback = degradation
    try:
        _reserve(&body, 32)
        if active:
            _put(&body, 0x08)
            _put(&body, 1)
        _wire_value(cap, K_INT64, &v)
        if v:
            _put(&body, 0x10)
            _put(&body, v)
        _wire_value(page, K_INT64, &v)
        if v:
            _put(&body, 0x18)
            _put(&body, v)
        _put_text(&body, 4, fallback, True)
        _submessage(b, 14, &body)
    finally:
        free(body.data)
    return 0


cdef int _pressure(Buf* b, object pressure) except -1:
    cdef unsigned char body[48]  # at most 9 + 11 + 2 + 11 bytes
    cdef int n = 0, k
    cdef double score
    cdef uint64_t bits, fresh, stale
    score_obj, freshness, stale_policy, shed = pressure
    score = float(score_obj)
    memcpy(&bits, &score, 8)
    _wire_value(freshness, K_INT32, &fresh)
    _wire_value(stale_policy, K_INT32, &stale)
    if bits:  # -0.0 is written: only all-zero bits are the default
        body[n] = 0x09
        n += 1
        for k in range(8):
            body[n] = <unsigned char>((bits >> (8 * k)) & 0xFF)
            n += 1
    cdef Buf inner
    inner.data = body
    inner.size = n
    inner.cap = 48
    if fresh:
        body[n] = 0x10
        inner.size = n + 1
        _put(&inner, fresh)
        n = inner.size
    if shed:
        body[n] = 0x20
        body[n + 1] = 1
        n += 2
    if stale:
        body[n] = 0x28
        inner.size = n + 1
        _put(&inner, stale)
        n = inner.size
    _put_bytes(b, 15, <const char*>body, n)
    return 0


def write_result(
    batch_id, decision, reason, retry_after_ms, reserved_tokens, reservation_id,
    granted_max_tokens, bucket_remaining, hourly_remaining, daily_remaining, duplicate,
    shadow_reason, degraded, degradation, pressure, pricing_multiplier, retryable, queued,
    entry, queue_wait_ms, fallback_model, owner, admission_token,
):
    """An AdmitBatchResult's wire bytes, as ``SerializeToString`` writes the
    message with these fields. ``degradation``: (active, max_tokens_cap,
    page_after_tokens, fallback_model) or None (not set); ``pressure``:
    (score, freshness, stale_policy, shed) or None."""
    cdef Buf b
    cdef uint64_t v
    b.data = NULL
    b.size = b.cap = b.scratch_cap = 0
    b.scratch = NULL
    try:
        _reserve(&b, 64 + 24 * len(decision))
        _wire_value(batch_id, K_UINT64, &v)
        if v:
            _put(&b, 0x08)
            _put(&b, v)
        _packed(&b, 2, decision, K_INT32)
        _packed(&b, 3, reason, K_INT32)
        _packed(&b, 4, retry_after_ms, K_INT64)
        _packed(&b, 5, reserved_tokens, K_INT64)
        _packed(&b, 6, reservation_id, K_UINT64)
        _packed(&b, 7, granted_max_tokens, K_INT64)
        _packed(&b, 8, bucket_remaining, K_INT64)
        _packed(&b, 9, hourly_remaining, K_INT64)
        _packed(&b, 10, daily_remaining, K_INT64)
        _packed_bool(&b, 11, duplicate)
        _packed(&b, 12, shadow_reason, K_INT32)
        _packed_bool(&b, 13, degraded)
        if degradation is not None:
            _degradation(&b, degradation)
        if pressure is not None:
            _pressure(&b, pressure)
        _packed_bool(&b, 21, retryable)
        _put_text(&b, 22, pricing_multiplier, True)
        _packed_bool(&b, 23, queued)
        _packed(&b, 24, entry, K_UINT32)
        _packed(&b, 25, queue_wait_ms, K_INT64)
        _strings(&b, 26, fallback_model)
        _strings(&b, 27, owner)
        _raw(&b, 28, admission_token)
        return PyBytes_FromStringAndSize(<const char*>b.data, b.size)
    finally:
        free(b.data)
        free(b.scratch)
