"""Retries recognised: a request that comes back is judged against its first
attempt's deadline.

A client that retries a refused request (the openai client does twice by
default, honouring ``retry-after-ms``) asks again with a new HTTP request,
and the sidecar mints a new ledger id for it. Judged as a fresh request, a
retry would start a whole new wait for an SLO its user has already spent
part of, and be served after its first token was due: engine time spent on
work that has missed. So a refusal of a request with a TTFT deadline
remembers when it first arrived, under its retry key (the client's
idempotency key or the SDK's, or the sidecar's digest of the tenant and the
request body; its request id when it has none), and an Admit with the same
key within the longest SLO is that request again: due at its first arrival
plus its lane's SLO (docs/gate.md, "Retries").

Bounded memory: entries live as long as the longest lane SLO (a retry later
than that is past any deadline anyway) and at most ``capacity`` of them are
kept (the oldest forgotten first: a forgotten retry is judged as a new
request, the behaviour without this memory).
"""

from __future__ import annotations

from collections import OrderedDict


class FirstArrivals:
    __slots__ = ("_entries", "capacity", "ttl_ns")

    def __init__(self, ttl_ns: int, capacity: int) -> None:
        self.ttl_ns = ttl_ns
        self.capacity = capacity
        # (tenant slot, retry key) -> (first arrival, remembered at), oldest first
        self._entries: OrderedDict[tuple[int, str], tuple[int, int]] = OrderedDict()

    def first(self, slot: int, key: str, now: int) -> int | None:
        """When the request under ``key`` first arrived, if it was refused
        within the memory's lifetime."""
        self._expire(now)
        hit = self._entries.get((slot, key))
        return None if hit is None else hit[0]

    def refused(self, slot: int, key: str, first_arrival: int, now: int) -> None:
        """A request of ``slot`` under ``key`` that first arrived at
        ``first_arrival`` was refused: its retries are judged from then."""
        if self.capacity <= 0:
            return
        entries = self._entries
        entries[(slot, key)] = (first_arrival, now)
        entries.move_to_end((slot, key))
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def _expire(self, now: int) -> None:
        entries = self._entries
        horizon = now - self.ttl_ns
        while entries:
            k, (_, at) = next(iter(entries.items()))
            if at > horizon:
                return
            del entries[k]

    def __len__(self) -> int:
        return len(self._entries)
