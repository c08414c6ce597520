"""The tables of ``burstgate simulate``: the terminal listing, ``--markdown``
and the HTML report print the very same strings.

- **runs**: per load and prefill slowdown, the pool's measured capacity and
  the arrivals as simulated (per-second CV and peak/mean);
- **comparison** (one per trace): rows grouped by load and prefill slowdown,
  a column per policy with the premium-only bound last; per group, SLO
  attainment per lane, goodput as a share of capacity and against the best
  policy, wasted work, refusals and aborts, and requests served after a
  refusal;
- per run and lane; the injected burst's window (when there is one); the
  per-run summary;
- with a prefix cache (a trace with block ids): its hit rate per run and
  lane, and per pricing window its hit rate, prefill cost, the miss rate
  reported and the multiplier in force, and the billing drift under fixed
  and dynamic prices (sim/reuse.py defines them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from controlplane.sim.report import GroupStats, RunStats

Section = tuple[str, tuple[str, ...], list[tuple[str, ...]]]
LANE_ORDER = ("premium", "standard", "batch")  # the default lanes, highest first
NONE = "-"  # a figure that does not apply (the bound's other lanes)


def at(r: RunStats) -> str:
    """A run's load, and its prefill slowdown when there is one."""
    slow = "" if r.prefill_slowdown == 1 else f", prefill x{r.prefill_slowdown:g}"
    return f"{r.load:g}x{slow}"


def policy_label(r: RunStats) -> str:
    if r.bound:
        return f"{r.policy} (bound)"
    return r.policy if r.autoscale == "off" else f"{r.policy} +{r.autoscale}"


def _unique(values: list[str]) -> list[str]:
    return list(dict.fromkeys(values))


def _lanes(runs: list[RunStats]) -> list[str]:
    seen = _unique([lane for r in runs for lane in r.lanes])
    return [lane for lane in LANE_ORDER if lane in seen] + sorted(set(seen) - set(LANE_ORDER))


# ---- runs ----

RUNS_HEAD = ("load", "prefill x", "capacity req/s", "requests", "arrivals/s CV", "peak / mean")


def runs_rows(runs: list[RunStats]) -> list[tuple[str, ...]]:
    out: dict[tuple[float, float], tuple[str, ...]] = {}
    for r in runs:
        key = (r.load, r.prefill_slowdown)
        if r.bound or key in out:
            continue
        out[key] = (
            f"{r.load:g}x", f"{r.prefill_slowdown:g}", f"{r.capacity_rps:,.1f}",
            f"{r.overall.requests:,}", f"{r.arrivals_cv:.2f}", f"{r.arrivals_peak_to_mean:.1f}",
        )  # fmt: skip
    return list(out.values())


# ---- the comparison: a column per policy ----


def _pct(x: float) -> str:
    return NONE if math.isnan(x) else f"{100 * x:.1f}"


def _slo(lanes: list[str]) -> Callable[[RunStats], str]:
    def cell(r: RunStats) -> str:
        return " / ".join(_pct(r.lanes[n].attainment) if n in r.lanes else NONE for n in lanes)

    return cell


def _refused_aborted(r: RunStats) -> str:
    o, n = r.overall, max(1, r.overall.requests)
    return f"{o.refused / n:.1%} / {o.aborted / n:.1%}"


def _engines(r: RunStats) -> str:
    return f"{r.engine_seconds:,.0f} / {r.engines_max}"


def comparison(runs: list[RunStats]) -> Section:
    lanes = _lanes(runs)
    metrics: list[tuple[str, Callable[[RunStats], str]]] = [
        (f"SLO met % ({' / '.join(lanes)})", _slo(lanes)),
        ("goodput / capacity", lambda r: f"{r.goodput_vs_capacity:.0%}"),
        ("goodput / best policy", lambda r: NONE if r.bound else f"{r.goodput_vs_best:.2f}"),
        ("wasted: tokens served late", lambda r: f"{r.wasted_share:.1%}"),
        ("refused / aborted", _refused_aborted),
        ("served after a refusal", lambda r: f"{r.overall.served_after_refusal:,}"),
        ("engine-seconds / engines max", _engines),
    ]
    labels = _unique([policy_label(r) for r in runs if not r.bound])
    labels += _unique([policy_label(r) for r in runs if r.bound])
    cells = {(r.load, r.prefill_slowdown, policy_label(r)): r for r in runs}
    groups = list(dict.fromkeys((r.load, r.prefill_slowdown) for r in runs))
    rows: list[tuple[str, ...]] = []
    for load, slow in groups:
        for i, (name, cell) in enumerate(metrics):
            found = [cells.get((load, slow, label)) for label in labels]
            head = (f"{load:g}x", f"{slow:g}") if i == 0 else ("", "")
            rows.append((*head, name, *(NONE if r is None else cell(r) for r in found)))
    title = "Comparison (goodput / best: against the best policy at that load; bound excluded):"
    return title, ("load", "prefill x", "", *labels), rows


# ---- per run and lane, and the summary ----

LANE_HEAD = (
    "load", "policy", "lane", "SLO met", "goodput tok/s", "TTFT p50/p99 ms",
    "gate wait p99 ms", "engine wait p99 ms", "refused", "served after refusal", "aborted",
)  # fmt: skip
SUMMARY_HEAD = (
    "load", "policy", "goodput / capacity", "Jain (tenants)", "preemptions",
    "engine queue max / mean", "KV usage mean / max", "goodput / best", "wasted",
)  # fmt: skip


def lane_cells(r: RunStats, lane: str, g: GroupStats) -> tuple[str, ...]:
    return (
        at(r), policy_label(r), lane, f"{g.attainment:.1%}", f"{g.goodput_tps:,.0f}",
        f"{g.ttft_p50_ms:,.0f} / {g.ttft_p99_ms:,.0f}", f"{g.gate_wait_p99_ms:,.0f}",
        f"{g.engine_wait_p99_ms:,.0f}", f"{g.refused / max(1, g.requests):.1%}",
        str(g.served_after_refusal), f"{g.aborted / max(1, g.requests):.1%}",
    )  # fmt: skip


def summary_cells(r: RunStats) -> tuple[str, ...]:
    best = NONE if math.isnan(r.goodput_vs_best) else f"{r.goodput_vs_best:.2f}"
    return (
        at(r), policy_label(r), f"{r.goodput_vs_capacity:.0%}", f"{r.jain_fairness:.3f}",
        f"{r.preemptions:,}", f"{r.engine_queue_max:,} / {r.engine_queue_mean:,.1f}",
        f"{r.kv_usage_mean:.0%} / {r.kv_usage_max:.0%}", best, f"{r.wasted_share:.1%}",
    )  # fmt: skip


def lane_rows(runs: list[RunStats]) -> list[tuple[str, ...]]:
    return [
        lane_cells(r, lane, g) for r in runs for lane, g in [*r.lanes.items(), ("all", r.overall)]
    ]


SCALING_HEAD = (
    "load", "policy", "engine-seconds", "vs off", "engines max", "scale-ups",
    "forecast alarms", "false alarms", "lead time p50 s", "fell back at s",
)  # fmt: skip
SCALING_TITLE = (
    "Autoscaling (vs off: engine-seconds over the same policy's fixed pool; false alarms: "
    "forecast scale-ups the reactive signal never reached, ceiling 5 %):"
)


def _opt(x: Any, fmt: str) -> str:
    return NONE if x is None else format(x, fmt)


def scaling_rows(runs: list[RunStats]) -> list[tuple[str, ...]]:
    fixed = {(r.load, r.prefill_slowdown, r.policy): r for r in runs if r.autoscale == "off"}
    out: list[tuple[str, ...]] = []
    for r in runs:
        if r.bound:
            continue
        base = fixed.get((r.load, r.prefill_slowdown, r.policy))
        ratio = (
            f"{r.engine_seconds / base.engine_seconds:.0%}"
            if base and base.engine_seconds
            else NONE
        )
        sc = r.scaling
        rate = sc.get("false_alarm_rate")
        out.append((
            at(r), policy_label(r), f"{r.engine_seconds:,.0f}", ratio, str(r.engines_max),
            str(sc.get("scale_ups", NONE)), str(sc.get("alarms", NONE)),
            NONE if rate is None else f"{sc['false_alarms']} ({rate:.1%})",
            _opt(sc.get("lead_time_median_s"), ".0f"), _opt(sc.get("fell_back_at_s"), ",.0f"),
        ))  # fmt: skip
    return out


BURST_HEAD = ("load", "policy", "lane", "requests", "SLO met", "refused", "aborted")
BURST_TITLE = "Requests that arrived inside the injected burst's window:"


def sections(runs: list[RunStats]) -> list[Section]:
    """Every table as (title, head, rows): the runs, the comparison, per
    run and lane, the injected burst's window (when there is one) and the
    per-run summary. The CLI draws them with its table renderer, or as
    Markdown; the HTML report as HTML."""
    out: list[Section] = [
        ("Runs (capacity measured on the engines modelled; arrivals as simulated):",
         RUNS_HEAD, runs_rows(runs)),
        comparison(runs),
        ("Per run and lane:", LANE_HEAD, lane_rows(runs)),
    ]  # fmt: skip
    windowed = [r for r in runs if r.burst_window]
    if windowed:
        burst: list[tuple[str, ...]] = [
            (at(r), policy_label(r), lane, f"{g.requests:,}", f"{g.attainment:.1%}",
             f"{g.refused / max(1, g.requests):.1%}", f"{g.aborted / max(1, g.requests):.1%}")
            for r in windowed
            for lane, g in r.burst_window.items()
        ]  # fmt: skip
        out.append((BURST_TITLE, BURST_HEAD, burst))
    if any(r.autoscale != "off" for r in runs):
        out.append((SCALING_TITLE, SCALING_HEAD, scaling_rows(runs)))
    out.append(("Per run:", SUMMARY_HEAD, [summary_cells(r) for r in runs]))
    if any(r.reuse is not None for r in runs):
        out += reuse_sections(runs)
    return out


# ---- the prefix cache and the billing drift (sim/reuse.py) ----

REUSE_LANE_HEAD = (
    "load", "policy", "lane", "requests", "prompt tokens", "cache hit rate",
    "prefill computed / asked",
)  # fmt: skip
WINDOW_HEAD = (
    "load", "policy", "window s", "hit rate", "prefill computed / asked",
    "prefill ms / 1k tok", "miss rate reported", "multiplier",
)  # fmt: skip
DRIFT_HEAD = (
    "load", "policy", "window s", "settled", "actual cost", "charge fixed", "charge dynamic",
    "cost / charge fixed", "cost / charge dynamic", "drift fixed", "drift dynamic",
)  # fmt: skip
DRIFT_SUMMARY_HEAD = (
    "load", "policy", "hit rate", "burst windows s", "burst drift fixed",
    "burst drift dynamic", "max drift fixed", "max drift dynamic",
)  # fmt: skip


def _f(x: float, fmt: str) -> str:
    return NONE if math.isnan(x) else format(x, fmt)


def _drift(x: float) -> str:
    return NONE if math.isnan(x) else f"{100 * x:+.1f}%"


def reuse_sections(runs: list[RunStats]) -> list[Section]:
    cached = [r for r in runs if r.reuse is not None]
    lanes: list[tuple[str, ...]] = []
    windows: list[tuple[str, ...]] = []
    drift: list[tuple[str, ...]] = []
    summary: list[tuple[str, ...]] = []
    for r in cached:
        u = r.reuse
        assert u is not None
        for lane, g in [*u.lanes.items()]:
            lanes.append((at(r), policy_label(r), lane, f"{g.requests:,}", f"{g.prompt_tokens:,}",
                          _f(g.hit_rate, ".1%"), _f(g.computed_over_asked, ".2f")))  # fmt: skip
        for w in u.windows:
            start = f"{w.start_s:,.0f}"
            windows.append((
                at(r), policy_label(r), start, _f(w.hit_rate, ".1%"),
                _f(w.computed_over_asked, ".2f"), _f(w.prefill_ms_per_ktok, ",.1f"),
                _f(w.miss_reported, ".3f"), f"{w.multiplier:g}",
            ))  # fmt: skip
            drift.append((
                at(r), policy_label(r), start, f"{w.settled:,}", f"{w.cost:,.4f}",
                f"{w.charge_fixed:,.4f}", f"{w.charge_dynamic:,.4f}", _f(w.ratio_fixed, ".3f"),
                _f(w.ratio_dynamic, ".3f"), _drift(w.drift_fixed), _drift(w.drift_dynamic),
            ))  # fmt: skip
        summary.append((
            at(r), policy_label(r), _f(u.hit_rate, ".1%"),
            ", ".join(f"{s:,.0f}" for s in u.burst_windows) or NONE,
            _drift(u.burst_drift_fixed), _drift(u.burst_drift_dynamic),
            _drift(u.max_drift_fixed), _drift(u.max_drift_dynamic),
        ))  # fmt: skip
    u0 = cached[0].reuse
    assert u0 is not None
    every = f"pricing windows of {u0.window_s} s"
    out: list[Section] = [
        (f"Prefix cache per run and lane ({u0.block_tokens}-token blocks; served requests):",
         REUSE_LANE_HEAD, lanes),
        (f"Prefix cache over time ({every}; the multiplier in force, set by the previous "
         "window's reported miss rate):", WINDOW_HEAD, windows),
        (f"Billing drift ({every}, by completion; {u0.currency}; the ledger's user_charge and "
         "actual_cost; drift: cost / charge against the fixed price's median window before "
         "the burst):",
         DRIFT_HEAD, drift),
        ("Billing drift, per run (burst: the mean absolute drift of the windows overlapping "
         "the injected burst; max: the largest absolute drift of any window):",
         DRIFT_SUMMARY_HEAD, summary),
    ]  # fmt: skip
    return out


def _row(cells: tuple[str, ...]) -> str:
    return "| " + " | ".join(cells) + " |"


def to_table(runs: list[RunStats]) -> str:
    """Every table as Markdown (``simulate --markdown``: for docs)."""
    lines: list[str] = []
    for title, head, rows in sections(runs):
        if lines:
            lines.append("")
        if title:
            lines += [title, ""]
        lines += [_row(head), "|" + "---|" * len(head)]
        lines += [_row(cells) for cells in rows]
    return "\n".join(lines)
