"""Capacity planning under the recipes' autoscaler, and what each plan costs
in engine-hours (issue 32)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import typer

from controlplane.analysis.plan import (
    ALWAYS_ON_NAME,
    DEMAND_WINDOW_S,
    PREDICTIVE_NAME,
    QUEUE_WAIT_NAME,
    REACTIVE_NAME,
    TARGET_UTILIZATION,
    EngineCapacity,
    plan_capacity,
    simulate,
    simulate_autoscaled,
)
from controlplane.analysis.summary import RateSeries
from tests.integration.analysis.conftest import run
from tests.integration.analysis.synth import T0_US, iso, write_csv

HOUR = 3600.0


def slow_swing(hours: int = 3) -> np.ndarray:
    """Engines busy swinging between 1 and 6 with a 30-minute period."""
    t = np.arange(hours * 3600)
    return 3.5 - 2.5 * np.cos(2 * np.pi * t / 1800)


def series_of(demand: np.ndarray) -> RateSeries:
    return RateSeries(demand, demand * 100, demand * 10)


def test_constants_are_the_planes_defaults() -> None:
    from controlplane.service.demand import DESIRED_WINDOW_S as PLANE_WINDOW_S
    from controlplane.settings import Settings

    assert Settings.model_fields["autoscale_target_utilization"].default == TARGET_UTILIZATION
    assert DEMAND_WINDOW_S == PLANE_WINDOW_S


def test_fixed_pool_engine_hours_are_engines_times_seconds() -> None:
    demand = np.random.default_rng(3).uniform(0.0, 5.0, 5000)
    assert simulate(demand, "x", base=3).engine_hours == pytest.approx(3 * 5000 / HOUR)
    warm = simulate(demand, "w", base=2, elastic=4, always_on=True)
    assert warm.engine_hours == pytest.approx(6 * 5000 / HOUR)
    # Every fixed pool of a plan, whatever its queue did.
    plan = plan_capacity(series_of(demand), EngineCapacity(rps=1.0))
    assert plan is not None
    fixed = [
        o for o in plan.outcomes if o.name not in (QUEUE_WAIT_NAME, REACTIVE_NAME, PREDICTIVE_NAME)
    ]
    assert len(fixed) == 3
    for o in fixed:
        assert o.engine_hours == pytest.approx(o.max_engines * 5000 / HOUR), o.name
    assert plan.demand_engine_hours == pytest.approx(demand.sum() / HOUR)
    assert plan.always_on is not None and plan.always_on.name == ALWAYS_ON_NAME
    assert plan.engine_hours_ratio(plan.always_on) == pytest.approx(1.0)


def test_queue_wait_elastic_pool_is_paid_from_its_trigger() -> None:
    demand = np.concatenate([np.full(10, 1.0), np.full(30, 6.0), np.full(400, 1.0)])
    outcome = simulate(demand, "r", base=2, elastic=4, lead_time_s=5)
    # Triggered at the end of second 10, serving from 16; the 24 queued
    # engine-seconds drain by second 44, the first quiet one; 300 quiet
    # seconds later (the end of second 343) the pool is released. So the 4
    # elastic engines are paid for seconds 11..343, the lead time included.
    assert outcome.engine_hours == pytest.approx((2 * 440 + 4 * 333) / HOUR)


def test_autoscaled_costs_between_the_work_and_always_on_on_a_slow_swing() -> None:
    demand = slow_swing()
    work_hours = demand.sum() / HOUR  # 10.5
    warm = simulate(demand, "w", base=1, elastic=5, always_on=True)  # 18
    reactive = simulate_autoscaled(demand, "r", base=1, elastic=5, lead_time_s=180)
    predictive = simulate_autoscaled(
        demand, "p", base=1, elastic=5, lead_time_s=180, predictive=True
    )
    assert work_hours < reactive.engine_hours < warm.engine_hours
    assert work_hours < predictive.engine_hours < warm.engine_hours
    # The predictive recommendation is never below the reactive one, so it
    # never has fewer engines and never queues longer (but pays a little more).
    assert predictive.queued_s <= reactive.queued_s
    assert predictive.engine_hours >= reactive.engine_hours
    # It follows the swing: up on every rise, and never above the maximum.
    assert reactive.scale_ups >= 6 and reactive.max_engines == 6


def test_the_autoscaler_never_goes_below_the_base() -> None:
    # The swing alone: the busiest 10-minute P95 already covers the peak, so
    # there is no elastic pool and every plan but the mean's costs the same.
    plan = plan_capacity(series_of(slow_swing()), EngineCapacity(rps=1.0))
    assert plan is not None and (plan.base_engines, plan.elastic_engines) == (6, 0)
    hours = {o.name: o.engine_hours for o in plan.outcomes}
    assert hours[REACTIVE_NAME] == hours[PREDICTIVE_NAME] == hours[ALWAYS_ON_NAME] == 18.0


def test_plan_autoscales_the_elastic_pool_for_bursts() -> None:
    demand = slow_swing()
    for start in range(600, demand.size, 1200):  # 20-s bursts, below each window's P95
        demand[start : start + 20] += 6.0
    plan = plan_capacity(series_of(demand), EngineCapacity(rps=1.0), lead_time_s=60)
    assert plan is not None and (plan.base_engines, plan.elastic_engines) == (6, 5)
    names = [o.name for o in plan.outcomes]
    assert names[3:] == [REACTIVE_NAME, PREDICTIVE_NAME, ALWAYS_ON_NAME]
    by_name = {o.name: o for o in plan.outcomes}
    base_only, warm = plan.outcomes[1], by_name[ALWAYS_ON_NAME]
    reactive, predictive = by_name[REACTIVE_NAME], by_name[PREDICTIVE_NAME]
    for o in (reactive, predictive):
        assert base_only.engine_hours < o.engine_hours < warm.engine_hours
        assert o.queued_s < base_only.queued_s
        assert (o.base_engines, o.max_engines) == (6, 11)
    assert predictive.queued_s <= reactive.queued_s
    ratio = plan.engine_hours_ratio(reactive)
    assert ratio is not None and ratio < 1.0


@pytest.mark.parametrize("lead", [0, 120])
def test_a_scale_up_serves_only_lead_time_later(lead: int) -> None:
    # 0.5 engines busy for 600 s, then a step to 4 (ceil(4 / 0.8) = 5 engines).
    demand = np.concatenate([np.full(600, 0.5), np.full(1200, 4.0)])
    # (a 10-s demand window, so one evaluation sees the whole step)
    outcome = simulate_autoscaled(
        demand, "r", base=1, elastic=7, lead_time_s=lead, demand_window_s=10
    )
    # The evaluation at 600 s sees 590..599 (0.5); the one at 615 s sees the
    # step and asks for 5, which serve from 615 + lead. Until then 1 engine.
    assert outcome.scale_ups == 1
    assert outcome.over_capacity_s == 15 + lead
    # Backlog 3 per second over 15 + lead seconds, drained at 1 per second
    # (5 engines for 4 busy): the queue lasts four times as long, less one
    # second (the one that ends with it empty).
    assert outcome.queued_s == 4 * (15 + lead) - 1
    # The 4 engines are paid for from 615 s, starting or not.
    assert outcome.engine_hours == pytest.approx((615 * 1 + 1185 * 5) / HOUR)


def test_a_scale_down_cancels_engines_still_starting() -> None:
    # A 30-s spike to 6 busy, then 0.5: the evaluation at 15 s asks for 8
    # (ceil(6 / 0.8)), serving at 315 s; the one at 30 s (seconds 20..29) asks
    # for 8 again. With a 60-s scale-down window the count drops back to 1 at
    # the first evaluation more than 60 s after that, 105 s, and the 7
    # starting engines are cancelled: they never serve, but were paid for
    # from 15 s to 105 s.
    demand = np.concatenate([np.full(30, 6.0), np.full(570, 0.5)])
    outcome = simulate_autoscaled(
        demand, "r", base=1, elastic=7, lead_time_s=300, scale_down_delay_s=60,
        demand_window_s=10, rate_limits=False,
    )  # fmt: skip
    assert outcome.scale_ups == 1
    assert outcome.over_capacity_s == 30  # only the spike, on 1 engine throughout
    assert outcome.engine_hours == pytest.approx((600 + 7 * (105 - 15)) / HOUR)


def test_plan_cli_shows_engine_hours(app: typer.Typer, tmp_path: Path) -> None:
    # 2 requests each second for 30 minutes at 1 request/s per engine: 2
    # engines busy throughout, no elastic pool, 2 x 0.5 h = 1 engine-hour.
    rows = [
        (iso(T0_US + s * 1_000_000 + k * 400_000, zone=True), 100, 10)
        for s in range(1800)
        for k in range(2)
    ]
    log = write_csv(tmp_path / "flat.csv", ("arrival_ts", "prompt_tokens", "output_tokens"), rows)
    code, out, _ = run(app, "plan", str(log), "--rps", "1", "--no-progress")
    assert code == 0
    header = next(line for line in out.splitlines() if line.strip().startswith("plan "))
    assert "engine-hours" in header and "vs always-on" in header
    always_on = next(line for line in out.splitlines() if ALWAYS_ON_NAME in line)
    assert always_on.split()[-2:] == ["1.00", "100%"]
    code, out, _ = run(app, "plan", str(log), "--rps", "1", "--json")
    assert code == 0
    outcomes = json.loads(out)["plan"]["outcomes"]
    assert len(outcomes) == 6
    assert all(o["engine_hours"] == pytest.approx(1.0) for o in outcomes[1:])
    assert outcomes[-1]["engine_hours_vs_always_on"] == pytest.approx(1.0)
