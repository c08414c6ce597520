"""The load test's report: per phase (base, pulse, recovery, ...) and in
all, the decision latency the client saw (p50/p95/p99/max), decisions by
outcome and reason, the server-side queue waits, refusals and errors; and a
per-second series (offered, admitted, latency p99 in all and per lane, calls
held) for plots.

Latency percentiles are over the calls that got an answer (nearest rank).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from controlplane.loadtest.profile import Phase
from controlplane.loadtest.run import Outcome, RunResult

SCHEMA = "burstgate.loadtest/v1"


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True, slots=True)
class PhaseStats:
    name: str
    seconds: float
    requests: int
    decisions: dict[str, int]
    reasons: dict[str, int]
    errors: dict[str, int]
    latency_ms: dict[str, float | None]
    queue_wait_ms: dict[str, float | None]
    held: int  # answered after waiting in the server's queue
    retries: int = 0  # Admits sent again after a retryable refusal
    served_after_refusal: int = 0
    gave_up: int = 0  # refused, and a retry could no longer meet the SLO

    @property
    def admitted(self) -> int:
        return self.decisions.get("admit", 0)

    @property
    def refused(self) -> int:
        return self.requests - self.admitted - sum(self.errors.values())

    def as_json(self) -> dict[str, Any]:
        return {
            "phase": self.name, "seconds": round(self.seconds, 3), "requests": self.requests,
            "offered_per_s": round(self.requests / self.seconds, 3) if self.seconds else None,
            "admitted": self.admitted, "refused": self.refused,
            "decisions": self.decisions, "reasons": self.reasons, "errors": self.errors,
            "latency_ms": self.latency_ms, "queue_wait_ms": self.queue_wait_ms,
            "held": self.held, "retries": self.retries,
            "served_after_refusal": self.served_after_refusal, "gave_up": self.gave_up,
        }  # fmt: skip


def stats(name: str, seconds: float, outcomes: list[Outcome]) -> PhaseStats:
    answered = [o for o in outcomes if o.decision]
    lat = [o.latency_ms for o in answered]
    waits = [float(o.queue_wait_ms) for o in answered if o.queue_wait_ms > 0]

    def pcts(v: list[float]) -> dict[str, float | None]:
        out = {f"p{q}": percentile(v, q) for q in (50, 95, 99)}
        out["max"] = max(v) if v else None
        return {k: None if x is None else round(x, 3) for k, x in out.items()}

    return PhaseStats(
        name=name,
        seconds=seconds,
        requests=len(outcomes),
        decisions=dict(Counter(o.decision for o in answered)),
        reasons=dict(Counter(o.reason for o in answered if o.decision != "admit")),
        errors=dict(Counter(o.error for o in outcomes if o.error)),
        latency_ms=pcts(lat),
        queue_wait_ms=pcts(waits),
        held=len(waits),
        retries=sum(o.retries for o in outcomes),
        served_after_refusal=sum(o.served_after_refusal for o in outcomes),
        gave_up=sum(o.gave_up for o in outcomes),
    )


def summarize(phases: list[Phase], result: RunResult) -> list[PhaseStats]:
    """One entry per phase name (in order of first appearance), then "all"."""
    names: list[str] = []
    seconds: dict[str, float] = {}
    for p in phases:
        if p.name not in seconds:
            names.append(p.name)
            seconds[p.name] = 0.0
        seconds[p.name] += p.end_s - p.start_s
    by_phase: dict[str, list[Outcome]] = {n: [] for n in names}
    for o in result.outcomes:
        by_phase.setdefault(o.arrival.phase, []).append(o)
    out = [stats(n, seconds[n], by_phase[n]) for n in names]
    total = sum(seconds.values())
    out.append(stats("all", total, result.outcomes))
    return out


def by_lane(phases: list[Phase], result: RunResult) -> list[PhaseStats]:
    """The whole run per lane asked for ("default" = the tenant's own): a
    mixed run's latency percentiles are the slowest lane's otherwise."""
    total = sum(p.end_s - p.start_s for p in phases)
    lanes: dict[str, list[Outcome]] = {}
    for o in result.outcomes:
        lanes.setdefault(o.arrival.tenant.lane or "default", []).append(o)
    return [stats(lane, total, outcomes) for lane, outcomes in sorted(lanes.items())]


def _lane_json(s: PhaseStats) -> dict[str, Any]:
    d = s.as_json()
    return {"lane": d.pop("phase"), **d}


def series(result: RunResult) -> dict[str, Any]:
    """Per second of the run: offered and admitted requests, latency p99 of
    the calls sent in that second, and the most calls held at once."""
    n = max(1, math.ceil(result.duration_s))
    offered = [0] * n
    admitted = [0] * n
    lat: list[list[float]] = [[] for _ in range(n)]
    for o in result.outcomes:
        s = min(n - 1, int(o.arrival.at_s))
        offered[s] += 1
        if o.decision == "admit":
            admitted[s] += 1
        if o.decision:
            lat[s].append(o.latency_ms)
    held = [0] * n
    for t, in_flight, _ in result.samples:
        s = min(n - 1, int(t))
        held[s] = max(held[s], in_flight)
    return {
        "t_s": [float(i) for i in range(n)],
        "offered": [float(x) for x in offered],
        "admitted": [float(x) for x in admitted],
        "latency_p99_ms": [percentile(v, 99) or 0.0 for v in lat],
        "held": [float(x) for x in held],
        "latency_p99_ms_by_lane": _lane_latency(result, n),
    }


def _lane_latency(result: RunResult, n: int) -> dict[str, list[float | None]]:
    """Per lane asked for (as ``by_lane``), the latency p99 of the calls
    sent in each second; None in a second with none of that lane's. The
    lanes' latencies differ by orders of magnitude (premium is answered at
    once, batch may be held for seconds): one p99 for all is the slowest
    lane's."""
    lat: dict[str, list[list[float]]] = {}
    for o in result.outcomes:
        if o.decision:
            lane = o.arrival.tenant.lane or "default"
            lat.setdefault(lane, [[] for _ in range(n)])[min(n - 1, int(o.arrival.at_s))].append(
                o.latency_ms
            )
    return {lane: [percentile(v, 99) for v in seconds] for lane, seconds in sorted(lat.items())}


def to_json(
    target: str, profile: dict[str, Any], phases: list[Phase], result: RunResult
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "target": target,
        "profile": profile,
        "phases_plan": [
            {"phase": p.name, "start_s": p.start_s, "end_s": p.end_s, "rate": p.rate}
            for p in phases
        ],
        "duration_s": round(result.duration_s, 3),
        "requests": len(result.outcomes),
        "completed": sum(o.completed for o in result.outcomes),
        "complete_errors": result.complete_errors,
        "engine_errors": result.engine_errors,
        "batches": result.batches,
        "phases": [s.as_json() for s in summarize(phases, result)],
        "lanes": [_lane_json(s) for s in by_lane(phases, result)],
        "series": series(result),
    }
