"""A pool that grows and shrinks under an autoscaler (sim/engine.py Pool):
engines start cold, serve once ready, drain before they go, and every
provisioned second is counted (issue 32)."""

from __future__ import annotations

import pytest

from controlplane.sim.engine import EngineParams, SimRequest
from controlplane.sim.pool import Pool

S = 1_000_000_000


def test_a_started_engine_costs_from_its_start_and_serves_only_once_ready() -> None:
    pool = Pool(1, EngineParams())
    new = pool.start(10 * S)
    assert pool.provisioned == 2 and pool.replicas == 2 and pool.engines_max == 2
    assert pool.route() is pool.engines[0]  # not routed to before it is up
    assert pool.ready(new)
    assert new in pool.engines and not pool.starting
    # 1 engine for 10 s, then 2 for 20 s
    assert pool.engine_seconds(30 * S) == pytest.approx(10 + 2 * 20)


def test_scaling_in_cancels_a_starting_engine_first() -> None:
    pool = Pool(1, EngineParams())
    new = pool.start(0)
    assert pool.stop_one(5 * S) is None  # cancelled while starting
    assert pool.replicas == 1 and not pool.ready(new)
    assert pool.engine_seconds(10 * S) == pytest.approx(10 + 5)


def test_a_drained_engine_finishes_its_work_takes_none_and_then_retires() -> None:
    pool = Pool(2, EngineParams())
    busy, idle = pool.engines
    busy.submit(SimRequest("r", 100, 10, 0), 0)
    victim = pool.stop_one(S)
    assert victim is idle  # the least outstanding work goes
    assert pool.replicas == 1 and pool.provisioned == 2
    assert all(pool.route() is busy for _ in range(3))  # nothing more goes to it
    pool.retire_idle(2 * S)
    assert idle not in pool.engines and idle in pool.retired
    assert pool.engine_seconds(4 * S) == pytest.approx(2 * 2 + 2 * 1)
    # the last ready engine stays, whatever the autoscaler asks
    assert pool.stop_one(5 * S) is None and pool.replicas == 1
