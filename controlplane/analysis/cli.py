"""``burstgate analyze | plan | forecast``: registered on the main Typer app.

Exit codes: 0 on success, 2 for bad input (missing file, no timestamp
column, a bad row under ``--on-bad-row fail``, inconsistent options, or an
input the checks refuse without ``--force``: checks.py).
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import numpy as np
import typer

from controlplane.analysis.bursts import (
    DEFAULT_BASELINE_SECONDS,
    DEFAULT_K,
    DEFAULT_MIN_SECONDS,
    BurstRule,
)
from controlplane.analysis.checks import check_log
from controlplane.analysis.extras import plotting_missing
from controlplane.analysis.forecast import (
    DEFAULT_HORIZON_S,
    DEFAULT_TRAIN_FRACTION,
    AxisForecast,
    forecast_axis,
)
from controlplane.analysis.jsonout import analysis_to_dict, forecast_to_dict, plan_to_dict
from controlplane.analysis.plan import DEFAULT_LEAD_TIME_S, EngineCapacity, plan_capacity
from controlplane.analysis.prefix import DEFAULT_WINDOW_S, PrefixParams
from controlplane.analysis.prefix_cli import (
    BlockIdsColOpt,
    BlockSizeOpt,
    CacheBlocksOpt,
    KvCapacityOpt,
    KvWindowOpt,
    PrefixOptionError,
    check_options,
    prefix_params,
)
from controlplane.analysis.presets import OPTION_FOR_FIELD, ColumnOptions, LogFormat
from controlplane.analysis.progress import Phases
from controlplane.analysis.reader import LogReadError, RequestLog, read_log
from controlplane.analysis.reportpath import ReportPathError, report_path
from controlplane.analysis.stats import make_timeline, per_second
from controlplane.analysis.summary import (
    DEFAULT_MAX_TENANTS,
    AnalysisParams,
    RateSeries,
    analyze,
    tenant_rows,
)
from controlplane.analysis.terminal import analysis_text, forecast_text, plan_text
from controlplane.analysis.timeunits import TimeUnit

BAD_INPUT_EXIT = 2
# Smaller files read in well under a second: a bar would only flicker.
PROGRESS_MIN_BYTES = 8 * 1024 * 1024


class OnBadRow(StrEnum):
    skip = "skip"
    fail = "fail"


LogArg = Annotated[
    Path,
    typer.Argument(
        help="Request log: CSV, JSON Lines (optionally .gz) or Parquet; - reads stdin.",
        allow_dash=True,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]
BadRowOpt = Annotated[
    OnBadRow, typer.Option("--on-bad-row", help="Skip bad rows (reported) or fail on the first.")
]
NoProgressOpt = Annotated[
    bool, typer.Option("--no-progress", help="No progress bar (it is off anyway when not a TTY).")
]
KOpt = Annotated[
    float, typer.Option("--burst-k", help="Sigmas above the baseline that make a second hot.")
]
MinSecondsOpt = Annotated[
    int,
    typer.Option(
        "--burst-min-seconds",
        help="Seconds the rate is averaged over, and must stay high, to count as a burst.",
    ),
]
BaselineOpt = Annotated[
    int, typer.Option("--baseline-seconds", help="Trailing baseline window in seconds.")
]
_INPUT = "Input"  # help panel for the options every command shares
FormatOpt = Annotated[
    LogFormat,
    typer.Option(
        "--format",
        help="Log format preset; auto recognises each by its columns.",
        rich_help_panel=_INPUT,
    ),
]
TimeUnitOpt = Annotated[
    TimeUnit | None,
    typer.Option(
        "--time-unit",
        help="Unit of numeric timestamps (default: inferred, and printed).",
        rich_help_panel=_INPUT,
    ),
]


def _col_opt(flag: str, what: str) -> Any:
    return typer.Option(
        flag, help=f"Column holding {what} (JSON: a.b for nested).", rich_help_panel=_INPUT
    )


TimeColOpt = Annotated[str | None, _col_opt("--time-col", "the arrival time")]
PromptColOpt = Annotated[str | None, _col_opt("--prompt-col", "prompt tokens")]
OutputColOpt = Annotated[str | None, _col_opt("--output-col", "output tokens")]
TenantColOpt = Annotated[str | None, _col_opt("--tenant-col", "the tenant")]
LaneColOpt = Annotated[str | None, _col_opt("--lane-col", "the lane")]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Analyse even when the input checks fail (missing tokens, implausible span); "
        "they are still reported.",
        rich_help_panel=_INPUT,
    ),
]


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(BAD_INPUT_EXIT)


def input_options(
    log_format: LogFormat,
    time_unit: TimeUnit | None,
    columns: tuple[str | None, str | None, str | None, str | None, str | None],
    block_ids_col: str | None = None,
    block_ids: bool = False,
) -> ColumnOptions:
    """``block_ids``: read the block-id column (only ``analyze`` uses it)."""
    fields = ("timestamp", "prompt_tokens", "output_tokens", "tenant", "lane", "block_ids")
    named = (*columns, block_ids_col)
    mapping = {f: c for f, c in zip(fields, named, strict=True) if c is not None}
    for canonical, column in mapping.items():
        if not column.strip():
            _fail(f"{OPTION_FOR_FIELD[canonical]} must name a column")
    return ColumnOptions(
        log_format=log_format, mapping=mapping, time_unit=time_unit, block_ids=block_ids
    )


def _show_progress(path: Path, no_progress: bool) -> bool:
    if no_progress or not sys.stderr.isatty():
        return False
    # Small files read in well under a second: a bar would only flicker.
    return not path.is_file() or path.stat().st_size >= PROGRESS_MIN_BYTES


def load_log(
    path: Path,
    on_bad_row: OnBadRow,
    options: ColumnOptions,
    force: bool,
    phases: Phases,
    needs_tokens: bool = True,
) -> RequestLog:
    """Read, say how the input was understood, and refuse what the checks refuse."""
    try:
        log = read_log(path, on_bad_row=on_bad_row.value, progress=phases, options=options)
    except LogReadError as exc:
        _fail(str(exc))
    if log.resolution is not None:
        typer.echo(f"input: {log.resolution.describe()}", err=True)
    if log.time is not None and log.time.kind != "empty":
        typer.echo(f"timestamps: {log.time.describe()}", err=True)
    findings = check_log(log, needs_tokens=needs_tokens)
    hard = [f for f in findings if f.fatal and not f.overridable]
    fatal = [f for f in findings if f.fatal and f.overridable]
    for finding in findings:
        if not finding.fatal or (force and finding.overridable):
            label = "warning (--force)" if finding.fatal else "warning"
            typer.echo(f"{label}: {finding.message}", err=True)
    if hard:
        _fail(hard[0].message)
    if fatal and not force:
        for finding in fatal:
            typer.echo(f"error: {finding.message}; --force analyses anyway", err=True)
        raise typer.Exit(BAD_INPUT_EXIT)
    log.forced = bool(fatal)
    return log


def _rule(k: float, min_seconds: int, baseline_seconds: int) -> BurstRule:
    try:
        return BurstRule(k=k, min_seconds=min_seconds, baseline_seconds=baseline_seconds)
    except ValueError as exc:
        _fail(str(exc))


def _emit_json(document: dict[str, Any]) -> None:
    typer.echo(json.dumps(document, indent=2, allow_nan=False))


def analyze_command(
    log: LogArg,
    json_out: JsonOpt = False,
    html: Annotated[
        str | None,
        typer.Option(
            "--html",
            metavar="FILE|DIR/",
            help="Write the HTML report to FILE, or to DIR/index.html when DIR is a directory.",
        ),
    ] = None,
    per_tenant: Annotated[
        bool, typer.Option("--per-tenant/--no-per-tenant", help="Break figures down by tenant.")
    ] = True,
    burst_k: KOpt = DEFAULT_K,
    burst_min_seconds: MinSecondsOpt = DEFAULT_MIN_SECONDS,
    baseline_seconds: BaselineOpt = DEFAULT_BASELINE_SECONDS,
    bin_seconds: Annotated[
        int,
        typer.Option(
            "--bin-seconds",
            metavar="N",
            help="Count rates in N-second bins (widened to whole steps of the timestamps' "
            "grid when they sit on a coarser one, e.g. 3 s).",
        ),
    ] = 1,
    max_tenants: Annotated[
        int, typer.Option("--max-tenants", help="Tenants analysed one by one, largest first.")
    ] = DEFAULT_MAX_TENANTS,
    on_bad_row: BadRowOpt = OnBadRow.skip,
    no_progress: NoProgressOpt = False,
    log_format: FormatOpt = LogFormat.auto,
    time_unit: TimeUnitOpt = None,
    time_col: TimeColOpt = None,
    prompt_col: PromptColOpt = None,
    output_col: OutputColOpt = None,
    tenant_col: TenantColOpt = None,
    lane_col: LaneColOpt = None,
    force: ForceOpt = False,
    block_ids_col: BlockIdsColOpt = None,
    block_size: BlockSizeOpt = None,
    cache_blocks: CacheBlocksOpt = None,
    kv_capacity_tokens: KvCapacityOpt = None,
    kv_window_seconds: KvWindowOpt = DEFAULT_WINDOW_S,
) -> None:
    """Burst statistics of a request log: rates, inter-arrivals, lengths, incidents;
    prefix-cache hit rates when it has block ids."""
    rule = _rule(burst_k, burst_min_seconds, baseline_seconds)
    try:
        check_options(block_size, cache_blocks, kv_capacity_tokens, kv_window_seconds)
    except PrefixOptionError as exc:
        _fail(str(exc))
    if bin_seconds < 1:
        _fail(f"--bin-seconds must be a whole number of seconds, at least 1 (got {bin_seconds})")
    if max_tenants < 1:
        _fail("--max-tenants must be at least 1")
    if html is not None and (why := plotting_missing("--html")):
        _fail(why)
    try:  # before reading: a bad path should not cost the whole analysis
        html_path = None if html is None else report_path(html)
    except ReportPathError as exc:
        _fail(str(exc))
    options = input_options(
        log_format,
        time_unit,
        (time_col, prompt_col, output_col, tenant_col, lane_col),
        block_ids_col,
        block_ids=True,
    )
    with Phases(_show_progress(log, no_progress)) as phases:
        request_log = load_log(log, on_bad_row, options, force, phases)
        params = AnalysisParams(
            rule=rule,
            per_tenant=per_tenant,
            max_tenants=max_tenants,
            bin_seconds=bin_seconds,
            prefix=_prefix_params(
                request_log, block_size, cache_blocks, kv_capacity_tokens, kv_window_seconds
            ),
        )
        with phases.steps("analysing") as step:
            analysis = analyze(request_log, params, progress=step)
    if json_out and analysis.binning.widened:  # the text report says it on stdout
        typer.echo(f"bins: {analysis.binning.note()}", err=True)
    if json_out:
        _emit_json(analysis_to_dict(analysis))
    else:
        typer.echo(analysis_text(analysis), nl=False)
    if html_path is not None:
        # Imported here: matplotlib costs ~0.5 s and ~25 MB that a text run does not need.
        from controlplane.analysis.report import write_report

        show = not no_progress and sys.stderr.isatty()
        try:
            with Phases(show) as phases, phases.spinner("rendering HTML report"):
                path = write_report(analysis, html_path)
        except OSError as exc:
            _fail(f"--html: cannot write {html_path}: {exc.strerror or exc}")
        typer.echo(f"HTML report: {path}", err=json_out)


def _prefix_params(
    log: RequestLog,
    block_size: int | None,
    cache_blocks: list[int] | None,
    kv_capacity_tokens: list[int] | None,
    kv_window_seconds: int,
) -> PrefixParams:
    if not log.has_block_ids and (cache_blocks or kv_capacity_tokens or block_size):
        typer.echo(
            "warning: --cache-blocks, --kv-capacity-tokens and --block-size are ignored: "
            "the log has no block ids",
            err=True,
        )
    preset = None if log.resolution is None else log.resolution.preset
    try:
        return prefix_params(
            block_size,
            None if preset is None else preset.block_size,
            cache_blocks,
            kv_capacity_tokens,
            kv_window_seconds,
        )
    except PrefixOptionError as exc:
        _fail(str(exc))


def plan_command(
    log: LogArg,
    prefill_tps: Annotated[
        float | None, typer.Option("--prefill-tps", help="Prompt tokens/s one engine prefills.")
    ] = None,
    decode_tps: Annotated[
        float | None, typer.Option("--decode-tps", help="Output tokens/s one engine decodes.")
    ] = None,
    rps: Annotated[
        float | None, typer.Option("--rps", help="Requests/s one engine serves.")
    ] = None,
    lead_time_s: Annotated[
        int, typer.Option("--lead-time-s", help="Seconds from scale-up trigger to a ready engine.")
    ] = DEFAULT_LEAD_TIME_S,
    json_out: JsonOpt = False,
    on_bad_row: BadRowOpt = OnBadRow.skip,
    no_progress: NoProgressOpt = False,
    log_format: FormatOpt = LogFormat.auto,
    time_unit: TimeUnitOpt = None,
    time_col: TimeColOpt = None,
    prompt_col: PromptColOpt = None,
    output_col: OutputColOpt = None,
    tenant_col: TenantColOpt = None,
    lane_col: LaneColOpt = None,
    force: ForceOpt = False,
) -> None:
    """Base pool from the 10-minute P95, elastic pool for bursts, and what the mean misses."""
    try:
        capacity = EngineCapacity(rps=rps, prefill_tps=prefill_tps, decode_tps=decode_tps)
    except ValueError as exc:
        _fail(str(exc))
    if lead_time_s < 0:
        _fail("--lead-time-s must be >= 0")
    options = input_options(
        log_format, time_unit, (time_col, prompt_col, output_col, tenant_col, lane_col)
    )
    with Phases(_show_progress(log, no_progress)) as phases:
        # Token columns are checked here, not by --force-able checks: a token plan
        # cannot be forced without them, and planning in requests/s needs none.
        request_log = load_log(log, on_bad_row, options, force, phases, needs_tokens=False)
        if rps is None and not request_log.has_tokens:
            _fail(
                "the log has no token columns; name them with --prompt-col/--output-col, "
                "or plan with --rps"
            )
        with phases.steps("analysing") as step:
            analysis = analyze(request_log, AnalysisParams(per_tenant=False), progress=step)
    plan = None
    if analysis.series is not None:
        plan = plan_capacity(analysis.series, capacity, lead_time_s)
    if json_out:
        _emit_json({**plan_to_dict(plan, request_log.source), "input": request_log.input_to_dict()})
    else:
        typer.echo(plan_text(plan, request_log.source), nl=False)


def _series_for(log: RequestLog, tenant: str | None) -> tuple[RateSeries, int] | None:
    """Per-second series on the log's timeline (optionally one tenant) and its row count."""
    timeline = make_timeline(log.ts_us)
    if timeline is None:
        return None
    if tenant is None:
        rows = np.arange(len(log), dtype=np.int64)
    else:
        groups = dict(tenant_rows(log)) if log.has_tenants else {}
        if tenant not in groups:
            known = ", ".join(list(groups)[:10]) or "none: the log has no tenant column"
            _fail(f"no tenant {tenant!r} in the log (tenants: {known})")
        rows = groups[tenant]
    bins = timeline.bins(log.ts_us[rows])
    series = RateSeries(
        requests=per_second(bins, timeline.n_bins),
        prompt_tokens=per_second(bins, timeline.n_bins, log.prompt_tokens[rows]),
        output_tokens=per_second(bins, timeline.n_bins, log.output_tokens[rows]),
    )
    return series, int(rows.size)


def forecast_command(
    log: LogArg,
    tenant: Annotated[
        str | None, typer.Option("--tenant", help="Forecast one tenant (default: all traffic).")
    ] = None,
    horizon_s: Annotated[
        int, typer.Option("--horizon-s", help="Seconds ahead to forecast and alarm.")
    ] = DEFAULT_HORIZON_S,
    train_fraction: Annotated[
        float, typer.Option("--train-fraction", help="Leading share of the log used to fit.")
    ] = DEFAULT_TRAIN_FRACTION,
    burst_k: KOpt = DEFAULT_K,
    burst_min_seconds: MinSecondsOpt = DEFAULT_MIN_SECONDS,
    baseline_seconds: BaselineOpt = DEFAULT_BASELINE_SECONDS,
    json_out: JsonOpt = False,
    on_bad_row: BadRowOpt = OnBadRow.skip,
    no_progress: NoProgressOpt = False,
    log_format: FormatOpt = LogFormat.auto,
    time_unit: TimeUnitOpt = None,
    time_col: TimeColOpt = None,
    prompt_col: PromptColOpt = None,
    output_col: OutputColOpt = None,
    tenant_col: TenantColOpt = None,
    lane_col: LaneColOpt = None,
    force: ForceOpt = False,
) -> None:
    """Forecast request and token rate; evaluate burst alarms on a held-out tail."""
    rule = _rule(burst_k, burst_min_seconds, baseline_seconds)
    if horizon_s < 1:
        _fail("--horizon-s must be at least 1")
    if not 0 < train_fraction < 1:
        _fail("--train-fraction must be between 0 and 1")
    options = input_options(
        log_format, time_unit, (time_col, prompt_col, output_col, tenant_col, lane_col)
    )
    with Phases(_show_progress(log, no_progress)) as phases:
        request_log = load_log(log, on_bad_row, options, force, phases)
        with phases.spinner("forecasting"):
            axes = _forecast_axes(request_log, tenant, rule, horizon_s, train_fraction)
    if json_out:
        _emit_json(
            {
                **forecast_to_dict(request_log.source, tenant, axes),
                "input": request_log.input_to_dict(),
            }
        )
    else:
        text = forecast_text(request_log.source, tenant, axes)
        typer.echo(text if axes else text + "no requests to forecast\n", nl=False)


def _forecast_axes(
    request_log: RequestLog,
    tenant: str | None,
    rule: BurstRule,
    horizon_s: int,
    train_fraction: float,
) -> list[AxisForecast]:
    found = _series_for(request_log, tenant)
    axes: list[AxisForecast] = []
    if found is not None:
        series, count = found
        axes.append(
            forecast_axis("requests", series.requests, rule, 1.0, horizon_s, train_fraction)
        )
        tokens_per_request = float(series.tokens.sum()) / count if count else 0.0
        if request_log.has_tokens and tokens_per_request > 0:
            axes.append(
                forecast_axis(
                    "tokens", series.tokens, rule, tokens_per_request, horizon_s, train_fraction
                )
            )
    return axes


def register(app: typer.Typer) -> None:
    """Add ``analyze``, ``plan`` and ``forecast`` to the ``burstgate`` app."""
    app.command("analyze")(analyze_command)
    app.command("plan")(plan_command)
    app.command("forecast")(forecast_command)
