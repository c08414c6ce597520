"""``analyze``: turn a RequestLog into overall, per-tenant and per-incident figures."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from controlplane.analysis.bursts import (
    Baseline,
    BurstRule,
    MergedBurst,
    compute_baseline,
    detect_bursts,
    merge_axes,
)
from controlplane.analysis.grid import Binning, choose_binning, timestamp_grid_us
from controlplane.analysis.prefix import PrefixAnalysis, PrefixParams, analyze_prefix
from controlplane.analysis.progress import StepCallback
from controlplane.analysis.reader import RequestLog
from controlplane.analysis.stats import (
    WINDOW_SECONDS,
    Distribution,
    FloatArray,
    IntArray,
    InterArrivalStats,
    SeriesStats,
    Timeline,
    WindowStats,
    distribution,
    interarrival_stats,
    make_timeline,
    rate,
    series_stats,
    window_stats,
)

# Tenants analysed one by one (largest first); the rest are counted. Each
# costs a pass over its rows and its own per-second series.
DEFAULT_MAX_TENANTS = 50
# Tenants named per incident: enough to see who drove it.
TOP_TENANTS_PER_INCIDENT = 5


@dataclass(frozen=True, slots=True)
class RateSeries:
    """Per-second series of one entity on the log's timeline."""

    requests: FloatArray
    prompt_tokens: FloatArray
    output_tokens: FloatArray

    @property
    def tokens(self) -> FloatArray:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class EntitySummary:
    """Figures for the whole log (tenant None) or one tenant."""

    tenant: str | None
    requests: int
    requests_per_s: SeriesStats | None
    prompt_tokens_per_s: SeriesStats | None
    output_tokens_per_s: SeriesStats | None
    tokens_per_s: SeriesStats | None
    interarrival: InterArrivalStats | None
    prompt_tokens: Distribution | None
    output_tokens: Distribution | None
    queue_wait_ms: Distribution | None
    latency_ms: Distribution | None
    decisions: dict[str, int]
    lanes: dict[str, int]
    windows: list[WindowStats]
    bursts: list[MergedBurst]


@dataclass(frozen=True, slots=True)
class TenantShare:
    tenant: str
    requests: int
    share: float  # of the incident's requests
    usual_share: float  # of the whole log's requests


@dataclass(frozen=True, slots=True)
class Incident:
    """One burst of the overall traffic: the post-incident record."""

    number: int
    start: int  # bin index, inclusive
    end: int  # bin index, exclusive
    detected_at: int
    axes: tuple[str, ...]
    requests: int
    prompt_tokens: int
    output_tokens: int
    peak_rps: float
    mean_rps: float
    baseline_rps: float
    peak_tokens_per_s: float
    mean_tokens_per_s: float
    baseline_tokens_per_s: float
    top_tenants: list[TenantShare]
    queue_wait_ms: Distribution | None
    latency_ms: Distribution | None
    decisions: dict[str, int]
    bin_seconds: int = 1  # the timeline's bins: start, end, detected_at count these

    @property
    def duration_s(self) -> int:
        return (self.end - self.start) * self.bin_seconds

    @property
    def excess_requests(self) -> float:
        """Requests above what the baseline rate would have brought."""
        return self.requests - self.baseline_rps * self.duration_s


@dataclass(frozen=True, slots=True)
class AnalysisParams:
    rule: BurstRule = field(default_factory=BurstRule)
    per_tenant: bool = True
    max_tenants: int = DEFAULT_MAX_TENANTS
    window_seconds: int = WINDOW_SECONDS
    bin_seconds: int = 1  # asked for; widened to whole steps of the timestamps' grid
    prefix: PrefixParams = field(default_factory=PrefixParams)  # logs with block ids


@dataclass(frozen=True, slots=True)
class Analysis:
    log: RequestLog
    params: AnalysisParams
    timeline: Timeline | None
    binning: Binning
    series: RateSeries | None
    request_baseline: Baseline | None
    token_baseline: Baseline | None
    overall: EntitySummary
    tenants: list[EntitySummary]
    tenants_not_shown: int
    incidents: list[Incident]
    out_of_order_rows: int
    prefix: PrefixAnalysis | None = None  # None: the log has no block ids (prefix.py)


def _label_counts(codes: npt.NDArray[np.int32], names: list[str]) -> dict[str, int]:
    counts = np.bincount(codes, minlength=len(names))
    return {names[i]: int(c) for i, c in enumerate(counts) if c > 0}


def _detect_both_axes(
    series: RateSeries,
    rule: BurstRule,
    tokens_per_request: float,
    with_tokens: bool,
    bin_seconds: int,
) -> list[MergedBurst]:
    by_axis = {"requests": detect_bursts(series.requests, rule, 1.0, bin_seconds)}
    if with_tokens and tokens_per_request > 0:
        by_axis["tokens"] = detect_bursts(series.tokens, rule, tokens_per_request, bin_seconds)
    return merge_axes(by_axis, gap=rule.in_bins(bin_seconds)[0])


def summarise_entity(
    log: RequestLog,
    rows: IntArray | slice,
    timeline: Timeline,
    params: AnalysisParams,
    tenant: str | None,
) -> tuple[EntitySummary, RateSeries]:
    """Figures for ``rows`` (indices into the log's columns, or a slice: a
    slice selects views, so the whole log is summarised without copies)."""
    ts = log.ts_us[rows]
    prompt = log.prompt_tokens[rows]
    output = log.output_tokens[rows]
    series = RateSeries(
        requests=rate(timeline, ts),
        prompt_tokens=rate(timeline, ts, prompt),
        output_tokens=rate(timeline, ts, output),
    )
    width = timeline.bin_seconds
    has_tokens = log.has_tokens
    count = int(ts.size)
    tokens_per_request = float((prompt + output).mean()) if count else 0.0
    summary = EntitySummary(
        tenant=tenant,
        requests=count,
        requests_per_s=series_stats(series.requests, width),
        prompt_tokens_per_s=series_stats(series.prompt_tokens, width) if has_tokens else None,
        output_tokens_per_s=series_stats(series.output_tokens, width) if has_tokens else None,
        tokens_per_s=series_stats(series.tokens, width) if has_tokens else None,
        interarrival=interarrival_stats(np.sort(ts), series.requests * width),
        prompt_tokens=distribution(prompt) if has_tokens else None,
        output_tokens=distribution(output) if has_tokens else None,
        queue_wait_ms=distribution(log.queue_wait_ms[rows]),
        latency_ms=distribution(log.latency_ms[rows]),
        decisions=_label_counts(log.decision_codes[rows], log.decision_names)
        if log.has_decisions
        else {},
        lanes=_label_counts(log.lane_codes[rows], log.lane_names) if log.has_lanes else {},
        windows=window_stats(
            timeline, series.requests, series.tokens if has_tokens else None, params.window_seconds
        ),
        bursts=_detect_both_axes(series, params.rule, tokens_per_request, has_tokens, width),
    )
    return summary, series


def _empty_summary() -> EntitySummary:
    return EntitySummary(
        tenant=None,
        requests=0,
        requests_per_s=None,
        prompt_tokens_per_s=None,
        output_tokens_per_s=None,
        tokens_per_s=None,
        interarrival=None,
        prompt_tokens=None,
        output_tokens=None,
        queue_wait_ms=None,
        latency_ms=None,
        decisions={},
        lanes={},
        windows=[],
        bursts=[],
    )


def _no_progress(_label: str, _done: int, _total: int) -> None:
    return None


def analyze(
    log: RequestLog,
    params: AnalysisParams | None = None,
    progress: StepCallback | None = None,
) -> Analysis:
    """``progress(label, done, total)`` is called as each entity is summarised."""
    params = params or AnalysisParams()
    step = progress or _no_progress
    binning = binning_of(log, params.bin_seconds)
    timeline = make_timeline(log.ts_us, binning.bin_us)
    if timeline is None:
        return Analysis(
            log=log,
            params=params,
            timeline=None,
            binning=binning,
            series=None,
            request_baseline=None,
            token_baseline=None,
            overall=_empty_summary(),
            tenants=[],
            tenants_not_shown=0,
            incidents=[],
            out_of_order_rows=0,
            prefix=analyze_prefix(log, params.prefix, binning.grid_us),
        )
    tenant_count = min(params.max_tenants, len(log.tenant_names)) if params.per_tenant else 0
    prefix_steps = 1 + len(set(params.prefix.cache_blocks)) if log.has_block_ids else 0
    total_steps = 2 + (tenant_count if log.has_tenants else 0) + prefix_steps
    step("overall", 0, total_steps)
    overall, series = summarise_entity(log, slice(None), timeline, params, None)
    width = timeline.bin_seconds
    tokens_per_request = float(series.tokens.sum()) * width / len(log)
    request_baseline = compute_baseline(series.requests, params.rule, 1.0, width)
    token_baseline = (
        compute_baseline(series.tokens, params.rule, tokens_per_request, width)
        if log.has_tokens and tokens_per_request > 0
        else None
    )
    tenants, not_shown = _tenant_summaries(log, timeline, params, step, total_steps)
    step("incidents", total_steps - prefix_steps - 1, total_steps)
    incidents = _incidents(log, timeline, series, overall.bursts, request_baseline, token_baseline)
    first = total_steps - prefix_steps

    def prefix_step(label: str, done: int, _total: int) -> None:
        step(label, first + done, total_steps)

    prefix = analyze_prefix(log, params.prefix, binning.grid_us, prefix_step)
    step("done", total_steps, total_steps)
    return Analysis(
        log=log,
        params=params,
        timeline=timeline,
        binning=binning,
        series=series,
        request_baseline=request_baseline,
        token_baseline=token_baseline,
        overall=overall,
        tenants=tenants,
        tenants_not_shown=not_shown,
        incidents=incidents,
        out_of_order_rows=int(np.count_nonzero(np.diff(log.ts_us) < 0)),
        prefix=prefix,
    )


def binning_of(log: RequestLog, requested_seconds: int = 1) -> Binning:
    """The bins for ``log``: ``requested_seconds`` widened to whole steps of
    its timestamps' grid (checks.py finds the grid; found here when unset)."""
    grid = log.grid_us
    if grid is None:
        ts = log.ts_us
        grid = timestamp_grid_us(ts if bool((np.diff(ts) >= 0).all()) else np.sort(ts))
    return choose_binning(grid, requested_seconds)


def tenant_rows(log: RequestLog) -> list[tuple[str, IntArray]]:
    """(tenant, row indices) for every tenant, most requests first."""
    order = np.argsort(log.tenant_codes, kind="stable").astype(np.int64)
    counts = np.bincount(log.tenant_codes, minlength=len(log.tenant_names))
    bounds = np.concatenate(([0], np.cumsum(counts)))
    ranked = sorted(range(len(counts)), key=lambda code: (-int(counts[code]), code))
    return [
        (log.tenant_names[code], order[bounds[code] : bounds[code + 1]])
        for code in ranked
        if counts[code] > 0
    ]


def _tenant_summaries(
    log: RequestLog,
    timeline: Timeline,
    params: AnalysisParams,
    step: StepCallback = _no_progress,
    total_steps: int = 0,
) -> tuple[list[EntitySummary], int]:
    if not (params.per_tenant and log.has_tenants):
        return [], 0
    groups = tenant_rows(log)
    shown = groups[: params.max_tenants]
    summaries = []
    for done, (name, rows) in enumerate(shown, start=1):
        step(f"tenant {name}", done, total_steps)
        summaries.append(summarise_entity(log, rows, timeline, params, name)[0])
    return summaries, len(groups) - len(shown)


def _incidents(
    log: RequestLog,
    timeline: Timeline,
    series: RateSeries,
    bursts: list[MergedBurst],
    req_base: Baseline,
    tok_base: Baseline | None,
) -> list[Incident]:
    if not bursts:
        return []
    order = np.argsort(log.ts_us, kind="stable")
    sorted_ts = log.ts_us[order]
    total_by_tenant = np.bincount(log.tenant_codes, minlength=len(log.tenant_names))
    out: list[Incident] = []
    for number, burst in enumerate(bursts, start=1):
        lo, hi = np.searchsorted(
            sorted_ts,
            [timeline.bin_start_us(burst.start), timeline.bin_start_us(burst.end)],
            side="left",
        )
        rows = order[lo:hi]
        req = series.requests[burst.start : burst.end]
        tok = series.tokens[burst.start : burst.end]
        width = timeline.bin_seconds
        out.append(
            Incident(
                number=number,
                start=burst.start,
                end=burst.end,
                detected_at=burst.detected_at,
                axes=burst.axes,
                requests=int(rows.size),
                prompt_tokens=int(log.prompt_tokens[rows].sum()),
                output_tokens=int(log.output_tokens[rows].sum()),
                peak_rps=float(req.max()),
                mean_rps=float(req.mean()),
                baseline_rps=_baseline_at(req_base, burst),
                peak_tokens_per_s=float(tok.max()),
                mean_tokens_per_s=float(tok.mean()),
                baseline_tokens_per_s=0.0 if tok_base is None else _baseline_at(tok_base, burst),
                top_tenants=_top_tenants(log, rows, total_by_tenant) if log.has_tenants else [],
                queue_wait_ms=distribution(log.queue_wait_ms[rows]),
                latency_ms=distribution(log.latency_ms[rows]),
                decisions=_label_counts(log.decision_codes[rows], log.decision_names)
                if log.has_decisions
                else {},
                bin_seconds=width,
            )
        )
    return out


def _baseline_at(baseline: Baseline, burst: MergedBurst) -> float:
    """Baseline mean just before the burst: its windows end before ``start``.

    Falls back to the detection second when the burst starts inside the
    warm-up (possible on the other axis of a merged burst)."""
    for index in (burst.start, burst.detected_at):
        value = baseline.mean[index]
        if not np.isnan(value):
            return float(value)
    return 0.0


def _top_tenants(
    log: RequestLog, rows: IntArray, total_by_tenant: npt.NDArray[np.int64]
) -> list[TenantShare]:
    counts = np.bincount(log.tenant_codes[rows], minlength=len(log.tenant_names))
    total = max(int(counts.sum()), 1)
    grand_total = max(int(total_by_tenant.sum()), 1)
    ranked = sorted(np.flatnonzero(counts), key=lambda code: (-int(counts[code]), int(code)))
    return [
        TenantShare(
            tenant=log.tenant_names[code],
            requests=int(counts[code]),
            share=int(counts[code]) / total,
            usual_share=int(total_by_tenant[code]) / grand_total,
        )
        for code in ranked[:TOP_TENANTS_PER_INCIDENT]
    ]
