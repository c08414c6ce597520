"""The prefix-cache figures of the HTML report: hit rate over time, and hit
rate against load (each window a point; the load bands' pooled rates a line).

Token-weighted rates are drawn (the share of prompt tokens not prefilled,
which is what prefill cost follows); the tables give both weightings.
"""

from __future__ import annotations

import numpy as np

from controlplane.analysis.plotaxes import TimeAxis, si_y
from controlplane.analysis.plots import DPI, TALL, WIDE, _new_figure, to_png
from controlplane.analysis.prefix import CacheModel, HitCounts, PrefixAnalysis
from controlplane.analysis.stats import FloatArray, Timeline
from controlplane.analysis.timescale import TimeScale

# One colour per cache, unbounded first; repeated past the last.
CACHE_COLOURS = ("#2ca02c", "#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2")
MARKERS_BELOW = 120  # windows: fewer get a marker per point on the time plot
LOG_LOAD_SPAN = 20.0  # max/min load above which the load axis is logarithmic


def _rates(counts: list[HitCounts]) -> FloatArray:
    return np.array(
        [np.nan if c.token_hit_rate is None else 100 * c.token_hit_rate for c in counts]
    )


def _colour(i: int) -> str:
    return CACHE_COLOURS[i % len(CACHE_COLOURS)]


def _label(prefix: PrefixAnalysis, cache: CacheModel) -> str:
    return cache.name(prefix.block_size)


def _style(cache: CacheModel) -> str:
    # Dashed and on top: an LRU cache large enough for the trace draws the
    # same line, which must not hide the unbounded one (or be hidden by it).
    return "--" if cache.capacity_blocks is None else "-"


def time_figure(prefix: PrefixAnalysis) -> bytes | None:
    """Requests/s per window above, token hit rate per window and cache below."""
    windows = prefix.windows
    if not windows:
        return None
    width_us = prefix.window.bin_us
    timeline = Timeline(t0_us=windows[0].start_us, n_bins=len(windows), bin_us=width_us)
    axis = TimeAxis.of(TimeScale.of(timeline))
    x = axis.x(np.arange(len(windows), dtype=np.float64) + 0.5)
    fig = _new_figure(TALL, DPI)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(1, 1.4))
    rates = np.array([w.requests_per_s for w in windows])
    top.bar(x, rates, width=axis.per_bin * 0.9, color="#9ecae1")
    top.set_ylabel("requests/s")
    si_y(top)
    top.set_title(
        f"Arrival rate and prefix-cache hit rate per {prefix.window.bin_seconds:,}-s window"
    )
    marker = "o" if len(windows) < MARKERS_BELOW else None
    for i, cache in enumerate(prefix.caches):
        bottom.plot(
            x,
            _rates(cache.windows),
            color=_colour(i),
            linestyle=_style(cache),
            zorder=3 if cache.capacity_blocks is None else 2,
            marker=marker,
            markersize=3,
            linewidth=1.2,
            label=_label(prefix, cache),
        )
    bottom.set_ylim(0, 105)
    bottom.set_ylabel("token hit rate (%)")
    bottom.legend(fontsize=8, loc="lower left", frameon=False)
    axis.apply(bottom)
    return to_png(fig)


def load_figure(prefix: PrefixAnalysis) -> bytes | None:
    """Token hit rate of each window against its load; band rates as a line."""
    loaded = [w for w in prefix.windows if w.load is not None and w.requests > 0]
    if not loaded or not prefix.median_rate:
        return None
    loads = np.array([w.load for w in loaded], dtype=np.float64)
    fig = _new_figure(WIDE, DPI)
    ax = fig.subplots()
    for i, cache in enumerate(prefix.caches):
        points = _rates([cache.windows[w.index] for w in loaded])
        ax.scatter(loads, points, s=12, alpha=0.45, color=_colour(i), linewidths=0)
        centres = []
        for band in prefix.bands:
            members = loads[(loads >= band.low) & (loads < band.high)]
            centres.append(float(np.median(members)) if members.size else np.nan)
        ax.plot(
            centres,
            _rates([band.counts[i] for band in prefix.bands]),
            color=_colour(i),
            linestyle=_style(cache),
            zorder=3 if cache.capacity_blocks is None else 2,
            marker="o",
            linewidth=1.8,
            label=f"{_label(prefix, cache)}: pooled per load band",
        )
    if loads.max() / max(loads.min(), 1e-9) > LOG_LOAD_SPAN:
        ax.set_xscale("log")
    ax.axvline(1.0, color="#777777", linestyle=":", linewidth=1)
    ax.set_ylim(0, 105)
    ax.set_xlabel(f"load: window requests/s over the median window's ({prefix.median_rate:,.2f}/s)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title("Prefix-cache hit rate against load (one point per window)")
    ax.legend(fontsize=8, loc="lower left", frameon=False)
    return to_png(fig)
