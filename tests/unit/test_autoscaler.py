"""The autoscaler's rule (controlplane/domain/autoscaler.py): up at once,
down to the highest recommendation of the stabilisation window, clamped;
the usual queue-length recipe; forecast alarms scored and the fall-back to
reactive (issue 32)."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.domain.autoscaler import (
    MAX_FALSE_ALARM_RATE,
    Autoscaler,
    ForecastScore,
    ScalerParams,
    queue_length_recommendation,
    wilson_lower,
)

S = 1_000_000_000


def test_scales_up_at_once_and_down_only_after_the_window() -> None:
    a = Autoscaler(
        ScalerParams(min_engines=1, max_engines=8, scale_down_delay_s=60, up_pods=0, down_pods=0)
    )
    assert a.replicas == 1
    assert a.decide(0, 5) == 5  # up at once
    assert a.decide(15 * S, 2) == 5  # 5 was asked within the window
    assert a.decide(45 * S, 3) == 5
    # 61 s after the 5: the window's highest is now 3 (at 45 s), not 2
    assert a.decide(61 * S, 2) == 3
    assert a.decide(106 * S, 2) == 2
    assert a.decide(120 * S, 40) == 8  # clamped to the maximum
    assert a.decide(121 * S, 0) == 8


def test_the_recipes_pods_policies_limit_each_step() -> None:
    # four pods a minute up, one per two minutes down (deploy/autoscaling)
    a = Autoscaler(ScalerParams(min_engines=1, max_engines=20, scale_down_delay_s=0))
    assert a.decide(0, 12) == 5  # +4 at most
    assert a.decide(15 * S, 12) == 5  # the minute is not over
    assert a.decide(61 * S, 12) == 9  # a new minute: +4 more
    assert a.decide(122 * S, 12) == 12
    assert a.decide(200 * S, 1) == 11  # down: one ...
    assert a.decide(260 * S, 1) == 11  # ... per two minutes
    assert a.decide(321 * S, 1) == 10


def test_recommendations_below_the_minimum_are_the_minimum() -> None:
    a = Autoscaler(ScalerParams(min_engines=2, max_engines=4, scale_down_delay_s=0))
    assert a.decide(0, 0) == 2
    assert a.decide(S, 3) == 3
    assert a.decide(2 * S, 1) == 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"min_engines": 0, "max_engines": 4}, "--min-engines"),
        ({"min_engines": 5, "max_engines": 4}, "--min-engines"),
        ({"min_engines": 1, "max_engines": 4, "engine_startup_s": -1}, "--engine-startup-s"),
        ({"min_engines": 1, "max_engines": 4, "scale_down_delay_s": float("nan")},
         "--scale-down-delay-s"),
    ],
)  # fmt: skip
def test_bad_parameters_are_refused_by_name(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ScalerParams(**kwargs)


def test_the_queue_length_recipe_divides_the_waiting_requests_by_its_target() -> None:
    assert queue_length_recommendation(0, 3, 5.0) == 0  # an empty queue asks for none
    assert queue_length_recommendation(11, 1, 5.0) == 3
    assert queue_length_recommendation(10, 2, 5.0) == 2
    # within the HPA's 10 % tolerance of the current count: unchanged
    assert queue_length_recommendation(21, 4, 5.0) == 4


def test_an_alarm_the_reactive_signal_reaches_is_confirmed_with_its_lead_time() -> None:
    score = ForecastScore(horizon_s=240)
    score.raise_alarm(0, 4)
    score.observe(60 * S, 3)
    score.observe(90 * S, 4)  # the reactive signal got there 90 s later
    summary = score.summary()
    assert summary["alarms"] == 1 and summary["false_alarms"] == 0
    assert summary["false_alarm_rate"] == 0 and summary["lead_time_median_s"] == 90
    assert score.active


def test_an_alarm_past_its_horizon_is_false_and_open_ones_are_not_scored() -> None:
    score = ForecastScore(horizon_s=240)
    score.raise_alarm(0, 4)
    score.raise_alarm(200 * S, 6)
    score.observe(241 * S, 3)  # the first is past its horizon; the second still open
    summary = score.summary()
    assert summary["alarms"] == 2 and summary["false_alarms"] == 1
    assert summary["false_alarm_rate"] == 1.0
    assert summary["lead_time_median_s"] is None


def _score(outcomes: str) -> ForecastScore:
    """Alarms scored in order: "t" confirmed, "f" false."""
    score = ForecastScore(horizon_s=10)
    t = 0
    for o in outcomes:
        score.raise_alarm(t, 5)
        t += 20 * S
        score.observe(t, 5 if o == "t" else 1)
    return score


def test_wilson_lower_bound() -> None:
    assert wilson_lower(0, 10) == 0.0
    # 5 in 10: the two-sided 95 % Wilson interval is [0.237, 0.763]
    assert wilson_lower(5, 10, z=1.959964) == pytest.approx(0.2366, abs=1e-3)
    assert wilson_lower(1, 1) > MAX_FALSE_ALARM_RATE
    assert wilson_lower(1, 20) < MAX_FALSE_ALARM_RATE


def test_the_forecast_is_dropped_once_its_false_alarms_are_surely_above_5_percent() -> None:
    # one false alarm after nineteen confirmed: within 5 %, kept
    kept = _score("t" * 19 + "f")
    assert kept.active and kept.summary()["false_alarm_rate"] == pytest.approx(0.05)
    # the first alarm false: at least ~27 % with 95 % confidence, dropped at once
    first = _score("f")
    assert not first.active and first.summary()["fell_back_at_s"] == 20
    # a quarter of them false: dropped, at the alarm that made it sure
    quarter = _score("tttf" * 5)
    assert not quarter.active
    fell = quarter.summary()["fell_back_at_s"]
    assert fell is not None and fell < 20 * 20
