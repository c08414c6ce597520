"""Axes shared by the report's time plots: the time axis, tick units, burst bands.

Kept apart from plots.py so every time plot reads the same way: UTC clock
time (or time since the log's zero for relative logs), counts as 12k / 3.4M,
bursts as numbered bands wide enough to see at any zoom.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
from matplotlib import dates as mdates
from matplotlib.axes import Axes
from matplotlib.ticker import FuncFormatter, MaxNLocator
from matplotlib.transforms import blended_transform_factory

from controlplane.analysis.parsing import US_PER_S
from controlplane.analysis.stats import FloatArray
from controlplane.analysis.summary import Incident
from controlplane.analysis.timescale import SECONDS_PER_DAY, TimeScale

BURST_COLOUR = "#d62728"
BAND_ALPHA = 0.3  # drawn over the series: seen at a glance, the series still readable through it
# A 7-second burst in a one-hour plot is 2 pixels wide: bands are drawn at
# least this share of the time axis (~7 px on a 1000-px plot), centred on the burst.
MIN_BAND_FRACTION = 0.008
# Width of a number's box as a share of the axis (~7 px a digit plus padding
# on a ~900-px axis). A number whose box would overlap the previous one is
# not printed (its band, and its link in the HTML, remain).
LABEL_DIGIT_FRACTION = 0.008
LABEL_PAD_FRACTION = 0.014
# Relative logs: the unit of the time axis, by span (seconds shown up to 5 minutes, ...).
RELATIVE_UNITS = ((300, 1, "s"), (5 * 3600, 60, "min"), (5 * SECONDS_PER_DAY, 3600, "h"))
_SI = ((1e9, "G"), (1e6, "M"), (1e3, "k"))


def si(value: float, _position: object = None) -> str:
    """Tick label with a k/M/G suffix: 35000 -> 35k, 2500 -> 2.5k, 0.5 -> 0.5."""
    magnitude = abs(value)
    for limit, suffix in _SI:
        if magnitude >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}"


def si_y(ax: Axes) -> None:
    ax.yaxis.set_major_formatter(FuncFormatter(si))


@dataclass(frozen=True, slots=True)
class TimeAxis:
    """Maps bin indices of the timeline (fractional ones too) to x values and
    labels the axis."""

    scale: TimeScale
    origin: float  # x of second 0
    per_bin: float  # x units per bin
    label: str

    @classmethod
    def of(cls, scale: TimeScale) -> TimeAxis:
        t0_s = scale.timeline.t0_us / US_PER_S
        width = scale.timeline.bin_seconds
        if not scale.relative:
            start = datetime.fromtimestamp(t0_s, tz=UTC)
            # matplotlib.dates is not annotated (hence the ignores in this module).
            origin = float(mdates.date2num(start))  # type: ignore[no-untyped-call]
            return cls(scale, origin, width / SECONDS_PER_DAY, "time (UTC)")
        span = scale.timeline.seconds
        seconds, unit = next(
            ((size, name) for limit, size, name in RELATIVE_UNITS if span <= limit),
            (SECONDS_PER_DAY, "days"),
        )
        return cls(
            scale,
            t0_s / seconds,
            width / seconds,
            f"time since the log's zero ({unit}; the timestamps are relative)",
        )

    def x(self, bins: FloatArray) -> FloatArray:
        result: FloatArray = self.origin + bins * self.per_bin
        return result

    def at(self, index: float) -> float:
        return self.origin + index * self.per_bin

    def apply(self, ax: Axes, label: bool = True) -> None:
        if self.scale.relative:
            ax.xaxis.set_major_locator(MaxNLocator(nbins=10, steps=[1, 2, 2.5, 5, 10]))
            ax.xaxis.set_major_formatter(FuncFormatter(si))
        else:
            locator = mdates.AutoDateLocator(tz=UTC, minticks=5, maxticks=12)  # type: ignore[no-untyped-call]
            formatter = mdates.ConciseDateFormatter(locator, tz=UTC)  # type: ignore[no-untyped-call]
            ax.xaxis.set_major_locator(locator)
            ax.xaxis.set_major_formatter(formatter)
        if label:
            ax.set_xlabel(self.label)


def band_spans(
    incidents: Sequence[Incident], axis: TimeAxis, n_bins: int
) -> list[tuple[int, float, float]]:
    """(number, x0, x1) per incident, widened to the minimum visible width."""
    least = MIN_BAND_FRACTION * n_bins
    spans = []
    for inc in incidents:
        lo, hi = float(inc.start), float(inc.end)
        if hi - lo < least:
            middle = (lo + hi) / 2
            lo, hi = middle - least / 2, middle + least / 2
        spans.append((inc.number, axis.at(lo), axis.at(hi)))
    return spans


def draw_bands(ax: Axes, spans: Sequence[tuple[int, float, float]], numbers: bool) -> None:
    """Bands over the full height of ``ax``; with ``numbers``, labels above it."""
    if not spans:
        return
    ax.broken_barh(
        [(x0, x1 - x0) for _, x0, x1 in spans],
        (0, 1),
        transform=ax.get_xaxis_transform(),
        facecolor=BURST_COLOUR,
        alpha=BAND_ALPHA,
        edgecolor=BURST_COLOUR,
        linewidth=0.8,
        zorder=3,  # over the lines: under them a dense per-second series hides the band
    )
    if not numbers:
        return
    lo, hi = ax.get_xlim()
    above = blended_transform_factory(ax.transData, ax.transAxes)

    def half_width(number: int) -> float:
        return (LABEL_DIGIT_FRACTION * len(str(number)) + LABEL_PAD_FRACTION) * (hi - lo) / 2

    last_edge = -np.inf
    for number, x0, x1 in spans:
        middle = (x0 + x1) / 2
        if middle - half_width(number) < last_edge:
            continue
        last_edge = middle + half_width(number)
        ax.text(
            middle,
            1.02,
            str(number),
            transform=above,
            ha="center",
            va="bottom",
            fontsize=9,
            fontweight="bold",
            color="white",
            bbox={"boxstyle": "round,pad=0.25", "facecolor": BURST_COLOUR, "edgecolor": "none"},
            clip_on=False,
        )
