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
* The same pools under the autoscaler the shipped KEDA/HPA recipes apply
  (controlplane/domain/autoscaler.py), on burstgate's desired engines
  (reactive) or also on its forecast (predictive).

Every plan is also costed in **engine-hours**: engines provisioned times
seconds of the log, an engine that is still starting included (it is paid
for from the moment it is asked for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from controlplane.analysis.stats import WINDOW_SECONDS, FloatArray, SeriesStats, series_stats
from controlplane.analysis.summary import RateSeries
from controlplane.domain.autoscaler import (
    DEFAULT_INTERVAL_S,
    DEFAULT_SCALE_DOWN_DELAY_S,
    Autoscaler,
    ScalerParams,
    engines_for,
)
from controlplane.domain.holt import HOLT_DEFAULTS, HoltForecaster, HoltParams
from controlplane.domain.units import NS_PER_S

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
# The control plane's defaults for the autoscaling signals: desired engines
# is ceil(demand / (per-engine rate * U)) with U =
# BURSTGATE_AUTOSCALE_TARGET_UTILIZATION (settings.py's default, 0.8), over
# the last DEMAND_WINDOW_S seconds (service/demand.py DESIRED_WINDOW_S). Here demand is
# already in engines busy, so the per-engine rate is 1.
TARGET_UTILIZATION = 0.8
DEMAND_WINDOW_S = 60
# The recipes' autoscaler: evaluated every 15 s (the HPA's sync period),
# down only to the highest recommendation of the last 300 s.
AUTOSCALE_INTERVAL_S = int(DEFAULT_INTERVAL_S)
AUTOSCALE_DOWN_DELAY_S = DEFAULT_SCALE_DOWN_DELAY_S
SECONDS_PER_HOUR = 3600.0
# Outcome names the terminal and JSON output refer to.
QUEUE_WAIT_NAME = "base + elastic on queue wait"
REACTIVE_NAME = "autoscaled on desired engines (reactive)"
PREDICTIVE_NAME = "autoscaled on the forecast (predictive)"
ALWAYS_ON_NAME = "base + elastic, always on (no autoscaler)"


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
    # Engines provisioned x seconds of the log, in hours; an engine counts
    # from the moment it is asked for (starting engines are paid for).
    engine_hours: float

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
    demand_engine_hours: float  # the work itself: engines busy x seconds, in hours

    @property
    def always_on(self) -> PlanOutcome | None:
        """The reference: base + elastic all the time, no autoscaler."""
        return next((o for o in self.outcomes if o.name == ALWAYS_ON_NAME), None)

    def engine_hours_ratio(self, outcome: PlanOutcome) -> float | None:
        """``outcome``'s engine-hours over the always-on reference's."""
        ref = self.always_on
        if ref is None or ref.engine_hours <= 0:
            return None
        return outcome.engine_hours / ref.engine_hours


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
    after queue wait first exceeds SCALE_UP_QUEUE_WAIT_S. They are paid for
    from the second after the trigger (during the lead time too) until
    released."""
    backlog = 0.0
    elastic_on = always_on
    ready_at: int | None = None
    quiet = 0
    over = queued = scale_ups = 0
    engine_seconds = 0
    worst_wait = 0.0
    for t, work in enumerate(demand.tolist()):
        if ready_at is not None and t >= ready_at:
            elastic_on, ready_at, quiet = True, None, 0
        capacity = base + (elastic if elastic_on else 0)
        engine_seconds += base + (elastic if elastic_on or ready_at is not None else 0)
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
        engine_hours=engine_seconds / SECONDS_PER_HOUR,
    )


def simulate_autoscaled(
    demand: FloatArray,
    name: str,
    base: int,
    elastic: int,
    lead_time_s: int,
    *,
    predictive: bool = False,
    target_utilization: float = TARGET_UTILIZATION,
    scale_down_delay_s: float = AUTOSCALE_DOWN_DELAY_S,
    interval_s: int = AUTOSCALE_INTERVAL_S,
    demand_window_s: int = DEMAND_WINDOW_S,
    rate_limits: bool = True,
) -> PlanOutcome:
    """The fluid queue under the recipes' autoscaler (domain/autoscaler.py),
    from ``base`` engines (its minimum, warm) up to ``base + elastic``.

    At the start of every ``interval_s``-th second it is given the plane's
    desired engines, ceil(mean demand of the last ``demand_window_s`` completed
    seconds / U); ``predictive`` also the forecast's, ceil(Holt forecast
    ``lead_time_s`` ahead / U) (the forecaster fed each completed second,
    from 0 like service/demand.py's), and takes the larger. Engines asked
    for serve ``lead_time_s`` later and are paid for from the moment they
    are asked for. A scale-down cancels engines still starting first (the
    last asked first), then removes ready ones at once: the fluid model has
    no draining.
    """
    if not 0 < target_utilization <= 1:
        raise ValueError("target utilisation must be in (0, 1]")
    scaler = Autoscaler(
        ScalerParams(
            min_engines=base,
            max_engines=base + max(0, elastic),
            engine_startup_s=float(lead_time_s),
            scale_down_delay_s=scale_down_delay_s,
            interval_s=float(interval_s),
            # the recipes' Pods policies (ScalerParams' defaults), or none
            **({} if rate_limits else {"up_pods": 0, "down_pods": 0}),
        )
    )
    forecaster = HoltForecaster(HoltParams(*HOLT_DEFAULTS))
    forecaster.update(0.0)  # nothing was asked before the log's first second
    horizon = max(1, lead_time_s)
    values = demand.tolist()
    ready = base
    pending: list[int] = []  # seconds from which engines asked for serve
    window_sum = 0.0  # demand of the last demand_window_s completed seconds
    backlog = 0.0
    over = queued = scale_ups = 0
    engine_seconds = 0
    worst_wait = 0.0
    for t, work in enumerate(values):
        if t % interval_s == 0:
            seen = min(t, demand_window_s)
            mean = window_sum / seen if seen else 0.0
            want = engines_for(mean, 1.0, target_utilization)
            if predictive:
                forecast = forecaster.forecast(horizon)
                want = max(want, engines_for(forecast, 1.0, target_utilization))
            asked = ready + len(pending)
            target = scaler.decide(t * NS_PER_S, want)
            if target > asked:
                pending.extend([t + lead_time_s] * (target - asked))
                scale_ups += 1
            elif target < asked:
                cancel = min(asked - target, len(pending))
                del pending[len(pending) - cancel :]
                ready -= asked - target - cancel
        while pending and pending[0] <= t:
            pending.pop(0)
            ready += 1
        engine_seconds += ready + len(pending)
        if work > ready + ROUNDING_SLACK:
            over += 1
        backlog = max(0.0, backlog + work - ready)
        if backlog > ROUNDING_SLACK:
            queued += 1
        worst_wait = max(worst_wait, backlog / ready)
        forecaster.update(work)
        window_sum += work
        if t >= demand_window_s:
            window_sum -= values[t - demand_window_s]
    return PlanOutcome(
        name=name,
        base_engines=base,
        max_engines=base + max(0, elastic),
        over_capacity_s=over,
        queued_s=queued,
        max_queue_wait_s=worst_wait,
        scale_ups=scale_ups,
        engine_hours=engine_seconds / SECONDS_PER_HOUR,
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
        simulate(demand, QUEUE_WAIT_NAME, base, elastic, lead_time_s),
        simulate_autoscaled(demand, REACTIVE_NAME, base, elastic, lead_time_s),
        simulate_autoscaled(demand, PREDICTIVE_NAME, base, elastic, lead_time_s, predictive=True),
        simulate(demand, ALWAYS_ON_NAME, base, elastic, always_on=True),
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
        demand_engine_hours=float(demand.sum()) / SECONDS_PER_HOUR,
    )
