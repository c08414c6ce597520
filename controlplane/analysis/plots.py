"""PNG figures for the HTML report.

Figures are built with ``matplotlib.figure.Figure`` on an explicit Agg canvas:
no pyplot, no global state, no display needed, safe in a server process.
"""

from __future__ import annotations

import io
import math

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from controlplane.analysis.parsing import US_PER_S, format_timestamp_us
from controlplane.analysis.reader import RequestLog
from controlplane.analysis.stats import FloatArray, Timeline, rolling_mean
from controlplane.analysis.summary import Analysis, Incident, RateSeries, tenant_rows

DPI = 100  # with the sizes below: ~1000 px wide, readable on a laptop screen
WIDE = (10.0, 4.2)  # inches: one row of panels
TALL = (10.0, 6.0)  # inches: two stacked panels sharing the time axis
# Above this many points a time series is drawn per bucket (max and mean) so
# a week-long log renders as fast as an hour-long one.
MAX_POINTS = 4000
SMOOTH_S = 10  # the darker line on rate plots: 10-second mean
BURST_COLOUR = "#d62728"
SHADE_ALPHA = 0.18  # light enough to read the series through the shading
TENANTS_PLOTTED = 8  # more colours than this are unreadable in a stacked plot
INCIDENT_CONTEXT_S = 60  # seconds shown either side of an incident
INCIDENT_DPI = 80  # incident zooms are many and small: lower resolution keeps the page light
HIST_BINS = 60  # fine enough to show shape, coarse enough that bins are not noise
CURVE_POINTS = 1000  # per part of a subsampled survival curve


def _new_figure(size: tuple[float, float], dpi: int = DPI) -> Figure:
    fig = Figure(figsize=size, dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def to_png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _minutes(n: int, start: int = 0) -> FloatArray:
    return (np.arange(n, dtype=np.float64) + start) / 60.0


def _bucketed(
    values: FloatArray, smooth_s: int = SMOOTH_S
) -> tuple[FloatArray, FloatArray, FloatArray, int]:
    """(x in minutes, bucket max, bucket mean, bucket seconds)."""
    step = max(1, math.ceil(values.size / MAX_POINTS))
    if step == 1:
        return _minutes(values.size), values, rolling_mean(values, smooth_s), 1
    usable = values.size // step * step
    shaped = values[:usable].reshape(-1, step)
    x = _minutes(shaped.shape[0]) * step
    return x, shaped.max(axis=1), shaped.mean(axis=1), step


def _shade(ax: Axes, incidents: list[Incident]) -> None:
    for inc in incidents:
        ax.axvspan(inc.start / 60.0, inc.end / 60.0, color=BURST_COLOUR, alpha=SHADE_ALPHA, lw=0)


def _time_label(timeline: Timeline) -> str:
    return f"minutes since {format_timestamp_us(timeline.t0_us)[:19]}Z"


def rate_figure(analysis: Analysis) -> bytes:
    """Requests/s and tokens/s over time, bursts shaded."""
    assert analysis.series is not None and analysis.timeline is not None
    series = analysis.series
    with_tokens = analysis.log.has_tokens
    fig = _new_figure(TALL if with_tokens else WIDE)
    axes = fig.subplots(2 if with_tokens else 1, 1, sharex=True, squeeze=False)[:, 0]
    window = analysis.params.rule.min_seconds
    x, peak, mean, step = _bucketed(series.requests, window)
    ax = axes[0]
    label_peak = "per second" if step == 1 else f"max second per {step} s"
    label_mean = f"{SMOOTH_S}-s mean" if step == 1 else f"mean per {step} s"
    label_window = f"{window}-s mean" if step == 1 else label_mean
    ax.plot(x, peak, lw=0.6, color="#9ecae1", label=label_peak)
    ax.plot(x, mean, lw=1.2, color="#08519c", label=label_window)
    if analysis.request_baseline is not None and step == 1:
        ax.plot(
            x,
            analysis.request_baseline.threshold,
            lw=0.8,
            ls="--",
            color="#636363",
            label=f"burst threshold ({window}-s avg)",
        )
    _shade(ax, analysis.incidents)
    ax.set_ylabel("requests/s")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title("Request rate (bursts shaded)")
    if with_tokens:
        ax = axes[1]
        for values, colour, label in (
            (series.prompt_tokens, "#fd8d3c", "prompt"),
            (series.output_tokens, "#31a354", "output"),
        ):
            xs, _, smooth, _ = _bucketed(values)
            ax.plot(xs, smooth, lw=1.0, color=colour, label=f"{label} ({label_mean})")
        xt, tok_peak, _, _ = _bucketed(series.tokens)
        ax.plot(xt, tok_peak, lw=0.5, color="#bdbdbd", label=f"total ({label_peak})", zorder=0)
        _shade(ax, analysis.incidents)
        ax.set_ylabel("tokens/s")
        ax.legend(loc="upper right", fontsize=8)
        ax.set_title("Token rate")
    axes[-1].set_xlabel(_time_label(analysis.timeline))
    return to_png(fig)


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
    windows = analysis.overall.windows
    if not windows:
        return None
    fig = _new_figure(WIDE)
    ax = fig.subplots()
    idx = np.arange(len(windows))
    width = 0.27  # three bars (mean, P95, max) fill ~80% of each window's slot
    for offset, values, colour, label in (
        (-width, [w.requests_per_s.mean for w in windows], "#9ecae1", "mean"),
        (0.0, [w.requests_per_s.p95 for w in windows], "#3182bd", "P95"),
        (width, [w.requests_per_s.max for w in windows], BURST_COLOUR, "max"),
    ):
        ax.bar(idx + offset, values, width=width, color=colour, label=label)
    ax.set_xticks(idx, [str(w.index) for w in windows])
    ax.set_xlabel("10-minute window")
    ax.set_ylabel("requests/s")
    ax.set_title("Per-window request rate: plan from P95, not the mean")
    ax.legend(fontsize=8)
    return to_png(fig)


def tenants_figure(analysis: Analysis) -> bytes | None:
    log, timeline = analysis.log, analysis.timeline
    if not analysis.tenants or timeline is None:
        return None
    groups = tenant_rows(log)
    fig = _new_figure(WIDE)
    left, right = fig.subplots(1, 2, width_ratios=(2, 1))
    step = max(SMOOTH_S, math.ceil(timeline.n_bins / MAX_POINTS))
    buckets = math.ceil(timeline.n_bins / step)
    stacks: list[FloatArray] = []
    labels: list[str] = []
    other = np.zeros(buckets)
    for i, (name, rows) in enumerate(groups):
        counts = np.bincount(timeline.bins(log.ts_us[rows]) // step, minlength=buckets) / step
        if i < TENANTS_PLOTTED:
            stacks.append(counts.astype(np.float64))
            labels.append(name or "(blank)")
        else:
            other += counts
    if len(groups) > TENANTS_PLOTTED:
        stacks.append(other)
        labels.append("other")
    left.stackplot(_minutes(buckets) * step, np.vstack(stacks), labels=labels)
    _shade(left, analysis.incidents)
    left.set_xlabel(_time_label(timeline))
    left.set_ylabel(f"requests/s ({step}-s mean)")
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
    series: RateSeries = analysis.series
    lo = max(0, incident.start - INCIDENT_CONTEXT_S)
    hi = min(series.requests.size, incident.end + INCIDENT_CONTEXT_S)
    x = np.arange(lo, hi) - incident.start
    panels = [("requests/s", series.requests, analysis.request_baseline, "#9ecae1")]
    if analysis.token_baseline is not None:
        panels.append(("tokens/s", series.tokens, analysis.token_baseline, "#fdd0a2"))
    panel_height, legend_height = 1.9, 0.6  # inches
    fig = _new_figure((9.0, panel_height * len(panels) + legend_height), dpi=INCIDENT_DPI)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    window = analysis.params.rule.min_seconds
    for ax, (label, values, base, colour) in zip(axes, panels, strict=True):
        # stairs() is one artist; bar() would be one per second, 20x slower.
        ax.stairs(
            values[lo:hi], np.append(x, x[-1] + 1) - 0.5, fill=True, color=colour, label=label
        )
        ax.plot(x, base.smoothed[lo:hi], color="#08519c", lw=1.2, label=f"{window}-s average")
        ax.plot(x, base.mean[lo:hi], color="#252525", lw=1, label="baseline")
        ax.plot(x, base.threshold[lo:hi], color="#636363", lw=1, ls="--", label="threshold")
        ax.axvspan(0, incident.duration_s, color=BURST_COLOUR, alpha=SHADE_ALPHA, lw=0)
        ax.axvline(
            incident.detected_at + 1 - incident.start,
            color=BURST_COLOUR,
            lw=1,
            ls=":",
            label="detected",
        )
        ax.set_ylabel(label)
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        loc="outside upper center",
        ncols=5,
        fontsize=7,
        frameon=False,
    )
    axes[-1].set_xlabel("seconds from burst start")
    return to_png(fig)
