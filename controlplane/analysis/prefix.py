"""Achievable prefix-cache hit rate of a log with block ids (``hash_ids``).

Requests are replayed in arrival order (ties in file order) through the
textbook prefix cache of ``controlplane.domain.prefixcache``: the hits are
the leading run of a request's blocks already cached; then all its blocks
are cached, most recent last, and an LRU cache evicts down to its capacity.
Always modelled: an unbounded cache (the reuse the trace allows at all).
Modelled when asked: one LRU cache per ``--cache-blocks`` or
``--kv-capacity-tokens`` (floor of tokens / block size) capacity. No capacity
is modelled by default: a hit rate at a capacity that is not the user's
hardware would read as a finding about their traffic.

**Weights.** Block-weighted: hit blocks / blocks. Token-weighted: a block
counts ``block_size`` tokens except a request's last, which counts
``input_length - (n - 1) * block_size`` (at least 0), so a request whose ids
fit its length counts exactly its prompt. Where they disagree the rule
stands as it is: tokens beyond ``n`` blocks go to the last block, and a last
block beyond the prompt counts 0 (the disagreements are counted and
reported, with the tokens per block they imply). Without a prompt-length
column every block counts ``block_size``. A request without ids counts no
blocks and no tokens. Rates are ratios of sums, never means of per-request
rates.

**Windows.** Per window of ``window_seconds`` from the first arrival (widened
to whole steps of the timestamps' grid, as the bins are): the requests that
arrived in it, their hits against the cache as the whole trace left it (the
cache is never reset), and the arrival rate. Its load is the rate over the
median rate of the windows; a window shorter than half the width (the last
one, usually) gets no load, since its rate is noise. Windows are grouped by
load into ``LOAD_BANDS`` to show how the hit rate moves with load.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from controlplane.analysis.grid import Binning, choose_binning
from controlplane.analysis.logdata import RequestLog
from controlplane.analysis.parsing import US_PER_S
from controlplane.analysis.stats import make_timeline
from controlplane.domain.prefixcache import PrefixCache

IntArray = npt.NDArray[np.int64]

DEFAULT_BLOCK_SIZE = 512  # tokens per block: Mooncake's, and vLLM's large-block setting
DEFAULT_WINDOW_S = 60
# Window load (rate over the median window rate) band edges: the published
# phase change of the hit rate falls between 5x and 20x the baseline.
LOAD_BANDS = (0.0, 0.5, 0.8, 1.25, 2.0, 5.0, 10.0, 20.0, math.inf)
MIN_WINDOW_SHARE = 0.5  # of the width, for a window's rate to count as a load
# A share of requests whose id count is not ceil(input_length / block_size)
# above which the block size is probably wrong (and said so).
MISMATCH_WARN_SHARE = 0.05
# Integer ids spread over at most this many times their count are used as
# array indices directly; sparser ones (hashes) are ranked first.
DENSE_SPAN = 4


@dataclass(frozen=True, slots=True)
class PrefixParams:
    block_size: int | None = None  # None: the preset's, else DEFAULT_BLOCK_SIZE
    cache_blocks: tuple[int, ...] = ()  # LRU capacities, in blocks
    window_seconds: int = DEFAULT_WINDOW_S


@dataclass(frozen=True, slots=True)
class HitCounts:
    hit_blocks: int
    blocks: int
    hit_tokens: int
    tokens: int

    @property
    def block_hit_rate(self) -> float | None:
        return self.hit_blocks / self.blocks if self.blocks else None

    @property
    def token_hit_rate(self) -> float | None:
        return self.hit_tokens / self.tokens if self.tokens else None


@dataclass(frozen=True, slots=True)
class CacheModel:
    capacity_blocks: int | None  # None: unbounded
    overall: HitCounts
    windows: list[HitCounts]  # one per PrefixWindow
    evictions: int

    def name(self, block_size: int) -> str:
        if self.capacity_blocks is None:
            return "unbounded"
        tokens = self.capacity_blocks * block_size
        return f"LRU {self.capacity_blocks:,} blocks ({tokens:,} tokens)"


@dataclass(frozen=True, slots=True)
class PrefixWindow:
    index: int
    start_us: int
    seconds: int
    requests: int
    prompt_tokens: int
    load: float | None  # requests/s over the median window's; None: too short or no median

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds


@dataclass(frozen=True, slots=True)
class LoadBand:
    low: float
    high: float  # inf for the last band
    windows: int
    requests: int
    counts: list[HitCounts]  # one per cache, in PrefixAnalysis.caches order


@dataclass(frozen=True, slots=True)
class PrefixAnalysis:
    column: str
    block_size: int
    block_size_source: str  # "option" | "preset" | "default"
    has_lengths: bool  # a prompt-length column weighs the last block
    requests: int
    requests_without_blocks: int
    missing: int  # of those, rows whose block-id value was absent or null
    blocks: int
    distinct_blocks: int
    tokens: int
    length_mismatches: int  # requests with ids whose count is not ceil(length / block size)
    tokens_per_block_median: float | None  # input_length / ids, over requests with both
    window: Binning
    median_rate: float | None
    windows: list[PrefixWindow]
    caches: list[CacheModel]
    bands: list[LoadBand]

    @property
    def mismatch_share(self) -> float:
        with_ids = self.requests - self.requests_without_blocks
        return self.length_mismatches / with_ids if with_ids else 0.0

    @property
    def block_size_doubtful(self) -> bool:
        return self.has_lengths and self.mismatch_share > MISMATCH_WARN_SHARE


def dense_codes(codes: IntArray) -> tuple[IntArray, int]:
    """Codes in ``0..distinct-1`` (equal where equal) and the number of distinct ones.

    Ids that already lie in a range at most ``DENSE_SPAN`` times their count
    (Mooncake numbers its blocks 0, 1, 2, ...) are kept: no sort needed."""
    if not codes.size:
        return codes, 0
    low, high = int(codes.min()), int(codes.max())
    if low >= 0 and high < DENSE_SPAN * codes.size:
        seen = np.zeros(high + 1, dtype=np.bool_)
        seen[codes] = True
        return codes, int(np.count_nonzero(seen))
    distinct, inverse = np.unique(codes, return_inverse=True)
    return inverse.reshape(-1).astype(np.int64, copy=False), int(distinct.size)


def unbounded_hits(offsets: IntArray, codes: IntArray) -> IntArray:
    """Leading-run hits per request against an unbounded cache, vectorised.

    A block is cached at request ``r`` exactly when it appeared in an earlier
    request, so the leading run ends at the first block whose first
    appearance is ``r`` itself. Same result as ``PrefixCache(None).access``
    request after request (the tests check it). ``codes`` as from ``dense_codes``."""
    lengths = np.diff(offsets)
    n = int(lengths.size)
    hits = np.zeros(n, dtype=np.int64)
    if not codes.size:
        return hits
    # int32 where it fits: these arrays are as long as the whole trace's blocks.
    kind: type[np.signedinteger[Any]] = np.int32 if n < 2**31 else np.int64
    request_of: npt.NDArray[np.signedinteger[Any]] = np.repeat(np.arange(n, dtype=kind), lengths)
    first: npt.NDArray[np.signedinteger[Any]] = np.full(int(codes.max()) + 1, n, dtype=kind)
    np.minimum.at(first, codes, request_of)
    cached = first[codes] < request_of
    del first, request_of
    # Each block's position in the trace, or past its end where cached: the
    # minimum over a request is where its leading run ends (or past the end).
    stop = np.arange(codes.size, dtype=np.int64)
    stop[cached] = codes.size
    del cached
    nonempty = lengths > 0
    starts = offsets[:-1][nonempty]
    hits[nonempty] = np.minimum(np.minimum.reduceat(stop, starts) - starts, lengths[nonempty])
    return hits


def lru_hits(offsets: IntArray, codes: IntArray, capacity: int) -> tuple[IntArray, int]:
    """Leading-run hits per request through an LRU cache of ``capacity``
    blocks, and its evictions."""
    cache = PrefixCache(capacity)
    access = cache.access
    bounds = offsets.tolist()
    n = len(bounds) - 1
    hits = np.fromiter(
        (access(codes[bounds[r] : bounds[r + 1]].tolist()) for r in range(n)),
        dtype=np.int64,
        count=n,
    )
    return hits, cache.evictions


def _in_arrival_order(log: RequestLog) -> tuple[IntArray, IntArray, IntArray]:
    """(order, offsets, codes) with requests sorted by arrival, ties in file order."""
    assert log.block_offsets is not None and log.block_codes is not None
    offsets, codes = log.block_offsets, log.block_codes
    if bool((np.diff(log.ts_us) >= 0).all()):
        return np.arange(len(log), dtype=np.int64), offsets, codes
    order = np.argsort(log.ts_us, kind="stable").astype(np.int64)
    lengths = np.diff(offsets)[order]
    sorted_offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=sorted_offsets[1:])
    gather = np.repeat(offsets[:-1][order] - sorted_offsets[:-1], lengths)
    gather += np.arange(int(sorted_offsets[-1]), dtype=np.int64)
    return order, sorted_offsets, codes[gather]


def _sums(index: IntArray, size: int, values: IntArray) -> IntArray:
    return np.bincount(index, weights=values, minlength=size).round().astype(np.int64)


def _counts(
    where: IntArray,
    size: int,
    hits: IntArray,
    lengths: IntArray,
    tokens: IntArray,
    token_hits: IntArray,
) -> list[HitCounts]:
    columns = [_sums(where, size, v) for v in (hits, lengths, token_hits, tokens)]
    return [HitCounts(*(int(c[i]) for c in columns)) for i in range(size)]


def _windows(
    ts: IntArray, prompt: IntArray, binning: Binning
) -> tuple[list[PrefixWindow], IntArray, float | None]:
    timeline = make_timeline(ts, binning.bin_us)
    if timeline is None:
        return [], np.zeros(0, np.int64), None
    index = timeline.bins(ts)
    count = np.bincount(index, minlength=timeline.n_bins)
    tokens = _sums(index, timeline.n_bins, prompt)
    width = binning.bin_seconds
    last_start = timeline.bin_start_us(timeline.n_bins - 1)
    last_seconds = min(width, max(1, math.ceil((int(ts.max()) + 1 - last_start) / US_PER_S)))
    seconds = [width] * (timeline.n_bins - 1) + [last_seconds]
    usable = [s >= MIN_WINDOW_SHARE * width for s in seconds]
    rates = [int(c) / s for c, s, ok in zip(count, seconds, usable, strict=True) if ok and c > 0]
    median = float(np.median(rates)) if rates else None
    windows = [
        PrefixWindow(
            index=i,
            start_us=timeline.bin_start_us(i),
            seconds=seconds[i],
            requests=int(count[i]),
            prompt_tokens=int(tokens[i]),
            load=int(count[i]) / seconds[i] / median if usable[i] and median else None,
        )
        for i in range(timeline.n_bins)
    ]
    return windows, index, median


def _bands(windows: list[PrefixWindow], caches: list[CacheModel]) -> list[LoadBand]:
    bands = []
    for low, high in itertools.pairwise(LOAD_BANDS):
        members = [w.index for w in windows if w.load is not None and low <= w.load < high]
        if not members:
            continue
        counts = [
            HitCounts(
                sum(c.windows[i].hit_blocks for i in members),
                sum(c.windows[i].blocks for i in members),
                sum(c.windows[i].hit_tokens for i in members),
                sum(c.windows[i].tokens for i in members),
            )
            for c in caches
        ]
        requests = sum(windows[i].requests for i in members)
        bands.append(LoadBand(low, high, len(members), requests, counts))
    return bands


def _no_progress(_label: str, _done: int, _total: int) -> None:
    return None


def analyze_prefix(
    log: RequestLog,
    params: PrefixParams,
    grid_us: int,
    progress: Callable[[str, int, int], None] = _no_progress,
) -> PrefixAnalysis | None:
    """Hit rates of the unbounded and the asked-for LRU caches; None without block ids."""
    if not log.has_block_ids:
        return None
    preset = None if log.resolution is None else log.resolution.preset
    if params.block_size is not None:
        block_size, source = params.block_size, "option"
    elif preset is not None and preset.block_size is not None:
        block_size, source = preset.block_size, "preset"
    else:
        block_size, source = DEFAULT_BLOCK_SIZE, "default"
    order, offsets, codes = _in_arrival_order(log)
    codes, distinct = dense_codes(codes)
    lengths = np.diff(offsets)
    has_lengths = "prompt_tokens" in log.columns
    prompt = log.prompt_tokens[order] if has_lengths else lengths * block_size
    whole = np.maximum(lengths - 1, 0) * block_size
    tokens = np.where(lengths > 0, whole + np.maximum(prompt - whole, 0), 0)
    expected = -(-prompt // block_size)  # ceil
    with_both = (lengths > 0) & (prompt > 0)
    binning = choose_binning(grid_us, params.window_seconds)
    windows, window_of, median = _windows(log.ts_us[order], prompt, binning)
    capacities: list[int | None] = [None, *sorted(set(params.cache_blocks))]
    caches = []
    for done, capacity in enumerate(capacities):
        label = "unbounded" if capacity is None else f"LRU {capacity:,} blocks"
        progress(f"prefix cache: {label}", done, len(capacities))
        if capacity is None:
            hits, evictions = unbounded_hits(offsets, codes), 0
        else:
            hits, evictions = lru_hits(offsets, codes, capacity)
        token_hits = np.where(hits < lengths, hits * block_size, tokens)
        overall = HitCounts(
            int(hits.sum()), int(lengths.sum()), int(token_hits.sum()), int(tokens.sum())
        )
        per_window = _counts(window_of, len(windows), hits, lengths, tokens, token_hits)
        caches.append(CacheModel(capacity, overall, per_window, evictions))
    return PrefixAnalysis(
        column=log.columns["block_ids"],
        block_size=block_size,
        block_size_source=source,
        has_lengths=has_lengths,
        requests=len(log),
        requests_without_blocks=int(np.count_nonzero(lengths == 0)),
        missing=log.blocks_missing,
        blocks=int(lengths.sum()),
        distinct_blocks=distinct,
        tokens=int(tokens.sum()),
        length_mismatches=int(np.count_nonzero((lengths > 0) & (lengths != expected)))
        if has_lengths
        else 0,
        tokens_per_block_median=float(np.median(prompt[with_both] / lengths[with_both]))
        if has_lengths and with_both.any()
        else None,
        window=binning,
        median_rate=median,
        windows=windows,
        caches=caches,
        bands=_bands(windows, caches),
    )
