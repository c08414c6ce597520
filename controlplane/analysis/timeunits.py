"""What a log's timestamps mean: dates, epoch numbers in some unit, or
offsets from the start of the trace in some unit.

The decision is taken once, on the first ``SAMPLE_ROWS`` timestamps (the
reader's first chunk, so it works on a pipe), and printed with how it was
reached: numbers whose median is a date between 2000 and 2100 in exactly one
unit are epoch times in that unit (the four ranges do not overlap); other
numbers are offsets from the start, in the unit the preset declares, the
unit ``--time-unit`` states, or else the coarsest unit that gives at least
``MIN_INFERRED_RATE`` requests per second. The whole-log plausibility checks
(checks.py) catch a wrong decision afterwards. See docs/analysis.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Literal

SAMPLE_ROWS = 10_000
# The coarsest unit whose rate reaches this is chosen for offsets. Seconds
# fit logs of 0.1 req/s and faster (BurstGPT: ~0.3/s); milliseconds fit
# 0.1-100 req/s (Mooncake: ~6/s, which read as seconds would be 0.006/s).
MIN_INFERRED_RATE = 0.1
# Epoch numbers are recognised between these instants (seconds).
EPOCH_MIN_S = datetime(2000, 1, 1, tzinfo=UTC).timestamp()
EPOCH_MAX_S = datetime(2100, 1, 1, tzinfo=UTC).timestamp()


class TimeUnit(StrEnum):
    s = "s"
    ms = "ms"
    us = "us"
    ns = "ns"


# Unit -> (numerator, denominator) of the exact conversion to microseconds.
_TO_US: dict[TimeUnit, tuple[int, int]] = {
    TimeUnit.s: (1_000_000, 1),
    TimeUnit.ms: (1_000, 1),
    TimeUnit.us: (1, 1),
    TimeUnit.ns: (1, 1_000),
}
UNIT_WORDS = {
    TimeUnit.s: "seconds",
    TimeUnit.ms: "milliseconds",
    TimeUnit.us: "microseconds",
    TimeUnit.ns: "nanoseconds",
}
UNITS_PER_S = {unit: 1_000_000 * den / num for unit, (num, den) in _TO_US.items()}

TimeKind = Literal["dates", "epoch", "relative", "empty"]
TimeSource = Literal["option", "preset", "magnitude", "inferred", "default", "data"]


def to_us_factor(unit: TimeUnit) -> tuple[int, int]:
    return _TO_US[unit]


@dataclass(frozen=True, slots=True)
class TimeDecision:
    """How numeric timestamps are turned into microseconds, and why."""

    kind: TimeKind
    unit: TimeUnit  # numbers are read in this unit (dates: stray numbers are epoch s)
    source: TimeSource
    reason: str  # the evidence, for the printed line
    notes: tuple[str, ...] = field(default=())  # warnings about the decision itself
    explicit_unit: bool = False  # --time-unit was given
    conflict: str = ""  # the stated unit contradicts the data (checks.py refuses)

    def describe(self) -> str:
        """One line for stderr, e.g. ``milliseconds since start (Mooncake preset; ...)``."""
        if self.kind == "dates":
            what = "dates"
        elif self.kind == "empty":
            what = "none (no rows)"
        elif self.kind == "epoch":
            what = f"epoch {UNIT_WORDS[self.unit]}"
        else:
            what = f"{UNIT_WORDS[self.unit]} since start"
        fixed = self.kind in ("dates", "empty") or self.source == "option"
        hint = "" if fixed else "; override with --time-unit"
        return f"{what} ({self.reason}{hint})"

    def as_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "unit": None if self.kind in ("dates", "empty") else self.unit.value,
            "source": self.source,
            "description": self.describe(),
            "notes": list(self.notes),
        }


def _number(value: object) -> float | None:
    """A timestamp sample value as a number, or None if it is a date/garbage."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value) if math.isfinite(value) and value >= 0 else None
    if isinstance(value, str):
        text = value.strip()
        if len(text) > 4 and text[4] == "-":  # YYYY-...: a date
            return None
        try:
            number = float(text)
        except ValueError:
            return None
        return number if math.isfinite(number) and number >= 0 else None
    return None


def epoch_unit(value: float) -> TimeUnit | None:
    """The unit in which ``value`` is a date in [2000, 2100), if any (at most one)."""
    for unit in TimeUnit:
        seconds = value / UNITS_PER_S[unit]
        if EPOCH_MIN_S <= seconds < EPOCH_MAX_S:
            return unit
    return None


def rate_in(unit: TimeUnit, rows: int, span: float) -> float:
    """Mean requests/s if ``span`` raw units are read in ``unit``."""
    return (rows - 1) / (span / UNITS_PER_S[unit])


def _infer_relative_unit(values: Sequence[float]) -> tuple[TimeUnit, str] | None:
    span = max(values) - min(values)
    if len(values) < 2 or span <= 0:
        return None
    for unit in TimeUnit:  # coarsest first
        rate = rate_in(unit, len(values), span)
        if rate >= MIN_INFERRED_RATE:
            return unit, (
                f"inferred from span/row count: {len(values):,} rows over {span:,.6g} units "
                f"= {rate:,.3g} req/s in {unit.value}"
            )
    return None


def decide(
    sample: Sequence[object],
    *,
    unit: TimeUnit | None,
    preset_unit: TimeUnit | None,
    preset_name: str | None,
) -> TimeDecision:
    """Decide from the first timestamps of the log (see the module docstring)."""
    numbers = [n for n in map(_number, sample) if n is not None]
    explicit = unit is not None
    if not sample:
        return TimeDecision("empty", unit or TimeUnit.s, "default", "no rows", (), explicit)
    if len(numbers) * 2 < len(sample):  # mostly ISO dates
        notes = (f"--time-unit {unit.value} ignored: the timestamps are dates",) if unit else ()
        return TimeDecision("dates", unit or TimeUnit.s, "data", "ISO 8601", notes, explicit)
    median = sorted(numbers)[len(numbers) // 2]
    looks_epoch = epoch_unit(median)
    if unit is not None:
        if looks_epoch == unit:
            when = datetime.fromtimestamp(median / UNITS_PER_S[unit], UTC)
            return TimeDecision("epoch", unit, "option", f"--time-unit; {when:%Y-%m-%d}", (), True)
        conflict = ""
        if looks_epoch is not None:
            when = datetime.fromtimestamp(median / UNITS_PER_S[looks_epoch], UTC)
            conflict = (
                f"--time-unit {unit.value} reads timestamps near {median:.4g} as "
                f"{UNIT_WORDS[unit]} since start, but they are {when:%Y-%m-%d} in epoch "
                f"{UNIT_WORDS[looks_epoch]}: use --time-unit {looks_epoch.value} or leave it out"
            )
        return TimeDecision("relative", unit, "option", "--time-unit", (), True, conflict)
    if looks_epoch is not None:
        when = datetime.fromtimestamp(median / UNITS_PER_S[looks_epoch], UTC)
        return TimeDecision(
            "epoch",
            looks_epoch,
            "magnitude",
            f"values near {median:.3g} are {when:%Y-%m-%d} in {looks_epoch.value}",
        )
    inferred = _infer_relative_unit(numbers)
    if preset_unit is not None:
        disagree: tuple[str, ...] = ()
        if inferred is not None and inferred[0] != preset_unit:
            disagree = (
                f"the {preset_name} preset says {UNIT_WORDS[preset_unit]}, but the span/row "
                f"count suggests {UNIT_WORDS[inferred[0]]} ({inferred[1]}); "
                "check the figures or set --time-unit",
            )
        return TimeDecision("relative", preset_unit, "preset", f"{preset_name} preset", disagree)
    if inferred is None:
        return TimeDecision(
            "relative", TimeUnit.s, "default", "too few distinct times to infer a unit"
        )
    return TimeDecision("relative", inferred[0], "inferred", inferred[1])
