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
- **Wasted work**: prompt + output tokens the engines served for requests
  that missed their SLO, as a share of all tokens served (an answer that
  comes too late is work the engine could have spent on one in time).
- **Goodput / best**: a run's goodput over the best goodput of the policies
  at the same load and prefill slowdown (the premium-only bound excluded:
  it serves a fifth of the requests and is no policy).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from controlplane.domain.units import NS_PER_MS, NS_PER_S
from controlplane.sim.harness import ABORTED, OUTCOMES, REFUSED, SERVED, Job, SimResult
from controlplane.sim.reuse import ReuseStats


@dataclass(slots=True)
class GroupStats:
    requests: int
    slo_met: int
    attainment: float
    goodput_tps: float
    served: int
    refused: int
    served_after_refusal: int
    aborted: int  # released, then aborted at the engine before it started (drop-late)
    served_tokens: int  # prompt + output tokens of the served requests
    late_tokens: int  # ... of those that missed their SLO (wasted work)
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
    wasted_share: float  # late_tokens / served_tokens, overall
    series: dict[str, list[float]] = field(default_factory=dict)
    # Per lane, the requests that arrived inside an injected burst's window.
    burst_window: dict[str, GroupStats] = field(default_factory=dict)
    # Set by run.simulate: what was run, and against what.
    bound: bool = False  # the premium-only bound, not a policy
    prefill_slowdown: float = 1.0
    profile: str = ""
    client: str = "none"
    arrivals_cv: float = float("nan")  # per-second arrivals of the trace as simulated
    arrivals_peak_to_mean: float = float("nan")
    goodput_vs_best: float = float("nan")  # see mark_best
    # The autoscaler (sim/scaling.py): "off" is a fixed pool of ``engines``.
    autoscale: str = "off"
    engine_seconds: float = 0.0  # engines provisioned x seconds, over the run
    engines_max: int = 0  # the most engines provisioned at once
    scaling: dict[str, Any] = field(default_factory=dict)  # ScalingLoop.summary
    # The prefix caches and the billing drift (sim/reuse.py); None: no cache modelled.
    reuse: ReuseStats | None = None


def _pct(values: list[int], q: float) -> float:
    return float(np.percentile(values, q)) / NS_PER_MS if values else float("nan")


def group_stats(jobs: list[Job], duration_ns: int) -> GroupStats:
    met = [
        j for j in jobs
        if j.outcome == SERVED and j.req.first_token_ns - j.req.arrival_ns <= j.slo_ns
    ]  # fmt: skip
    served = [j for j in jobs if j.outcome == SERVED]
    served_tokens = sum(j.req.prompt + j.req.output for j in served)
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
        refused=sum(1 for j in jobs if j.outcome == REFUSED),
        served_after_refusal=sum(1 for j in served if j.refusals),
        aborted=sum(1 for j in jobs if j.outcome == ABORTED),
        served_tokens=served_tokens,
        late_tokens=served_tokens - tokens,
        ttft_p50_ms=_pct(ttft, 50),
        ttft_p99_ms=_pct(ttft, 99),
        e2e_p50_ms=_pct(e2e, 50),
        e2e_p99_ms=_pct(e2e, 99),
        gate_wait_p50_ms=_pct(gate, 50),
        gate_wait_p99_ms=_pct(gate, 99),
        engine_wait_p50_ms=_pct(eng, 50),
        engine_wait_p99_ms=_pct(eng, 99),
        refusals_by_reason=dict(Counter(j.reason for j in jobs if j.outcome == REFUSED)),
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
    open_jobs = [j for j in jobs if j.outcome not in OUTCOMES]
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
    kv = [float(np.mean(s.kv_usage)) if s.kv_usage else 0.0 for s in result.samples]
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
        wasted_share=overall.late_tokens / overall.served_tokens if overall.served_tokens else 0.0,
        burst_window=burst_window,
        series={
            "t_s": [s.t_ns / NS_PER_S for s in result.samples],
            "engine_queue": [float(d) for d in depth],
            "kv_usage": kv,
            "engines": [float(s.engines) for s in result.samples],
        },
        engine_seconds=result.engine_seconds,
        engines_max=result.engines_max,
        scaling=result.scaling,
    )


def mark_best(group: list[RunStats]) -> None:
    """Set ``goodput_vs_best`` on runs of one load and slowdown: goodput over
    the best policy's (the bound excluded, and left NaN)."""
    best = max((r.overall.goodput_tps for r in group if not r.bound), default=0.0)
    for r in group:
        if not r.bound:
            r.goodput_vs_best = r.overall.goodput_tps / best if best > 0 else float("nan")


def to_json(runs: list[RunStats], *, series: bool = False) -> str:
    out = []
    for r in runs:
        d = asdict(r)
        if not series:
            d.pop("series")
        out.append(d)
    return json.dumps({"runs": out}, indent=2, default=float)
