"""Machine output (``--json``). The schema is documented in docs/analysis.md;
bump the version in ``ANALYSIS_SCHEMA`` when a field changes meaning or goes."""

from __future__ import annotations

import dataclasses
from typing import Any

from controlplane.analysis.bursts import MergedBurst
from controlplane.analysis.forecast import AlarmScore, AxisEvaluation, AxisForecast
from controlplane.analysis.parsing import format_timestamp_us
from controlplane.analysis.plan import (
    AUTOSCALE_DOWN_DELAY_S,
    AUTOSCALE_INTERVAL_S,
    DEMAND_WINDOW_S,
    TARGET_UTILIZATION,
    CapacityPlan,
)
from controlplane.analysis.prefix_out import prefix_to_dict
from controlplane.analysis.stats import Timeline
from controlplane.analysis.summary import Analysis, EntitySummary, Incident

ANALYSIS_SCHEMA = "burstgate.analysis/v1"
PLAN_SCHEMA = "burstgate.plan/v1"
# v2: "usable" (replaces v1's "acceptable") also requires a positive median
# lead before the burst starts; "lead_vs_start_s" added.
FORECAST_SCHEMA = "burstgate.forecast/v2"


def _plain(value: Any) -> Any:
    """Dataclass (or None) -> dict of plain JSON values."""
    if value is None:
        return None
    return dataclasses.asdict(value)


def _iso(timeline: Timeline, index: int) -> str:
    return format_timestamp_us(timeline.bin_start_us(index))


def _burst(timeline: Timeline, burst: MergedBurst) -> dict[str, Any]:
    return {
        "start": _iso(timeline, burst.start),
        "end": _iso(timeline, burst.end),
        "duration_s": (burst.end - burst.start) * timeline.bin_seconds,
        "detected_at": _iso(timeline, burst.detected_at + 1),  # end of the hot run's last bin
        "axes": list(burst.axes),
    }


def entity_to_dict(entity: EntitySummary, timeline: Timeline | None) -> dict[str, Any]:
    return {
        "tenant": entity.tenant,
        "requests": entity.requests,
        "rates": {
            "requests_per_s": _plain(entity.requests_per_s),
            "prompt_tokens_per_s": _plain(entity.prompt_tokens_per_s),
            "output_tokens_per_s": _plain(entity.output_tokens_per_s),
            "tokens_per_s": _plain(entity.tokens_per_s),
        },
        "interarrival": _plain(entity.interarrival),
        "lengths": {
            "prompt_tokens": _plain(entity.prompt_tokens),
            "output_tokens": _plain(entity.output_tokens),
        },
        "queue_wait_ms": _plain(entity.queue_wait_ms),
        "latency_ms": _plain(entity.latency_ms),
        "decisions": entity.decisions,
        "lanes": entity.lanes,
        "windows": [
            {
                "index": w.index,
                "start": format_timestamp_us(w.start_us),
                "seconds": w.seconds,
                "requests": w.requests,
                "requests_per_s": _plain(w.requests_per_s),
                "tokens_per_s": _plain(w.tokens_per_s),
            }
            for w in entity.windows
        ],
        "bursts": [] if timeline is None else [_burst(timeline, b) for b in entity.bursts],
    }


def incident_to_dict(incident: Incident, timeline: Timeline) -> dict[str, Any]:
    return {
        "number": incident.number,
        "start": _iso(timeline, incident.start),
        "end": _iso(timeline, incident.end),
        "duration_s": incident.duration_s,
        "detected_at": _iso(timeline, incident.detected_at + 1),
        "axes": list(incident.axes),
        "requests": incident.requests,
        "excess_requests": incident.excess_requests,
        "prompt_tokens": incident.prompt_tokens,
        "output_tokens": incident.output_tokens,
        "peak_rps": incident.peak_rps,
        "mean_rps": incident.mean_rps,
        "baseline_rps": incident.baseline_rps,
        "peak_tokens_per_s": incident.peak_tokens_per_s,
        "mean_tokens_per_s": incident.mean_tokens_per_s,
        "baseline_tokens_per_s": incident.baseline_tokens_per_s,
        "top_tenants": [dataclasses.asdict(t) for t in incident.top_tenants],
        "queue_wait_ms": _plain(incident.queue_wait_ms),
        "latency_ms": _plain(incident.latency_ms),
        "decisions": incident.decisions,
    }


def analysis_to_dict(analysis: Analysis) -> dict[str, Any]:
    log, timeline, rule = analysis.log, analysis.timeline, analysis.params.rule
    return {
        "schema": ANALYSIS_SCHEMA,
        "source": log.source,
        "format": log.fmt,
        "input": log.input_to_dict(),
        "columns": log.columns,
        "rows": {
            "read": log.rows_read,
            "analysed": len(log),
            "bad": log.bad_row_count,
            "bad_rows": [dataclasses.asdict(b) for b in log.bad_rows],
            "out_of_order": analysis.out_of_order_rows,
        },
        "span": {
            "start": None if timeline is None else _iso(timeline, 0),
            "end": None if timeline is None else format_timestamp_us(int(log.ts_us.max())),
            "seconds": 0 if timeline is None else timeline.seconds,
        },
        "binning": analysis.binning.as_dict(),
        "parameters": {
            "bin_seconds": analysis.binning.bin_seconds,
            "burst_k": rule.k,
            "burst_min_seconds": rule.min_seconds,
            "baseline_seconds": rule.baseline_seconds,
            "window_seconds": analysis.params.window_seconds,
        },
        "overall": entity_to_dict(analysis.overall, timeline),
        "tenants": [entity_to_dict(t, timeline) for t in analysis.tenants],
        "tenants_not_shown": analysis.tenants_not_shown,
        "incidents": []
        if timeline is None
        else [incident_to_dict(i, timeline) for i in analysis.incidents],
        "prefix_cache": prefix_to_dict(analysis.prefix),
    }


def plan_to_dict(plan: CapacityPlan | None, source: str) -> dict[str, Any]:
    if plan is None:
        return {"schema": PLAN_SCHEMA, "source": source, "plan": None}
    return {
        "schema": PLAN_SCHEMA,
        "source": source,
        "plan": {
            "capacity": dataclasses.asdict(plan.capacity),
            "lead_time_s": plan.lead_time_s,
            "demand_engines": dataclasses.asdict(plan.demand),
            "busiest_window": plan.busiest_window,
            "window_p95_engines": plan.window_p95,
            "busiest_hour_mean_engines": plan.busiest_hour_mean,
            "base_engines": plan.base_engines,
            "elastic_engines": plan.elastic_engines,
            "mean_engines": plan.mean_engines,
            "demand_engine_hours": plan.demand_engine_hours,
            "autoscaler": {
                "interval_s": AUTOSCALE_INTERVAL_S,
                "scale_down_delay_s": AUTOSCALE_DOWN_DELAY_S,
                "demand_window_s": DEMAND_WINDOW_S,
                "target_utilization": TARGET_UTILIZATION,
                "engine_startup_s": plan.lead_time_s,
            },
            "outcomes": [
                {
                    **dataclasses.asdict(o),
                    "over_capacity_min": o.over_capacity_min,
                    "engine_hours_vs_always_on": plan.engine_hours_ratio(o),
                }
                for o in plan.outcomes
            ],
        },
    }


def score_to_dict(score: AlarmScore) -> dict[str, Any]:
    return {
        "bursts": score.bursts,
        "predicted": score.predicted,
        "recall": score.recall,
        "alarms": score.alarms,
        "true_alarms": score.true_alarms,
        "late_alarms": score.late_alarms,
        "false_alarms": score.false_alarms,
        "precision": score.precision,
        # The two figures a verdict rests on, side by side: how often it cries
        # wolf, and whether its alarms come before the burst starts (> 0 s).
        "false_alarm_ratio": score.false_alarm_ratio,
        "median_lead_vs_start_s": score.median_lead_vs_start_s,
        "median_lead_vs_detection_s": score.median_lead_vs_detection_s,
        "false_alarms_per_hour": score.false_alarms_per_hour,
        "chance_precision": score.chance_precision,
        "quiet_alarm_rate": score.quiet_alarm_rate,
        "lead_vs_start_s": score.lead_vs_start_s,
        "lead_vs_detection_s": score.lead_vs_detection_s,
        "usable": score.usable,
        "verdict": score.verdict,
    }


def _evaluation_to_dict(ev: AxisEvaluation | None) -> dict[str, Any] | None:
    if ev is None:
        return None
    return {
        "params": dataclasses.asdict(ev.params),
        "alarm_z": ev.alarm_z,
        "train_bursts": ev.fitted_on_bursts,
        "train": score_to_dict(ev.train),
        "test": score_to_dict(ev.test),
        "persistence_z": ev.persistence_z,
        "persistence_test": score_to_dict(ev.persistence_test),
        "mae": ev.mae,
        "persistence_mae": ev.persistence_mae,
        "mean_mae": ev.mean_mae,
    }


def forecast_to_dict(source: str, tenant: str | None, axes: list[AxisForecast]) -> dict[str, Any]:
    return {
        "schema": FORECAST_SCHEMA,
        "source": source,
        "tenant": tenant,
        "axes": [
            {
                "axis": f.axis,
                "horizon_s": f.horizon_s,
                "train_seconds": f.train_seconds,
                "test_seconds": f.test_seconds,
                "now": dataclasses.asdict(f.now),
                "evaluation": _evaluation_to_dict(f.evaluation),
            }
            for f in axes
        ],
    }
