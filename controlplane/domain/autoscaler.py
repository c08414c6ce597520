"""An autoscaler's decision rule, as the shipped KEDA and HPA recipes apply it
(deploy/autoscaling, docs/autoscaling.md), and how a forecast that drives it
is scored.

``Autoscaler`` turns a recommendation (engines wanted now) into a replica
count the way a Kubernetes HPA with our recipes' ``behavior`` does:

- evaluated every ``interval_s`` (the HPA controller's sync period, 15 s);
- **up at once**: a recommendation above the current count is taken
  (``stabilizationWindowSeconds: 0``);
- **down only after** ``scale_down_delay_s``: the count goes down to the
  *highest* recommendation of the last ``scale_down_delay_s`` seconds (the
  HPA's scale-down stabilisation window), so an engine that takes minutes to
  start is not dropped between two pulses;
- at most ``up_pods`` more per ``up_period_s`` and ``down_pods`` fewer per
  ``down_period_s`` (the HPA's ``Pods`` policies: four a minute up, one per
  two minutes down in the recipes; 0 = no limit): a change is limited by
  the changes in the same direction within the period before it;
- clamped to ``[min_engines, max_engines]``.

``ForecastScore`` scores scale-ups a forecast drove (an *alarm*: the
forecast asked for more engines than the reactive signal at that moment).
An alarm for ``k`` engines at ``t`` is **confirmed** when the reactive
signal itself reaches ``k`` within ``horizon_s`` after ``t`` (the forecast
saw it coming; the gap is its *lead time*), and **false** otherwise (the
engines were started for nothing). The design documents allow at most 5 %
false alarms (``MAX_FALSE_ALARM_RATE``): as soon as the scored alarms show,
with 95 % confidence, a false-alarm rate above that (the one-sided Wilson
score lower bound of false / scored exceeds 5 %), the forecast is not good
enough on this traffic and the autoscaler falls back to the reactive signal
for good (``fell_back_at_ns``), saying so in its report. A bound, not the
raw share: the first alarm being false says little about a 5 % rate, a
first false alarm after nineteen confirmed ones says it is within it, and
no count of alarms has to be chosen before judging.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from controlplane.domain.units import NS_PER_S

# The HPA controller's default sync period (--horizontal-pod-autoscaler-sync-period).
DEFAULT_INTERVAL_S = 15.0
# The shipped recipes' scale-down stabilisation window (deploy/autoscaling):
# the HPA's own default. Measured against 600 s on the diurnal trace
# (docs/benchmarks-history.md, "Scaling the engines"): a third fewer engine-seconds than the peak's
# fixed pool instead of a quarter to a third, premium within 1 point either
# way (the gate keeps it through a start-up gap).
DEFAULT_SCALE_DOWN_DELAY_S = 300.0
DEFAULT_ENGINE_STARTUP_S = 120.0  # BURSTGATE_AUTOSCALE_ENGINE_STARTUP_S's default
# The design documents' ceiling on predictive scale-ups that were not needed.
MAX_FALSE_ALARM_RATE = 0.05
# One-sided 95 % normal quantile: the confidence of the fall-back's judgement.
Z_95 = 1.6448536269514722
# The usual recipe's target: sum(vllm:num_requests_waiting) / 5 per replica
# (AverageValue 5; what public KEDA-on-vLLM guides ship).
QUEUE_LENGTH_TARGET = 5.0


@dataclass(frozen=True, slots=True)
class ScalerParams:
    min_engines: int
    max_engines: int
    engine_startup_s: float = DEFAULT_ENGINE_STARTUP_S
    scale_down_delay_s: float = DEFAULT_SCALE_DOWN_DELAY_S
    interval_s: float = DEFAULT_INTERVAL_S
    # The recipes' scaleUp / scaleDown Pods policies (0 pods: no limit).
    up_pods: int = 4
    up_period_s: float = 60.0
    down_pods: int = 1
    down_period_s: float = 120.0

    def __post_init__(self) -> None:
        if self.min_engines < 1:
            raise ValueError(f"--min-engines: must be >= 1, got {self.min_engines}")
        if self.max_engines < self.min_engines:
            raise ValueError(
                f"--min-engines: {self.min_engines} is above the maximum ({self.max_engines}, "
                "--engines)"
            )
        for name in ("engine_startup_s", "scale_down_delay_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 0, got {value!r}")
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError(f"autoscaler interval: must be > 0, got {self.interval_s!r}")
        for name in ("up_pods", "down_pods"):
            if getattr(self, name) < 0:
                raise ValueError(f"autoscaler {name}: must be >= 0, got {getattr(self, name)!r}")
        for name in ("up_period_s", "down_period_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"autoscaler {name}: must be > 0, got {value!r}")


class Autoscaler:
    """Replica count from recommendations, one call per evaluation."""

    __slots__ = ("_changes", "_history", "p", "replicas")

    def __init__(self, params: ScalerParams, replicas: int | None = None) -> None:
        self.p = params
        self.replicas = params.min_engines if replicas is None else replicas
        self._history: deque[tuple[int, int]] = deque()  # (t_ns, clamped recommendation)
        self._changes: deque[tuple[int, int]] = deque()  # (t_ns, replicas added (+) or removed (-))

    def _changed(self, now_ns: int, up: bool) -> int:
        """Replicas added (``up``) or removed within the policy's period."""
        p = self.p
        period = p.up_period_s if up else p.down_period_s
        since = now_ns - int(period * NS_PER_S)
        return sum(abs(d) for t, d in self._changes if t > since and (d > 0) == up)

    def decide(self, now_ns: int, recommendation: int) -> int:
        """The replica count after this evaluation (also ``self.replicas``)."""
        p = self.p
        want = min(p.max_engines, max(p.min_engines, recommendation))
        history = self._history
        history.append((now_ns, want))
        horizon = now_ns - int(p.scale_down_delay_s * NS_PER_S)
        while history and history[0][0] < horizon:
            history.popleft()
        if want >= self.replicas:
            target = want
            if p.up_pods:
                room = max(0, p.up_pods - self._changed(now_ns, True))
                target = min(target, self.replicas + room)
        else:
            # down to the highest recommendation of the window, never up
            target = min(self.replicas, max(w for _, w in history))
            if p.down_pods:
                floor = self.replicas - max(0, p.down_pods - self._changed(now_ns, False))
                target = max(target, floor)
        if target != self.replicas:
            self._changes.append((now_ns, target - self.replicas))
            keep = now_ns - int(max(p.up_period_s, p.down_period_s) * NS_PER_S)
            while self._changes and self._changes[0][0] <= keep:
                self._changes.popleft()
            self.replicas = target
        return self.replicas


def engines_for(tokens_per_s: float, per_engine: float, utilization: float) -> int:
    """Engines that take ``tokens_per_s`` at ``utilization`` of each one's
    work rate (ceil; 0 for no demand): the plane's desired engines
    (service/demand.py) and ``burstgate plan``'s (one engine per engine
    busy) alike."""
    if tokens_per_s <= 0:
        return 0
    need = tokens_per_s / (per_engine * utilization)
    return max(1, math.ceil(need - 1e-9))  # 2.0000000001 is two engines


def queue_length_recommendation(waiting: int, replicas: int, target: float) -> int:
    """The usual recipe: an HPA on ``sum(vllm:num_requests_waiting)`` with an
    ``AverageValue`` target: ceil(total / target), within the HPA's 10 %
    tolerance of the current count left at the current count."""
    want = math.ceil(waiting / target - 1e-9) if waiting > 0 else 0
    if replicas and abs(waiting / (target * replicas) - 1.0) <= 0.1:
        return replicas
    return want


def wilson_lower(k: int, n: int, z: float = Z_95) -> float:
    """The Wilson score interval's lower bound for ``k`` successes in ``n``."""
    if n <= 0:
        return 0.0
    p = k / n
    z2 = z * z
    centre = p + z2 / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, (centre - spread) / (1 + z2 / n))


@dataclass(slots=True)
class Alarm:
    t_ns: int
    engines: int
    confirmed_ns: int = -1  # when the reactive signal reached ``engines``; -1: not (yet)
    false: bool = False  # the horizon passed without the reactive signal reaching it


@dataclass(slots=True)
class ForecastScore:
    """Alarms a forecast raised, scored against the reactive signal."""

    horizon_s: float
    alarms: list[Alarm] = field(default_factory=list)
    fell_back_at_ns: int = -1
    _open: deque[Alarm] = field(default_factory=deque)
    _scored: int = 0
    _false: int = 0

    def observe(self, now_ns: int, reactive: int) -> None:
        """The reactive signal's value at ``now_ns``: confirms open alarms it
        reaches, and closes as false those older than the horizon."""
        horizon = int(self.horizon_s * NS_PER_S)
        keep: deque[Alarm] = deque()
        for a in self._open:
            if reactive >= a.engines:
                a.confirmed_ns = now_ns
                self._scored += 1
            elif now_ns - a.t_ns > horizon:
                a.false = True
                self._scored += 1
                self._false += 1
            else:
                keep.append(a)
        self._open = keep
        if (
            self.fell_back_at_ns < 0
            and self._false
            and wilson_lower(self._false, self._scored) > MAX_FALSE_ALARM_RATE
        ):
            self.fell_back_at_ns = now_ns

    def raise_alarm(self, now_ns: int, engines: int) -> None:
        alarm = Alarm(now_ns, engines)
        self.alarms.append(alarm)
        self._open.append(alarm)

    @property
    def active(self) -> bool:
        """The forecast still drives scale-ups (it has not been judged too poor)."""
        return self.fell_back_at_ns < 0

    def summary(self) -> dict[str, float | int | None]:
        """Alarms raised, how many were false, the false-alarm rate over the
        scored ones (an alarm still inside its horizon when the run ends is
        neither), the median lead time of the confirmed ones, and when (s)
        the autoscaler fell back to the reactive signal."""
        confirmed = [a for a in self.alarms if a.confirmed_ns >= 0]
        leads = sorted((a.confirmed_ns - a.t_ns) / NS_PER_S for a in confirmed)
        false = sum(1 for a in self.alarms if a.false)
        scored = len(confirmed) + false
        return {
            "alarms": len(self.alarms),
            "false_alarms": false,
            "false_alarm_rate": false / scored if scored else None,
            "lead_time_median_s": leads[len(leads) // 2] if leads else None,
            "fell_back_at_s": self.fell_back_at_ns / NS_PER_S
            if self.fell_back_at_ns >= 0
            else None,
        }
