"""Whole-log plausibility checks, run after reading and before analysing.

Each problem is a ``Finding``: fatal ones make the CLI refuse with exit
code 2 unless ``--force``; the rest are warnings. All of them go to stderr
and into the JSON ``input.findings``. Thresholds (docs/analysis.md):

* **missing_tokens** (fatal): neither a prompt nor an output token column.
  One of the two missing is a warning.
* **implausible_span** (fatal): at least ``MIN_ROWS_TO_JUDGE`` rows and a
  mean rate below ``MIN_RATE`` (one request per 100 s: a 1-hour trace read
  in seconds instead of milliseconds is 0.007/s) or above ``MAX_RATE``.
* **time_unit_conflict** (fatal): ``--time-unit`` reads epoch-looking
  numbers as offsets.
* **span_too_long** (refused even with ``--force``): more than
  ``MAX_SPAN_DAYS`` of one-second bins.
* **zero_gaps** (warning): at least ``MIN_GAPS`` gaps and more than
  ``MAX_ZERO_GAP_SHARE`` of them exactly zero: the timestamps are too coarse
  for the traffic, so inter-arrival figures describe the rounding. Rates are
  still right: ``analyze`` counts them in bins of whole grid steps (grid.py).
  Not fatal: a log in a recognised shape is analysed, its flaws reported.
* **timestamp_grid** (warning): the timestamps sit on a grid that one-second
  bins would cut unevenly (3 s, 1.5 s, 0.3 s): ``analyze`` bins at whole
  steps of it.
* **early_dates** (warning): dates before 2000, e.g. offsets exported as dates.

A recognised preset (``--format`` or auto) whose time unit did not come from
``--time-unit`` is never refused for its data: ``implausible_span`` is then
a warning too (the preset says what the numbers are).
"""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np

from controlplane.analysis.grid import describe_step, timestamp_grid_us
from controlplane.analysis.logdata import Finding, RequestLog
from controlplane.analysis.presets import COLUMN_ALIASES
from controlplane.analysis.timeunits import (
    MIN_INFERRED_RATE,
    UNIT_WORDS,
    UNITS_PER_S,
    TimeUnit,
)

MIN_ROWS_TO_JUDGE = 1_000
MIN_RATE = 0.01  # requests/s
MAX_RATE = 100_000.0  # requests/s
MAX_SPAN_DAYS = 366
MIN_GAPS = 100
MAX_ZERO_GAP_SHARE = 0.5
EARLY_US = int(datetime(2000, 1, 1, tzinfo=UTC).timestamp()) * 1_000_000
_US = 1_000_000


def _duration(seconds: float) -> str:
    if seconds >= 2 * 86_400:
        return f"{seconds / 86_400:,.1f} days"
    if seconds >= 2 * 3_600:
        return f"{seconds / 3_600:,.1f} hours"
    if seconds >= 120:
        return f"{seconds / 60:,.1f} minutes"
    return f"{seconds:,.3g} s"


def _other_unit(log: RequestLog, rate: float) -> TimeUnit | None:
    """The coarsest other unit that would make the mean rate plausible."""
    if log.time is None or log.time.kind not in ("relative", "epoch"):
        return None
    current = log.time.unit
    for unit in TimeUnit:
        scaled = rate * UNITS_PER_S[unit] / UNITS_PER_S[current]
        if unit != current and MIN_INFERRED_RATE <= scaled <= MAX_RATE:
            return unit
    return None


def _span_findings(log: RequestLog, sorted_ts: np.ndarray) -> list[Finding]:
    rows = int(sorted_ts.size)
    span_s = float(sorted_ts[-1] - sorted_ts[0]) / _US
    findings: list[Finding] = []
    read_as = "dates" if log.time is None else log.time.describe().split(" (")[0]
    if span_s > MAX_SPAN_DAYS * 86_400:
        findings.append(
            Finding(
                "span_too_long",
                f"the timestamps ({read_as}) span {_duration(span_s)}, more than the "
                f"{MAX_SPAN_DAYS} days of one-second bins analyze handles; check --time-unit "
                "or split the log",
                fatal=True,
                overridable=False,
            )
        )
    if rows < MIN_ROWS_TO_JUDGE or span_s <= 0:
        return findings
    rate = (rows - 1) / span_s
    if MIN_RATE <= rate <= MAX_RATE:
        return findings
    what = f"{rows:,} requests over {_duration(span_s)} ({read_as}) is {rate:,.3g} req/s"
    better = _other_unit(log, rate)
    if better is not None and log.time is not None and log.time.kind == "relative":
        fix = f"if the numbers are {UNIT_WORDS[better]}, say --time-unit {better.value}"
    elif rate < MIN_RATE:
        fix = "per-second burst figures of traffic this sparse would measure noise"
    else:
        fix = "check the timestamps"
    findings.append(
        Finding("implausible_span", f"{what}, implausible; {fix}", fatal=not _recognised(log))
    )
    return findings


def _recognised(log: RequestLog) -> bool:
    """A preset recognised the shape, and the time unit is not the user's
    (a --time-unit that makes the span implausible is a mistake to stop)."""
    recognised = log.resolution is not None and log.resolution.preset is not None
    return recognised and not (log.time is not None and log.time.explicit_unit)


def _gap_findings(sorted_ts: np.ndarray, grid_us: int) -> list[Finding]:
    if sorted_ts.size <= MIN_GAPS:
        return []
    share = float(np.count_nonzero(np.diff(sorted_ts) == 0)) / (sorted_ts.size - 1)
    if share <= MAX_ZERO_GAP_SHARE:
        return []
    return [
        Finding(
            "zero_gaps",
            f"{share:.0%} of inter-arrival gaps are zero: the timestamps ({describe_step(grid_us)} "
            "steps) are too coarse for this traffic, so the inter-arrival figures (gap "
            "percentiles, CV, KS distance) describe the rounding, not the traffic; rates are "
            "counted in bins of whole steps and stay right",
            fatal=False,
        )
    ]


def _grid_findings(grid_us: int) -> list[Finding]:
    if _US % grid_us == 0:  # one-second bins hold whole steps
        return []
    return [
        Finding(
            "timestamp_grid",
            f"the timestamps sit on a {describe_step(grid_us)} grid, which one-second bins "
            "would cut unevenly: analyze counts rates in bins of whole grid steps "
            "(see --bin-seconds); plan and forecast count per second",
            fatal=False,
        )
    ]


def _token_findings(log: RequestLog, needs_tokens: bool) -> list[Finding]:
    has_prompt = "prompt_tokens" in log.columns
    has_output = "output_tokens" in log.columns
    if has_prompt and has_output:
        return []
    if has_prompt or has_output:
        missing = "output" if has_prompt else "prompt"
        option = "--output-col" if has_prompt else "--prompt-col"
        return [
            Finding(
                "missing_tokens",
                f"no {missing} token column: {missing} tokens count as 0 (name it with {option})",
                fatal=False,
            )
        ]
    looked = ", ".join(COLUMN_ALIASES["prompt_tokens"][:3] + COLUMN_ALIASES["output_tokens"][:3])
    found = ", ".join(log.column_names[:12]) or "(none)"
    return [
        Finding(
            "missing_tokens",
            f"no token columns (looked for {looked}, ...; found {found}): token rates and "
            "token bursts cannot be computed; name them with --prompt-col/--output-col",
            fatal=needs_tokens,
        )
    ]


def check_log(log: RequestLog, *, needs_tokens: bool = True) -> list[Finding]:
    """Findings about ``log`` as a whole (also stored in ``log.findings``)."""
    findings: list[Finding] = []
    if log.time is not None:
        findings.extend(Finding("time_unit", note, fatal=False) for note in log.time.notes)
        if log.time.conflict:
            findings.append(Finding("time_unit_conflict", log.time.conflict, fatal=True))
    if log.rows_read or len(log):
        findings.extend(_token_findings(log, needs_tokens))
    if len(log) >= 2:
        ts = log.ts_us
        sorted_ts = ts if bool((np.diff(ts) >= 0).all()) else np.sort(ts)
        log.grid_us = timestamp_grid_us(sorted_ts)
        findings.extend(_span_findings(log, sorted_ts))
        findings.extend(_gap_findings(sorted_ts, log.grid_us))
        findings.extend(_grid_findings(log.grid_us))
        if sorted_ts[0] < EARLY_US and log.time is not None and log.time.kind == "dates":
            findings.append(
                Finding(
                    "early_dates",
                    "the dates start before 2000 (offsets exported as dates?); "
                    "the figures are computed as the dates say",
                    fatal=False,
                )
            )
    log.findings = findings
    return findings
