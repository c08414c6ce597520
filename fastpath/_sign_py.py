"""HMAC-SHA256 admission-token MACs, the pure-Python reference (fastpath/_sign_c.pyx is
the compiled build; both must give the same bytes, tests/unit/service/test_sign_fast.py).

The key arrives as HMAC's 64-byte key block (RFC 2104: the key, hashed first when
longer than a block, padded with zeros): what the key means, and the token's layout,
are the service's (controlplane/service/signing.py). Here: the MAC, HMAC-SHA256
truncated to 16 bytes, of one message, or of every admitted row of a batch.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["MAC_BYTES", "MacKey"]

MAC_BYTES = 16
BLOCK = 64
# prompt, granted, reservation id, len(tenant), len(request), len(model)
_FACTS = struct.Struct(">qqQHHH")


class MacKey:
    """HMAC-SHA256 under one key block, its inner and outer states computed once
    (a token costs the message's blocks, not the key's)."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, block: bytes) -> None:
        if len(block) != BLOCK:
            raise ValueError("an HMAC-SHA256 key block has 64 bytes")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    def mac(self, data: bytes) -> bytes:
        """HMAC-SHA256(key, data), its first 16 bytes."""
        inner = self._inner.copy()
        inner.update(data)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()[:MAC_BYTES]

    def sign_rows(
        self, facts: Any, admitted: Sequence[int], n: int, tenant_ids: list[str],
        request_ids: list[str], names: Sequence[str],
        body_of: Callable[[int, int, int, int, int], bytes],
    ) -> list[bytes]:  # fmt: skip
        """Entry ``admitted[j]``'s token, for the j-th row of ``facts`` (int64
        columns: lane, pool, model (ids into ``names``), reserved, granted,
        reservation id, multiplier bits, pricing window, issued ns): its body
        (``body_of(lane, pool, bits, window, issued)``, asked once per distinct
        five) followed by the MAC of the body, then of::

            prompt i64 | granted i64 | reservation id u64 | u16 len(tenant) |
            u16 len(request) | u16 len(model) | tenant | request | model

        (UTF-8, prompt = reserved - granted). b"" for the other entries of ``n``."""
        out = [b""] * n
        bodies: dict[tuple[int, ...], tuple[bytes, Any]] = {}
        tenants: dict[str, bytes] = {}
        models: dict[int, bytes] = {}
        pack, outer = _FACTS.pack, self._outer
        for i, (lane, pool, model, reserved, granted, rid, bits, window, at) in zip(
            admitted, facts.tolist(), strict=True
        ):
            shared = (lane, pool, bits, window, at)
            got = bodies.get(shared)
            if got is None:
                body = body_of(lane, pool, bits, window, at)
                inner = self._inner.copy()
                inner.update(body)
                got = bodies[shared] = (body, inner)
            body, inner = got
            tenant = tenant_ids[i]
            t = tenants.get(tenant)
            if t is None:
                t = tenants[tenant] = tenant.encode()
            m = models.get(model)
            if m is None:
                m = models[model] = names[model].encode()
            r = request_ids[i].encode()
            h = inner.copy()
            h.update(pack(reserved - granted, granted, rid, len(t), len(r), len(m)) + t + r + m)
            o = outer.copy()
            o.update(h.digest())
            out[i] = body + o.digest()[:MAC_BYTES]
        return out
