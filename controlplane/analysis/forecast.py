"""Short-horizon rate forecasting and burst alarms (SPEC §5, burst prediction).

Model: Holt's linear method with a damped trend (Gardner & McKenzie), one
step per second:

    level_t = a*y_t + (1-a)*(level_{t-1} + phi*trend_{t-1})
    trend_t = b*(level_t - level_{t-1}) + (1-b)*phi*trend_{t-1}
    yhat_{t+h|t} = level_t + (phi + phi^2 + ... + phi^h) * trend_t

With ``b = 0`` it is an EWMA. The damped trend keeps a one-minute horizon
from extrapolating a few noisy seconds into a cliff.

Alarm: at second ``t`` raise a burst alarm when ``yhat_{t+h|t}`` exceeds the
burst detector's own baseline by ``z`` sigmas (``mu(t) + z*sigma(t)``, the
same baseline as bursts.py). ``a``, ``b``, ``phi`` and ``z`` are chosen on the
first part of the series only; the rest is the test set.

Scoring (``evaluate_alarms``): a burst is *predicted* when an alarm is on at
some second in ``[start - h, detected_at)``, i.e. before the reactive
detector itself would have fired; the lead time is measured from that first
alarm second. Alarm episodes (runs of alarm seconds, gaps up to the burst
window merged) are *true* if they predict a burst, *late* if they start
inside a burst already detected (harmless, not credited), *false* otherwise.
The false-alarm ratio is false / (true + false): the share of warnings that
cried wolf. SPEC §5: above 5% the predictor does more harm than good.

*Usable* (``AlarmScore.usable``): it predicted at least one burst, at most 5%
of its alarms were false, and its median lead before the burst *starts* is
positive. An alarm between the start and the reactive detection still beats
the detector, but it is not a forecast: the burst is already arriving, so a
forecaster whose typical alarm comes then has nothing to offer over watching
the current rate.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from controlplane.analysis.bursts import (
    Baseline,
    BurstInterval,
    BurstRule,
    compute_baseline,
    detect_bursts,
    runs,
)
from controlplane.analysis.stats import FloatArray
from controlplane.domain.holt import HOLT_DEFAULTS, HoltForecaster, HoltParams

DEFAULT_HORIZON_S = 60  # one minute: enough to tighten admission or start a warm engine
DEFAULT_TRAIN_FRACTION = 0.5  # first half trains, second half tests
MAX_FALSE_ALARM_RATIO = 0.05  # SPEC §5: more than 5% false alarms does more harm than good
# Below this many test bursts a recall or precision is an anecdote, not a rate.
MIN_BURSTS_TO_JUDGE = 5
# Parameter grids searched on the training part. Small on purpose: a few
# dozen candidates cannot overfit a handful of bursts as badly as a fine grid.
ALPHA_GRID = (0.02, 0.05, 0.1, 0.2, 0.4)
BETA_GRID = (0.0, 0.02, 0.1)
PHI_GRID = (0.8, 0.95)
Z_GRID = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0)
# Used when the training part holds no burst to fit against (and by the
# live demand forecast, service/demand.py).
FALLBACK_PARAMS = HOLT_DEFAULTS
SECONDS_PER_HOUR = 3600


def holt_forecasts(series: FloatArray, params: HoltParams, horizon_s: int) -> FloatArray:
    """``out[t]`` = forecast for ``t + horizon_s`` made after seeing ``series[t]``.

    Same recursion as HoltForecaster, unrolled over plain floats for speed.
    """
    if series.size == 0:
        return np.zeros(0)
    a, b, phi = params.alpha, params.beta, params.phi
    ahead = params.damping_sum(horizon_s)
    values = series.tolist()
    level, trend = values[0], 0.0
    out = [level]
    for value in values[1:]:
        previous = level
        level = a * value + (1 - a) * (previous + phi * trend)
        trend = b * (level - previous) + (1 - b) * phi * trend
        out.append(level + ahead * trend)
    return np.maximum(np.asarray(out, dtype=np.float64), 0.0)


def alarm_seconds(predicted: FloatArray, baseline: Baseline, z: float) -> npt.NDArray[np.bool_]:
    ready = baseline.ready
    alarm = np.zeros(predicted.size, dtype=np.bool_)
    alarm[ready] = predicted[ready] > baseline.mean[ready] + z * baseline.sigma[ready]
    return alarm


@dataclass(frozen=True, slots=True)
class AlarmScore:
    bursts: int
    predicted: int
    alarms: int
    true_alarms: int
    late_alarms: int
    false_alarms: int
    seconds: int
    quiet_seconds: int
    quiet_alarm_seconds: int
    lead_window_seconds: int  # seconds inside some burst's [start - h, detected_at)
    lead_vs_detection_s: list[int]
    lead_vs_start_s: list[int]

    @property
    def recall(self) -> float | None:
        return self.predicted / self.bursts if self.bursts else None

    @property
    def precision(self) -> float | None:
        scored = self.true_alarms + self.false_alarms
        return self.true_alarms / scored if scored else None

    @property
    def false_alarm_ratio(self) -> float | None:
        scored = self.true_alarms + self.false_alarms
        return self.false_alarms / scored if scored else None

    @property
    def chance_precision(self) -> float | None:
        """Precision of an alarm raised at a random second: the share of time
        inside lead windows. A long horizon makes "true" alarms cheap."""
        return self.lead_window_seconds / self.seconds if self.seconds else None

    @property
    def false_alarms_per_hour(self) -> float:
        return self.false_alarms * SECONDS_PER_HOUR / self.seconds if self.seconds else 0.0

    @property
    def quiet_alarm_rate(self) -> float | None:
        """Share of burst-free seconds with an alarm on (false-positive rate)."""
        return self.quiet_alarm_seconds / self.quiet_seconds if self.quiet_seconds else None

    @property
    def median_lead_vs_detection_s(self) -> float | None:
        return float(np.median(self.lead_vs_detection_s)) if self.lead_vs_detection_s else None

    @property
    def median_lead_vs_start_s(self) -> float | None:
        return float(np.median(self.lead_vs_start_s)) if self.lead_vs_start_s else None

    @property
    def warns_ahead(self) -> bool:
        """The median alarm comes before the burst starts (lead > 0 s)."""
        lead = self.median_lead_vs_start_s
        return lead is not None and lead > 0

    @property
    def usable(self) -> bool:
        """Predicts bursts, within the 5% false-alarm limit, ahead of their start."""
        far = self.false_alarm_ratio
        within = far is not None and far <= MAX_FALSE_ALARM_RATIO
        return self.predicted > 0 and within and self.warns_ahead

    @property
    def verdict(self) -> str:
        """One honest line on whether to act on these alarms."""
        far = self.false_alarm_ratio
        if far is not None and far > MAX_FALSE_ALARM_RATIO:
            return f"not usable: {far:.0%} of alarms were false (limit 5%)"
        if self.bursts == 0:
            return "no bursts to predict in the test part"
        if self.predicted == 0:
            return "not usable: no burst was predicted"
        lead = self.median_lead_vs_start_s
        if not self.warns_ahead:
            return (
                f"not usable: the median alarm comes {-(lead or 0.0):g} s after the burst starts "
                "(it must come before)"
                if lead
                else "not usable: the median alarm comes as the burst starts, not before"
            )
        caveat = (
            f", but {self.bursts} test bursts are too few to be sure"
            if self.bursts < MIN_BURSTS_TO_JUDGE
            else ""
        )
        return (
            f"usable: within the 5% false-alarm limit, a median {lead:g} s before the burst "
            f"starts{caveat}"
        )


def evaluate_alarms(
    alarm: npt.NDArray[np.bool_],
    bursts: list[BurstInterval],
    horizon_s: int,
    merge_gap: int,
    lo: int,
    hi: int,
) -> AlarmScore:
    """Score alarms against bursts, both restricted to seconds ``[lo, hi)``."""
    scored = [b for b in bursts if lo <= b.start < hi]
    windows = [(max(lo, b.start - horizon_s), b.detected_at) for b in scored]
    lead_detect: list[int] = []
    lead_start: list[int] = []
    for burst, (w_lo, w_hi) in zip(scored, windows, strict=True):
        hits = np.flatnonzero(alarm[w_lo:w_hi])
        if hits.size:
            first = w_lo + int(hits[0])
            lead_detect.append(burst.detected_at - first)
            lead_start.append(burst.start - first)
    episodes: list[tuple[int, int]] = []
    for start, end in runs(alarm[lo:hi]):
        if episodes and lo + start - episodes[-1][1] <= merge_gap:
            episodes[-1] = (episodes[-1][0], lo + end)
        else:
            episodes.append((lo + start, lo + end))
    true = late = false = 0
    for a, e in episodes:
        if any(a < w_hi and e > w_lo for w_lo, w_hi in windows):
            true += 1
        elif any(a < b.end + merge_gap and e > b.detected_at for b in bursts):
            late += 1
        else:
            false += 1
    in_lead = np.zeros(hi - lo, dtype=np.bool_)
    for w_lo, w_hi in windows:
        in_lead[max(0, w_lo - lo) : max(0, w_hi - lo)] = True
    busy = np.zeros(hi - lo, dtype=np.bool_)
    for b in bursts:
        busy[max(0, b.start - horizon_s - lo) : max(0, b.end + merge_gap - lo)] = True
    quiet = ~busy
    return AlarmScore(
        bursts=len(scored),
        predicted=len(lead_detect),
        alarms=len(episodes),
        true_alarms=true,
        late_alarms=late,
        false_alarms=false,
        seconds=hi - lo,
        quiet_seconds=int(quiet.sum()),
        quiet_alarm_seconds=int((alarm[lo:hi] & quiet).sum()),
        lead_window_seconds=int(in_lead.sum()),
        lead_vs_detection_s=lead_detect,
        lead_vs_start_s=lead_start,
    )


def _choice_key(score: AlarmScore) -> tuple[float, ...]:
    """Order candidates: usable ones first (within the false-alarm limit and
    warning before the start), then recall, precision and lead time; then
    those within the limit that warn late; then the fewest false alarms."""
    far = score.false_alarm_ratio
    within = far is not None and far <= MAX_FALSE_ALARM_RATIO and score.predicted > 0
    lead = score.median_lead_vs_start_s or 0.0
    if within:
        return (2.0 if score.usable else 1.0, score.recall or 0.0, score.precision or 0.0, lead)
    return (0.0, -(far if far is not None else 1.0), score.recall or 0.0, lead)


@dataclass(frozen=True, slots=True)
class AxisEvaluation:
    """Forecaster fitted and tested on one series (requests/s or tokens/s)."""

    params: HoltParams
    alarm_z: float
    fitted_on_bursts: int  # bursts in the training part
    train: AlarmScore
    test: AlarmScore
    persistence_z: float
    persistence_test: AlarmScore  # naive comparator: alarm on the current rate
    mae: float | None  # test-part error of yhat(t+h) vs the smoothed rate at t+h
    persistence_mae: float | None
    mean_mae: float | None  # comparator: the training mean as the forecast


@dataclass(frozen=True, slots=True)
class ForecastNow:
    """State at the end of the log: what admission would act on."""

    level: float
    forecast: float
    threshold: float | None
    alarm: bool


@dataclass(frozen=True, slots=True)
class AxisForecast:
    axis: str
    horizon_s: int
    train_seconds: int
    test_seconds: int
    evaluation: AxisEvaluation | None  # None when the series is too short to split
    now: ForecastNow


def _mae(predicted: FloatArray, target: FloatArray, lo: int, hi: int, horizon: int) -> float | None:
    """Mean |predicted[t] - target[t + horizon]| over t in [lo, hi - horizon)."""
    stop = hi - horizon
    if stop <= lo:
        return None
    return float(np.abs(predicted[lo:stop] - target[lo + horizon : hi]).mean())


def fit_and_evaluate(
    series: FloatArray,
    rule: BurstRule,
    unit: float,
    horizon_s: int = DEFAULT_HORIZON_S,
    train_fraction: float = DEFAULT_TRAIN_FRACTION,
) -> AxisEvaluation | None:
    """Choose parameters on ``series[:split]``, report on ``series[split:]``."""
    n = series.size
    split = int(n * train_fraction)
    if split < rule.baseline_seconds or n - split < horizon_s:
        return None  # not enough history to train, or nothing to test
    baseline = compute_baseline(series, rule, unit)
    bursts = detect_bursts(series, rule, unit)
    gap = rule.min_seconds
    train_bursts = sum(1 for b in bursts if b.start < split)

    best: tuple[tuple[float, ...], HoltParams, float, FloatArray] | None = None
    grid = [
        (a, b, phi)
        for a, b, phi in itertools.product(ALPHA_GRID, BETA_GRID, PHI_GRID)
        if not (b == 0.0 and phi != PHI_GRID[-1])  # phi is moot without a trend
    ]
    if train_bursts == 0:
        grid = [FALLBACK_PARAMS]
    for a, b, phi in grid:
        params = HoltParams(a, b, phi)
        predicted = holt_forecasts(series, params, horizon_s)
        for z in Z_GRID if train_bursts else (rule.k,):
            score = evaluate_alarms(
                alarm_seconds(predicted, baseline, z), bursts, horizon_s, gap, 0, split
            )
            key = _choice_key(score)
            if best is None or key > best[0]:
                best = (key, params, z, predicted)
    assert best is not None
    _, params, z, predicted = best

    current = baseline.smoothed
    persist_best: tuple[tuple[float, ...], float] | None = None
    for pz in Z_GRID if train_bursts else (rule.k,):
        score = evaluate_alarms(
            alarm_seconds(current, baseline, pz), bursts, horizon_s, gap, 0, split
        )
        if persist_best is None or _choice_key(score) > persist_best[0]:
            persist_best = (_choice_key(score), pz)
    assert persist_best is not None
    persistence_z = persist_best[1]
    train_mean = np.full(n, float(series[:split].mean()))
    return AxisEvaluation(
        params=params,
        alarm_z=z,
        fitted_on_bursts=train_bursts,
        train=evaluate_alarms(
            alarm_seconds(predicted, baseline, z), bursts, horizon_s, gap, 0, split
        ),
        test=evaluate_alarms(
            alarm_seconds(predicted, baseline, z), bursts, horizon_s, gap, split, n
        ),
        persistence_z=persistence_z,
        persistence_test=evaluate_alarms(
            alarm_seconds(current, baseline, persistence_z), bursts, horizon_s, gap, split, n
        ),
        mae=_mae(predicted, current, split, n, horizon_s),
        persistence_mae=_mae(current, current, split, n, horizon_s),
        mean_mae=_mae(train_mean, current, split, n, horizon_s),
    )


def forecast_axis(
    axis: str,
    series: FloatArray,
    rule: BurstRule,
    unit: float,
    horizon_s: int = DEFAULT_HORIZON_S,
    train_fraction: float = DEFAULT_TRAIN_FRACTION,
) -> AxisForecast:
    """Evaluate honestly, then forecast from the end of the series."""
    if horizon_s < 1:
        raise ValueError("horizon must be at least 1 second")
    if not 0 < train_fraction < 1:
        raise ValueError("train fraction must be between 0 and 1")
    evaluation = fit_and_evaluate(series, rule, unit, horizon_s, train_fraction)
    params = evaluation.params if evaluation else HoltParams(*FALLBACK_PARAMS)
    z = evaluation.alarm_z if evaluation else rule.k
    forecaster = HoltForecaster(params)
    for value in series.tolist():
        forecaster.update(value)
    baseline = compute_baseline(series, rule, unit)
    ahead = forecaster.forecast(horizon_s)
    threshold: float | None = None
    if series.size and baseline.ready[-1]:
        threshold = float(baseline.mean[-1] + z * baseline.sigma[-1])
    split = int(series.size * train_fraction)
    return AxisForecast(
        axis=axis,
        horizon_s=horizon_s,
        train_seconds=split if evaluation else 0,
        test_seconds=series.size - split if evaluation else 0,
        evaluation=evaluation,
        now=ForecastNow(
            level=forecaster.level if forecaster.level is not None else 0.0,
            forecast=ahead,
            threshold=threshold,
            alarm=threshold is not None and ahead > threshold,
        ),
    )
