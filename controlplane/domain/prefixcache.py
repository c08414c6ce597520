"""A prefix cache of KV blocks: the textbook model of vLLM's prefix caching.

A prompt is a sequence of block ids, one per fixed-size block of tokens,
equal ids meaning equal content *and* equal prefix (the ids are chained
hashes, as in vLLM, Mooncake's traces and LiteLLM's prefix hashes). A request
is served in two moves, each defined here once so that ``burstgate analyze``
and the simulator count the same thing:

1. ``match(blocks)``: the hits are the **leading run** of the request's
   blocks present in the cache, looked up in order and stopping at the first
   block that is absent. A cached block after a miss does not count: its KV
   depends on every token before it, which must be computed anyway. The
   lookup changes nothing (no recency update).
2. ``insert(blocks)``: after prefill **all** the request's blocks are in the
   cache, each inserted or, if present, moved to most recently used, in the
   request's order (so its first block is the least recent of its own).
   Then, while the cache holds more than ``capacity`` blocks, the least
   recently used block is evicted. A request longer than the cache thus
   leaves only its last ``capacity`` blocks behind; evicting as each block
   goes in would leave the same set (the LRU order is the same either way).

``access(blocks)`` is the two in sequence: lookup against the state before
the request, then insertion. ``capacity`` None is an unbounded cache, which
never evicts: its hit rate is the reuse the trace allows at all.

Left out on purpose (docs/analysis.md, "Prefix-cache hit rate"): blocks
pinned by running requests (an offline trace has no concurrency), vLLM's
rule that the last token is always recomputed, and its caching of full
blocks only (a trace's last, partial block is cached like the others).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


class PrefixCache:
    """An LRU cache of block ids (unbounded when ``capacity`` is None)."""

    __slots__ = ("_blocks", "capacity", "evictions")

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"prefix cache capacity must be at least 1 block (got {capacity})")
        self.capacity = capacity
        self.evictions = 0
        # Insertion order is recency order: first = least recently used.
        self._blocks: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: Hashable) -> bool:
        return block in self._blocks

    def match(self, blocks: Sequence[Hashable]) -> int:
        """How many of ``blocks``, from the first, are cached (no state change)."""
        cached = self._blocks
        hits = 0
        for block in blocks:
            if block not in cached:
                break
            hits += 1
        return hits

    def insert(self, blocks: Sequence[Hashable]) -> None:
        """Make every block of ``blocks`` most recent, in order; then evict down to capacity."""
        cached = self._blocks
        refresh = cached.move_to_end
        for block in blocks:
            if block in cached:
                refresh(block)
            else:
                cached[block] = None
        capacity = self.capacity
        if capacity is not None:
            excess = len(cached) - capacity
            if excess > 0:
                self.evictions += excess
                evict = cached.popitem
                for _ in range(excess):
                    evict(last=False)

    def access(self, blocks: Sequence[Hashable]) -> int:
        """Serve one request: its leading-run hits, then all its blocks cached."""
        hits = self.match(blocks)
        self.insert(blocks)
        return hits
