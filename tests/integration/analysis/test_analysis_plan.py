"""Capacity planning: fluid queue by hand, pool sizing, engine capacity."""

from __future__ import annotations

import numpy as np
import pytest

from controlplane.analysis.plan import (
    SCALE_DOWN_QUIET_S,
    EngineCapacity,
    plan_capacity,
    simulate,
)
from controlplane.analysis.summary import RateSeries


def test_fluid_queue_by_hand() -> None:
    # Two engines; arriving work 1, 3, 3, 1, 0 engine-seconds.
    outcome = simulate(np.array([1.0, 3.0, 3.0, 1.0, 0.0]), "x", base=2)
    # Backlog after each second: 0, 1, 2, 1, 0 -> worst wait 2/2 = 1 s.
    assert outcome.over_capacity_s == 2
    assert outcome.queued_s == 3
    assert outcome.max_queue_wait_s == pytest.approx(1.0)
    assert outcome.scale_ups == 0 and outcome.max_engines == 2


def test_reactive_elastic_pool_arrives_after_the_lead_time() -> None:
    demand = np.concatenate([np.full(10, 1.0), np.full(30, 6.0), np.full(400, 1.0)])
    reactive = simulate(demand, "r", base=2, elastic=4, lead_time_s=5)
    warm = simulate(demand, "w", base=2, elastic=4, always_on=True)
    base_only = simulate(demand, "b", base=2)
    assert reactive.scale_ups == 1
    # Wait passes 1 s during second 10 (backlog 4 on 2 engines = 2 s): the
    # trigger; engines join 5 s later, from second 16 on.
    assert reactive.over_capacity_s == 6  # seconds 10..15 at 2 engines
    assert warm.over_capacity_s == 0 and warm.queued_s == 0
    assert base_only.over_capacity_s == 30
    assert reactive.max_queue_wait_s < base_only.max_queue_wait_s
    # The elastic pool is released only after SCALE_DOWN_QUIET_S quiet seconds.
    assert SCALE_DOWN_QUIET_S < 400


def test_plan_sizes_base_on_busiest_window_p95() -> None:
    # Window 0 (600 s) at 2 req/s, window 1 at 4 req/s with a 20-s spike to 12.
    requests = np.concatenate([np.full(600, 2.0), np.full(600, 4.0)])
    requests[900:920] = 12.0
    series = RateSeries(requests, requests * 100, requests * 10)
    plan = plan_capacity(series, EngineCapacity(rps=2.0), lead_time_s=60)
    assert plan is not None
    assert plan.busiest_window == 1
    assert plan.window_p95 == pytest.approx(2.0)  # P95 of window 1 is 4 req/s = 2 engines
    assert (plan.base_engines, plan.elastic_engines) == (2, 4)  # peak 12 req/s = 6 engines
    assert plan.busiest_hour_mean == pytest.approx((600 * 2 + 580 * 4 + 20 * 12) / 1200 / 2)
    assert plan.mean_engines == 2
    names = [o.name for o in plan.outcomes]
    assert names[0].startswith("mean-based") and names[-1].endswith("(no autoscaler)")
    assert plan.outcomes[-1].over_capacity_s == 0


def test_token_capacity_demand() -> None:
    series = RateSeries(np.array([1.0]), np.array([8000.0]), np.array([300.0]))
    capacity = EngineCapacity(prefill_tps=4000.0, decode_tps=100.0)
    # 8000/4000 + 300/100 = 5 engines busy.
    assert capacity.demand(series).tolist() == [5.0]
    assert "prefill" in capacity.describe()


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"rps": 1.0, "prefill_tps": 1.0, "decode_tps": 1.0},
        {"prefill_tps": 100.0},
        {"rps": 0.0},
        {"rps": float("inf")},
    ],
)
def test_capacity_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        EngineCapacity(**kwargs)


def test_empty_series_has_no_plan() -> None:
    empty = RateSeries(np.zeros(0), np.zeros(0), np.zeros(0))
    assert plan_capacity(empty, EngineCapacity(rps=1.0)) is None
    with pytest.raises(ValueError):
        plan_capacity(empty, EngineCapacity(rps=1.0), lead_time_s=-1)
