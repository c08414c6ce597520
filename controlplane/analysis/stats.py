"""Summary statistics over per-second series, inter-arrivals and lengths.

Conventions (documented in docs/analysis.md):

* Bins are anchored at the first arrival: bin ``i`` covers
  ``[t0 + i w, t0 + (i+1) w)`` with ``w`` one second, or a whole multiple of
  the timestamps' grid when that is coarser (grid.py). Anchoring at the
  first request rather than at wall-clock boundaries makes the first bin a
  full one and the figures independent of where the log happens to start
  within a second (and keeps bins on the grid). The log's span is
  ``n_bins = floor((t_last - t0) / w) + 1`` bins. Every series is a rate
  per second: the bin's count divided by its seconds.
* Standard deviations are population (ddof=0) figures; percentiles use
  NumPy's default linear interpolation (Hyndman & Fan type 7).
* Ratios whose denominator is zero are reported as ``None``, never inf/NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from controlplane.analysis.parsing import US_PER_S

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# SPEC §5: capacity is planned from P95 over 10-minute windows.
WINDOW_SECONDS = 600
# ln(100): the P99 of an exponential distribution is mean * ln(100).
LN_100 = math.log(100.0)


@dataclass(frozen=True, slots=True)
class Timeline:
    """The bins shared by every series of one log: ``bin_us`` wide (one second
    unless the timestamps' grid asks for more: grid.py), from the first arrival."""

    t0_us: int
    n_bins: int
    bin_us: int = US_PER_S

    @property
    def bin_seconds(self) -> int:
        return self.bin_us // US_PER_S

    @property
    def seconds(self) -> int:
        """The span the bins cover."""
        return self.n_bins * self.bin_seconds

    def bins(self, ts_us: IntArray) -> IntArray:
        return (ts_us - self.t0_us) // self.bin_us

    def bin_start_us(self, index: int) -> int:
        return self.t0_us + index * self.bin_us


def make_timeline(ts_us: IntArray, bin_us: int = US_PER_S) -> Timeline | None:
    if ts_us.size == 0:
        return None
    t0 = int(ts_us.min())
    return Timeline(t0_us=t0, n_bins=int((int(ts_us.max()) - t0) // bin_us) + 1, bin_us=bin_us)


def per_second(
    bins: IntArray, n_bins: int, weights: npt.NDArray[np.int64] | None = None
) -> FloatArray:
    """Sum of ``weights`` (or count) per bin, as float64 of length ``n_bins``
    (a rate per second when the bins are one second wide; see ``rate``)."""
    if weights is None:
        return np.bincount(bins, minlength=n_bins).astype(np.float64)
    summed = np.bincount(bins, weights=weights.astype(np.float64), minlength=n_bins)
    return summed.astype(np.float64, copy=False)  # already float64; the stubs say intp


def rate(
    timeline: Timeline, ts_us: IntArray, weights: npt.NDArray[np.int64] | None = None
) -> FloatArray:
    """Per bin of ``timeline``: count (or sum of ``weights``) divided by the
    bin's seconds, so every series is per second whatever the bin width."""
    sums = per_second(timeline.bins(ts_us), timeline.n_bins, weights)
    return sums if timeline.bin_us == US_PER_S else sums / timeline.bin_seconds


@dataclass(frozen=True, slots=True)
class SeriesStats:
    """Statistics of a per-second rate series (requests/s or tokens/s)."""

    seconds: int  # the span of the series (bins x bin width)
    total: float  # the rate's integral: requests or tokens in all
    mean: float
    std: float
    p50: float
    p95: float
    p99: float
    max: float
    cv: float | None  # std / mean; > 1 means strongly bursty
    peak_to_mean: float | None  # max / mean; > 3 means do not plan from the mean


def series_stats(values: FloatArray, bin_seconds: int = 1) -> SeriesStats | None:
    """Of a per-second rate counted in bins of ``bin_seconds``."""
    if values.size == 0:
        return None
    mean = float(values.mean())
    std = float(values.std())
    p50, p95, p99 = (float(q) for q in np.percentile(values, [50, 95, 99]))
    peak = float(values.max())
    return SeriesStats(
        seconds=int(values.size) * bin_seconds,
        total=float(values.sum()) * bin_seconds,
        mean=mean,
        std=std,
        p50=p50,
        p95=p95,
        p99=p99,
        max=peak,
        cv=std / mean if mean > 0 else None,
        peak_to_mean=peak / mean if mean > 0 else None,
    )


@dataclass(frozen=True, slots=True)
class Distribution:
    """Distribution of a per-request quantity (token length, wait, latency)."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float


def distribution(values: npt.NDArray[np.float64] | IntArray) -> Distribution | None:
    finite = values[~np.isnan(values)] if values.dtype.kind == "f" else values
    if finite.size == 0:
        return None
    p50, p90, p95, p99 = (float(q) for q in np.percentile(finite, [50, 90, 95, 99]))
    return Distribution(
        count=int(finite.size),
        mean=float(finite.mean()),
        p50=p50,
        p90=p90,
        p95=p95,
        p99=p99,
        max=float(finite.max()),
    )


@dataclass(frozen=True, slots=True)
class InterArrivalStats:
    """Gaps between consecutive arrivals, compared with a Poisson process.

    For Poisson arrivals the gaps are exponential: CV 1, P99 = mean * ln 100,
    and per-second counts have variance equal to their mean (dispersion 1).
    ``ks_distance`` is the Kolmogorov-Smirnov distance to the exponential with
    the same mean: 0 is a perfect fit; it is reported as an effect size, not a
    test, because with thousands of gaps any deviation is "significant".
    """

    count: int
    mean_s: float
    std_s: float
    p50_s: float
    p99_s: float
    max_s: float
    cv: float | None
    exponential_p99_s: float
    p99_vs_exponential: float | None
    ks_distance: float | None
    count_dispersion: float | None  # var/mean of the counts per bin


def interarrival_stats(
    sorted_ts_us: IntArray, counts_per_bin: FloatArray
) -> InterArrivalStats | None:
    if sorted_ts_us.size < 2:
        return None
    gaps = np.diff(sorted_ts_us).astype(np.float64) / US_PER_S
    mean = float(gaps.mean())
    std = float(gaps.std())
    p50, p99 = (float(q) for q in np.percentile(gaps, [50, 99]))
    exp_p99 = mean * LN_100
    count_mean = float(counts_per_bin.mean())
    return InterArrivalStats(
        count=int(gaps.size),
        mean_s=mean,
        std_s=std,
        p50_s=p50,
        p99_s=p99,
        max_s=float(gaps.max()),
        cv=std / mean if mean > 0 else None,
        exponential_p99_s=exp_p99,
        p99_vs_exponential=p99 / exp_p99 if exp_p99 > 0 else None,
        ks_distance=ks_distance_exponential(gaps),
        count_dispersion=(float(counts_per_bin.var()) / count_mean if count_mean > 0 else None),
    )


def ks_distance_exponential(gaps: FloatArray) -> float | None:
    """sup |F_empirical - F_exp| with the exponential fitted by its mean."""
    mean = float(gaps.mean()) if gaps.size else 0.0
    if mean <= 0:
        return None
    x = np.sort(gaps)
    n = x.size
    model = -np.expm1(-x / mean)  # 1 - exp(-x/mean), accurate for small x
    upper = np.arange(1, n + 1, dtype=np.float64) / n - model
    lower = model - np.arange(0, n, dtype=np.float64) / n
    return float(max(upper.max(), lower.max()))


@dataclass(frozen=True, slots=True)
class WindowStats:
    """One 10-minute window (the last one may be shorter)."""

    index: int
    start_us: int
    seconds: int
    requests: int
    requests_per_s: SeriesStats
    tokens_per_s: SeriesStats | None


def window_stats(
    timeline: Timeline,
    requests: FloatArray,
    tokens: FloatArray | None,
    window_seconds: int = WINDOW_SECONDS,
) -> list[WindowStats]:
    """Windows of ``window_seconds`` (rounded down to whole bins, at least one)."""
    width = timeline.bin_seconds
    step = max(1, window_seconds // width)
    out: list[WindowStats] = []
    for index, start in enumerate(range(0, requests.size, step)):
        stop = min(start + step, requests.size)
        req = series_stats(requests[start:stop], width)
        assert req is not None  # start < size, so the slice is non-empty
        out.append(
            WindowStats(
                index=index,
                start_us=timeline.bin_start_us(start),
                seconds=(stop - start) * width,
                requests=round(req.total),
                requests_per_s=req,
                tokens_per_s=None if tokens is None else series_stats(tokens[start:stop], width),
            )
        )
    return out


def rolling_mean(values: FloatArray, width: int) -> FloatArray:
    """Trailing mean over ``width`` bins (shorter at the start)."""
    csum = np.concatenate(([0.0], np.cumsum(values)))
    hi = np.arange(1, values.size + 1)
    lo = np.maximum(0, hi - width)
    return (csum[hi] - csum[lo]) / (hi - lo)
