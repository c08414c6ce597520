"""The modelled engine's prefix cache: which prompt blocks an engine still
holds, and which of them it may evict.

It follows vLLM's automatic prefix caching (V1 ``KVCacheManager``) closely
enough for its effect under load, not its data structures:

- A **unit** is one block of a request's ``block ids`` (a trace's
  ``hash_ids``: equal ids mean equal content *and* equal prefix); it holds
  ``unit_tokens`` tokens, i.e. ``unit_blocks`` of the engine's KV blocks.
- Cached units live **in the KV cache itself**: a unit referenced by a
  running request is in use; a unit no running request references stays
  cached but counts as a free block, and is evicted, least recently freed
  first, when a request needs that memory (vLLM's free block queue). So the
  cache is as large as the KV memory running requests leave over: under a
  burst more requests run, fewer blocks are free, cached prefixes are
  evicted sooner, the hit rate falls.
- A request's **hit** is the leading run of its ids found cached (a hole
  ends it), at most all but its last token (the engine must compute one
  token to sample from, as vLLM caps it); those units are shared with
  whoever holds them, not copied.
- A unit is **cached once computed** (when the request's computed tokens
  cover it, during its prefill, as vLLM caches a block once full), so a
  request arriving while another with the same prefix is still in prefill
  shares it. A unit computed again while a copy is cached (no leading run
  reached it) stays the request's private block and is freed uncached.
- Freed units go to the eviction order tail-first (a prompt's last block
  is evicted before its first, as vLLM frees blocks in reverse).

Not modelled: decode-produced blocks are not cached (a trace's ids cover
prompts only; a next turn's copy of the previous answer is a miss), and
units are whole trace blocks (a partial last block is never cached).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence


class PrefixCache:
    """Reference counts of units in use and the eviction order of the
    free ones. The engine owns the block arithmetic (``free_blocks``); this
    keeps the invariant ``evictable units x unit_blocks <= free blocks``
    through :meth:`evict_to`."""

    __slots__ = ("evictions", "hits", "lru", "queries", "refs", "unit_blocks", "unit_tokens")

    def __init__(self, unit_tokens: int, block_size: int) -> None:
        if unit_tokens < 1 or unit_tokens % block_size:
            raise ValueError(
                f"--block-tokens: must be a positive multiple of the engine's block_size "
                f"({block_size}), got {unit_tokens}"
            )
        self.unit_tokens = unit_tokens
        self.unit_blocks = unit_tokens // block_size
        self.refs: dict[int, int] = {}  # unit id -> running requests holding it
        self.lru: OrderedDict[int, None] = OrderedDict()  # free but cached, oldest first
        # vLLM's counters (vllm:prefix_cache_queries / _hits): tokens looked
        # up and tokens found, per lookup (a preempted request looks up again).
        self.queries = 0
        self.hits = 0
        self.evictions = 0  # units evicted to make room

    def match(self, ids: Sequence[int], max_units: int) -> tuple[int, int]:
        """(units of the leading run cached, how many of them are free):
        no change."""
        hit = free = 0
        refs, lru = self.refs, self.lru
        for b in ids[: max(0, max_units)]:
            if b in refs:
                pass
            elif b in lru:
                free += 1
            else:
                break
            hit += 1
        return hit, free

    def take(self, ids: Sequence[int]) -> None:
        """Reference ``ids`` (a match's leading run) for a starting request."""
        refs, lru = self.refs, self.lru
        for b in ids:
            if b in lru:
                del lru[b]
                refs[b] = 1
            else:
                refs[b] += 1

    def register(self, unit: int) -> bool:
        """A request computed ``unit``: cache it, held by that request.
        False when a copy is cached already (the request keeps its own)."""
        if unit in self.refs or unit in self.lru:
            return False
        self.refs[unit] = 1
        return True

    def release(self, held: Sequence[int]) -> int:
        """A request let go of ``held``; returns the units now free (still
        cached, last evicted first)."""
        refs, lru = self.refs, self.lru
        freed = 0
        for b in reversed(held):
            n = refs[b] - 1
            if n:
                refs[b] = n
                continue
            del refs[b]
            lru[b] = None
            freed += 1
        return freed

    def evict_to(self, free_blocks: int) -> None:
        """Evict the least recently freed units until the cached free ones
        fit in ``free_blocks``."""
        lru, k = self.lru, self.unit_blocks
        while lru and len(lru) * k > free_blocks:
            lru.popitem(last=False)
            self.evictions += 1

    @property
    def cached_units(self) -> int:
        return len(self.refs) + len(self.lru)


class MissMeter:
    """One engine's miss rate as a sidecar would report it: hits and
    queries (tokens) over the last ``window_ns``, None before any query."""

    def __init__(self, window_ns: int) -> None:
        self.window_ns = window_ns
        self._marks: deque[tuple[int, int, int]] = deque()  # (t, queries, hits)

    def rate(self, now_ns: int, queries: int, hits: int) -> float | None:
        marks = self._marks
        marks.append((now_ns, queries, hits))
        while len(marks) > 1 and marks[1][0] <= now_ns - self.window_ns:
            marks.popleft()
        _, q0, h0 = marks[0]
        if queries == q0:
            return None
        return 1.0 - (hits - h0) / (queries - q0)
