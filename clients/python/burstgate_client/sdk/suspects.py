"""Values that broke an AdmitStream: sent unary for a while.

The server ends an AdmitStream at a batch it refuses (INVALID_ARGUMENT, or
PERMISSION_DENIED for a sidecar key's scope), naming the field and entry:
``batch 7: lane[3]: unknown lane 'gold'``. The SDK checks what it can before
sending, but not what only the server knows (its lanes, a key's tenants and
pools). So the (field, value) named is *suspect* for ``SUSPECT_S``: entries
carrying it go as unary Admits, where an error is that caller's alone,
instead of breaking the stream for every caller sharing it again.
"""

from __future__ import annotations

import re

from burstgate_client.sdk.entries import Entry

SUSPECT_S = 10.0
FIELDS = ("lane", "tenant_id", "pool", "model")
# "batch 7: lane[3]: unknown lane ..." -> ("7", "lane", "3"); "batch 7: pool: ..." -> index None
_FIELD = re.compile(r"^batch (\d+): (\w+)(?:\[(\d+)\])?:")


class Suspects:
    def __init__(self) -> None:
        self._until: dict[tuple[str, str], float] = {}

    def __bool__(self) -> bool:
        return bool(self._until)

    def mark(
        self, batches: dict[int, list[Entry]], details: str, now: float
    ) -> tuple[str, str] | None:
        """Remember the (field, value) ``details`` (a stream's error message)
        names in one of ``batches`` (by batch_id); return it, or None."""
        m = _FIELD.match(details)
        if m is None or m.group(2) not in FIELDS:
            return None
        group = batches.get(int(m.group(1)))
        if not group:
            return None
        field, index = m.group(2), m.group(3)
        e = group[int(index)] if index is not None and int(index) < len(group) else group[0]
        suspect = (field, str(getattr(e, field)))
        self._until[suspect] = now + SUSPECT_S
        return suspect

    def __call__(self, e: Entry, now: float) -> bool:
        """Whether ``e`` carries a suspect value."""
        if not self._until:
            return False
        for field in FIELDS:
            key = (field, str(getattr(e, field)))
            until = self._until.get(key)
            if until is not None:
                if until > now:
                    return True
                del self._until[key]
        return False
