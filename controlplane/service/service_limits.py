"""The settings the admission service reads, as one small frozen record.

The process settings have many more fields (database, TLS, metrics,
replicas ...) that the service has no business knowing; taking only these
keeps ``service/`` free of the settings module and makes each part's inputs
visible. The server builds it from its settings with ``ServiceLimits.of``;
simulators, benchmarks and tests do the same, or set the fields directly."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from controlplane.domain.policy import Policy


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceLimits:
    """No defaults here: the settings hold them (docs/configuration.md),
    so each is written once."""

    # the policy in force until a config names one
    policy: Policy
    # the tenant an unknown tenant id is charged to ("" or None: refused)
    default_tenant: str | None
    # memory protection: open reservations overall and per tenant (0 = no cap)
    max_open_reservations: int
    max_open_reservations_per_tenant: int
    # how long an open reservation, a refusal and a settled id are remembered
    reservation_ttl_s: float
    rejection_replay_s: float
    settled_id_window_s: float
    # a load report older than this no longer counts
    load_report_stale_s: float
    # refused requests remembered for their retries' deadlines
    retry_memory: int
    # retry_after of a refusal for concurrency
    concurrency_retry_ms: int
    # a Complete may report up to this times its reservation
    complete_max_overrun_ratio: float
    # the autoscaling signal (``ServiceViews.pool_demand``)
    autoscale_target_utilization: float
    autoscale_engine_startup_s: float
    # most entries in one AdmitStream or AdmitBatch message
    max_batch: int

    @classmethod
    def of(cls, settings: Any) -> ServiceLimits:
        """The fields of the same names from ``settings`` (the process
        ``Settings``, or anything with these attributes)."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})
