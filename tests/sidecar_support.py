"""Plain stand-ins for the SDK's answers and client, for the sidecar's
tests that run without a control plane (the end-to-end ones use the real
SDK and server)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb


@dataclass(frozen=True, slots=True)
class FakeAdmission:
    request_id: str = "r"
    admitted: bool = True
    reason: str = ""
    retry_after_ms: int = 0
    retryable: bool = False
    granted_max_tokens: int = 0
    reservation_id: int = 1
    degraded: bool = False
    max_tokens_cap: int = 0
    fallback_model: str = ""
    pricing_multiplier: str = "1.000000"
    bucket_remaining: int = 1000
    hourly_remaining: int = -1
    daily_remaining: int = -1
    queue_wait_ms: int = 0
    offline: bool = False
    quota_exhausted: bool = False


def refused(reason: str, retry_after_ms: int = 0, **kw: Any) -> FakeAdmission:
    quota = reason in ("hourly_quota", "daily_quota")
    retryable = reason not in ("max_tokens", "unknown_tenant", "tenant_disabled")
    return FakeAdmission(admitted=False, reason=reason, retry_after_ms=retry_after_ms,
                         retryable=retryable and not quota, reservation_id=0,
                         quota_exhausted=quota, **kw)  # fmt: skip


@dataclass(frozen=True, slots=True)
class FakeLimits:
    tenant_id: str = "acme"
    token_rate: float = 100.0
    burst_tokens: int = 1000
    bucket_tokens: int = 400
    bucket_full_in_ms: int = 6000
    max_concurrency: int = 8
    inflight_requests: int = 3
    hourly_quota: int = -1
    hourly_remaining: int = -1
    daily_quota: int = -1
    daily_remaining: int = -1
    hour_resets_in_ms: int = 1_800_000
    day_resets_in_ms: int = 36_000_000


@dataclass(frozen=True, slots=True)
class FakeCompletion:
    delivered: bool = True


@dataclass
class Call:
    tenant_id: str
    request_id: str
    kw: dict[str, Any]


@dataclass
class FakeAdmitter:
    """Answers ``decide(call)`` (default: admit with the asked max_tokens)
    and records every call."""

    decide: Callable[[Call], FakeAdmission] | None = None
    limits_answer: FakeLimits | None = field(default_factory=FakeLimits)
    admits: list[Call] = field(default_factory=list)
    completes: list[Call] = field(default_factory=list)
    reports: list[pb.LoadReport] = field(default_factory=list)
    completed: asyncio.Event | None = None

    async def admit(self, tenant_id: str, request_id: str, **kw: Any) -> FakeAdmission:
        call = Call(tenant_id, request_id, kw)
        self.admits.append(call)
        if self.decide is not None:
            return dataclasses.replace(self.decide(call), request_id=request_id)
        return FakeAdmission(request_id=request_id, granted_max_tokens=kw["max_tokens"])

    async def complete(self, tenant_id: str, request_id: str, **kw: Any) -> FakeCompletion:
        self.completes.append(Call(tenant_id, request_id, kw))
        return FakeCompletion()

    async def report_load(self, report: pb.LoadReport) -> pb.LoadReportAck | None:
        self.reports.append(report)
        return pb.LoadReportAck(pool=report.pool, engines_reporting=1)

    async def limits(self, tenant_id: str) -> FakeLimits | None:
        return self.limits_answer

    @property
    def pending_completions(self) -> int:
        return 0

    async def aclose(self) -> None:
        return None
