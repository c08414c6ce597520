"""Self-contained HTML report of ``burstgate simulate``: the run parameters,
the per-lane and summary tables (the figures of ``to_table``) and PNG plots
embedded as base64 data URIs, so the one file can be mailed or attached to a
ticket. No network, no scripts; the ``--json`` document is embedded in
``<script type="application/json" id="burstgate-data">`` for tools.

Figures follow controlplane/analysis/plots.py: ``matplotlib.figure.Figure``
on an explicit Agg canvas, no pyplot and no global state.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from html import escape
from typing import TypeVar

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from controlplane.analysis.plots import DPI, to_png
from controlplane.sim.report import GroupStats, RunStats, to_json
from controlplane.sim.tables import (
    LANE_HEAD,
    RUNS_HEAD,
    SUMMARY_HEAD,
    at,
    comparison,
    lane_rows,
    policy_label,
    reuse_sections,
    runs_rows,
    summary_cells,
)

PANEL = (4.4, 3.3)  # inches per panel; three panels a row fill ~1000 px
MAX_COLS = 3
MAX_POINTS = 4000  # above this a time series is drawn as the max per bucket of samples
# tab10: the same policy has the same colour in every figure
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
LINESTYLES = ("-", "--", ":", "-.")  # policies with identical series stay visible

_STYLE = """
body{font:15px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:1080px;
padding:0 1rem;color:#222}
h1{margin-bottom:.2rem}h2{border-bottom:2px solid #ddd;padding-bottom:.2rem;margin-top:2.2rem}
table{border-collapse:collapse;margin:.6rem 0;font-variant-numeric:tabular-nums}
th,td{padding:.2rem .6rem;border-bottom:1px solid #eee;text-align:right}
th:nth-child(-n+3),td:nth-child(-n+3){text-align:left}
img{max-width:100%;border:1px solid #eee;margin:.4rem 0}
.meta{color:#666}code{background:#f4f4f4;padding:0 .2rem}
"""


T = TypeVar("T")


def _unique(values: list[T]) -> list[T]:
    return list(dict.fromkeys(values))


def _lanes(runs: list[RunStats]) -> list[str]:
    return _unique([lane for r in runs for lane in r.lanes])


def _group(run: RunStats, lane: str) -> GroupStats | None:
    return run.overall if lane == "all" else run.lanes.get(lane)


# ---- tables: the cells of to_table() (report.py), as HTML ----


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


# ---- figures ----


def _panels(n: int, width: float = PANEL[0]) -> tuple[Figure, list[Axes]]:
    cols = min(n, MAX_COLS)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(width * cols, PANEL[1] * rows + 0.5), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.subplots(rows, cols, squeeze=False, sharey=True)
    axes = [ax for row in grid for ax in row]
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _ylabel(axes: list[Axes], text: str) -> None:
    for ax in axes:
        spec = ax.get_subplotspec()
        if spec is not None and spec.is_first_col():
            ax.set_ylabel(text)


def _legend(fig: Figure, ax: Axes) -> None:
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncols=min(len(labels), 6),
               fontsize=8, frameon=False)  # fmt: skip


def _bars(
    ax: Axes, groups: list[str], policies: list[str], value: Callable[[str, str], float]
) -> None:
    """Grouped bars: one group per label, one bar per policy in it."""
    x = np.arange(len(groups))
    width = 0.8 / max(1, len(policies))
    for i, policy in enumerate(policies):
        heights = [value(policy, g) for g in groups]
        ax.bar(x + (i - (len(policies) - 1) / 2) * width, heights, width=width,
               color=COLOURS[i % len(COLOURS)], label=policy)  # fmt: skip
    ax.set_xticks(x, groups)


def _find(runs: list[RunStats], policy: str, panel: str) -> RunStats | None:
    """The run of ``policy`` (its table label) in ``panel`` (its load, and
    prefill slowdown when there is one: ``tables.at``)."""
    return next((r for r in runs if policy_label(r) == policy and at(r) == panel), None)


def _policies(runs: list[RunStats]) -> list[str]:
    return _unique([policy_label(r) for r in runs])


def _panels_of(runs: list[RunStats]) -> list[str]:
    return _unique([at(r) for r in runs])


def _lane_figure(
    runs: list[RunStats], metric: Callable[[GroupStats], float], ylabel: str, log: bool
) -> bytes:
    lanes = [*_lanes(runs), "all"]
    policies = _policies(runs)
    loads = _panels_of(runs)
    fig, axes = _panels(len(loads))
    for ax, load in zip(axes, loads, strict=True):

        def value(policy: str, lane: str, load: str = load) -> float:
            r = _find(runs, policy, load)
            g = _group(r, lane) if r is not None else None
            v = metric(g) if g is not None else math.nan
            return v if v > 0 or not log else math.nan  # nothing to draw on a log axis

        _bars(ax, lanes, policies, value)
        ax.set_title(f"load {load} capacity")
        ax.set_xlabel("lane")
        if log and any(value(p, lane) > 0 for p in policies for lane in lanes):
            ax.set_yscale("log")
    _ylabel(axes, ylabel)
    _legend(fig, axes[0])
    return to_png(fig)


def attainment_figure(runs: list[RunStats]) -> bytes:
    return _lane_figure(runs, lambda g: 100 * g.attainment, "SLO attainment (% of requests)", False)


def ttft_figure(runs: list[RunStats]) -> bytes:
    return _lane_figure(runs, lambda g: g.ttft_p99_ms, "TTFT p99 (ms, log scale)", True)


def goodput_figure(runs: list[RunStats]) -> bytes:
    fig, (ax,) = _panels(1, width=2 * PANEL[0])
    labels = _panels_of(runs)

    def value(policy: str, label: str) -> float:
        r = _find(runs, policy, label)
        return r.overall.goodput_tps if r is not None else math.nan

    _bars(ax, labels, _policies(runs), value)
    capacity = [r.overall.goodput_tps / r.goodput_vs_capacity for r in runs
                if r.goodput_vs_capacity > 0]  # fmt: skip
    if capacity:
        ax.axhline(capacity[0], color="#636363", ls="--", lw=1, label="pool token capacity")
    ax.set_xlabel("load (x the pool's capacity)")
    ax.set_ylabel("goodput (tokens/s)")
    ax.set_title("Goodput: tokens/s of the requests that met their SLO")
    _legend(fig, ax)
    return to_png(fig)


def _thin(t: list[float], y: list[float]) -> tuple[np.ndarray, np.ndarray, int]:
    """(times, values, samples per point): the max of each bucket keeps the peaks."""
    ts, ys = np.asarray(t, dtype=np.float64), np.asarray(y, dtype=np.float64)
    step = max(1, math.ceil(ts.size / MAX_POINTS))
    if step == 1:
        return ts, ys, 1
    usable = ts.size // step * step
    return ts[:usable:step], ys[:usable].reshape(-1, step).max(axis=1), step


def series_figure(runs: list[RunStats], key: str, ylabel: str, scale: float = 1.0) -> bytes:
    policies = _policies(runs)
    loads = _panels_of(runs)
    fig, axes = _panels(len(loads))
    for ax, load in zip(axes, loads, strict=True):
        steps = 1
        for i, policy in enumerate(policies):
            r = _find(runs, policy, load)
            if r is None:
                continue
            t, y, step = _thin(r.series.get("t_s", []), r.series.get(key, []))
            steps = max(steps, step)
            ax.plot(t, y * scale, lw=1.2, color=COLOURS[i % len(COLOURS)],
                    ls=LINESTYLES[i % len(LINESTYLES)], label=policy)  # fmt: skip
        note = f" (max per {steps} samples)" if steps > 1 else ""
        ax.set_title(f"load {load} capacity{note}")
        ax.set_xlabel("simulated time (s)")
    _ylabel(axes, ylabel)
    _legend(fig, axes[0])
    return to_png(fig)


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{data}">'


# ---- the page ----


def _header(runs: list[RunStats], title: str, command: str) -> str:
    first = runs[0]
    loads = ", ".join(f"{load:g}x" for load in _unique([r.load for r in runs]))
    items = [
        ("command", f"<code>{escape(command)}</code>"),
        ("engines", f"{first.engines:,} ({escape(first.profile)})"),
        ("clients", escape(first.client)),
        ("pool capacity", f"{first.capacity_rps:,.1f} requests/s (measured on this trace's mix)"),
        ("loads", escape(f"{loads} (x the pool's capacity)")),
        ("policies", escape(", ".join(_policies(runs)))),
        ("requests per run", f"{first.overall.requests:,}"),
    ]
    rows = "".join(f"<tr><td>{escape(k)}</td><td>{v}</td></tr>" for k, v in items)
    return (
        f"<h1>{escape(title)}</h1><table>{rows}</table>"
        '<p class="meta">SLO attainment: requests whose time to first token (from first arrival, '
        "waits and retries included) met their lane's SLO, over all requests; a refusal is a "
        "miss. Goodput: prompt + output tokens of those requests per second of the run. "
        "Definitions: docs/simulate.md.</p>"
    )


def render_html(runs: list[RunStats], *, title: str, command: str) -> str:
    """The whole page, one string; every text from the runs or the caller is escaped."""
    if not runs:
        raise ValueError("render_html: no runs to report")
    plots = [
        ("SLO attainment per lane", attainment_figure(runs)),
        ("Goodput per policy and load", goodput_figure(runs)),
        ("TTFT p99 per lane", ttft_figure(runs)),
        ("Engine queue depth over time",
         series_figure(runs, "engine_queue", "requests waiting in engine queues")),
        ("KV cache usage over time",
         series_figure(runs, "kv_usage", "KV cache usage (%, mean over engines)", 100.0)),
    ]  # fmt: skip
    body = [
        _header(runs, title, command),
        "<h2>Runs</h2>" + _table(RUNS_HEAD, runs_rows(runs)),
        "<h2>Comparison</h2>" + _table(*comparison(runs)[1:]),
        "<h2>Per lane</h2>" + _table(LANE_HEAD, lane_rows(runs)),
        "<h2>Summary</h2>" + _table(SUMMARY_HEAD, [summary_cells(r) for r in runs]),
        # the prefix cache's and the billing drift's tables, when one was modelled
        *(
            f"<h2>{escape(name)}</h2>" + _table(head, rows)
            for name, head, rows in (
                reuse_sections(runs) if any(r.reuse is not None for r in runs) else []
            )
        ),
        *(f"<h2>{escape(name)}</h2>{_img(png, name)}" for name, png in plots),
    ]
    data = to_json(runs).replace("</", "<\\/")
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>"
        + "".join(body)
        + f'<script type="application/json" id="burstgate-data">{data}</script>'
        + "</body></html>\n"
    )
