"""Forecaster: recursion by hand, alarm scoring by hand, known ramped bursts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from controlplane.analysis.bursts import BurstInterval, BurstRule
from controlplane.analysis.cli import register
from controlplane.analysis.forecast import (
    MAX_FALSE_ALARM_RATIO,
    evaluate_alarms,
    fit_and_evaluate,
    forecast_axis,
    holt_forecasts,
)
from controlplane.domain.holt import HoltForecaster, HoltParams
from tests.integration.analysis.synth import T0_US, iso, write_csv


def test_holt_recursion_by_hand() -> None:
    f = HoltForecaster(HoltParams(alpha=0.5, beta=0.5, phi=1.0))
    assert f.forecast(5) == 0.0  # nothing seen yet
    for value in (10.0, 14.0):
        f.update(value)
    # level = 0.5*14 + 0.5*(10 + 0) = 12; trend = 0.5*(12 - 10) + 0.5*0 = 1
    assert (f.level, f.trend) == (12.0, 1.0)
    assert f.forecast(3) == 15.0  # 12 + 3*1
    damped = HoltParams(alpha=0.5, beta=0.5, phi=0.5)
    assert damped.damping_sum(3) == pytest.approx(0.5 + 0.25 + 0.125)


def test_ewma_when_beta_is_zero() -> None:
    f = HoltForecaster(HoltParams(0.5, 0.0, 1.0))
    for rate in (4.0, 4.0, 8.0):
        f.update(rate)
    assert f.forecast(10) == 6.0  # EWMA: flat forecast at the level


def test_batch_matches_online_and_never_negative() -> None:
    rng = np.random.default_rng(0)
    series = rng.poisson(5.0, 300).astype(np.float64)
    series[200:] = 0.0  # a cliff: a trend could forecast below zero
    params = HoltParams(0.3, 0.2, 0.9)
    batch = holt_forecasts(series, params, 30)
    online = HoltForecaster(params)
    expected = []
    for value in series:
        online.update(float(value))
        expected.append(online.forecast(30))
    np.testing.assert_allclose(batch, expected, rtol=1e-12, atol=1e-12)
    assert batch.min() >= 0.0
    with pytest.raises(ValueError):
        HoltParams(0.0, 0.1, 0.9)


def test_linear_ramp_is_extrapolated() -> None:
    ramp = np.arange(200, dtype=np.float64)
    ahead = holt_forecasts(ramp, HoltParams(0.5, 0.5, 1.0), 10)
    assert ahead[-1] == pytest.approx(199 + 10, rel=1e-3)


def _burst(start: int, end: int, detected: int) -> BurstInterval:
    return BurstInterval(start, end, detected, 10.0, 8.0, 2.0, 5.0)


def test_alarm_scoring_by_hand() -> None:
    bursts = [_burst(100, 120, 105), _burst(300, 320, 306)]
    alarm = np.zeros(500, dtype=bool)
    alarm[90:93] = True  # within [100 - 20, 105): predicts burst 1, 15 s before detection
    alarm[110:115] = True  # inside burst 1 after detection: late, not credited
    alarm[200:202] = True  # nowhere near a burst: false
    # burst 2 gets no alarm before its detection at 306
    score = evaluate_alarms(alarm, bursts, horizon_s=20, merge_gap=5, lo=0, hi=500)
    assert (score.bursts, score.predicted, score.recall) == (2, 1, 0.5)
    assert (score.alarms, score.true_alarms, score.late_alarms, score.false_alarms) == (3, 1, 1, 1)
    assert score.precision == 0.5 and score.false_alarm_ratio == 0.5
    assert score.lead_vs_detection_s == [15] and score.lead_vs_start_s == [10]
    assert score.false_alarms_per_hour == pytest.approx(3600 / 500)
    # Lead windows [80, 105) and [280, 306): 51 of 500 seconds.
    assert score.chance_precision == pytest.approx(51 / 500)
    assert not score.usable
    # Only the test part [250, 500): burst 2, the false alarm falls outside.
    tail = evaluate_alarms(alarm, bursts, horizon_s=20, merge_gap=5, lo=250, hi=500)
    assert (tail.bursts, tail.predicted, tail.alarms) == (1, 0, 0)
    assert tail.recall == 0.0 and tail.precision is None


def _ramped_bursts(seed: int) -> np.ndarray:
    """Poisson at 10/s with nine bursts that ramp to 40/s over 40 s, hold 20 s."""
    rates = np.full(4000, 10.0)
    for start in range(350, 3900, 400):
        rates[start : start + 40] = np.linspace(10.0, 40.0, 40)
        rates[start + 40 : start + 60] = 40.0
    return np.random.default_rng(seed).poisson(rates).astype(np.float64)


def test_forecaster_warns_before_ramped_bursts() -> None:
    series = _ramped_bursts(3)
    evaluation = fit_and_evaluate(series, BurstRule(), unit=1.0, horizon_s=30)
    assert evaluation is not None
    test = evaluation.test
    assert test.bursts == 4
    assert test.recall is not None and test.recall >= 0.75
    assert test.false_alarm_ratio is not None and test.false_alarm_ratio <= MAX_FALSE_ALARM_RATIO
    lead = test.median_lead_vs_detection_s
    assert lead is not None and lead > 0  # it warns before the reactive detector fires
    # ...but on 40-second ramps barely before the burst itself starts, and the
    # verdict follows that lead, not the false-alarm ratio alone.
    assert test.usable == (
        test.median_lead_vs_start_s is not None and test.median_lead_vs_start_s > 0
    )
    # Honest baselines are computed on the same test part.
    assert evaluation.persistence_test.bursts == 4
    assert evaluation.mae is not None and evaluation.mean_mae is not None


def _slow_ramps(seed: int) -> np.ndarray:
    """Poisson at 10/s with bursts that build up over 150 s to 40/s: a trend is visible."""
    rates = np.full(4000, 10.0)
    for start in range(350, 3900, 400):
        rates[start : start + 150] = np.linspace(10.0, 40.0, 150)
        rates[start + 150 : start + 170] = 40.0
    return np.random.default_rng(seed).poisson(rates).astype(np.float64)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_forecaster_is_usable_when_bursts_build_up(seed: int) -> None:
    evaluation = fit_and_evaluate(_slow_ramps(seed), BurstRule(), unit=1.0, horizon_s=60)
    assert evaluation is not None
    test = evaluation.test
    assert test.bursts >= 4 and test.predicted == test.bursts
    assert test.median_lead_vs_start_s is not None and test.median_lead_vs_start_s > 0
    assert test.usable and test.verdict.startswith("usable: ")
    assert f"a median {test.median_lead_vs_start_s:g} s before the burst starts" in test.verdict


def test_alarms_that_lag_the_burst_start_are_not_usable() -> None:
    """No false alarm, every burst "predicted" before detection, yet each
    alarm comes after the burst started: that is no forecast."""
    bursts = [_burst(s, s + 20, s + 5) for s in (100, 300, 500, 700, 900)]
    late = np.zeros(1000, dtype=bool)
    for b in bursts:
        late[b.start + 2 : b.end] = True  # 2 s after the start, 3 s before detection
    score = evaluate_alarms(late, bursts, horizon_s=30, merge_gap=5, lo=0, hi=1000)
    assert (score.predicted, score.false_alarms, score.false_alarm_ratio) == (5, 0, 0.0)
    assert score.lead_vs_start_s == [-2] * 5 and score.lead_vs_detection_s == [3] * 5
    assert not score.usable
    assert score.verdict == (
        "not usable: the median alarm comes 2 s after the burst starts (it must come before)"
    )
    at_start = np.zeros(1000, dtype=bool)
    for b in bursts:
        at_start[b.start : b.end] = True
    on_time = evaluate_alarms(at_start, bursts, horizon_s=30, merge_gap=5, lo=0, hi=1000)
    assert on_time.median_lead_vs_start_s == 0 and not on_time.usable
    early = np.zeros(1000, dtype=bool)
    for b in bursts:
        early[b.start - 10 : b.end] = True
    ahead = evaluate_alarms(early, bursts, horizon_s=30, merge_gap=5, lo=0, hi=1000)
    assert ahead.median_lead_vs_start_s == 10 and ahead.usable
    assert (
        ahead.verdict
        == "usable: within the 5% false-alarm limit, a median 10 s before the burst starts"
    )


def _step_log(path: Path) -> Path:
    """10 requests/s, evenly spaced, with 30-second steps to 40/s: nothing
    foretells a step, so every alarm can only come once it has begun."""
    rates = np.full(2400, 10)
    for start in range(350, 2300, 400):
        rates[start : start + 30] = 40
    # Arrivals from the start of each second, so the bins (anchored at the first
    # arrival) hold exactly the planted rates.
    offsets = [s + i / r for s, r in enumerate(rates) for i in range(r)]
    rows = [(iso(T0_US + round(o * 1e6), zone=True), 100, 20) for o in offsets]
    return write_csv(path, ("timestamp", "prompt_tokens", "output_tokens"), rows)


def test_forecast_cli_refuses_usable_when_alarms_lag(tmp_path: Path) -> None:
    app = typer.Typer()
    register(app)
    log = _step_log(tmp_path / "steps.csv")
    result = CliRunner().invoke(app, ["forecast", str(log), "--horizon-s", "30", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["schema"] == "burstgate.forecast/v2"
    for axis in document["axes"]:
        test = axis["evaluation"]["test"]
        # Within the false-alarm limit and catching every burst before detection...
        assert test["predicted"] == test["bursts"] >= 2
        assert test["false_alarm_ratio"] is not None and test["false_alarm_ratio"] <= 0.05
        assert test["median_lead_vs_detection_s"] > 0
        # ...but not before the burst starts: not usable, and the output says why.
        assert test["median_lead_vs_start_s"] <= 0
        assert test["usable"] is False and test["verdict"].startswith(
            "not usable: the median alarm"
        )
    text = CliRunner().invoke(app, ["forecast", str(log), "--horizon-s", "30"])
    assert text.exit_code == 0
    assert re.search(r"false-alarm ratio 0%, median alarm (at|\d+ s after) the start", text.stdout)
    assert "usable: within" not in text.stdout


def test_forecast_axis_reports_now_and_handles_short_series() -> None:
    series = np.full(900, 5.0)
    result = forecast_axis("requests", series, BurstRule(), 1.0, horizon_s=60)
    assert result.now.forecast == pytest.approx(5.0)
    assert result.now.threshold is not None and not result.now.alarm
    assert result.evaluation is not None and result.evaluation.test.bursts == 0
    short = forecast_axis("requests", np.full(100, 5.0), BurstRule(), 1.0, horizon_s=60)
    assert short.evaluation is None and short.train_seconds == 0
    with pytest.raises(ValueError):
        forecast_axis("requests", series, BurstRule(), 1.0, horizon_s=0)
    with pytest.raises(ValueError):
        forecast_axis("requests", series, BurstRule(), 1.0, train_fraction=1.0)
