"""The timestamps' grid, and the bin width the rates are counted in.

Some public traces round every arrival to a coarse step: a conversation trace
whose timestamps sit on a 3-second grid holds, at 1-second bins, all of each
3 seconds' requests in one bin and none in the next two. Its per-second CV is
then the grid's, not the traffic's (measured on such a trace: 1.52 at 1 s
against 0.75 at its real resolution). So the grid is detected and rates are
binned at a whole multiple of it (docs/analysis.md, "Bins and the
timestamps' grid").

**Grid.** The largest step ``g`` (in µs) such that at least ``GRID_SHARE``
(99%) of the arrivals sit on one grid of step ``g`` (the same residue
modulo ``g``): a few off-grid rows (a retry logged to the millisecond) do
not hide the grid. Counted over arrivals, not gaps: on a dense log most gaps
are zero, which any step divides, and one off-grid row makes two off-grid
gaps among the few non-zero ones. The candidates are the most frequent
non-zero gaps and their pairwise greatest common divisors: the true grid's
gaps are ``g``, ``2g``, ``3g``, ... and any two of them share ``g``. Needs
``MIN_GAPS`` non-zero gaps; fewer say nothing (grid 1 µs, the timestamps'
own unit).

**Bins.** A whole number of seconds (every figure and the burst rule count
in seconds), at least the requested width (1 s by default), and a whole
multiple of the grid: a 4-s bin over a 3-s grid would hold one grid point,
then two, and alternate. Hence the smallest such width: a 3-s grid and the
default give 3-s bins; a 1-ms grid gives 1-s bins, as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from controlplane.analysis.parsing import US_PER_S

GRID_SHARE = 0.99  # of the arrivals that must sit on the grid
MIN_GAPS = 50  # non-zero gaps needed to call anything a grid
CANDIDATES = 24  # most frequent gaps tried (and their pairwise GCDs)
SAMPLE = 200_000  # arrivals (and gaps) examined at most, evenly spaced through the log
PREFILTER, PREFILTER_SHARE = 2_000, 0.9  # a candidate must pass on the first arrivals first
MAX_BIN_SECONDS = 3_600  # a grid whose whole-second multiple is longer is not honoured


def _on_grid_share(ts: npt.NDArray[np.int64], step: int) -> float:
    """Share of ``ts`` in the most common residue class modulo ``step``."""
    _, counts = np.unique(ts % step, return_counts=True)
    return float(counts.max()) / ts.size


def timestamp_grid_us(sorted_ts_us: npt.NDArray[np.int64]) -> int:
    """The step the sorted arrival times sit on, in µs (1: no coarser grid)."""
    gaps = np.diff(sorted_ts_us)
    gaps = gaps[gaps > 0]
    if gaps.size < MIN_GAPS:
        return 1
    values, counts = np.unique(gaps[:: max(1, gaps.size // SAMPLE)], return_counts=True)
    # The most frequent gaps, smallest first among equals: on a grid these are
    # its first few multiples.
    order = np.lexsort((values, -counts))[:CANDIDATES]
    common = [int(v) for v in values[order]]
    candidates = set(common)
    for i, a in enumerate(common):
        for b in common[i + 1 :]:
            candidates.add(math.gcd(a, b))
    ts = sorted_ts_us[:: max(1, sorted_ts_us.size // SAMPLE)]
    head = ts[:PREFILTER]
    for step in sorted(candidates, reverse=True):
        if step <= 1 or _on_grid_share(head, step) < PREFILTER_SHARE:
            continue  # a quick no on a few rows spares a pass over all of them
        if _on_grid_share(ts, step) >= GRID_SHARE:
            return step
    return 1


def describe_step(us: int) -> str:
    """``3 s``, ``250 ms``, ``1 µs``: a step in the coarsest exact unit."""
    for size, unit in ((US_PER_S, "s"), (1_000, "ms")):
        if us % size == 0:
            return f"{us // size:,} {unit}"
    if us >= 1_000:
        return f"{us / 1_000:g} ms"
    return f"{us} µs"


@dataclass(frozen=True, slots=True)
class Binning:
    """How arrivals are counted: bins of ``bin_seconds``, on a grid of ``grid_us``."""

    grid_us: int  # the timestamps' step (1: none coarser than a microsecond)
    requested_seconds: int  # --bin-seconds (default 1)
    bin_seconds: int  # what is used

    @property
    def bin_us(self) -> int:
        return self.bin_seconds * US_PER_S

    @property
    def widened(self) -> bool:
        return self.bin_seconds != self.requested_seconds

    def note(self) -> str:
        """One sentence for the terminal, JSON and report ("" when nothing to say)."""
        if not self.widened:
            return ""
        asked = f"{self.requested_seconds:,}-s bins"
        return (
            f"the timestamps sit on a {describe_step(self.grid_us)} grid: rates are counted in "
            f"{self.bin_seconds:,}-s bins, not {asked} (a bin must hold whole grid steps, "
            "or it measures the grid), so CV, percentiles and peaks are per "
            f"{self.bin_seconds:,}-s bin, as rates per second; bursts shorter than a bin "
            "cannot be seen"
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "grid_s": self.grid_us / US_PER_S,
            "requested_bin_seconds": self.requested_seconds,
            "bin_seconds": self.bin_seconds,
            "note": self.note() or None,
        }


def choose_binning(grid_us: int, requested_seconds: int = 1) -> Binning:
    """The smallest whole-second multiple of the grid at least as wide as asked."""
    if requested_seconds < 1:
        raise ValueError("bin seconds must be at least 1")
    if grid_us <= 1 or US_PER_S * requested_seconds % grid_us == 0:
        return Binning(grid_us, requested_seconds, requested_seconds)
    unit = math.lcm(grid_us, US_PER_S) // US_PER_S  # whole seconds of whole grid steps
    if unit > MAX_BIN_SECONDS:  # an odd grid (1.0001 s): the nearest whole second above it
        seconds = max(requested_seconds, math.ceil(grid_us / US_PER_S))
    else:
        seconds = unit * math.ceil(requested_seconds / unit)
    return Binning(grid_us, requested_seconds, seconds)
