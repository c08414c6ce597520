# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
# cython: cdivision=True, autotestdict=False
#
# Compiled admission-token MACs: HMAC-SHA256 truncated to 16 bytes.
#
# fastpath/_sign_py.py is the reference and documents the messages; this file must give
# the same bytes (tests/unit/service/test_sign_fast.py checks both against Python's hmac
# on random inputs).  A batch's tokens are signed here in one call, without a Python
# object per entry beyond its token: the per-token Python of the reference (copying
# hashlib states, packing, joining) cost ~1.5 us a token, several times the hashing.
#
# SHA-256 is FIPS 180-4's, in portable C, and through the x86 SHA extensions when the CPU
# has them (checked once with CPUID; _set_sha_ni(False) forces the portable code, for
# the tests).  HMAC's inner and outer states after the key block are computed once per
# key; a batch's entries that share a token body (lane, pool, multiplier, window, issue
# time) share its hashing too: the inner context after the body is copied per entry.

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_INCREF
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>

    typedef struct {
        uint32_t h[8];
        uint8_t buf[64];
        uint32_t n;        /* bytes in buf */
        uint64_t total;    /* bytes hashed, key block included */
    } bg_sha256;

    static const uint32_t BG_K[64] = {
        0x428a2f98,0x71374491,0xb5c0fbcf,0xe9b5dba5,0x3956c25b,0x59f111f1,0x923f82a4,0xab1c5ed5,
        0xd807aa98,0x12835b01,0x243185be,0x550c7dc3,0x72be5d74,0x80deb1fe,0x9bdc06a7,0xc19bf174,
        0xe49b69c1,0xefbe4786,0x0fc19dc6,0x240ca1cc,0x2de92c6f,0x4a7484aa,0x5cb0a9dc,0x76f988da,
        0x983e5152,0xa831c66d,0xb00327c8,0xbf597fc7,0xc6e00bf3,0xd5a79147,0x06ca6351,0x14292967,
        0x27b70a85,0x2e1b2138,0x4d2c6dfc,0x53380d13,0x650a7354,0x766a0abb,0x81c2c92e,0x92722c85,
        0xa2bfe8a1,0xa81a664b,0xc24b8b70,0xc76c51a3,0xd192e819,0xd6990624,0xf40e3585,0x106aa070,
        0x19a4c116,0x1e376c08,0x2748774c,0x34b0bcb5,0x391c0cb3,0x4ed8aa4a,0x5b9cca4f,0x682e6ff3,
        0x748f82ee,0x78a5636f,0x84c87814,0x8cc70208,0x90befffa,0xa4506ceb,0xbef9a3f7,0xc67178f2};

    static const uint32_t BG_H0[8] = {
        0x6a09e667,0xbb67ae85,0x3c6ef372,0xa54ff53a,0x510e527f,0x9b05688c,0x1f83d9ab,0x5be0cd19};

    #define BG_ROR(x, r) (((x) >> (r)) | ((x) << (32 - (r))))

    static void bg_blocks_portable(uint32_t *h, const uint8_t *p, size_t nblocks) {
        uint32_t w[64];
        while (nblocks--) {
            int t;
            for (t = 0; t < 16; t++)
                w[t] = ((uint32_t)p[4*t] << 24) | ((uint32_t)p[4*t+1] << 16)
                     | ((uint32_t)p[4*t+2] << 8) | (uint32_t)p[4*t+3];
            for (t = 16; t < 64; t++) {
                uint32_t s0 = BG_ROR(w[t-15], 7) ^ BG_ROR(w[t-15], 18) ^ (w[t-15] >> 3);
                uint32_t s1 = BG_ROR(w[t-2], 17) ^ BG_ROR(w[t-2], 19) ^ (w[t-2] >> 10);
                w[t] = w[t-16] + s0 + w[t-7] + s1;
            }
            uint32_t a = h[0], b = h[1], c = h[2], d = h[3];
            uint32_t e = h[4], f = h[5], g = h[6], k = h[7];
            for (t = 0; t < 64; t++) {
                uint32_t S1 = BG_ROR(e, 6) ^ BG_ROR(e, 11) ^ BG_ROR(e, 25);
                uint32_t ch = (e & f) ^ (~e & g);
                uint32_t t1 = k + S1 + ch + BG_K[t] + w[t];
                uint32_t S0 = BG_ROR(a, 2) ^ BG_ROR(a, 13) ^ BG_ROR(a, 22);
                uint32_t mj = (a & b) ^ (a & c) ^ (b & c);
                uint32_t t2 = S0 + mj;
                k = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
            }
            h[0] += a; h[1] += b; h[2] += c; h[3] += d;
            h[4] += e; h[5] += f; h[6] += g; h[7] += k;
            p += 64;
        }
    }

    #if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    #include <cpuid.h>
    #include <immintrin.h>
    #define BG_HAVE_NI_CODE 1

    /* The SHA extensions' round structure (Intel's "SHA extensions" white paper):
       4 rounds per group, message vectors in a ring of four. */
    __attribute__((target("sha,sse4.1,ssse3")))
    static void bg_blocks_ni(uint32_t *h, const uint8_t *p, size_t nblocks) {
        const __m128i MASK = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
        __m128i tmp = _mm_loadu_si128((const __m128i *)&h[0]);
        __m128i st1 = _mm_loadu_si128((const __m128i *)&h[4]);
        tmp = _mm_shuffle_epi32(tmp, 0xB1);           /* CDAB */
        st1 = _mm_shuffle_epi32(st1, 0x1B);           /* EFGH */
        __m128i st0 = _mm_alignr_epi8(tmp, st1, 8);   /* ABEF */
        st1 = _mm_blend_epi16(st1, tmp, 0xF0);        /* CDGH */
        while (nblocks--) {
            __m128i abef = st0, cdgh = st1, msg, m[4];
            int j;
            for (j = 0; j < 4; j++)
                m[j] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * j)), MASK);
            #pragma GCC unroll 16
            for (j = 0; j < 16; j++) {
                msg = _mm_add_epi32(m[j & 3], _mm_loadu_si128((const __m128i *)&BG_K[4 * j]));
                st1 = _mm_sha256rnds2_epu32(st1, st0, msg);
                if (j >= 3 && j <= 14) {
                    __m128i t = _mm_alignr_epi8(m[j & 3], m[(j - 1) & 3], 4);
                    m[(j + 1) & 3] = _mm_add_epi32(m[(j + 1) & 3], t);
                    m[(j + 1) & 3] = _mm_sha256msg2_epu32(m[(j + 1) & 3], m[j & 3]);
                }
                msg = _mm_shuffle_epi32(msg, 0x0E);
                st0 = _mm_sha256rnds2_epu32(st0, st1, msg);
                if (j >= 1 && j <= 12)
                    m[(j - 1) & 3] = _mm_sha256msg1_epu32(m[(j - 1) & 3], m[j & 3]);
            }
            st0 = _mm_add_epi32(st0, abef);
            st1 = _mm_add_epi32(st1, cdgh);
            p += 64;
        }
        tmp = _mm_shuffle_epi32(st0, 0x1B);           /* FEBA */
        st1 = _mm_shuffle_epi32(st1, 0xB1);           /* DCHG */
        st0 = _mm_blend_epi16(tmp, st1, 0xF0);        /* DCBA */
        st1 = _mm_alignr_epi8(st1, tmp, 8);           /* ABEF */
        _mm_storeu_si128((__m128i *)&h[0], st0);
        _mm_storeu_si128((__m128i *)&h[4], st1);
    }

    static int bg_cpu_has_ni(void) {
        unsigned int a, b, c, d;
        if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
        if (!(c & (1u << 19)) || !(c & (1u << 9))) return 0;   /* SSE4.1, SSSE3 */
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
        return (b >> 29) & 1;                                   /* SHA */
    }
    #else
    #define BG_HAVE_NI_CODE 0
    static void bg_blocks_ni(uint32_t *h, const uint8_t *p, size_t nblocks) {
        bg_blocks_portable(h, p, nblocks);
    }
    static int bg_cpu_has_ni(void) { return 0; }
    #endif

    static int bg_use_ni = 0;

    static inline void bg_blocks(uint32_t *h, const uint8_t *p, size_t nblocks) {
        if (bg_use_ni) bg_blocks_ni(h, p, nblocks); else bg_blocks_portable(h, p, nblocks);
    }

    static void bg_init(bg_sha256 *c) {
        memcpy(c->h, BG_H0, sizeof c->h);
        c->n = 0;
        c->total = 0;
    }

    static void bg_update(bg_sha256 *c, const uint8_t *p, size_t len) {
        c->total += len;
        if (c->n) {
            size_t take = 64 - c->n;
            if (take > len) take = len;
            memcpy(c->buf + c->n, p, take);
            c->n += (uint32_t)take; p += take; len -= take;
            if (c->n < 64) return;
            bg_blocks(c->h, c->buf, 1);
            c->n = 0;
        }
        if (len >= 64) {
            bg_blocks(c->h, p, len / 64);
            p += len & ~(size_t)63;
            len &= 63;
        }
        if (len) { memcpy(c->buf, p, len); c->n = (uint32_t)len; }
    }

    static void bg_final(bg_sha256 *c, uint8_t out[32]) {
        uint64_t bits = c->total * 8;
        uint8_t pad[72];
        size_t padlen = (c->n < 56) ? 56 - c->n : 120 - c->n;
        int i;
        memset(pad, 0, sizeof pad);
        pad[0] = 0x80;
        for (i = 0; i < 8; i++) pad[padlen + i] = (uint8_t)(bits >> (56 - 8 * i));
        bg_update(c, pad, padlen + 8);
        for (i = 0; i < 8; i++) {
            out[4*i] = (uint8_t)(c->h[i] >> 24); out[4*i+1] = (uint8_t)(c->h[i] >> 16);
            out[4*i+2] = (uint8_t)(c->h[i] >> 8); out[4*i+3] = (uint8_t)c->h[i];
        }
    }

    /* HMAC's last step: the outer hash of the inner digest, truncated. */
    static void bg_hmac_finish(const bg_sha256 *outer_key, bg_sha256 *inner, uint8_t *mac16) {
        uint8_t d[32];
        bg_sha256 o;
        bg_final(inner, d);
        o = *outer_key;
        bg_update(&o, d, 32);
        bg_final(&o, d);
        memcpy(mac16, d, 16);
    }

    static inline void bg_be64(uint8_t *p, uint64_t v) {
        int i;
        for (i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (56 - 8 * i));
    }
    static inline void bg_be16(uint8_t *p, uint32_t v) { p[0] = (uint8_t)(v >> 8); p[1] = (uint8_t)v; }
    """
    ctypedef struct bg_sha256:
        uint32_t h[8]
        uint8_t buf[64]
        uint32_t n
        uint64_t total
    int BG_HAVE_NI_CODE
    int bg_use_ni
    int bg_cpu_has_ni()
    void bg_init(bg_sha256 *c) nogil
    void bg_update(bg_sha256 *c, const uint8_t *p, size_t len) nogil
    void bg_hmac_finish(const bg_sha256 *outer_key, bg_sha256 *inner, uint8_t *mac16) nogil
    void bg_be64(uint8_t *p, uint64_t v) nogil
    void bg_be16(uint8_t *p, uint32_t v) nogil

cdef extern from "Python.h":
    const char *PyUnicode_AsUTF8AndSize(object s, Py_ssize_t *size) except NULL

import numpy as np

__all__ = ["MAC_BYTES", "MacKey"]

MAC_BYTES = 16
DEF _BLOCK = 64
DEF _MAC = 16
DEF _BODIES = 16  # distinct token bodies kept per batch (a batch has a few)

bg_use_ni = bg_cpu_has_ni()


def _set_sha_ni(bint on):
    """Use the x86 SHA extensions (when the CPU has them) or the portable code; returns
    whether they are now in use. For the tests, which check both."""
    global bg_use_ni
    bg_use_ni = 1 if (on and bg_cpu_has_ni()) else 0
    return bool(bg_use_ni)


cdef struct _Body:
    int64_t lane, pool, bits, window, at
    bg_sha256 ctx        # the inner hash after the key block and the body
    Py_ssize_t index     # in the batch's list of body objects


cdef class MacKey:
    """HMAC-SHA256 under one key block (fastpath/_sign_py.py)."""

    cdef bg_sha256 _inner
    cdef bg_sha256 _outer

    def __init__(self, bytes block):
        cdef uint8_t pad[_BLOCK]
        cdef const uint8_t *k
        cdef int i
        if len(block) != _BLOCK:
            raise ValueError("an HMAC-SHA256 key block has 64 bytes")
        k = <const uint8_t *>PyBytes_AS_STRING(block)
        for i in range(_BLOCK):
            pad[i] = k[i] ^ 0x36
        bg_init(&self._inner)
        bg_update(&self._inner, pad, _BLOCK)
        for i in range(_BLOCK):
            pad[i] = k[i] ^ 0x5C
        bg_init(&self._outer)
        bg_update(&self._outer, pad, _BLOCK)

    def mac(self, bytes data):
        """HMAC-SHA256(key, data), its first 16 bytes."""
        cdef bg_sha256 h = self._inner
        cdef uint8_t out[_MAC]
        bg_update(&h, <const uint8_t *>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))
        bg_hmac_finish(&self._outer, &h, out)
        return PyBytes_FromStringAndSize(<char *>out, _MAC)

    def sign_rows(self, facts, admitted, Py_ssize_t n, list tenant_ids, list request_ids,
                  names, body_of):
        """As the reference's: one token per admitted entry, b"" for the others."""
        cdef const int64_t[:, ::1] f = np.ascontiguousarray(facts, dtype=np.int64)
        cdef Py_ssize_t m = f.shape[0], j, i, k, nb = 0, last = -1
        cdef Py_ssize_t tlen, rlen, mlen, blen
        cdef _Body bodies[_BODIES]
        cdef _Body *bd
        cdef _Body spare
        cdef bg_sha256 h
        cdef uint8_t head[30]
        cdef const char *ts
        cdef const char *rs
        cdef const char *ms
        cdef char *dst
        cdef list objs = []   # the body bytes, by _Body.index
        cdef list out
        cdef object tok, body, empty = b""
        cdef int64_t model_prev = -1
        cdef Py_ssize_t slot = 0
        if len(admitted) != m:
            raise ValueError("one row of facts per admitted entry")
        if f.shape[1] != 9:
            raise ValueError("facts has 9 columns")
        out = PyList_New(n)
        for i in range(n):
            Py_INCREF(empty)
            PyList_SET_ITEM(out, i, empty)
        ms = NULL
        mlen = 0
        for j in range(m):
            i = admitted[j]
            if i < 0 or i >= n:
                raise IndexError("an admitted entry outside the batch")
            # the body: the last one used, else one of the batch's, else new
            bd = NULL
            if last >= 0 and _same(&bodies[last], &f[j, 0]):
                bd = &bodies[last]
            else:
                for k in range(nb):
                    if _same(&bodies[k], &f[j, 0]):
                        bd = &bodies[k]
                        last = k
                        break
            if bd == NULL:
                body = body_of(f[j, 0], f[j, 1], f[j, 6], f[j, 7], f[j, 8])
                if not isinstance(body, bytes):
                    raise TypeError("body_of returns bytes")
                if nb < _BODIES:
                    bd = &bodies[nb]
                    last = nb
                    nb += 1
                else:  # more distinct bodies than kept: reuse the slots in turn
                    bd = &bodies[slot]
                    last = slot
                    slot = (slot + 1) % _BODIES
                bd.lane, bd.pool, bd.bits, bd.window, bd.at = (
                    f[j, 0], f[j, 1], f[j, 6], f[j, 7], f[j, 8])
                bd.index = len(objs)
                objs.append(body)
                bd.ctx = self._inner
                bg_update(&bd.ctx, <const uint8_t *>PyBytes_AS_STRING(body),
                          PyBytes_GET_SIZE(body))
            body = objs[bd.index]
            ts = PyUnicode_AsUTF8AndSize(tenant_ids[i], &tlen)
            rs = PyUnicode_AsUTF8AndSize(request_ids[i], &rlen)
            if f[j, 2] != model_prev:
                ms = PyUnicode_AsUTF8AndSize(names[f[j, 2]], &mlen)
                model_prev = f[j, 2]
            if tlen > 0xFFFF or rlen > 0xFFFF or mlen > 0xFFFF:
                raise OverflowError("a signed name is longer than 65535 bytes")
            if f[j, 5] < 0:
                raise OverflowError("a reservation id is not negative")
            bg_be64(head, <uint64_t>(f[j, 3] - f[j, 4]))
            bg_be64(head + 8, <uint64_t>f[j, 4])
            bg_be64(head + 16, <uint64_t>f[j, 5])
            bg_be16(head + 24, <uint32_t>tlen)
            bg_be16(head + 26, <uint32_t>rlen)
            bg_be16(head + 28, <uint32_t>mlen)
            h = bd.ctx
            bg_update(&h, head, 30)
            bg_update(&h, <const uint8_t *>ts, tlen)
            bg_update(&h, <const uint8_t *>rs, rlen)
            bg_update(&h, <const uint8_t *>ms, mlen)
            blen = PyBytes_GET_SIZE(body)
            tok = PyBytes_FromStringAndSize(NULL, blen + _MAC)
            dst = PyBytes_AS_STRING(tok)
            memcpy(dst, PyBytes_AS_STRING(body), blen)
            bg_hmac_finish(&self._outer, &h, <uint8_t *>(dst + blen))
            out[i] = tok
        return out


cdef inline bint _same(const _Body *b, const int64_t *row) noexcept nogil:
    return (b.lane == row[0] and b.pool == row[1] and b.bits == row[6]
            and b.window == row[7] and b.at == row[8])
