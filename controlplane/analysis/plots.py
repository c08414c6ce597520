"""PNG figures for the HTML report.

Figures are built with ``matplotlib.figure.Figure`` on an explicit Agg canvas:
no pyplot, no global state, no display needed, safe in a server process.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from controlplane.analysis.bursts import Baseline
from controlplane.analysis.parsing import US_PER_S
from controlplane.analysis.plotaxes import (
    BAND_ALPHA,
    BURST_COLOUR,
    TimeAxis,
    band_spans,
    draw_bands,
    si,
    si_y,
)
from controlplane.analysis.reader import RequestLog
from controlplane.analysis.stats import FloatArray, rolling_mean
from controlplane.analysis.summary import Analysis, Incident, RateSeries, tenant_rows
from controlplane.analysis.timescale import TimeScale

DPI = 100  # with the sizes below: ~1000 px wide, readable on a laptop screen
WIDE = (10.0, 4.2)  # inches: one row of panels
TALL = (10.0, 6.6)  # inches: two stacked panels sharing the time axis
# Above this many points a time series is drawn per bucket (max and mean) so
# a week-long log renders as fast as an hour-long one.
MAX_POINTS = 4000
SMOOTH_S = 10  # the darker line on the tenant plot: 10-second mean
THRESHOLD_COLOUR = "#252525"
# Head room above the highest value, as a share of it: the legend sits there
# instead of on the data, and no bar or peak touches the frame.
HEADROOM = 0.3
TENANTS_PLOTTED = 8  # more colours than this are unreadable in a stacked plot
INCIDENT_CONTEXT_S = 60  # seconds shown either side of an incident
INCIDENT_DPI = 80  # incident zooms are many and small: lower resolution keeps the page light
HIST_BINS = 60  # fine enough to show shape, coarse enough that bins are not noise
CURVE_POINTS = 1000  # per part of a subsampled survival curve
MAX_WINDOW_LABELS = 24  # more 10-minute windows than this: label every n-th, no value labels
MIN_LINK_PX = 14.0  # the HTML link over a band is at least this wide (image pixels)


def _new_figure(size: tuple[float, float], dpi: int = DPI) -> Figure:
    fig = Figure(figsize=size, dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def to_png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _bucketed(
    values: FloatArray, smooth_s: int = SMOOTH_S
) -> tuple[FloatArray, FloatArray, FloatArray, int]:
    """(x in seconds since the first bin, bucket max, bucket mean, bucket seconds)."""
    step = max(1, math.ceil(values.size / MAX_POINTS))
    if step == 1:
        return np.arange(values.size, dtype=np.float64), values, rolling_mean(values, smooth_s), 1
    usable = values.size // step * step
    shaped = values[:usable].reshape(-1, step)
    x = np.arange(shaped.shape[0], dtype=np.float64) * step
    return x, shaped.max(axis=1), shaped.mean(axis=1), step


def _bucket_mean(values: FloatArray, step: int) -> FloatArray:
    """Per-bucket mean ignoring NaN (NaN where a bucket is all NaN), without
    numpy's all-NaN warning: the threshold is NaN during the warm-up."""
    usable = values.size // step * step
    shaped = values[:usable].reshape(-1, step)
    present = ~np.isnan(shaped)
    count = present.sum(axis=1)
    total = np.where(present, shaped, 0.0).sum(axis=1)
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


@dataclass(frozen=True, slots=True)
class BandBox:
    """Where a burst band lies on the timeline PNG, in percent of its size,
    so the HTML can lay a link over it that scales with the image."""

    number: int
    left: float
    top: float
    width: float
    height: float


@dataclass(frozen=True, slots=True)
class TimelineFigure:
    png: bytes
    bands: list[BandBox]


def _rate_panel(
    ax: Axes,
    axis: TimeAxis,
    values: FloatArray,
    baseline: Baseline | None,
    window: int,
    k: float,
    colours: tuple[str, str],
) -> None:
    """One rate series: per second (light), its burst-rule average (dark) and
    the burst threshold (dashed), the line that average must cross."""
    x, peak, mean, step = _bucketed(values, window)
    smooth = baseline.smoothed if baseline is not None and step == 1 else mean
    xs = axis.x(x)
    light, dark = colours
    ax.plot(
        xs, peak, lw=0.6, color=light, label="per second" if step == 1 else f"max 1 s / {step} s"
    )
    ax.plot(
        xs,
        smooth,
        lw=1.2,
        color=dark,
        label=f"{window}-s mean" if step == 1 else f"mean / {step} s",
    )
    top = float(np.max(peak)) if peak.size else 0.0
    if baseline is not None:
        threshold = baseline.threshold if step == 1 else _bucket_mean(baseline.threshold, step)
        ax.plot(
            xs,
            threshold[: xs.size],
            lw=1.3,
            ls="--",
            color=THRESHOLD_COLOUR,
            label=f"burst threshold ({window}-s mean > baseline + {k:g}$\\sigma$)",
        )
        if np.any(~np.isnan(threshold)):
            top = max(top, float(np.nanmax(threshold)))
    ax.set_ylim(0, max(top, 1.0) * (1 + HEADROOM))
    si_y(ax)
    ax.grid(axis="y", color="#eeeeee", lw=0.6)
    ax.set_axisbelow(True)


def build_rate_figure(
    analysis: Analysis,
) -> tuple[Figure, list[Axes], list[tuple[int, float, float]]]:
    """The timeline figure, its panels and the band spans (number, x0, x1)."""
    assert analysis.series is not None and analysis.timeline is not None
    series, timeline = analysis.series, analysis.timeline
    axis = TimeAxis.of(TimeScale.of(timeline))
    with_tokens = analysis.log.has_tokens
    fig = _new_figure(TALL if with_tokens else WIDE)
    axes = list(fig.subplots(2 if with_tokens else 1, 1, sharex=True, squeeze=False)[:, 0])
    rule = analysis.params.rule
    panels: list[tuple[str, FloatArray, Baseline | None, tuple[str, str]]] = [
        ("requests/s", series.requests, analysis.request_baseline, ("#9ecae1", "#08519c"))
    ]
    if with_tokens:
        panels.append(("tokens/s", series.tokens, analysis.token_baseline, ("#fdd0a2", "#d94801")))
    spans = band_spans(analysis.incidents, axis, timeline.n_bins)
    for ax, (label, values, baseline, colours) in zip(axes, panels, strict=True):
        _rate_panel(ax, axis, values, baseline, rule.min_seconds, rule.k, colours)
        ax.set_ylabel(label)
    axes[0].set_xlim(axis.at(0), axis.at(timeline.n_bins))
    for i, ax in enumerate(axes):
        draw_bands(ax, spans, numbers=i == 0)
        handles, labels = ax.get_legend_handles_labels()
        if spans:
            handles.append(Patch(facecolor=BURST_COLOUR, alpha=BAND_ALPHA, edgecolor=BURST_COLOUR))
            labels.append("burst (numbered above)" if i == 0 else "burst")
        ax.legend(
            handles, labels, loc="upper left", ncols=4, fontsize=8, framealpha=0.9, edgecolor="none"
        )
    axis.apply(axes[-1])
    return fig, axes, spans


def rate_figure(analysis: Analysis) -> TimelineFigure:
    """Requests/s and tokens/s over time: thresholds drawn, bursts as numbered bands."""
    fig, axes, spans = build_rate_figure(analysis)
    png = to_png(fig)  # drawing fixes the constrained layout: pixel positions are final
    width, height = fig.bbox.width, fig.bbox.height
    first, last = axes[0], axes[-1]
    label_px = 18.0  # the number boxes above the top panel belong to the link too
    top_px = min(height, first.bbox.y1 + label_px)
    bottom_px = last.bbox.y0
    boxes = []
    for number, x0, x1 in spans:
        left = float(first.transData.transform((x0, 0.0))[0])
        right = float(first.transData.transform((x1, 0.0))[0])
        if right - left < MIN_LINK_PX:  # an easy target, wider than the band it covers
            middle = (left + right) / 2
            left, right = middle - MIN_LINK_PX / 2, middle + MIN_LINK_PX / 2
        left, right = max(left, first.bbox.x0), min(right, first.bbox.x1)
        boxes.append(
            BandBox(
                number=number,
                left=100.0 * left / width,
                top=100.0 * (height - top_px) / height,
                width=100.0 * max(right - left, 0.0) / width,
                height=100.0 * (top_px - bottom_px) / height,
            )
        )
    return TimelineFigure(png=png, bands=boxes)


def interarrival_figure(analysis: Analysis) -> bytes | None:
    """Histogram and survival function of gaps vs the exponential."""
    if len(analysis.log) < 2:
        return None
    gaps = np.diff(np.sort(analysis.log.ts_us)).astype(np.float64) / US_PER_S
    mean = float(gaps.mean())
    if mean <= 0:
        return None
    fig = _new_figure(WIDE)
    left, right = fig.subplots(1, 2)
    top = float(np.percentile(gaps, 99.9))
    edges = np.linspace(0.0, max(top, mean), HIST_BINS + 1)
    left.hist(gaps[gaps <= edges[-1]], bins=edges, density=True, color="#9ecae1", label="observed")
    xs = np.linspace(0.0, edges[-1], 200)
    left.plot(
        xs,
        np.exp(-xs / mean) / mean,
        color=BURST_COLOUR,
        lw=1.5,
        label=f"exponential, mean {mean:.3g} s",
    )
    left.set_xlabel("gap between arrivals (s)")
    left.set_ylabel("density")
    left.set_title("Inter-arrival histogram")
    left.legend(fontsize=8)
    ordered = np.sort(gaps)
    n = ordered.size
    # A few thousand points draw the same curve as a million, in milliseconds:
    # evenly spaced ranks for the body, geometric ones for the tail.
    ranks = np.concatenate(
        (np.linspace(0, n - 1, CURVE_POINTS), n - np.geomspace(1, n, CURVE_POINTS))
    )
    picks = np.unique(np.clip(ranks.astype(np.int64), 0, n - 1))
    x = ordered[picks]
    right.plot(x, 1.0 - picks / n, color="#08519c", lw=1.2, label="observed")
    right.plot(x, np.exp(-x / mean), color=BURST_COLOUR, lw=1.2, ls="--", label="exponential")
    right.set_yscale("log")
    right.set_ylim(0.5 / n, 1.5)  # below 1/n the data say nothing
    right.set_xlabel("gap (s)")
    right.set_ylabel("P(gap > x)")
    right.set_title("Tail (log scale): above the line = longer lulls")
    right.legend(fontsize=8)
    return to_png(fig)


def lengths_figure(log: RequestLog) -> bytes | None:
    if not log.has_tokens or len(log) == 0:
        return None
    fig = _new_figure(WIDE)
    axes = fig.subplots(1, 2)
    for ax, values, colour, title in (
        (axes[0], log.prompt_tokens, "#fd8d3c", "Prompt tokens per request"),
        (axes[1], log.output_tokens, "#31a354", "Output tokens per request"),
    ):
        positive = values[values > 0]
        if positive.size == 0:
            ax.set_title(f"{title}: all zero")
            continue
        low, high = float(positive.min()), float(positive.max())
        edges = np.geomspace(low, max(high, low * 1.01), HIST_BINS + 1)
        ax.hist(positive, bins=edges, color=colour)
        ax.set_xscale("log")
        for q, style in ((50, "-"), (99, "--")):
            value = float(np.percentile(values, q))
            ax.axvline(value, color="#252525", ls=style, lw=1, label=f"P{q} {value:,.0f}")
        ax.set_title(title)
        ax.set_xlabel("tokens (log scale)")
        ax.set_ylabel("requests")
        ax.legend(fontsize=8)
    return to_png(fig)


def windows_figure(analysis: Analysis) -> bytes | None:
    fig = build_windows_figure(analysis)
    return None if fig is None else to_png(fig)


def build_windows_figure(analysis: Analysis) -> Figure | None:
    """Mean, P95 and max requests/s per 10-minute window, the max labelled."""
    windows = analysis.overall.windows
    if not windows or analysis.timeline is None:
        return None
    scale = TimeScale.of(analysis.timeline)
    fig = _new_figure(WIDE)
    ax = fig.subplots()
    idx = np.arange(len(windows))
    width = 0.27  # three bars (mean, P95, max) fill ~80% of each window's slot
    peaks = [w.requests_per_s.max for w in windows]
    for offset, values, colour, label in (
        (-width, [w.requests_per_s.mean for w in windows], "#9ecae1", "mean"),
        (0.0, [w.requests_per_s.p95 for w in windows], "#3182bd", "P95"),
        (width, peaks, BURST_COLOUR, "max"),
    ):
        bars = ax.bar(idx + offset, values, width=width, color=colour, label=label)
    few = len(windows) <= MAX_WINDOW_LABELS
    if few:
        ax.bar_label(bars, labels=[si(p) for p in peaks], fontsize=8, padding=2)
    # Head room: the tallest bar, its value and the legend all stay inside the frame.
    ax.set_ylim(0, max(max(peaks), 1.0) * (1 + HEADROOM))
    every = 1 if few else math.ceil(len(windows) / MAX_WINDOW_LABELS)
    shown = idx[::every]
    ax.set_xticks(
        shown,
        [f"{windows[i].index}\n{scale.moment(windows[i].start_us)[-8:-3]}" for i in shown],
    )
    ax.set_xlabel(f"10-minute window: number and start ({scale.zone})")
    ax.set_ylabel("requests/s")
    si_y(ax)
    ax.set_title("Per-window request rate: plan from P95, not the mean")
    ax.legend(fontsize=8, loc="upper left", ncols=3, frameon=False)
    return fig


def tenants_figure(analysis: Analysis) -> bytes | None:
    log, timeline = analysis.log, analysis.timeline
    if not analysis.tenants or timeline is None:
        return None
    axis = TimeAxis.of(TimeScale.of(timeline))
    groups = tenant_rows(log)
    fig = _new_figure(WIDE)
    left, right = fig.subplots(1, 2, width_ratios=(2, 1))
    step = max(SMOOTH_S, math.ceil(timeline.n_bins / MAX_POINTS))
    buckets = math.ceil(timeline.n_bins / step)
    stacks: list[FloatArray] = []
    labels: list[str] = []
    other = np.zeros(buckets)
    for i, (name, rows) in enumerate(groups):
        counts = np.bincount(timeline.bins(log.ts_us[rows]) // step, minlength=buckets) / (
            step * timeline.bin_seconds
        )
        if i < TENANTS_PLOTTED:
            stacks.append(counts.astype(np.float64))
            labels.append(name or "(blank)")
        else:
            other += counts
    if len(groups) > TENANTS_PLOTTED:
        stacks.append(other)
        labels.append("other")
    left.stackplot(
        axis.x(np.arange(buckets, dtype=np.float64) * step), np.vstack(stacks), labels=labels
    )
    left.set_xlim(axis.at(0), axis.at(timeline.n_bins))
    draw_bands(left, band_spans(analysis.incidents, axis, timeline.n_bins), numbers=False)
    axis.apply(left, label=False)
    left.set_xlabel(axis.label if axis.scale.relative else "time (UTC); red: bursts")
    left.set_ylabel(f"requests/s ({step * timeline.bin_seconds}-s mean)")
    si_y(left)
    left.set_title("Request rate by tenant")
    left.legend(fontsize=7, loc="upper left")
    shown = analysis.tenants[:TENANTS_PLOTTED]
    names = [t.tenant or "(blank)" for t in shown]
    cvs = [t.requests_per_s.cv if t.requests_per_s and t.requests_per_s.cv else 0.0 for t in shown]
    right.barh(names[::-1], cvs[::-1], color="#3182bd")
    right.axvline(1.0, color=BURST_COLOUR, ls="--", lw=1, label="CV = 1")
    right.set_xlabel("CV of requests/s")
    right.set_title("Burstiness by tenant")
    right.legend(fontsize=8)
    return to_png(fig)


def incident_figure(analysis: Analysis, incident: Incident) -> bytes:
    """Zoom on one incident: each axis with its own baseline and threshold."""
    assert analysis.series is not None and analysis.request_baseline is not None
    assert analysis.timeline is not None
    series: RateSeries = analysis.series
    scale = TimeScale.of(analysis.timeline)
    width = analysis.timeline.bin_seconds
    context = -(-INCIDENT_CONTEXT_S // width)  # in bins
    lo = max(0, incident.start - context)
    hi = min(series.requests.size, incident.end + context)
    x = (np.arange(lo, hi) - incident.start) * width  # seconds from the burst's start
    panels = [("requests/s", series.requests, analysis.request_baseline, "#9ecae1")]
    if analysis.token_baseline is not None:
        panels.append(("tokens/s", series.tokens, analysis.token_baseline, "#fdd0a2"))
    panel_height, legend_height = 1.9, 0.9  # inches
    fig = _new_figure((9.0, panel_height * len(panels) + legend_height), dpi=INCIDENT_DPI)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    window = analysis.params.rule.min_seconds
    for ax, (label, values, base, colour) in zip(axes, panels, strict=True):
        # stairs() is one artist; bar() would be one per second, 20x slower.
        ax.stairs(
            values[lo:hi],
            np.append(x, x[-1] + width) - width / 2,
            fill=True,
            color=colour,
            label=label,
        )
        ax.plot(x, base.smoothed[lo:hi], color="#08519c", lw=1.2, label=f"{window}-s average")
        ax.plot(x, base.mean[lo:hi], color="#252525", lw=1, label="baseline")
        ax.plot(
            x, base.threshold[lo:hi], color=THRESHOLD_COLOUR, lw=1.2, ls="--", label="threshold"
        )
        ax.axvspan(0, incident.duration_s, color=BURST_COLOUR, alpha=BAND_ALPHA, lw=0)
        ax.axvline(
            (incident.detected_at + 1 - incident.start) * width,
            color=BURST_COLOUR,
            lw=1,
            ls=":",
            label="detected",
        )
        ax.set_ylabel(label)
        si_y(ax)
    axes[0].set_title(
        f"Burst {incident.number}: {scale.at(incident.start)} ({scale.zone}), "
        f"{incident.duration_s} s, on {' and '.join(incident.axes)}",
        fontsize=10,
    )
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        loc="outside lower center",
        ncols=5,
        fontsize=8,
        frameon=False,
    )
    axes[-1].set_xlabel("seconds from burst start")
    return to_png(fig)
