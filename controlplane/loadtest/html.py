"""Self-contained HTML page of a load test: the per-phase table, and plots of
offered and admitted rate, decision latency p99 per lane and the calls the
server held over time, with the phases shaded. PNGs embedded as data URIs, the
``--json`` document embedded for tools; no network, no scripts.

Figures as in controlplane/analysis/plots.py: a ``Figure`` on an explicit
Agg canvas, no pyplot.
"""

from __future__ import annotations

import base64
import json
from html import escape
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from controlplane.analysis.plots import to_png

SHADE = {"pulse": "#d62728", "burst": "#d62728", "recovery": "#2ca02c"}
STYLE = """
body{font:15px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:1080px;
padding:0 1rem;color:#222}
h2{border-bottom:2px solid #ddd;padding-bottom:.2rem;margin-top:2rem}
table{border-collapse:collapse;font-variant-numeric:tabular-nums}
th,td{padding:.2rem .6rem;border-bottom:1px solid #eee;text-align:right}
th:first-child,td:first-child,.why td:nth-child(2),.why td:nth-child(3){text-align:left}
img{max-width:100%}.meta{color:#666}
"""
COLUMNS = (("phase", "phase"), ("requests", "requests"), ("offered/s", "offered_per_s"),
           ("admitted", "admitted"), ("refused", "refused"), ("held", "held"))  # fmt: skip
RETRY_COLUMNS = (("retries", "retries"), ("served after refusal", "served_after_refusal"),
                 ("gave up", "gave_up"))  # fmt: skip


def _figure(doc: dict[str, Any]) -> Figure:
    s = doc["series"]
    fig = Figure(figsize=(10, 8.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 1, sharex=True)
    t = s["t_s"]
    axes[0].step(t, s["offered"], where="post", label="offered", color="#1f77b4")
    axes[0].step(t, s["admitted"], where="post", label="admitted", color="#ff7f0e")
    axes[0].set_ylabel("requests/s")
    _lane_latency(axes[1], t, s)
    axes[2].step(t, s["held"], where="post", color="#8c564b",
                 label="calls held by the server (queue depth)")  # fmt: skip
    axes[2].set_ylabel("calls")
    axes[2].set_xlabel("seconds since the start")
    for ax in axes:
        for p in doc["phases_plan"]:
            colour = SHADE.get(p["phase"])
            if colour:
                ax.axvspan(p["start_s"], p["end_s"], color=colour, alpha=0.08, lw=0)
        ax.grid(alpha=0.3)
        if ax.get_yscale() == "linear":
            ax.set_ylim(bottom=0)
        ax.legend(loc="upper right", fontsize=9)
    axes[0].set_title("shaded: red = pulse/burst, green = recovery", fontsize=10, loc="left")
    return fig


LANE_COLOURS = {"premium": "#d62728", "standard": "#1f77b4", "batch": "#7f7f7f"}


def _lane_latency(ax: Any, t: list[float], s: dict[str, Any]) -> None:
    """Decision latency p99 per lane (log scale: premium's milliseconds
    and batch's held seconds on one axis); a second with none of a lane's
    calls is a gap. A document without the per-lane series (written before
    it existed) shows the p99 of all."""
    lanes = s.get("latency_p99_ms_by_lane") or {"all": s["latency_p99_ms"]}
    shown = False
    for i, (lane, values) in enumerate(lanes.items()):
        ys = [float("nan") if v is None or v <= 0 else v for v in values]
        if all(y != y for y in ys):  # NaN everywhere: nothing answered
            continue
        colour = LANE_COLOURS.get(lane, f"C{i + 4}")
        ax.plot(t, ys, color=colour, marker=".", markersize=3, label=f"{lane} p99")
        shown = True
    if shown:
        ax.set_yscale("log")
    ax.set_ylabel("decision latency, ms")


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return escape(str(v))


def _table(head: list[str], rows: list[list[Any]], cls: str = "") -> str:
    body = "".join("<tr>" + "".join(f"<td>{_cell(c)}</td>" for c in r) + "</tr>" for r in rows)
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    return f'<table class="{cls}"><tr>{th}</tr>{body}</table>'


def _shape(p: dict[str, Any]) -> str:
    if p["profile"] == "replay":
        return f"trace {p['trace']} at {p['speed']:g}x, tenants by {p['assign']}"
    return f"base {p['base']:g}/s, peak {p['peak']:g}/s"


def render(doc: dict[str, Any]) -> str:
    # As the text report: the retry columns when any client retried (replay
    # retries by default, loadtest with --retries).
    retried = any(ph.get("retries") for ph in doc["phases"])
    rows: list[list[Any]] = []
    for ph in doc["phases"]:
        lat, wait = ph["latency_ms"], ph["queue_wait_ms"]
        cells = [ph[key] for _, key in COLUMNS]
        cells += [lat[k] for k in ("p50", "p95", "p99", "max")] + [wait["p99"]]
        cells.append(sum(ph["errors"].values()))
        if retried:
            cells += [ph[key] for _, key in RETRY_COLUMNS]
        rows.append(cells)
    head = [h for h, _ in COLUMNS] + ["p50 ms", "p95 ms", "p99 ms", "max ms",
                                      "queue wait p99 ms", "errors"]  # fmt: skip
    if retried:
        head += [h for h, _ in RETRY_COLUMNS]
    lanes = [[ln["lane"], ln["requests"], ln["admitted"], ln["refused"], ln["held"],
              ln["latency_ms"]["p50"], ln["latency_ms"]["p99"], ln["queue_wait_ms"]["p99"]]
             for ln in doc.get("lanes", [])]  # fmt: skip
    why = [[ph["phase"], kind, name, n] for ph in doc["phases"] if ph["phase"] != "all"
           for kind, counts in (("refused", ph["reasons"]), ("error", ph["errors"]))
           for name, n in sorted(counts.items())]  # fmt: skip
    p = doc["profile"]
    data = json.dumps(doc).replace("</", "<\\/")
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<title>burstgate loadtest: {escape(p["profile"])}</title><style>{STYLE}</style></head><body>
<h1>burstgate loadtest: {escape(p["profile"])} against {escape(doc["target"])}</h1>
<p class="meta">{doc["requests"]:,} requests in {doc["duration_s"]:.1f} s; {escape(_shape(p))};
seed {p["seed"]}; {doc["completed"]:,} completed (reservations settled).
Latency: the Admit call as the client saw it (including any time the server held it).</p>
<h2>By phase</h2>
{_table(head, rows)}
<h2>By lane (the whole run)</h2>
{
        _table(
            [
                "lane",
                "requests",
                "admitted",
                "refused",
                "held",
                "p50 ms",
                "p99 ms",
                "queue wait p99 ms",
            ],
            lanes,
        )
    }
<h2>Refusals and errors by phase</h2>
{_table(["phase", "outcome", "reason or status", "requests"], why, "why")}
<h2>Over time</h2>
<img alt="offered and admitted rate, latency p99 per lane and calls held over time"
 src="data:image/png;base64,{base64.b64encode(to_png(_figure(doc))).decode()}">
<script type="application/json" id="burstgate-data">{data}</script>
</body></html>
"""
