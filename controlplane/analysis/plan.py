"""Capacity planning from a request log (SPEC §5).

Demand is expressed in *engines busy*: each second's arriving work divided by
one engine's capacity, either requests/s or prefill and decode tokens/s
(``prompt/prefill_tps + output/decode_tps``: an engine time-shares the two
phases). Work is charged to the second its request arrives; the fluid queue
below carries what does not fit into later seconds.

* Base pool: the busiest 10-minute window's P95 of demand, rounded up.
* Elastic pool: enough on top of the base for the highest second.
* The elastic pool scales on queue wait (not utilisation) and is usable only
  ``lead_time_s`` after the trigger; the simulation shows what that costs,
  next to what a plan from the busiest hour's mean would have missed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from controlplane.analysis.stats import WINDOW_SECONDS, FloatArray, SeriesStats, series_stats
from controlplane.analysis.summary import RateSeries

DEFAULT_LEAD_TIME_S = 180  # typical time to start an engine and load weights
PLAN_PERCENTILE = 95.0  # SPEC §5: base pool sized for P95
HOUR_S = 3600  # a mean-based planner provisions for the busiest hour's mean
# Queue wait (seconds of queued work at current capacity) that triggers
# scale-up: above per-second noise, well below an interactive timeout.
SCALE_UP_QUEUE_WAIT_S = 1.0
# Quiet seconds (no queue, demand within base) before the elastic pool is
# released; releasing too early pays the lead time again on the next burst.
SCALE_DOWN_QUIET_S = 300
# Demand within this of a whole engine rounds down, so float noise in
# e.g. 6.0000000001 does not buy a seventh engine.
ROUNDING_SLACK = 1e-9


@dataclass(frozen=True, slots=True)
class EngineCapacity:
    """What one engine sustains: requests/s, or prefill and decode tokens/s."""

    rps: float | None = None
    prefill_tps: float | None = None
    decode_tps: float | None = None

    def __post_init__(self) -> None:
        by_tokens = self.prefill_tps is not None or self.decode_tps is not None
        if (self.rps is None) == (not by_tokens):
            raise ValueError("give either --rps or both --prefill-tps and --decode-tps")
        if by_tokens and (self.prefill_tps is None or self.decode_tps is None):
            raise ValueError("--prefill-tps and --decode-tps go together")
        for value in (self.rps, self.prefill_tps, self.decode_tps):
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError("engine capacities must be positive numbers")

    def demand(self, series: RateSeries) -> FloatArray:
        """Engines busy per second."""
        if self.rps is not None:
            return series.requests / self.rps
        assert self.prefill_tps is not None and self.decode_tps is not None
        return series.prompt_tokens / self.prefill_tps + series.output_tokens / self.decode_tps

    def describe(self) -> str:
        if self.rps is not None:
            return f"{self.rps:g} requests/s per engine"
        return f"{self.prefill_tps:g} prefill + {self.decode_tps:g} decode tokens/s per engine"


@dataclass(frozen=True, slots=True)
class PlanOutcome:
    """How one provisioning plan would have fared on the log."""

    name: str
    base_engines: int
    max_engines: int
    over_capacity_s: int  # seconds whose arriving work exceeded capacity
    queued_s: int  # seconds ending with work still queued
    max_queue_wait_s: float  # queued work / capacity, at its worst
    scale_ups: int

    @property
    def over_capacity_min(self) -> float:
        return self.over_capacity_s / 60.0


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    capacity: EngineCapacity
    lead_time_s: int
    demand: SeriesStats
    busiest_window: int  # index of the 10-minute window with the highest P95
    window_p95: float  # its P95 demand, engines
    busiest_hour_mean: float
    base_engines: int
    elastic_engines: int
    mean_engines: int
    outcomes: list[PlanOutcome]


def _engines(demand: float) -> int:
    return max(1, math.ceil(demand - ROUNDING_SLACK))


def simulate(
    demand: FloatArray,
    name: str,
    base: int,
    elastic: int = 0,
    lead_time_s: int = 0,
    always_on: bool = False,
) -> PlanOutcome:
    """Fluid queue, one step per second; elastic engines join ``lead_time_s``
    after queue wait first exceeds SCALE_UP_QUEUE_WAIT_S."""
    backlog = 0.0
    elastic_on = always_on
    ready_at: int | None = None
    quiet = 0
    over = queued = scale_ups = 0
    worst_wait = 0.0
    for t, work in enumerate(demand.tolist()):
        if ready_at is not None and t >= ready_at:
            elastic_on, ready_at, quiet = True, None, 0
        capacity = base + (elastic if elastic_on else 0)
        if work > capacity + ROUNDING_SLACK:
            over += 1
        backlog = max(0.0, backlog + work - capacity)
        if backlog > ROUNDING_SLACK:
            queued += 1
        wait = backlog / capacity
        worst_wait = max(worst_wait, wait)
        if elastic and not always_on:
            if not elastic_on and ready_at is None and wait > SCALE_UP_QUEUE_WAIT_S:
                ready_at = t + 1 + lead_time_s
                scale_ups += 1
            if elastic_on:
                quiet = quiet + 1 if backlog <= ROUNDING_SLACK and work <= base else 0
                if quiet >= SCALE_DOWN_QUIET_S:
                    elastic_on = False
    return PlanOutcome(
        name=name,
        base_engines=base,
        max_engines=base + elastic,
        over_capacity_s=over,
        queued_s=queued,
        max_queue_wait_s=worst_wait,
        scale_ups=scale_ups,
    )


def plan_capacity(
    series: RateSeries,
    capacity: EngineCapacity,
    lead_time_s: int = DEFAULT_LEAD_TIME_S,
    window_s: int = WINDOW_SECONDS,
) -> CapacityPlan | None:
    """Recommend base and elastic pools; None for an empty log."""
    if lead_time_s < 0:
        raise ValueError("lead time must be >= 0 seconds")
    demand = capacity.demand(series)
    stats = series_stats(demand)
    if stats is None:
        return None
    window_p95s = [
        float(np.percentile(demand[start : start + window_s], PLAN_PERCENTILE))
        for start in range(0, demand.size, window_s)
    ]
    busiest = int(np.argmax(window_p95s))
    hour_means = [
        float(demand[start : start + HOUR_S].mean()) for start in range(0, demand.size, HOUR_S)
    ]
    base = _engines(window_p95s[busiest])
    elastic = max(0, _engines(stats.max) - base)
    mean_engines = _engines(max(hour_means))
    outcomes = [
        simulate(demand, "mean-based (busiest hour's mean)", mean_engines),
        simulate(demand, "base pool only (10-min P95)", base),
        simulate(demand, "base + elastic, reactive", base, elastic, lead_time_s),
        simulate(demand, "base + elastic, pre-warmed", base, elastic, always_on=True),
    ]
    return CapacityPlan(
        capacity=capacity,
        lead_time_s=lead_time_s,
        demand=stats,
        busiest_window=busiest,
        window_p95=window_p95s[busiest],
        busiest_hour_mean=max(hour_means),
        base_engines=base,
        elastic_engines=elastic,
        mean_engines=mean_engines,
        outcomes=outcomes,
    )
