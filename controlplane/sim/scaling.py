"""An autoscaler in the simulation's loop (``burstgate simulate --autoscale``).

Every ``interval_s`` the loop reads a signal, turns it into a replica count
with the shipped recipes' rule (controlplane/domain/autoscaler.py) and the
harness starts or drains engines to match. Modes:

- ``off``: no autoscaler; the pool has ``--engines`` engines all the time
  (provisioned for the peak).
- ``reactive``: follows burstgate's ``desired_engines`` for the pool
  (``AdmissionService.views.pool_demand``, what the KEDA and HPA recipes read).
- ``predictive``: the larger of ``desired_engines`` and
  ``desired_engines_predicted`` (the forecast an engine start-up ahead),
  as the recipes' two triggers combine; its scale-ups beyond the reactive
  value are scored as alarms, and the loop falls back to reactive once
  more than 5 % of them are false with 95 % confidence (``ForecastScore``).
- ``queue-length``: the usual recipe, an HPA on the engines' own
  ``sum(vllm:num_requests_waiting)`` at 5 per replica. Whatever burstgate
  holds in its own queues is invisible to it: that is what it costs.

The autoscalers start at ``--min-engines`` (warm) and never exceed
``--engines``; a new engine serves ``--engine-startup-s`` after it is asked
for. ``reactive`` and ``predictive`` need burstgate's signals, so they run
only with burstgate policies; ``off`` and ``queue-length`` run with any.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from controlplane.domain.autoscaler import (
    QUEUE_LENGTH_TARGET,
    Autoscaler,
    ForecastScore,
    ScalerParams,
    queue_length_recommendation,
)
from controlplane.domain.units import NS_PER_S
from controlplane.sim.pool import Pool


class AutoscaleMode(StrEnum):
    OFF = "off"
    REACTIVE = "reactive"
    PREDICTIVE = "predictive"
    QUEUE_LENGTH = "queue-length"


# Modes that read burstgate's pool demand (policies without it cannot run them).
NEEDS_DEMAND = frozenset({AutoscaleMode.REACTIVE, AutoscaleMode.PREDICTIVE})


class ScalingLoop:
    """One run's autoscaler: signal, rule, and the record of what it did."""

    def __init__(
        self,
        mode: AutoscaleMode,
        params: ScalerParams,
        policy: object,
        *,
        queue_target: float = QUEUE_LENGTH_TARGET,
    ) -> None:
        if mode == AutoscaleMode.OFF:
            raise ValueError("ScalingLoop: --autoscale off runs without a loop")
        if mode in NEEDS_DEMAND and not hasattr(policy, "pool_demand"):
            raise ValueError(
                f"--autoscale {mode}: needs burstgate's desired_engines; policy "
                f"{getattr(policy, 'name', policy)!r} has none"
            )
        self.mode = mode
        self.params = params
        self.policy = policy
        self.queue_target = queue_target
        self.scaler = Autoscaler(params)
        # An alarm is confirmed when the reactive signal gets there within
        # twice the start-up time: the forecast looks one start-up ahead,
        # and as far again is allowed for its timing being off.
        self.score = ForecastScore(horizon_s=max(2 * params.engine_startup_s, params.interval_s))
        self.scale_ups = 0

    @property
    def interval_ns(self) -> int:
        return max(1, int(self.params.interval_s * NS_PER_S))

    def evaluate(self, now_ns: int, pool: Pool) -> int:
        """The replica count the pool should have after this evaluation."""
        if self.mode == AutoscaleMode.QUEUE_LENGTH:
            waiting = sum(e.num_waiting for e in pool.engines)
            signal = queue_length_recommendation(waiting, pool.replicas, self.queue_target)
            reactive = signal
        else:
            demand = self.policy.pool_demand()  # type: ignore[attr-defined]
            reactive = signal = demand.desired_engines
            if self.mode == AutoscaleMode.PREDICTIVE:
                self.score.observe(now_ns, reactive)
                if self.score.active:
                    signal = max(reactive, demand.desired_engines_predicted)
        before = pool.replicas
        target = self.scaler.decide(now_ns, signal)
        if target > before:
            self.scale_ups += 1
            floor = min(self.params.max_engines, max(self.params.min_engines, reactive))
            if self.mode == AutoscaleMode.PREDICTIVE and target > floor:
                self.score.raise_alarm(now_ns, target)
        return target

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": str(self.mode), "scale_ups": self.scale_ups}
        if self.mode == AutoscaleMode.PREDICTIVE:
            out |= self.score.summary()
        return out
