"""Self-contained HTML report: one file with the PNGs embedded as base64
data URIs, so it can be mailed or attached to a ticket alone. Where it is
written is decided by reportpath.py; the burst timeline, incident table and
post-incident articles are in report_bursts.py.

Every figure shown in a table cell carries ``data-metric="..."`` with the key
it reports, and the full ``--json`` document is embedded in
``<script type="application/json" id="burstgate-data">``, so tests and tools
can check the report against an independent computation.
"""

from __future__ import annotations

import base64
import json
from html import escape
from pathlib import Path

from controlplane.analysis import plots
from controlplane.analysis.grid import describe_step
from controlplane.analysis.jsonout import analysis_to_dict
from controlplane.analysis.report_bursts import burst_table, incident_story, timeline_html
from controlplane.analysis.report_prefix import prefix_section_body
from controlplane.analysis.stats import Distribution, SeriesStats
from controlplane.analysis.summary import Analysis, EntitySummary, Incident
from controlplane.analysis.terminal import CV_BURSTY, PEAK_TO_MEAN_LIMIT, bin_words, num
from controlplane.analysis.timescale import TimeScale

# The most severe incidents (by excess requests) get a zoom plot each; the
# rest get their table. Keeps a noisy day's report a few MB at most.
MAX_INCIDENT_PLOTS = 20

_STYLE = """
body{font:15px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:1080px;
padding:0 1rem;color:#222}
h1{margin-bottom:.2rem}h2{border-bottom:2px solid #ddd;padding-bottom:.2rem;margin-top:2.2rem}
table{border-collapse:collapse;margin:.6rem 0;font-variant-numeric:tabular-nums}
th,td{padding:.2rem .6rem;border-bottom:1px solid #eee;text-align:right}
th:first-child,td:first-child{text-align:left}
img{max-width:100%;border:1px solid #eee;margin:.4rem 0}
.meta{color:#666}.ok{color:#2a7a2a}.warn{color:#b35900;font-weight:600}
.incident{border-left:4px solid #d62728;padding-left:1rem;margin:1.4rem 0}
nav a{margin-right:.8rem}code{background:#f4f4f4;padding:0 .2rem}
.timeline{position:relative;display:inline-block;max-width:100%;border:1px solid #eee;
margin:.4rem 0}
.timeline img{display:block;border:0;margin:0}
.timeline a.band{position:absolute;border-radius:2px}
.timeline a.band:hover,.timeline a.band:focus{background:rgba(214,39,40,.22);
outline:2px solid #d62728}
table.bursts td{white-space:nowrap}table.bursts th,table.bursts td{padding:.2rem .45rem}
table.bursts th{text-align:right;vertical-align:bottom}table.bursts th.group{text-align:center;
border-bottom:1px solid #ccc}
table.bursts a{color:#fff;background:#d62728;border-radius:3px;padding:0 .35rem;
text-decoration:none;font-weight:600}
td.trigger{color:#d62728;font-weight:600}
tr:target,article:target{background:#fff6d6}
"""


def _img(png: bytes | None, alt: str) -> str:
    if png is None:
        return f'<p class="meta">({escape(alt)}: not enough data to plot)</p>'
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{data}">'


def _cell(value: float | int | None, key: str) -> str:
    return f'<td data-metric="{escape(key)}">{num(value)}</td>'


def _series_table(entity: EntitySummary, prefix: str) -> str:
    rows = [
        ("requests/s", "requests_per_s", entity.requests_per_s),
        ("prompt tokens/s", "prompt_tokens_per_s", entity.prompt_tokens_per_s),
        ("output tokens/s", "output_tokens_per_s", entity.output_tokens_per_s),
        ("tokens/s", "tokens_per_s", entity.tokens_per_s),
    ]
    fields = ("mean", "std", "p50", "p95", "p99", "max", "cv", "peak_to_mean")
    head = "".join(
        f"<th>{h}</th>"
        for h in ("per second", "mean", "std", "P50", "P95", "P99", "max", "CV", "peak/mean")
    )
    body = []
    for label, key, stats in rows:
        if stats is None:
            continue
        cells = "".join(_cell(_field(stats, f), f"{prefix}{key}.{f}") for f in fields)
        body.append(f"<tr><td>{label}</td>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _field(stats: SeriesStats | Distribution, name: str) -> float | int | None:
    value: float | int | None = getattr(stats, name)
    return value


def _dist_table(rows: list[tuple[str, str, Distribution | None]]) -> str:
    fields = ("count", "mean", "p50", "p90", "p95", "p99", "max")
    head = "".join(
        f"<th>{h}</th>" for h in ("per request", "count", "mean", "P50", "P90", "P95", "P99", "max")
    )
    body = [
        f"<tr><td>{label}</td>"
        + "".join(_cell(_field(d, f), f"{key}.{f}") for f in fields)
        + "</tr>"
        for label, key, d in rows
        if d is not None
    ]
    return f"<table><tr>{head}</tr>{''.join(body)}</table>" if body else ""


def _verdict(what: str, s: SeriesStats | None) -> str:
    if s is None or s.cv is None or s.peak_to_mean is None:
        return f'<li class="meta">{what}: not enough traffic to judge.</li>'
    cv_class = "warn" if s.cv > CV_BURSTY else "ok"
    pm_class = "warn" if s.peak_to_mean > PEAK_TO_MEAN_LIMIT else "ok"
    cv_text = "strongly bursty" if s.cv > CV_BURSTY else "not strongly bursty"
    pm_text = (
        "do not plan capacity from the mean"
        if s.peak_to_mean > PEAK_TO_MEAN_LIMIT
        else "the mean understates the peak, by less than 3x"
    )
    return (
        f'<li>{what}: <span class="{cv_class}">CV {s.cv:.2f}, {cv_text}</span>; '
        f'<span class="{pm_class}">peak-to-mean {s.peak_to_mean:.2f}, {pm_text}</span>.</li>'
    )


def _verdicts(entity: EntitySummary) -> str:
    items = _verdict("Requests/s", entity.requests_per_s)
    if entity.tokens_per_s is not None:
        items += _verdict("Tokens/s", entity.tokens_per_s)
    return (
        f'<ul>{items}</ul><p class="meta">SPEC thresholds: CV &gt; 1 is strongly bursty; '
        "peak-to-mean &gt; 3 means capacity cannot be planned from the mean.</p>"
    )


def _section(ident: str, title: str, body: str) -> str:
    return f'<section id="{ident}"><h2>{escape(title)}</h2>{body}</section>'


def _incident_html(analysis: Analysis, scale: TimeScale, inc: Incident, png: bytes | None) -> str:
    story = incident_story(analysis, inc, scale)
    key = f"incidents.{inc.number}"
    table = _dist_table(
        [
            ("queue wait (ms)", f"{key}.queue_wait_ms", inc.queue_wait_ms),
            ("latency (ms)", f"{key}.latency_ms", inc.latency_ms),
        ]
    )
    plot = _img(png, f"incident {inc.number} zoom") if png else ""
    return (
        f'<article class="incident" id="incident-{inc.number}">'
        f"<h3>Incident {inc.number}: {escape(scale.at(inc.start))} ({escape(scale.zone)}), "
        f"{inc.duration_s} s</h3>"
        f"<p>{' '.join(story)} "
        f'<a href="#burst-{inc.number}">Back to the burst table</a>.</p>{table}{plot}</article>'
    )


def _tenant_table(analysis: Analysis) -> str:
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "tenant",
            "requests",
            "mean/s",
            "P95/s",
            "P99/s",
            "max/s",
            "CV",
            "peak/mean",
            "gap CV",
            "tokens/s P99",
            "bursts",
        )
    )
    body = []
    for t in analysis.tenants:
        r = t.requests_per_s
        key = f"tenants.{t.tenant}"
        body.append(
            f"<tr><td>{escape(t.tenant or '(blank)')}</td>{_cell(t.requests, key + '.requests')}"
            + "".join(
                _cell(_field(r, f) if r else None, f"{key}.requests_per_s.{f}")
                for f in ("mean", "p95", "p99", "max", "cv", "peak_to_mean")
            )
            + _cell(t.interarrival.cv if t.interarrival else None, f"{key}.interarrival.cv")
            + _cell(t.tokens_per_s.p99 if t.tokens_per_s else None, f"{key}.tokens_per_s.p99")
            + _cell(len(t.bursts), f"{key}.bursts")
            + "</tr>"
        )
    more = (
        f'<p class="meta">{analysis.tenants_not_shown} smaller tenants not shown.</p>'
        if analysis.tenants_not_shown
        else ""
    )
    return f"<table><tr>{head}</tr>{''.join(body)}</table>{more}"


def _windows_table(analysis: Analysis, scale: TimeScale) -> str:
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "window",
            f"start ({escape(scale.zone)})",
            "seconds",
            "requests",
            "mean/s",
            "P95/s",
            "max/s",
            "CV",
            "tokens/s P95",
        )
    )
    body = []
    for w in analysis.overall.windows:
        key = f"windows.{w.index}"
        r = w.requests_per_s
        body.append(
            f"<tr><td>{w.index}</td><td>{escape(scale.moment(w.start_us))}</td>"
            f"{_cell(w.seconds, key + '.seconds')}{_cell(w.requests, key + '.requests')}"
            + "".join(
                _cell(_field(r, f), f"{key}.requests_per_s.{f}")
                for f in ("mean", "p95", "max", "cv")
            )
            + _cell(w.tokens_per_s.p95 if w.tokens_per_s else None, f"{key}.tokens_per_s.p95")
            + "</tr>"
        )
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def render_html(analysis: Analysis) -> str:
    log, overall, rule = analysis.log, analysis.overall, analysis.params.rule
    title = f"burstgate burst report: {Path(log.source).name}"
    scale = None if analysis.timeline is None else TimeScale.of(analysis.timeline)
    span = (
        "no requests"
        if scale is None or analysis.timeline is None
        else f"{scale.at(0)} to {scale.moment(int(log.ts_us.max()))} ({scale.zone}), "
        f"{analysis.timeline.n_bins:,} {bin_words(analysis.timeline.bin_seconds)}"
    )
    note = f'<p class="warn">{escape(scale.note())}</p>' if scale and scale.relative else ""
    header = (
        f"<h1>{escape(title)}</h1>"
        f'<p class="meta">{escape(log.source)} ({log.fmt}) - {len(log):,} requests, '
        f"{log.bad_row_count:,} bad rows - {span}</p>{note}"
    )
    sections = [
        "summary",
        "rates",
        "interarrival",
        "lengths",
        "windows",
        "prefix-cache",
        "tenants",
        "incidents",
        "data-quality",
        "method",
    ]
    nav = (
        "<nav>" + "".join(f'<a href="#{s}">{s.replace("-", " ")}</a>' for s in sections) + "</nav>"
    )
    parts = [header, nav]
    if scale is None:
        parts.append(_section("summary", "Summary", "<p>The log holds no requests.</p>"))
        for ident in sections[1:]:
            parts.append(_section(ident, ident.replace("-", " ").capitalize(), "<p>No data.</p>"))
        return _page(title, parts, analysis)

    parts.append(
        _section(
            "summary",
            "Summary",
            _verdicts(overall)
            + _series_table(overall, "overall.")
            + f'<p>Burst incidents: <a href="#rates">{len(analysis.incidents)}</a>; '
            f"{'tenant column present' if log.has_tenants else 'no tenant column'}.</p>"
            + _findings_html(analysis, "summary"),
        )
    )
    parts.append(_rates_section(analysis, scale))
    ia = overall.interarrival
    ia_text = (
        "<p>Fewer than two arrivals: no gaps to compare.</p>"
        if ia is None
        else f"<p>Mean gap {ia.mean_s:.3f} s, P50 {ia.p50_s:.3f} s, "
        f'P99 <span data-metric="overall.interarrival.p99_s">{ia.p99_s:.3f}</span> s against '
        f"{ia.exponential_p99_s:.3f} s for Poisson arrivals at the same rate; "
        f'gap CV <span data-metric="overall.interarrival.cv">{num(ia.cv)}</span> (Poisson: 1); '
        f"Kolmogorov-Smirnov distance to the exponential {num(ia.ks_distance, 3)}; "
        f"count dispersion per {bin_words(analysis.binning.bin_seconds)[:-1]} (variance/mean) "
        f"{num(ia.count_dispersion)} (Poisson: 1).</p>"
    )
    parts.append(
        _section(
            "interarrival",
            "Inter-arrival times vs Poisson",
            ia_text
            + _img(plots.interarrival_figure(analysis), "inter-arrival histogram vs exponential"),
        )
    )
    parts.append(
        _section(
            "lengths",
            "Token density: prompt and output lengths",
            _dist_table(
                [
                    ("prompt tokens", "overall.lengths.prompt_tokens", overall.prompt_tokens),
                    ("output tokens", "overall.lengths.output_tokens", overall.output_tokens),
                    ("queue wait (ms)", "overall.queue_wait_ms", overall.queue_wait_ms),
                    ("latency (ms)", "overall.latency_ms", overall.latency_ms),
                ]
            )
            + (
                _img(plots.lengths_figure(log), "prompt and output length distributions")
                if log.has_tokens
                else "<p>The log has no token columns.</p>"
            ),
        )
    )
    parts.append(
        _section(
            "windows",
            "10-minute windows",
            _windows_table(analysis, scale)
            + _img(plots.windows_figure(analysis), "10-minute windows"),
        )
    )
    parts.append(
        _section("prefix-cache", "Prefix cache", prefix_section_body(analysis.prefix, scale))
    )
    parts.append(
        _section(
            "tenants",
            "Per-tenant breakdown",
            _tenant_table(analysis) + _img(plots.tenants_figure(analysis), "per-tenant breakdown")
            if analysis.tenants
            else "<p>No per-tenant breakdown: the log has no tenant column "
            "(or --no-per-tenant was given).</p>",
        )
    )
    plotted = {
        inc.number
        for inc in sorted(analysis.incidents, key=lambda i: -i.excess_requests)[:MAX_INCIDENT_PLOTS]
    }
    incident_intro = (
        f"<p>Rule: a burst is where the {rule.min_seconds}-second average of requests/s or "
        f"tokens/s stays more than {rule.k:g} standard deviations above its trailing "
        f"{rule.baseline_seconds}-second baseline for at least {rule.min_seconds} consecutive "
        f"seconds (see the method section). {len(analysis.incidents)} found"
        + (
            f"; zoom plots for the {MAX_INCIDENT_PLOTS} largest"
            if len(analysis.incidents) > MAX_INCIDENT_PLOTS
            else ""
        )
        + ".</p>"
    )
    parts.append(
        _section(
            "incidents",
            "Post-incident reports",
            incident_intro
            + "".join(
                _incident_html(
                    analysis,
                    scale,
                    inc,
                    plots.incident_figure(analysis, inc) if inc.number in plotted else None,
                )
                for inc in analysis.incidents
            ),
        )
    )
    parts.append(_section("data-quality", "Data quality", _quality_html(analysis)))
    parts.append(_section("method", "Method", _method_html(analysis)))
    return _page(title, parts, analysis)


def _rates_section(analysis: Analysis, scale: TimeScale) -> str:
    rule = analysis.params.rule
    axes = "request and token" if analysis.log.has_tokens else "request"
    intro = (
        f"<p>Dashed: the burst threshold on each panel; a burst is where the dark "
        f"{rule.min_seconds}-s mean stays above it for {rule.min_seconds} s or more. "
        "Red bands are the bursts, numbered (a short burst is widened to stay visible); "
        "click a band for its row in the table below, and a number for its "
        "post-incident report.</p>"
    )
    table_intro = (
        '<h3>Bursts</h3><p class="meta">Per axis: the highest one-second rate, and the '
        f"{rule.min_seconds}-s mean and the threshold at the second the mean stood furthest "
        "above the threshold (or came closest to it); in red on the axis that triggered. "
        "Excess: requests or tokens above what the baseline rate would have brought.</p>"
    )
    return _section(
        "rates",
        f"Bursts on the {axes} rate over time",
        intro
        + timeline_html(plots.rate_figure(analysis), analysis, scale)
        + table_intro
        + burst_table(analysis, scale),
    )


def _notes(analysis: Analysis) -> list[tuple[str, str, str]]:
    """(code, kind, message) of every input finding, and the binning note."""
    log = analysis.log
    notes = [
        (f.code, "refused without --force; forced" if f.fatal else "warning", f.message)
        for f in log.findings
    ]
    if analysis.binning.widened:
        notes.append(("bins", "note", analysis.binning.note()))
    return notes


def _findings_html(analysis: Analysis, where: str) -> str:
    """Every finding about the input, in the summary and in "Data quality"
    (each ``data-finding``: a reader of the summary alone sees them all)."""
    notes = _notes(analysis)
    if not notes:
        return '<p class="meta">Input checks: no findings.</p>' if where == "summary" else ""
    items = "".join(
        f'<li data-finding="{escape(code)}"><span class="warn">{escape(code)}</span> '
        f"({escape(kind)}): {escape(message)}</li>"
        for code, kind, message in notes
    )
    title = (
        f'<p>Input findings ({len(notes)}; <a href="#data-quality">data quality</a>):</p>'
        if where == "summary"
        else f"<p>Input findings ({len(notes)}):</p>"
    )
    return f"{title}<ul>{items}</ul>"


def _quality_html(analysis: Analysis) -> str:
    log = analysis.log
    items = [
        f"<li>{log.rows_read:,} rows read, {len(log):,} analysed, {log.bad_row_count:,} bad.</li>",
        f"<li>{analysis.out_of_order_rows:,} rows earlier than the row before them "
        "(order does not matter to the analysis).</li>",
        "<li>Columns: "
        + ", ".join(
            f"<code>{escape(k)}</code> from <code>{escape(v)}</code>"
            for k, v in log.columns.items()
        )
        + ".</li>",
    ]
    binning = analysis.binning
    grid = (
        f"the timestamps' grid: {describe_step(binning.grid_us)}"
        if binning.grid_us > 1
        else "no timestamp grid coarser than a microsecond"
    )
    items.append(
        f"<li>Bins: {bin_words(binning.bin_seconds)} ({grid}; "
        f"asked: {binning.requested_seconds:,} s).</li>"
    )
    items += [f"<li>line {b.line}: {escape(b.reason)}</li>" for b in log.bad_rows]
    return f"<ul>{''.join(items)}</ul>" + _findings_html(analysis, "data-quality")


def _method_html(analysis: Analysis) -> str:
    rule = analysis.params.rule
    return (
        f"<p>{bin_words(analysis.binning.bin_seconds).capitalize()} start at the first "
        "arrival (wider than a second only when the timestamps sit on a coarser grid, or "
        "--bin-seconds asks; rates are per second either way). Standard deviations are "
        "population figures; percentiles interpolate linearly. CV = std/mean of the series; "
        "peak-to-mean = max/mean. Windows are 10 minutes from the first arrival (the last may "
        "be shorter).</p>"
        f"<p>Bursts: s(t) is the mean rate over the {rule.min_seconds} seconds ending at t. "
        f"Its baseline is the mean and standard deviation of s over the {rule.baseline_seconds} "
        "seconds before that window (sigma never below the Poisson value at the baseline rate). "
        f"A second is hot when s(t) &gt; mean + {rule.k:g} sigma; a burst is a run of at least "
        f"{rule.min_seconds} hot seconds on requests/s or tokens/s. Its edges are change points: "
        "where the per-second excess over the threshold, summed from the first hot second, "
        "peaks. It is detected when the run reaches its minimum length. "
        "Full description: docs/analysis.md.</p>"
    )


def _page(title: str, parts: list[str], analysis: Analysis) -> str:
    data = json.dumps(analysis_to_dict(analysis), allow_nan=False).replace("</", "<\\/")
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>"
        + "".join(parts)
        + f'<script type="application/json" id="burstgate-data">{data}</script>'
        + "</body></html>\n"
    )


def write_report(analysis: Analysis, path: str | Path) -> Path:
    """Write the report to exactly ``path`` (see reportpath.report_path) and return it."""
    target = Path(path)
    target.write_text(render_html(analysis), encoding="utf-8")
    return target
