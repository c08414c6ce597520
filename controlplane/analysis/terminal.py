"""Readable terminal summaries for analyze, plan and forecast."""

from __future__ import annotations

from controlplane.analysis.forecast import AlarmScore, AxisForecast
from controlplane.analysis.parsing import US_PER_S, format_timestamp_us
from controlplane.analysis.plan import (
    AUTOSCALE_DOWN_DELAY_S,
    AUTOSCALE_INTERVAL_S,
    DEMAND_WINDOW_S,
    TARGET_UTILIZATION,
    CapacityPlan,
)
from controlplane.analysis.prefix_out import prefix_lines
from controlplane.analysis.stats import Distribution, SeriesStats
from controlplane.analysis.summary import Analysis, EntitySummary
from controlplane.analysis.timescale import is_relative, since_zero

# SPEC §5 thresholds for the verdict lines.
CV_BURSTY = 1.0  # CV > 1: strongly bursty
PEAK_TO_MEAN_LIMIT = 3.0  # peak/mean > 3: capacity cannot be planned from the mean
# Terminal tables stay short; --json and --html carry everything.
MAX_WINDOW_ROWS = 12
MAX_INCIDENT_ROWS = 15
MAX_TENANT_ROWS = 10
MAX_BAD_ROW_LINES = 5
DASH = "-"


def num(value: float | int | None, digits: int | None = None) -> str:
    """Compact human number: thousands separators, fewer decimals when large."""
    if value is None:
        return DASH
    if isinstance(value, int):
        return f"{value:,}"
    if digits is None:
        magnitude = abs(value)
        digits = 0 if magnitude >= 1000 else 1 if magnitude >= 100 else 2
    return f"{value:,.{digits}f}"


def pct(value: float | None) -> str:
    return DASH if value is None else f"{100 * value:.0f}%"


def when(ts_us: int) -> str:
    """ISO time to the second, for tables; ``+H:MM:SS`` since the log's zero
    when its timestamps are relative (placed at 1970 by the reader)."""
    if is_relative(ts_us):
        return since_zero(ts_us // US_PER_S)
    return format_timestamp_us(ts_us)[:19] + "Z"


def bin_words(bin_seconds: int) -> str:
    """``one-second bins``, ``3-second bins``."""
    return "one-second bins" if bin_seconds == 1 else f"{bin_seconds:,}-second bins"


def _series_row(label: str, s: SeriesStats | None) -> str:
    if s is None:
        return f"  {label:<18}{DASH:>9}"
    cells = [s.mean, s.std, s.p50, s.p95, s.p99, s.max]
    return (
        f"  {label:<18}"
        + "".join(f"{num(c):>10}" for c in cells)
        + f"{num(s.cv):>8}{num(s.peak_to_mean):>11}"
    )


def _dist_line(
    label: str, d: Distribution | None, unit: str = "", digits: int | None = None
) -> str | None:
    if d is None:
        return None
    cells = (("mean", d.mean), ("P50", d.p50), ("P90", d.p90), ("P99", d.p99), ("max", d.max))
    return f"  {label}: " + ", ".join(f"{name} {num(v, digits)}{unit}" for name, v in cells)


def verdict(what: str, s: SeriesStats | None) -> str:
    """SPEC §5 reading of CV and peak-to-mean for one series."""
    if s is None or s.cv is None or s.peak_to_mean is None:
        return f"  {what}: not enough traffic to judge"
    bursty = (
        f"strongly bursty (CV {s.cv:.2f} > 1)"
        if s.cv > CV_BURSTY
        else f"not strongly bursty (CV {s.cv:.2f} <= 1)"
    )
    planning = (
        f"do not plan from the mean (peak/mean {s.peak_to_mean:.2f} > 3)"
        if s.peak_to_mean > PEAK_TO_MEAN_LIMIT
        else f"peak/mean {s.peak_to_mean:.2f} <= 3"
    )
    return f"  {what}: {bursty}; {planning}"


def entity_lines(entity: EntitySummary, title: str) -> list[str]:
    lines = [f"{title} - {entity.requests:,} requests"]
    if entity.requests == 0:
        return [*lines, "  (no requests)"]
    header = "".join(f"{h:>10}" for h in ("mean", "std", "P50", "P95", "P99", "max"))
    lines.append(f"  {'per second':<18}{header}{'CV':>8}{'peak/mean':>11}")
    lines.append(_series_row("requests/s", entity.requests_per_s))
    if entity.tokens_per_s is not None:
        lines.append(_series_row("prompt tokens/s", entity.prompt_tokens_per_s))
        lines.append(_series_row("output tokens/s", entity.output_tokens_per_s))
        lines.append(_series_row("tokens/s", entity.tokens_per_s))
    lines.append(verdict("verdict, requests", entity.requests_per_s))
    if entity.tokens_per_s is not None:
        lines.append(verdict("verdict, tokens", entity.tokens_per_s))
    ia = entity.interarrival
    if ia is not None:
        lines.append(
            f"  inter-arrival: mean {ia.mean_s:.3f} s, P50 {ia.p50_s:.3f} s, P99 {ia.p99_s:.3f} s "
            f"(exponential {ia.exponential_p99_s:.3f} s, x{num(ia.p99_vs_exponential)}), "
            f"CV {num(ia.cv)}"
        )
        lines.append(
            f"  vs Poisson: KS distance {num(ia.ks_distance, 3)} (0 = exponential gaps), "
            f"count dispersion {num(ia.count_dispersion)} (1 = Poisson)"
        )
    for line in (
        _dist_line("prompt tokens/request", entity.prompt_tokens, digits=0),
        _dist_line("output tokens/request", entity.output_tokens, digits=0),
        _dist_line("queue wait", entity.queue_wait_ms, " ms"),
        _dist_line("latency", entity.latency_ms, " ms"),
    ):
        if line is not None:
            lines.append(line)
    if entity.decisions:
        lines.append(
            "  decisions: "
            + ", ".join(f"{k or '(blank)'} {v:,}" for k, v in entity.decisions.items())
        )
    if entity.lanes:
        lines.append(
            "  lanes: " + ", ".join(f"{k or '(blank)'} {v:,}" for k, v in entity.lanes.items())
        )
    return lines


def window_lines(entity: EntitySummary) -> list[str]:
    if not entity.windows:
        return []
    lines = [
        f"10-minute windows ({len(entity.windows)})",
        f"  {'#':>3}  {'start':<20}{'s':>5}{'requests':>10}{'mean/s':>9}{'P95/s':>8}"
        f"{'max/s':>8}{'CV':>7}{'tok/s P95':>11}",
    ]
    windows = entity.windows
    shown = (
        windows
        if len(windows) <= MAX_WINDOW_ROWS
        else sorted(windows, key=lambda w: -w.requests_per_s.p95)[:MAX_WINDOW_ROWS]
    )
    for w in sorted(shown, key=lambda w: w.index):
        r = w.requests_per_s
        lines.append(
            f"  {w.index:>3}  {when(w.start_us):<20}{w.seconds:>5}{w.requests:>10,}"
            f"{num(r.mean):>9}{num(r.p95):>8}{num(r.max):>8}{num(r.cv):>7}"
            f"{num(w.tokens_per_s.p95 if w.tokens_per_s else None):>11}"
        )
    if len(windows) > len(shown):
        lines.append(f"  ... {len(windows) - len(shown)} quieter windows in --json/--html")
    return lines


def analysis_text(analysis: Analysis) -> str:
    log, timeline, rule = analysis.log, analysis.timeline, analysis.params.rule
    out = [f"burstgate analyze: {log.source} ({log.fmt})"]
    out.append(
        f"rows: {len(log):,} analysed, {log.bad_row_count:,} bad"
        + (f", {analysis.out_of_order_rows:,} out of order" if analysis.out_of_order_rows else "")
    )
    for bad in log.bad_rows[:MAX_BAD_ROW_LINES]:
        out.append(f"  line {bad.line}: {bad.reason}")
    if log.bad_row_count > MAX_BAD_ROW_LINES:
        out.append(f"  ... {log.bad_row_count - MAX_BAD_ROW_LINES:,} more bad rows")
    if log.columns:
        out.append("columns: " + ", ".join(f"{k}={v}" for k, v in log.columns.items()))
    if timeline is None:
        out.append("no requests to analyse")
        return "\n".join(out) + "\n"
    out.append(
        f"span: {when(timeline.t0_us)} to {when(int(log.ts_us.max()))}"
        + (" since the log's zero" if is_relative(timeline.t0_us) else "")
        + f" ({timeline.n_bins:,} {bin_words(timeline.bin_seconds)} from the first arrival)"
    )
    if analysis.binning.widened:
        out.append(f"bins: {analysis.binning.note()}")
    out.append("")
    out.extend(entity_lines(analysis.overall, "Overall"))
    out.append("")
    out.extend(window_lines(analysis.overall))
    out.append("")
    out.append(
        f"Bursts ({rule.min_seconds}-s average > trailing {rule.baseline_seconds}-s baseline "
        f"+ {rule.k:g} sigma for >= {rule.min_seconds} s, requests or tokens): "
        f"{len(analysis.incidents)}"
    )
    if analysis.incidents:
        out.append(
            f"  {'#':>3}  {'start':<20}{'dur s':>6}  {'axes':<16}{'peak/s':>7}{'mean/s':>7}"
            f"{'base/s':>7}{'excess req':>11}  top tenant"
        )
    for inc in analysis.incidents[:MAX_INCIDENT_ROWS]:
        top = inc.top_tenants[0] if inc.top_tenants else None
        top_text = f"{top.tenant} ({pct(top.share)})" if top else DASH
        out.append(
            f"  {inc.number:>3}  {when(timeline.bin_start_us(inc.start)):<20}{inc.duration_s:>6}  "
            f"{'+'.join(inc.axes):<16}{num(inc.peak_rps, 0):>7}{num(inc.mean_rps, 1):>7}"
            f"{num(inc.baseline_rps, 1):>7}{num(inc.excess_requests, 0):>11}  {top_text}"
        )
    if len(analysis.incidents) > MAX_INCIDENT_ROWS:
        out.append(f"  ... {len(analysis.incidents) - MAX_INCIDENT_ROWS} more in --json/--html")
    if analysis.tenants:
        out.append("")
        out.append(
            f"Per tenant ({len(analysis.tenants) + analysis.tenants_not_shown} tenants"
            + (f", top {MAX_TENANT_ROWS} shown" if len(analysis.tenants) > MAX_TENANT_ROWS else "")
            + ")"
        )
        out.append(
            f"  {'tenant':<20}{'requests':>10}{'mean/s':>9}{'P99/s':>8}{'max/s':>7}{'CV':>7}"
            f"{'peak/mean':>10}{'IA CV':>7}{'tok/s P99':>11}{'bursts':>7}"
        )
        for t in analysis.tenants[:MAX_TENANT_ROWS]:
            r = t.requests_per_s
            out.append(
                f"  {(t.tenant or '(blank)')[:19]:<20}{t.requests:>10,}"
                f"{num(r.mean if r else None):>9}"
                f"{num(r.p99 if r else None):>8}{num(r.max if r else None):>7}"
                f"{num(r.cv if r else None):>7}{num(r.peak_to_mean if r else None):>10}"
                f"{num(t.interarrival.cv if t.interarrival else None):>7}"
                f"{num(t.tokens_per_s.p99 if t.tokens_per_s else None):>11}{len(t.bursts):>7}"
            )
    out.append("")
    out.extend(prefix_lines(analysis.prefix))
    return "\n".join(out) + "\n"


def plan_text(plan: CapacityPlan | None, source: str) -> str:
    if plan is None:
        return f"burstgate plan: {source}\nno requests to plan from\n"
    d = plan.demand
    hours = plan.demand.seconds / 3600
    lines = [
        f"burstgate plan: {source}",
        f"engine capacity: {plan.capacity.describe()}; scale-up lead time {plan.lead_time_s} s",
        f"demand (engines busy per second): mean {num(d.mean)}, P95 {num(d.p95)}, "
        f"P99 {num(d.p99)}, peak {num(d.max)}",
        f"busiest 10-minute window (#{plan.busiest_window}) P95: {num(plan.window_p95)} engines; "
        f"busiest hour's mean: {num(plan.busiest_hour_mean)} engines",
        "",
        f"recommendation: base pool {plan.base_engines} engines (busiest 10-minute P95), "
        f"elastic pool +{plan.elastic_engines} for bursts "
        f"(scale on queue wait, ready {plan.lead_time_s} s after the trigger)",
        f"a plan from the mean would provision {plan.mean_engines} engines",
        f"autoscaled: the recipes' rule every {AUTOSCALE_INTERVAL_S} s (up at once, down after "
        f"{AUTOSCALE_DOWN_DELAY_S:g} s) between the base and base + elastic, on "
        f"ceil({DEMAND_WINDOW_S}-s mean demand / {TARGET_UTILIZATION:g}); predictive also on the "
        f"Holt forecast {plan.lead_time_s} s ahead",
        f"engine-hours over the log's {num(hours)} h (an engine counts from the moment it is "
        f"asked for); the work itself: {num(plan.demand_engine_hours)} engine-hours",
        "",
        f"  {'plan':<43}{'engines':>8}{'over capacity':>22}{'time queued':>13}"
        f"{'max wait':>10}{'scale-ups':>11}{'engine-hours':>14}{'vs always-on':>14}",
    ]
    for o in plan.outcomes:
        engines = (
            str(o.base_engines)
            if o.max_engines == o.base_engines
            else (f"{o.base_engines}-{o.max_engines}")
        )
        lines.append(
            f"  {o.name:<43}{engines:>8}"
            f"{f'{o.over_capacity_s:,} s ({o.over_capacity_min:.1f} min)':>22}"
            f"{f'{o.queued_s:,} s':>13}{f'{o.max_queue_wait_s:.1f} s':>10}{o.scale_ups:>11}"
            f"{num(o.engine_hours):>14}{pct(plan.engine_hours_ratio(o)):>14}"
        )
    return "\n".join(lines) + "\n"


def lead_text(lead_s: float | None) -> str:
    """The median alarm time against the burst start, in words."""
    if lead_s is None:
        return "median lead -"
    if lead_s > 0:
        return f"median lead {lead_s:g} s before the start"
    if lead_s < 0:
        return f"median alarm {-lead_s:g} s after the start"
    return "median alarm at the start, no lead"


def _score_lines(label: str, s: AlarmScore) -> list[str]:
    detection = (
        f" ({s.median_lead_vs_detection_s:g} s before detection)"
        if s.median_lead_vs_detection_s is not None
        else ""
    )
    return [
        f"    {label}:",
        f"      bursts {s.bursts}, predicted {s.predicted} (recall {pct(s.recall)}); "
        f"alarms {s.alarms}: {s.true_alarms} true, {s.false_alarms} false, {s.late_alarms} late",
        f"      false-alarm ratio {pct(s.false_alarm_ratio)}, "
        f"{lead_text(s.median_lead_vs_start_s)}{detection}",
        f"      {num(s.false_alarms_per_hour)} false alarms/h; a random alarm would be "
        f"{pct(s.chance_precision)} true",
        f"      {s.verdict}",
    ]


def forecast_text(source: str, tenant: str | None, axes: list[AxisForecast]) -> str:
    lines = [f"burstgate forecast: {source} (tenant: {tenant or 'all'})"]
    for f in axes:
        now = f.now
        unit = "requests/s" if f.axis == "requests" else "tokens/s"
        lines.append("")
        lines.append(f"{f.axis} - horizon {f.horizon_s} s")
        alarm = "ALARM" if now.alarm else "no alarm"
        lines.append(
            f"  end of log: level {num(now.level)} {unit}, forecast +{f.horizon_s} s "
            f"{num(now.forecast)} {unit}, alarm threshold {num(now.threshold)} -> {alarm}"
        )
        ev = f.evaluation
        if ev is None:
            lines.append("  evaluation: log too short to split into train and test parts")
            continue
        p = ev.params
        lines.append(
            f"  fitted on the first {f.train_seconds:,} s ({ev.fitted_on_bursts} bursts): "
            f"alpha {p.alpha:g}, beta {p.beta:g}, phi {p.phi:g}, alarm at z >= {ev.alarm_z:g}"
        )
        lines.append(f"  tested on the last {f.test_seconds:,} s:")
        lines.extend(_score_lines("Holt forecast", ev.test))
        lines.extend(
            _score_lines(f"baseline: current rate, z >= {ev.persistence_z:g}", ev.persistence_test)
        )
        lines.append(
            f"    forecast error at +{f.horizon_s} s (MAE): Holt {num(ev.mae)}, "
            f"current rate {num(ev.persistence_mae)}, training mean {num(ev.mean_mae)} {unit}"
        )
    return "\n".join(lines) + "\n"
