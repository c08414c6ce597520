"""Holt's linear method with a damped trend, online: the burst forecaster's
model (controlplane/analysis/forecast.py fits and scores it on logs; the
live demand forecast, service/demand.py, feeds it one value per second).
Pure: no I/O, no NumPy."""

from __future__ import annotations

from dataclasses import dataclass

# (alpha, beta, phi) when nothing was fitted: the analysis's fallback when
# its training part holds no burst, and the live demand forecast's.
HOLT_DEFAULTS = (0.1, 0.02, 0.95)


@dataclass(frozen=True, slots=True)
class HoltParams:
    alpha: float
    beta: float
    phi: float

    def __post_init__(self) -> None:
        if not (0 < self.alpha <= 1 and 0 <= self.beta <= 1 and 0 < self.phi <= 1):
            raise ValueError("need 0 < alpha <= 1, 0 <= beta <= 1, 0 < phi <= 1")

    def damping_sum(self, horizon: int) -> float:
        """phi + phi^2 + ... + phi^horizon."""
        if self.phi == 1.0:
            return float(horizon)
        return self.phi * (1 - self.phi**horizon) / (1 - self.phi)


class HoltForecaster:
    """Online forecaster for admission: feed one value per second, ask ahead.

    >>> f = HoltForecaster(HoltParams(0.5, 0.0, 1.0))
    >>> for rate in (4.0, 4.0, 8.0):
    ...     f.update(rate)
    >>> f.forecast(10)
    6.0
    """

    def __init__(self, params: HoltParams) -> None:
        self.params = params
        self.level: float | None = None
        self.trend = 0.0

    def update(self, value: float) -> None:
        a, b, phi = self.params.alpha, self.params.beta, self.params.phi
        if self.level is None:
            self.level = value
            return
        previous = self.level
        self.level = a * value + (1 - a) * (previous + phi * self.trend)
        self.trend = b * (self.level - previous) + (1 - b) * phi * self.trend

    def forecast(self, horizon_s: int) -> float:
        """Expected rate ``horizon_s`` seconds ahead (never negative)."""
        if self.level is None:
            return 0.0
        return max(0.0, self.level + self.params.damping_sum(horizon_s) * self.trend)
