"""Signed admissions: what lets Reannounce restore only what this plane
issued (docs/ha.md, "Signed admissions").

Every admitted answer (unary, batch column, stream release, replay) carries
an ``admission_token``: the facts the restoring replica needs and cannot
trust a sidecar for, and an HMAC-SHA256 over them and the facts the
sidecar re-announces in the clear. A re-announced entry whose token is
missing, of another key, or does not match its fields is refused; a
restored reservation takes its lane, pool, multiplier, pricing window and
admission time from the token.

The token (version 1), all integers big-endian::

    0x01 | key id u32 | issued_ns i64 | pricing_window i64 | multiplier in
    millionths i64 | u16 len | lane | u16 len | pool | MAC (16 bytes)

The MAC is HMAC-SHA256, truncated to 128 bits (RFC 2104 section 5), over
the token without its MAC followed by::

    prompt_tokens i64 | granted_max_tokens i64 | reservation_id u64 |
    u16 len(tenant_id) | u16 len(request_id) | u16 len(model) |
    tenant_id | request_id | model

Canonical bytes rather than JSON: every variable part is length-prefixed,
so two different sets of facts never encode alike; the multiplier is
integer millionths (the six places the ledger bills), never a float's text.
The version byte comes first so a later format can be told apart.

The key: 32 random bytes created once in the database (store/signing.py),
so every replica of a deployment and a restarted plane share it; or the
``admission_signing_key`` setting. Its id is derived from the key itself
(the first 4 bytes of a SHA-256 of it), so replicas agree on it without
storing it. Rotation: the plane signs with its current key and accepts the
current and the previous one.

Cost: HMAC's key schedule is done once per key (the inner and outer
SHA-256 states are kept and copied per token), and the MAC is computed in
the fast path's build (fastpath/_sign_c.pyx, through the CPU's SHA
instructions when it has them): a batch's tokens in one call, with no
Python object per token but the token.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from controlplane.domain.money import multiplier_decimal
from controlplane.service import records as R
from fastpath import MacKey

VERSION = 1
KEY_BYTES = 32
MAC_BYTES = 16
# The longest token: a lane and a pool of at most 128 characters of up to
# 4 UTF-8 bytes each, with room to spare. OpenReservation.admission_token
# longer than this is INVALID_ARGUMENT (restore.py).
MAX_TOKEN_BYTES = 1024
_HEAD = struct.Struct(">BIqqqH")  # version, key id, issued, window, multiplier, len(lane)
_U16 = struct.Struct(">H")
_FACTS = struct.Struct(">qqQHHH")  # prompt, granted, reservation id, three lengths
_MIN_TOKEN = _HEAD.size + _U16.size + MAC_BYTES
_KEY_ID_LABEL = b"burstgate admission signing key id\x00"
# A row's columns sign_rows reads, in its unpacking order.
_ROW_FIELDS = [R.LANE, R.POOL, R.MODEL, R.RESERVED, R.GRANTED, R.RID, R.MULTIPLIER, R.WINDOW,
               R.DECIDED_NS]  # fmt: skip
_bits_float = functools.lru_cache(maxsize=1024)(R.bits_float)


def key_id(secret: bytes) -> int:
    """The id a token names its key by: derived from the key, so every
    replica holding the key computes the same one."""
    return int.from_bytes(hashlib.sha256(_KEY_ID_LABEL + secret).digest()[:4], "big")


@functools.lru_cache(maxsize=1024)
def multiplier_micros(value: float) -> int:
    """A record's float multiplier in millionths: the 6-place decimal the
    answer shows and the ledger bills (money.multiplier_decimal)."""
    return int(multiplier_decimal(value).scaleb(6))


@functools.lru_cache(maxsize=4096)
def _utf8(s: str) -> bytes:
    # lane, pool and model names repeat: encoded once
    return s.encode()


@dataclass(frozen=True, slots=True)
class Signed:
    """What a valid token vouches for, beyond the fields it was checked with."""

    lane: str
    pool: str
    multiplier_micros: int
    pricing_window: int
    issued_ns: int

    @property
    def multiplier(self) -> Decimal:
        return Decimal(self.multiplier_micros).scaleb(-6)


class _Key:
    __slots__ = ("fast", "id")

    def __init__(self, secret: bytes) -> None:
        if len(secret) < KEY_BYTES:
            raise ValueError(f"an admission signing key has at least {KEY_BYTES} bytes")
        block = secret.ljust(64, b"\0") if len(secret) <= 64 else hashlib.sha256(secret).digest()
        block = block.ljust(64, b"\0")
        self.id = key_id(secret)
        # HMAC's two keyed SHA-256 states, computed once (hmac.digest would
        # redo them per token, at twice the cost of the whole MAC), in the
        # fast path's build (a batch's tokens in one compiled call)
        self.fast = MacKey(block)

    def mac(self, data: bytes) -> bytes:
        return self.fast.mac(data)


class AdmissionSigner:
    """Signs admissions with the current key; verifies with the current and
    the previous. Created with a random key of its own (a service without a
    database: unit tests, the simulator); the server installs the
    deployment's keys at start and after a rotation (:meth:`install`)."""

    def __init__(self, keys: Sequence[bytes] = ()) -> None:
        self.install(keys or [os.urandom(KEY_BYTES)])

    def install(self, keys: Sequence[bytes]) -> None:
        """``keys``: the current key first, then the previous one (at most
        two are kept: a token of an older key no longer verifies)."""
        if not keys:
            raise ValueError("at least one admission signing key")
        keys = list(keys[:2])
        if keys == getattr(self, "_raw", None):
            return  # (every config poll installs them again)
        self._raw = keys
        made = [_Key(k) for k in keys]
        self._current = made[0]
        self._by_id = {k.id: k for k in reversed(made)}

    @property
    def key_ids(self) -> list[int]:
        """The current key's id, then the previous one's."""
        return [self._current.id, *(i for i in self._by_id if i != self._current.id)]

    def sign(
        self, tenant_id: str, request_id: str, model: str, lane: str, pool: str, prompt: int,
        granted: int, reservation_id: int, multiplier: float, window: int, issued_ns: int,
    ) -> bytes:  # fmt: skip
        key = self._current
        lane_b, pool_b = _utf8(lane), _utf8(pool)
        body = b"".join((
            _HEAD.pack(VERSION, key.id, issued_ns, window, multiplier_micros(multiplier),
                       len(lane_b)),
            lane_b, _U16.pack(len(pool_b)), pool_b,
        ))  # fmt: skip
        t, r, m = _utf8(tenant_id), request_id.encode(), _utf8(model)
        facts = _FACTS.pack(prompt, granted, reservation_id, len(t), len(r), len(m))
        return body + key.mac(b"".join((body, facts, t, r, m)))

    def sign_record(self, key: tuple[str, str], rec: tuple[Any, ...]) -> bytes:
        """The token of an admitted record (records.py's fields)."""
        return self.sign(
            key[0], key[1], rec[R.MODEL], rec[R.LANE], rec[R.POOL],
            rec[R.RESERVED] - rec[R.GRANTED], rec[R.GRANTED], rec[R.RID], rec[R.MULTIPLIER],
            rec[R.WINDOW], rec[R.DECIDED_NS],
        )  # fmt: skip

    def sign_rows(
        self, rows: Any, tenant_ids: Sequence[str], request_ids: Sequence[str],
        names: Sequence[str],
    ) -> list[bytes] | None:  # fmt: skip
        """A batch's token column: entry i's token when its row (request
        table layout, ``names`` the interned names) is an admission, fresh
        or replayed; b"" otherwise. None when nothing was admitted."""
        admitted = (rows[:, R.REASON] == 0).nonzero()[0]
        if not admitted.size:
            return None
        key = self._current

        # The entries of a batch share their body (lane, pool, multiplier,
        # window, decision time) a few ways only: each distinct body is built
        # here once and hashed once, then its hash state copied per entry.
        def body_of(lane: int, pool: int, bits: int, window: int, at: int) -> bytes:
            lane_b, pool_b = _utf8(names[lane]), _utf8(names[pool])
            return b"".join((
                _HEAD.pack(VERSION, key.id, at, window, multiplier_micros(_bits_float(bits)),
                           len(lane_b)),
                lane_b, _U16.pack(len(pool_b)), pool_b,
            ))  # fmt: skip

        tenants = tenant_ids if isinstance(tenant_ids, list) else list(tenant_ids)
        requests = request_ids if isinstance(request_ids, list) else list(request_ids)
        return key.fast.sign_rows(
            rows[admitted][:, _ROW_FIELDS], admitted.tolist(), len(rows), tenants, requests,
            names, body_of,
        )  # fmt: skip

    def verify(
        self, token: bytes, tenant_id: str, request_id: str, model: str, prompt: int,
        granted: int, reservation_id: int,
    ) -> Signed | str:  # fmt: skip
        """The signed facts, or why the token is refused (a reannounce
        entry's detail). Never raises, whatever the bytes."""
        if not token:
            return "unsigned: no admission_token (the Admit answer's)"
        if len(token) < _MIN_TOKEN or token[0] != VERSION:
            return "signature does not match: not an admission token of this version"
        key = self._by_id.get(int.from_bytes(token[1:5], "big"))
        if key is None:
            return (
                "signature does not match: signed with a key this plane does not hold "
                "(another deployment's, or rotated out)"
            )
        try:
            t, r, m = tenant_id.encode(), request_id.encode(), model.encode()
            facts = _FACTS.pack(prompt, granted, reservation_id, len(t), len(r), len(m))
        except (struct.error, UnicodeEncodeError):  # out of the signed range: never signed
            return "signature does not match"
        body = bytes(token[:-MAC_BYTES])
        if not hmac.compare_digest(key.mac(b"".join((body, facts, t, r, m))), token[-MAC_BYTES:]):
            return "signature does not match"
        # Signed by this plane: well formed (still parsed defensively).
        try:
            _, _, issued, window, micros, lane_len = _HEAD.unpack_from(body)
            at = _HEAD.size
            lane = body[at : at + lane_len].decode()
            at += lane_len
            (pool_len,) = _U16.unpack_from(body, at)
            pool = body[at + _U16.size : at + _U16.size + pool_len].decode()
            if at + _U16.size + pool_len != len(body):
                raise ValueError("trailing bytes")
        except (struct.error, UnicodeDecodeError, ValueError):
            return "signature does not match: malformed"
        return Signed(lane, pool, micros, window, issued)
