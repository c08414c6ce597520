"""Burst detection on a per-second rate series.

The rule (docs/analysis.md, "The burst rule"), with ``t = min_seconds``:

1. Smooth: ``s(u)`` is the mean rate over the ``t`` seconds ending at ``u``.
   One-second counts at a few requests per second are mostly Poisson noise.
2. Baseline: mean ``mu(u)`` and standard deviation ``sigma(u)`` of ``s`` over
   the ``baseline_seconds`` that end just before the current window starts,
   so a burst never inflates its own baseline. ``sigma`` is floored at the
   Poisson standard deviation of a ``t``-second average at rate ``mu`` (and
   at one event per window when the baseline is quieter than that), so
   perfectly regular or silent traffic does not turn every wobble into a
   burst.
3. A second is *hot* when ``s(u) > mu(u) + k * sigma(u)``; scoring starts once
   ``min(baseline_seconds, 60)`` seconds of baseline history exist.
4. A burst is a run of at least ``t`` consecutive hot seconds: the smoothed
   rate stayed ``k`` sigma up for ``t`` seconds. (Any single hot second is
   too easy: scored every second, a 3-sigma test on Poisson traffic fires a
   few times an hour by chance; requiring ``t`` in a row makes that about
   one in ten hours, while a 3-second spike to 6x still qualifies because
   its 5-second average stays high for 5 seconds.)
5. Its extent lies between the start of the first hot window and the last
   hot second, with each edge where the summed excess of the per-second rate
   over the threshold, counted from the first hot second, peaks; bursts at most
   ``t`` seconds apart are one burst. It is *detected* at the second the run
   reaches ``t`` hot seconds: that is when a reactive system could know.

In bins wider than a second (a coarse timestamp grid, grid.py) the rule's
seconds become whole bins, rounded up; "second" above reads "bin". A burst
whose edges lie closer than ``t`` is widened to ``t`` inside its hot windows:
no burst is ever listed shorter than the rule's minimum.

The same rule serves request rate and token rate (the two axes of load);
``unit`` is the size of one event on the series (1 for requests, mean tokens
per request for tokens) and only enters the Poisson floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from controlplane.analysis.stats import FloatArray, rolling_mean

# Defaults, all overridable from the CLI.
# Three sigma, held for min_seconds in a row: about one false burst per ten
# hours of pure Poisson traffic (measured), while real bursts of 2.5x and up get through.
DEFAULT_K = 3.0
DEFAULT_MIN_SECONDS = 5  # shortest burst worth reacting to; shorter spikes drain from queues
DEFAULT_BASELINE_SECONDS = 300  # five minutes: long enough for a stable sigma, short enough
#                                 to follow the daily swell
# Fewest baseline seconds before scoring; sigma from fewer points is too noisy.
MIN_WARMUP_SECONDS = 60


@dataclass(frozen=True, slots=True)
class BurstRule:
    k: float = DEFAULT_K
    min_seconds: int = DEFAULT_MIN_SECONDS
    baseline_seconds: int = DEFAULT_BASELINE_SECONDS

    def __post_init__(self) -> None:
        if not (self.k > 0 and math.isfinite(self.k)):
            raise ValueError("burst k must be a positive number")
        if self.min_seconds < 1:
            raise ValueError("burst min-seconds must be at least 1")
        if self.baseline_seconds < 2:
            raise ValueError("burst baseline-seconds must be at least 2")

    @property
    def warmup_seconds(self) -> int:
        return min(self.baseline_seconds, MIN_WARMUP_SECONDS)

    def in_bins(self, bin_seconds: int) -> tuple[int, int, int]:
        """(min, baseline, warm-up) in bins of ``bin_seconds``, rounded up:
        a burst is never shorter than ``min_seconds``."""

        def up(seconds: int) -> int:
            return -(-seconds // bin_seconds)

        return up(self.min_seconds), max(2, up(self.baseline_seconds)), up(self.warmup_seconds)


@dataclass(frozen=True, slots=True)
class Baseline:
    """Per-second detector state; arrays are aligned with the input series."""

    smoothed: FloatArray  # s(t)
    mean: FloatArray  # mu(t); NaN before warm-up
    sigma: FloatArray  # floored sigma(t); NaN before warm-up
    threshold: FloatArray  # mu + k*sigma; NaN before warm-up

    @property
    def ready(self) -> npt.NDArray[np.bool_]:
        return ~np.isnan(self.threshold)


@dataclass(frozen=True, slots=True)
class BurstInterval:
    """A burst on one series, in bin indices (``end`` exclusive)."""

    start: int
    end: int
    detected_at: int  # second the hot run reached min_seconds: a reactive detector knows
    peak: float  # highest one-second rate inside
    mean: float  # mean rate inside
    baseline: float  # mu at the first hot second
    threshold: float  # mu + k*sigma at the first hot second

    @property
    def duration(self) -> int:
        return self.end - self.start


def compute_baseline(
    series: FloatArray, rule: BurstRule, unit: float = 1.0, bin_seconds: int = 1
) -> Baseline:
    """The detector's state on a per-second rate counted in ``bin_seconds``
    bins: the rule's seconds become whole bins (``BurstRule.in_bins``)."""
    n = series.size
    m, baseline_bins, warmup_bins = rule.in_bins(bin_seconds)
    smoothed = rolling_mean(series, m)
    # Rolling mean/std of s over the baseline window, centred on the global
    # mean first so the sum-of-squares trick does not cancel catastrophically.
    centre = float(smoothed.mean()) if n else 0.0
    shifted = smoothed - centre
    csum = np.concatenate(([0.0], np.cumsum(shifted)))
    csq = np.concatenate(([0.0], np.cumsum(shifted * shifted)))
    # Baseline for second t ends at j = t - m: the windows before t's own.
    j = np.arange(n) - m
    hi = j + 1
    lo = np.maximum(0, hi - baseline_bins)
    count = np.maximum(hi - lo, 0)
    ready = (j >= 0) & (count >= warmup_bins)
    safe_hi = np.where(ready, hi, 1)
    safe_lo = np.where(ready, lo, 0)
    safe_count = np.where(ready, count, 1).astype(np.float64)
    b_mean_c = (csum[safe_hi] - csum[safe_lo]) / safe_count
    b_var = np.maximum((csq[safe_hi] - csq[safe_lo]) / safe_count - b_mean_c * b_mean_c, 0.0)
    b_mean = b_mean_c + centre
    # A rate averaged over m bins is averaged over `window` seconds: its
    # Poisson variance is unit * rate / window.
    window = m * bin_seconds
    poisson_rate = np.maximum(b_mean, unit / window)  # at least one event per window
    floor = np.sqrt(unit * poisson_rate / window)
    sigma = np.maximum(np.sqrt(b_var), floor)
    threshold = b_mean + rule.k * sigma
    nan = np.full(n, np.nan)
    return Baseline(
        smoothed=smoothed,
        mean=np.where(ready, b_mean, nan),
        sigma=np.where(ready, sigma, nan),
        threshold=np.where(ready, threshold, nan),
    )


def hot_seconds(baseline: Baseline) -> npt.NDArray[np.bool_]:
    ready = baseline.ready
    hot = np.zeros(baseline.smoothed.size, dtype=np.bool_)
    hot[ready] = baseline.smoothed[ready] > baseline.threshold[ready]
    return hot


def runs(mask: npt.NDArray[np.bool_]) -> list[tuple[int, int]]:
    """Maximal runs of True as (start, end-exclusive) pairs."""
    if mask.size == 0:
        return []
    edges = np.diff(np.concatenate(([0], mask.astype(np.int8), [0])))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    return [(int(a), int(b)) for a, b in zip(starts, ends, strict=True)]


def _extent(series: FloatArray, lo: int, first_hot: int, hi: int, cut: float) -> tuple[int, int]:
    """Burst edges inside ``[lo, hi)``, the stretch covered by hot windows.

    Each edge maximises the summed excess over ``cut`` between it and the
    first hot second (a change-point estimate): a lone noisy second before
    the rise adds less than the quiet seconds between it and the rise take
    away, so the edges land where the rate actually changed.
    """
    excess = series[lo:hi] - cut
    k = first_hot - lo
    leftward = np.cumsum(excess[: k + 1][::-1])  # sums over [first_hot - j, first_hot]
    rightward = np.cumsum(excess[k:])  # sums over [first_hot, first_hot + j]
    return first_hot - int(np.argmax(leftward)), first_hot + int(np.argmax(rightward)) + 1


def _at_least(start: int, end: int, m: int, lo: int, hi: int) -> tuple[int, int]:
    """``[start, end)`` widened to ``m`` bins if shorter, evenly on both sides,
    within ``[lo, hi)`` (the hot windows' stretch, always at least ``m``
    long): a burst the rule saw for ``m`` bins is never listed shorter, and
    the widened part is where its ``m``-bin averages were hot."""
    short = m - (end - start)
    if short <= 0:
        return start, end
    start = max(lo, start - short // 2)
    end = start + m
    if end > hi:
        end, start = hi, hi - m
    return start, end


def detect_bursts(
    series: FloatArray, rule: BurstRule | None = None, unit: float = 1.0, bin_seconds: int = 1
) -> list[BurstInterval]:
    """Bursts on one per-second rate series (counted in bins of
    ``bin_seconds``) under ``rule`` (see module docstring); every one at
    least ``rule.min_seconds`` long."""
    rule = rule or BurstRule()
    if series.size == 0:
        return []
    baseline = compute_baseline(series, rule, unit, bin_seconds)
    hot = hot_seconds(baseline)
    if not hot.any():
        return []
    m = rule.in_bins(bin_seconds)[0]
    # (start, end, first hot second, detected) per qualifying run.
    found: list[tuple[int, int, int, int]] = []
    for first_hot, end in runs(hot):
        if end - first_hot < m:
            continue
        lo = max(0, first_hot - m + 1)
        extent = _extent(series, lo, first_hot, end, float(baseline.threshold[first_hot]))
        item = (*_at_least(*extent, m, lo, end), first_hot, first_hot + m - 1)
        if found and item[0] - found[-1][1] <= m:
            prev = found[-1]
            found[-1] = (prev[0], max(prev[1], item[1]), prev[2], prev[3])
        else:
            found.append(item)
    out: list[BurstInterval] = []
    for start, end, first_hot, detected in found:
        window = series[start:end]
        out.append(
            BurstInterval(
                start=start,
                end=end,
                detected_at=detected,
                peak=float(window.max()),
                mean=float(window.mean()),
                baseline=float(baseline.mean[first_hot]),
                threshold=float(baseline.threshold[first_hot]),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class MergedBurst:
    """A burst on either axis; overlapping or near bursts on both axes merge."""

    start: int
    end: int
    detected_at: int
    axes: tuple[str, ...]  # which series triggered: "requests", "tokens"


def merge_axes(by_axis: dict[str, list[BurstInterval]], gap: int) -> list[MergedBurst]:
    """Union of per-axis bursts; intervals within ``gap`` seconds merge."""
    tagged = sorted(
        (b.start, b.end, b.detected_at, axis) for axis, bursts in by_axis.items() for b in bursts
    )
    merged: list[MergedBurst] = []
    for start, end, detected, axis in tagged:
        if merged and start - merged[-1].end <= gap:
            prev = merged[-1]
            axes = prev.axes if axis in prev.axes else (*prev.axes, axis)
            merged[-1] = MergedBurst(
                prev.start, max(prev.end, end), min(prev.detected_at, detected), axes
            )
        else:
            merged.append(MergedBurst(start, end, detected, (axis,)))
    return [MergedBurst(b.start, b.end, b.detected_at, tuple(sorted(b.axes))) for b in merged]
