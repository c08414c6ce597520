"""What a simulation run measured, per lane and tenant, and its renderings.

Definitions (stated in docs/simulate.md as well):

- **SLO attainment**: served requests whose time to first token (from their
  first arrival at the front door, waits and retries included) met their
  lane's TTFT SLO, over all requests of the group; a refused request
  counts as a miss.
- **Goodput**: prompt + output tokens of the requests that met their SLO,
  per second of the run (first arrival to last event).
- **burstgate wait**: front door to release to the pool; **engine wait**:
  release to the engine first scheduling it (its FIFO queue).
- **Jain's fairness index** over tenants' SLO attainment.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np

from controlplane.domain.units import NS_PER_MS, NS_PER_S
from controlplane.sim.harness import Job, SimResult


@dataclass(slots=True)
class GroupStats:
    requests: int
    slo_met: int
    attainment: float
    goodput_tps: float
    served: int
    refused: int
    served_after_refusal: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    gate_wait_p50_ms: float
    gate_wait_p99_ms: float
    engine_wait_p50_ms: float
    engine_wait_p99_ms: float
    refusals_by_reason: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class RunStats:
    policy: str
    load: float
    engines: int
    duration_s: float
    capacity_rps: float
    lanes: dict[str, GroupStats]
    tenants: dict[str, GroupStats]
    overall: GroupStats
    jain_fairness: float
    preemptions: int
    engine_queue_max: int
    engine_queue_mean: float
    kv_usage_mean: float
    kv_usage_max: float
    goodput_vs_capacity: float  # overall goodput / the pool's token capacity
    series: dict[str, list[float]] = field(default_factory=dict)
    # Per lane, the requests that arrived inside an injected burst's window.
    burst_window: dict[str, GroupStats] = field(default_factory=dict)


def _pct(values: list[int], q: float) -> float:
    return float(np.percentile(values, q)) / NS_PER_MS if values else float("nan")


def group_stats(jobs: list[Job], duration_ns: int) -> GroupStats:
    met = [
        j for j in jobs
        if j.outcome == "served" and j.req.first_token_ns - j.req.arrival_ns <= j.slo_ns
    ]  # fmt: skip
    served = [j for j in jobs if j.outcome == "served"]
    ttft = [j.req.first_token_ns - j.req.arrival_ns for j in served]
    e2e = [j.req.done_ns - j.req.arrival_ns for j in served]
    gate = [j.req.released_ns - j.req.arrival_ns for j in served]
    eng = [j.req.started_ns - j.req.released_ns for j in served]
    tokens = sum(j.req.prompt + j.req.output for j in met)
    return GroupStats(
        requests=len(jobs),
        slo_met=len(met),
        attainment=len(met) / len(jobs) if jobs else float("nan"),
        goodput_tps=tokens * NS_PER_S / duration_ns if duration_ns else 0.0,
        served=len(served),
        refused=sum(1 for j in jobs if j.outcome == "refused"),
        served_after_refusal=sum(1 for j in served if j.refusals),
        ttft_p50_ms=_pct(ttft, 50),
        ttft_p99_ms=_pct(ttft, 99),
        e2e_p50_ms=_pct(e2e, 50),
        e2e_p99_ms=_pct(e2e, 99),
        gate_wait_p50_ms=_pct(gate, 50),
        gate_wait_p99_ms=_pct(gate, 99),
        engine_wait_p50_ms=_pct(eng, 50),
        engine_wait_p99_ms=_pct(eng, 99),
        refusals_by_reason=dict(Counter(j.reason for j in jobs if j.outcome == "refused")),
    )


def _by(jobs: Iterable[Job], attr: str) -> dict[str, list[Job]]:
    out: dict[str, list[Job]] = {}
    for j in jobs:
        out.setdefault(getattr(j, attr), []).append(j)
    return out


def jain(values: list[float]) -> float:
    """Jain's index: 1 = perfectly even, 1/n = one gets everything."""
    if not values or not any(values):
        return float("nan")
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def summarise(
    result: SimResult,
    load: float,
    capacity_tokens_per_s: float,
    window_ns: tuple[int, int] | None = None,
) -> RunStats:
    """Everything a run measured; ``window_ns`` = [start, end) of an injected
    burst, whose arrivals are also reported on their own, per lane."""
    jobs = result.jobs
    open_jobs = [j for j in jobs if j.outcome not in ("served", "refused")]
    if open_jobs:
        raise RuntimeError(f"{len(open_jobs)} requests never ended (first: {open_jobs[0]})")
    dur = max(1, result.duration_ns)
    lanes = {k: group_stats(v, dur) for k, v in sorted(_by(jobs, "lane").items())}
    tenants = {k: group_stats(v, dur) for k, v in sorted(_by(jobs, "tenant").items())}
    overall = group_stats(jobs, dur)
    burst_window: dict[str, GroupStats] = {}
    if window_ns is not None:
        inside = [j for j in jobs if window_ns[0] <= j.req.arrival_ns < window_ns[1]]
        burst_window = {k: group_stats(v, dur) for k, v in sorted(_by(inside, "lane").items())}
    depth = [sum(s.queue_depth) for s in result.samples]
    kv = [float(np.mean(s.kv_usage)) for s in result.samples]
    return RunStats(
        policy=result.policy,
        load=load,
        engines=result.engines,
        duration_s=dur / NS_PER_S,
        capacity_rps=result.capacity_rps,
        lanes=lanes,
        tenants=tenants,
        overall=overall,
        jain_fairness=jain([g.attainment for g in tenants.values()]),
        preemptions=result.preemptions,
        engine_queue_max=max(depth, default=0),
        engine_queue_mean=float(np.mean(depth)) if depth else 0.0,
        kv_usage_mean=float(np.mean(kv)) if kv else 0.0,
        kv_usage_max=max(kv, default=0.0),
        goodput_vs_capacity=overall.goodput_tps / capacity_tokens_per_s
        if capacity_tokens_per_s
        else float("nan"),
        burst_window=burst_window,
        series={
            "t_s": [s.t_ns / NS_PER_S for s in result.samples],
            "engine_queue": [float(d) for d in depth],
            "kv_usage": kv,
        },
    )


def to_json(runs: list[RunStats], *, series: bool = False) -> str:
    out = []
    for r in runs:
        d = asdict(r)
        if not series:
            d.pop("series")
        out.append(d)
    return json.dumps({"runs": out}, indent=2, default=float)


# The comparison tables' columns and cells: the terminal table and the HTML
# report print the very same strings.
LANE_HEAD = (
    "load", "policy", "lane", "SLO met", "goodput tok/s", "TTFT p50/p99 ms",
    "gate wait p99 ms", "engine wait p99 ms", "refused", "served after refusal",
)  # fmt: skip
SUMMARY_HEAD = (
    "load", "policy", "goodput / capacity", "Jain (tenants)", "preemptions",
    "engine queue max / mean", "KV usage mean / max",
)  # fmt: skip


def lane_cells(r: RunStats, lane: str, g: GroupStats) -> tuple[str, ...]:
    return (
        f"{r.load:g}x", r.policy, lane, f"{g.attainment:.1%}", f"{g.goodput_tps:,.0f}",
        f"{g.ttft_p50_ms:,.0f} / {g.ttft_p99_ms:,.0f}", f"{g.gate_wait_p99_ms:,.0f}",
        f"{g.engine_wait_p99_ms:,.0f}", f"{g.refused / max(1, g.requests):.1%}",
        str(g.served_after_refusal),
    )  # fmt: skip


def summary_cells(r: RunStats) -> tuple[str, ...]:
    return (
        f"{r.load:g}x", r.policy, f"{r.goodput_vs_capacity:.0%}", f"{r.jain_fairness:.3f}",
        f"{r.preemptions:,}", f"{r.engine_queue_max:,} / {r.engine_queue_mean:,.1f}",
        f"{r.kv_usage_mean:.0%} / {r.kv_usage_max:.0%}",
    )  # fmt: skip


def _row(cells: tuple[str, ...]) -> str:
    return "| " + " | ".join(cells) + " |"


BURST_HEAD = ("load", "policy", "lane", "requests", "SLO met", "refused")
BURST_TITLE = "Requests that arrived inside the injected burst's window:"
Section = tuple[str, tuple[str, ...], list[tuple[str, ...]]]


def sections(runs: list[RunStats]) -> list[Section]:
    """The comparison as (title, head, rows) tables: per run and lane, the
    injected burst's window (when there is one), and the per-run summary.
    The CLI draws them with its table renderer, or as Markdown."""
    lanes = [
        lane_cells(r, lane, g) for r in runs for lane, g in [*r.lanes.items(), ("all", r.overall)]
    ]
    out: list[Section] = [("", LANE_HEAD, lanes)]
    windowed = [r for r in runs if r.burst_window]
    if windowed:
        burst: list[tuple[str, ...]] = [
            (f"{r.load:g}x", r.policy, lane, f"{g.requests:,}", f"{g.attainment:.1%}",
             f"{g.refused / max(1, g.requests):.1%}")
            for r in windowed
            for lane, g in r.burst_window.items()
        ]  # fmt: skip
        out.append((BURST_TITLE, BURST_HEAD, burst))
    out.append(("", SUMMARY_HEAD, [summary_cells(r) for r in runs]))
    return out


def to_table(runs: list[RunStats]) -> str:
    """The comparison as Markdown tables (``simulate --markdown``: for docs)."""
    lines: list[str] = []
    for title, head, rows in sections(runs):
        if lines:
            lines.append("")
        if title:
            lines += [title, ""]
        lines += [_row(head), "|" + "---|" * len(head)]
        lines += [_row(cells) for cells in rows]
    return "\n".join(lines)
