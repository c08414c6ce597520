"""The HTML report's "Prefix cache" section: hit rates by cache, by load band
and per window, and the two figures (prefix_plots.py). Every figure in a
table cell carries ``data-metric`` with its key under ``prefix_cache``."""

from __future__ import annotations

import base64
from html import escape

from controlplane.analysis import prefix_plots
from controlplane.analysis.prefix import HitCounts, PrefixAnalysis
from controlplane.analysis.prefix_out import (
    LRU_OPTIONS,
    band_label,
    doubt_note,
    no_block_ids_note,
    rate,
)
from controlplane.analysis.terminal import num
from controlplane.analysis.timescale import TimeScale

# Per-window rows shown: a week of minutes would be a 10,000-row table. The
# busiest windows are the ones a reader looks for; --json has them all.
MAX_WINDOW_ROWS = 60


def _png(png: bytes | None, alt: str) -> str:
    if png is None:
        return f'<p class="meta">({escape(alt)}: not enough data to plot)</p>'
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{data}">'


def _rate_cells(counts: HitCounts, key: str) -> str:
    return (
        f'<td data-metric="{escape(key)}.block_hit_rate">{rate(counts.block_hit_rate)}</td>'
        f'<td data-metric="{escape(key)}.token_hit_rate">{rate(counts.token_hit_rate)}</td>'
    )


def _caches_table(prefix: PrefixAnalysis) -> str:
    head = "".join(
        f"<th>{h}</th>"
        for h in ("cache", "blocks hit", "blocks", "block hit rate", "token hit rate", "evictions")
    )
    rows = []
    for i, cache in enumerate(prefix.caches):
        key = f"prefix_cache.caches.{i}"
        o = cache.overall
        evictions = "-" if cache.capacity_blocks is None else num(cache.evictions)
        rows.append(
            f"<tr><td>{escape(cache.name(prefix.block_size))}</td>"
            f'<td data-metric="{key}.hit_blocks">{num(o.hit_blocks)}</td>'
            f'<td data-metric="{key}.blocks">{num(o.blocks)}</td>'
            + _rate_cells(o, key)
            + f'<td data-metric="{key}.evictions">{evictions}</td></tr>'
        )
    return f'<table class="prefix"><tr>{head}</tr>{"".join(rows)}</table>'


def _cache_heads(prefix: PrefixAnalysis) -> str:
    return "".join(
        f'<th colspan="2">{escape(c.name(prefix.block_size))}: block, token hit rate</th>'
        for c in prefix.caches
    )


def _bands_table(prefix: PrefixAnalysis) -> str:
    if not prefix.bands:
        return '<p class="meta">No window long and busy enough to have a load.</p>'
    rows = []
    for b, band in enumerate(prefix.bands):
        key = f"prefix_cache.by_load.{b}"
        rows.append(
            f"<tr><td>{escape(band_label(band))}</td>"
            f'<td data-metric="{key}.windows">{num(band.windows)}</td>'
            f'<td data-metric="{key}.requests">{num(band.requests)}</td>'
            + "".join(
                _rate_cells(counts, f"{key}.caches.{i}") for i, counts in enumerate(band.counts)
            )
            + "</tr>"
        )
    return (
        "<table><tr><th>load</th><th>windows</th><th>requests</th>"
        f"{_cache_heads(prefix)}</tr>{''.join(rows)}</table>"
    )


def _windows_table(prefix: PrefixAnalysis, scale: TimeScale) -> str:
    windows = prefix.windows
    shown = sorted(windows, key=lambda w: -w.requests)[:MAX_WINDOW_ROWS]
    rows = []
    for w in sorted(shown, key=lambda w: w.index):
        key = f"prefix_cache.windows.{w.index}"
        rows.append(
            f"<tr><td>{w.index}</td><td>{escape(scale.moment(w.start_us))}</td>"
            f'<td data-metric="{key}.requests">{num(w.requests)}</td>'
            f'<td data-metric="{key}.requests_per_s">{num(w.requests_per_s)}</td>'
            f'<td data-metric="{key}.load">{num(w.load)}</td>'
            + "".join(
                _rate_cells(c.windows[w.index], f"{key}.caches.{i}")
                for i, c in enumerate(prefix.caches)
            )
            + "</tr>"
        )
    more = (
        f'<p class="meta">The {MAX_WINDOW_ROWS} busiest of {len(windows):,} windows; '
        "--json has them all.</p>"
        if len(windows) > len(shown)
        else ""
    )
    return (
        f"<table><tr><th>window</th><th>start ({escape(scale.zone)})</th><th>requests</th>"
        f"<th>requests/s</th><th>load</th>{_cache_heads(prefix)}</tr>{''.join(rows)}</table>" + more
    )


def prefix_section_body(prefix: PrefixAnalysis | None, scale: TimeScale | None) -> str:
    if prefix is None:
        return f'<p data-finding="no_block_ids">The {escape(no_block_ids_note())}.</p>'
    if not prefix.windows or scale is None:
        return "<p>No requests.</p>"
    source = {"option": "--block-size", "preset": "the preset's", "default": "the default"}
    intro = (
        f"<p>Block ids from <code>{escape(prefix.column)}</code>, "
        f"{prefix.block_size:,} tokens a block ({source[prefix.block_size_source]}): "
        f"{num(prefix.requests)} requests, {num(prefix.blocks)} blocks "
        f"({num(prefix.distinct_blocks)} distinct), {num(prefix.tokens)} prompt tokens"
        + (
            f"; {num(prefix.requests_without_blocks)} requests without block ids"
            if prefix.requests_without_blocks
            else ""
        )
        + ". A request's hits are the leading run of its blocks already cached; then all "
        "its blocks are cached, and an LRU cache evicts the least recently used "
        "(docs/analysis.md, &ldquo;Prefix-cache hit rate&rdquo;).</p>"
    )
    warn = (
        f'<p class="warn" data-finding="block_size">{escape(note)}</p>'
        if (note := doubt_note(prefix))
        else ""
    )
    lru_hint = (
        f'<p class="meta">Only the unbounded cache is modelled; {LRU_OPTIONS} models '
        "an LRU cache of your engines' KV capacity.</p>"
        if len(prefix.caches) == 1
        else ""
    )
    load_intro = (
        f"<h3>By load</h3><p>Load: a window's requests/s over the median window's "
        f"({num(prefix.median_rate)}/s), {prefix.window.bin_seconds:,}-s windows; "
        "rates pooled over the windows of each band.</p>"
    )
    return (
        intro
        + warn
        + _caches_table(prefix)
        + lru_hint
        + load_intro
        + _bands_table(prefix)
        + _png(prefix_plots.load_figure(prefix), "prefix-cache hit rate against load")
        + "<h3>Over time</h3>"
        + _png(prefix_plots.time_figure(prefix), "prefix-cache hit rate over time")
        + _windows_table(prefix, scale)
    )
