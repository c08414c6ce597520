"""The report's burst parts: the timeline with linked bands, the incident
table, and one post-incident article per burst.

Links run band -> table row (``#burst-N``) -> article (``#incident-N``) and
back, so a reader goes from "what is that red band" to "who drove it" in
two clicks.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from html import escape

import numpy as np

from controlplane.analysis.bursts import Baseline
from controlplane.analysis.plots import TimelineFigure
from controlplane.analysis.stats import FloatArray
from controlplane.analysis.summary import Analysis, Incident
from controlplane.analysis.terminal import num, pct
from controlplane.analysis.timescale import TimeScale

# Above this many bursts the table lists the largest (by excess requests) and
# says how many it left out; every burst keeps its band on the timeline.
MAX_TABLE_ROWS = 200


@dataclass(frozen=True, slots=True)
class AxisPeak:
    """An incident on one axis: the figures that show why it is (or is not) a burst."""

    peak: float  # highest one-second rate inside
    smoothed: float  # the burst-rule average at the second nearest or furthest over...
    threshold: float | None  # ...the threshold then (None during warm-up)


def axis_peak(values: FloatArray, baseline: Baseline, inc: Incident) -> AxisPeak:
    """Figures at the second where the rule's average stood furthest above its
    threshold (or came closest, when it never crossed). Not at the average's
    peak: by then the burst's first seconds have entered the trailing
    baseline, and the threshold shown would be higher than the one crossed."""
    smoothed = baseline.smoothed[inc.start : inc.end]
    threshold = baseline.threshold[inc.start : inc.end]
    ready = ~np.isnan(threshold)
    if ready.any():
        margin = np.where(ready, smoothed - np.where(ready, threshold, 0.0), -np.inf)
        at = int(np.argmax(margin))
    else:
        at = int(np.argmax(smoothed))
    return AxisPeak(
        peak=float(values[inc.start : inc.end].max()),
        smoothed=float(smoothed[at]),
        threshold=float(threshold[at]) if ready[at] else None,
    )


def excess_tokens(inc: Incident) -> float:
    """Tokens above what the baseline token rate would have brought."""
    return inc.prompt_tokens + inc.output_tokens - inc.baseline_tokens_per_s * inc.duration_s


def _cell(value: float | int | None, key: str, css: str = "") -> str:
    # The class goes first: tools read `data-metric="KEY">VALUE<` (see report.py).
    klass = f'class="{css}" ' if css else ""
    return f'<td {klass}data-metric="{escape(key)}">{num(value)}</td>'


def _axis_cells(peak: AxisPeak | None, key: str, triggered: bool) -> str:
    if peak is None:
        return "<td>-</td>" * 3
    return (
        # whole requests or tokens in one-second bins; a rate in wider ones
        _cell(round(peak.peak) if peak.peak.is_integer() else peak.peak, f"{key}.peak")
        + _cell(peak.smoothed, f"{key}.smoothed", "trigger" if triggered else "")
        + _cell(peak.threshold, f"{key}.threshold")
    )


def burst_table(analysis: Analysis, scale: TimeScale) -> str:
    """One row per burst: number, start, duration, axis, peak against threshold, excess."""
    incidents = analysis.incidents
    if not incidents:
        return '<p id="burst-table">No bursts under this rule.</p>'
    series = analysis.series
    assert series is not None and analysis.request_baseline is not None
    window = analysis.params.rule.min_seconds
    shown = incidents
    if len(incidents) > MAX_TABLE_ROWS:
        largest = sorted(incidents, key=lambda i: -i.excess_requests)[:MAX_TABLE_ROWS]
        shown = sorted(largest, key=lambda i: i.number)
    tokens = analysis.token_baseline is not None
    head = (
        '<tr><th rowspan="2">#</th>'
        f'<th rowspan="2">start ({escape(scale.zone)})</th><th rowspan="2">duration</th>'
        '<th rowspan="2">axis</th><th colspan="3" class="group">requests/s</th>'
        + ('<th colspan="3" class="group">tokens/s</th>' if tokens else "")
        + '<th rowspan="2">excess requests</th>'
        + ('<th rowspan="2">excess tokens</th>' if tokens else "")
        + "</tr><tr>"
        + (
            f"<th>{analysis.binning.bin_seconds}-s peak</th><th>{window}-s mean</th>"
            "<th>threshold</th>"
        )
        * (2 if tokens else 1)
        + "</tr>"
    )
    rows = []
    for inc in shown:
        key = f"incidents.{inc.number}"
        req = axis_peak(series.requests, analysis.request_baseline, inc)
        tok = (
            axis_peak(series.tokens, analysis.token_baseline, inc)
            if analysis.token_baseline is not None
            else None
        )
        rows.append(
            f'<tr id="burst-{inc.number}">'
            f'<td><a href="#incident-{inc.number}" data-metric="{key}.number">{inc.number}</a></td>'
            f'<td data-metric="{key}.start">{escape(scale.at(inc.start))}</td>'
            f'<td data-metric="{key}.duration_s">{inc.duration_s} s</td>'
            f'<td data-metric="{key}.axes">{escape(" + ".join(inc.axes))}</td>'
            + _axis_cells(req, f"{key}.requests_per_s", "requests" in inc.axes)
            + (_axis_cells(tok, f"{key}.tokens_per_s", "tokens" in inc.axes) if tokens else "")
            + _cell(round(inc.excess_requests), f"{key}.excess_requests")
            + (_cell(round(excess_tokens(inc)), f"{key}.excess_tokens") if tokens else "")
            + "</tr>"
        )
    more = (
        f'<p class="meta">{len(incidents) - len(shown):,} smaller bursts not listed '
        f"(the {MAX_TABLE_ROWS} with the most excess requests are).</p>"
        if len(shown) < len(incidents)
        else ""
    )
    return f'<table id="burst-table" class="bursts">{head}{"".join(rows)}</table>{more}'


def timeline_html(figure: TimelineFigure, analysis: Analysis, scale: TimeScale) -> str:
    """The timeline PNG with a transparent link laid over each band."""
    data = base64.b64encode(figure.png).decode("ascii")
    by_number = {inc.number: inc for inc in analysis.incidents}
    links = []
    for box in figure.bands:
        inc = by_number[box.number]
        title = (
            f"Burst {inc.number}: {scale.at(inc.start)} ({scale.zone}), {inc.duration_s} s, "
            f"{' + '.join(inc.axes)}"
        )
        links.append(
            f'<a class="band" id="band-{inc.number}" href="#burst-{inc.number}" '
            f'title="{escape(title)}" aria-label="{escape(title)}" '
            f'style="left:{box.left:.3f}%;top:{box.top:.3f}%;'
            f'width:{box.width:.3f}%;height:{box.height:.3f}%"></a>'
        )
    alt = "request and token rate over time: burst thresholds dashed, bursts as numbered bands"
    return (
        f'<div class="timeline"><img alt="{alt}" src="data:image/png;base64,{data}">'
        + "".join(links)
        + "</div>"
    )


def incident_story(analysis: Analysis, inc: Incident, scale: TimeScale) -> list[str]:
    """The post-incident narrative, one sentence per fact."""
    rule = analysis.params.rule
    zone = scale.zone
    story = [
        f"From {scale.at(inc.start)} to {scale.at(inc.end)} ({zone}; {inc.duration_s} s) "
        f"requests averaged {inc.mean_rps:.1f}/s against a baseline of {inc.baseline_rps:.1f}/s "
        f"(peak {inc.peak_rps:.0f}/s): {inc.requests:,} requests, about "
        f"{inc.excess_requests:,.0f} more than the baseline rate would have brought."
    ]
    if analysis.log.has_tokens:
        story.append(
            f"Tokens averaged {inc.mean_tokens_per_s:,.0f}/s (baseline "
            f"{inc.baseline_tokens_per_s:,.0f}/s, peak {inc.peak_tokens_per_s:,.0f}/s), about "
            f"{excess_tokens(inc):,.0f} tokens more than the baseline rate."
        )
    story.append(
        f"Triggered on {' and '.join(inc.axes)}; a reactive detector ({rule.min_seconds}-s "
        f"average over baseline + {rule.k:g} sigma) would have fired at "
        f"{scale.at(inc.detected_at + 1)}, {inc.detected_at + 1 - inc.start} s in."
    )
    if inc.top_tenants:
        story.append(
            "Top tenants: "
            + "; ".join(
                f"{escape(t.tenant or '(blank)')} {t.requests:,} requests ({pct(t.share)} of the "
                f"burst, {pct(t.usual_share)} of the log)"
                for t in inc.top_tenants
            )
            + "."
        )
    if inc.decisions:
        story.append(
            "Decisions: "
            + ", ".join(f"{escape(k or '(blank)')} {v:,}" for k, v in inc.decisions.items())
            + "."
        )
    return story
