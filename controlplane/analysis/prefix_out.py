"""The prefix-cache hit rates (prefix.py) as JSON and as terminal lines.

The JSON object is ``prefix_cache`` of ``analyze --json`` (docs/analysis.md,
"Prefix-cache hit rate"); hit rates are ``null`` where nothing was looked up.
"""

from __future__ import annotations

import math
from typing import Any

from controlplane.analysis.parsing import format_timestamp_us
from controlplane.analysis.prefix import CacheModel, HitCounts, LoadBand, PrefixAnalysis
from controlplane.analysis.presets import COLUMN_ALIASES, OPTION_FOR_FIELD

LRU_OPTIONS = "--cache-blocks or --kv-capacity-tokens"


def no_block_ids_note() -> str:
    """The one line for a log without block ids."""
    names = ", ".join(COLUMN_ALIASES["block_ids"])
    return (
        f"the log has no block ids (no column {names}), so no prefix-cache hit rate; "
        f"name the column with {OPTION_FOR_FIELD['block_ids']}"
    )


def counts_to_dict(counts: HitCounts) -> dict[str, Any]:
    return {
        "hit_blocks": counts.hit_blocks,
        "blocks": counts.blocks,
        "hit_tokens": counts.hit_tokens,
        "tokens": counts.tokens,
        "block_hit_rate": counts.block_hit_rate,
        "token_hit_rate": counts.token_hit_rate,
    }


def _cache_to_dict(cache: CacheModel, block_size: int) -> dict[str, Any]:
    capacity = cache.capacity_blocks
    return {
        "name": cache.name(block_size),
        "kind": "unbounded" if capacity is None else "lru",
        "capacity_blocks": capacity,
        "capacity_tokens": None if capacity is None else capacity * block_size,
        **counts_to_dict(cache.overall),
        "evictions": cache.evictions,
    }


def _band_to_dict(band: LoadBand) -> dict[str, Any]:
    return {
        "load_from": band.low,
        "load_to": None if math.isinf(band.high) else band.high,
        "windows": band.windows,
        "requests": band.requests,
        "caches": [counts_to_dict(c) for c in band.counts],
    }


def prefix_to_dict(prefix: PrefixAnalysis | None) -> dict[str, Any]:
    if prefix is None:
        return {"available": False, "note": no_block_ids_note()}
    return {
        "available": True,
        "note": doubt_note(prefix),
        "column": prefix.column,
        "block_size": prefix.block_size,
        "block_size_source": prefix.block_size_source,
        "token_weights_from_lengths": prefix.has_lengths,
        "requests": prefix.requests,
        "requests_without_blocks": prefix.requests_without_blocks,
        "missing": prefix.missing,
        "blocks": prefix.blocks,
        "distinct_blocks": prefix.distinct_blocks,
        "tokens": prefix.tokens,
        "length_mismatches": prefix.length_mismatches,
        "tokens_per_block_median": prefix.tokens_per_block_median,
        "window": {
            "requested_seconds": prefix.window.requested_seconds,
            "seconds": prefix.window.bin_seconds,
        },
        "median_requests_per_s": prefix.median_rate,
        "caches": [_cache_to_dict(c, prefix.block_size) for c in prefix.caches],
        "windows": [
            {
                "index": w.index,
                "start": format_timestamp_us(w.start_us),
                "seconds": w.seconds,
                "requests": w.requests,
                "requests_per_s": w.requests_per_s,
                "prompt_tokens_per_s": w.prompt_tokens / w.seconds,
                "load": w.load,
                "caches": [counts_to_dict(c.windows[w.index]) for c in prefix.caches],
            }
            for w in prefix.windows
        ],
        "by_load": [_band_to_dict(b) for b in prefix.bands],
    }


def doubt_note(prefix: PrefixAnalysis) -> str | None:
    """Why the block size may be wrong, or None."""
    if not prefix.block_size_doubtful:
        return None
    implied = prefix.tokens_per_block_median
    return (
        f"{prefix.mismatch_share:.0%} of the requests with block ids have a count other than "
        f"ceil(input length / {prefix.block_size}); their median input length per id is "
        f"{implied:,.1f} tokens: if that is the block size, say --block-size"
    )


def rate(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def band_label(band: LoadBand) -> str:
    if math.isinf(band.high):
        return f">= {band.low:g}x"
    return f"{band.low:g}-{band.high:g}x"


def prefix_lines(prefix: PrefixAnalysis | None) -> list[str]:
    if prefix is None:
        return [f"Prefix cache: {no_block_ids_note()}"]
    source = {"option": "--block-size", "preset": "the preset's", "default": "default"}
    lines = [
        f"Prefix cache ({prefix.column}, {prefix.block_size:,}-token blocks, "
        f"{source[prefix.block_size_source]}): {prefix.requests:,} requests, "
        f"{prefix.blocks:,} blocks ({prefix.distinct_blocks:,} distinct), "
        f"{prefix.tokens:,} prompt tokens"
    ]
    if prefix.requests_without_blocks:
        count = prefix.requests_without_blocks
        lines.append(f"  {count:,} request{'' if count == 1 else 's'} without block ids")
    if (note := doubt_note(prefix)) is not None:
        lines.append(f"  warning: {note}")
    lines.append(f"  {'cache':<40}{'block hit':>10}{'token hit':>11}{'evictions':>12}")
    for cache in prefix.caches:
        evictions = "-" if cache.capacity_blocks is None else f"{cache.evictions:,}"
        lines.append(
            f"  {cache.name(prefix.block_size):<40}{rate(cache.overall.block_hit_rate):>10}"
            f"{rate(cache.overall.token_hit_rate):>11}{evictions:>12}"
        )
    if len(prefix.caches) == 1:
        lines.append(f"  (an LRU cache of your capacity: {LRU_OPTIONS})")
    if prefix.bands and prefix.median_rate:
        lines.append(
            f"  token hit rate by load ({prefix.window.bin_seconds:,}-s windows; load = "
            f"requests/s over the median window's {prefix.median_rate:,.2f}/s):"
        )
        names = ["unbounded" if c.capacity_blocks is None else f"LRU {c.capacity_blocks:,}"
                 for c in prefix.caches]  # fmt: skip
        lines.append(
            f"  {'load':<12}{'windows':>8}{'requests':>10}" + "".join(f"{n:>16}" for n in names)
        )
        for band in prefix.bands:
            lines.append(
                f"  {band_label(band):<12}{band.windows:>8,}{band.requests:>10,}"
                + "".join(f"{rate(c.token_hit_rate):>16}" for c in band.counts)
            )
    return lines
