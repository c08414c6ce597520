"""Burst analysis of request logs: statistics, incidents, planning, forecasting.

Offline and dependency-light (NumPy, matplotlib for the HTML report). The
public entry points are re-exported here; ``cli.register`` adds the
``analyze``, ``plan`` and ``forecast`` commands to the ``burstgate`` app.
"""

from controlplane.analysis.bursts import BurstInterval, BurstRule, detect_bursts
from controlplane.analysis.forecast import forecast_axis
from controlplane.analysis.plan import CapacityPlan, EngineCapacity, plan_capacity
from controlplane.analysis.reader import LogReadError, RequestLog, read_log
from controlplane.analysis.summary import Analysis, AnalysisParams, analyze
from controlplane.domain.holt import HoltForecaster, HoltParams

__all__ = [
    "Analysis",
    "AnalysisParams",
    "BurstInterval",
    "BurstRule",
    "CapacityPlan",
    "EngineCapacity",
    "HoltForecaster",
    "HoltParams",
    "LogReadError",
    "RequestLog",
    "analyze",
    "detect_bursts",
    "forecast_axis",
    "plan_capacity",
    "read_log",
]
