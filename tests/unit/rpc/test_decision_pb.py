"""The unary Admit's wire answer (``decision_to_pb``) is the message the
keyword constructor builds from the same decision, byte for byte."""

from __future__ import annotations

import itertools

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb

from controlplane.domain import AdmitDecision, Decision, Degradation, Pressure
from controlplane.domain.money import format_multiplier
from controlplane.rpc.admission import decision_to_pb
from controlplane.rpc.convert import ceil_ms, degradation_pb, pressure_pb
from fastpath import Reason


def reference(d: AdmitDecision) -> pb.AdmitResponse:
    return pb.AdmitResponse(
        request_id=d.request_id,
        decision=pb.Decision.ValueType(d.decision),
        reason=pb.Reason.ValueType(d.reason),
        retry_after_ms=ceil_ms(d.retry_after_ns),
        reserved_tokens=d.reserved_tokens,
        reservation_id=d.reservation_id,
        granted_max_tokens=d.granted_max_tokens,
        remaining=pb.Remaining(
            bucket_tokens=d.bucket_remaining,
            hourly_tokens=d.hourly_remaining,
            daily_tokens=d.daily_remaining,
        ),
        message=d.message,
        duplicate=d.duplicate,
        lane=d.lane,
        pricing_multiplier=format_multiplier(d.pricing_multiplier),
        retryable=d.retryable,
        queue_wait_ms=ceil_ms(d.queue_wait_ns),
        degradation=degradation_pb(d.degradation),
        shadow_reason=pb.Reason.ValueType(d.shadow_reason),
        pressure=pressure_pb(d.pressure),
        admission_token=d.admission_token,
    )


def decisions() -> list[AdmitDecision]:
    out = []
    pressures = [
        None,
        Pressure(0.0, 0, "", False),
        Pressure(0.25, 1, "", False),
        Pressure(1.0, 2, "fail_open", True),
        Pressure(0.5, 3, "fail_closed", False),
    ]
    degradations = [None, Degradation(0, 0, ""), Degradation(512, 128, "small-model")]
    for i, (admit, pressure, degradation) in enumerate(
        itertools.product((True, False), pressures, degradations)
    ):
        zero = i % 3 == 0  # every count at zero on some
        out.append(
            AdmitDecision(
                request_id=f"r-{i}" if i % 4 else "",
                decision=Decision.ADMIT if admit else Decision.REJECT,
                reason=Reason.OK if admit else Reason.TOKEN_RATE,
                retry_after_ns=0 if admit or zero else 1_500_001,
                reserved_tokens=0 if zero else 150,
                reservation_id=0 if zero else 2**63 + i,
                granted_max_tokens=0 if zero else 50,
                bucket_remaining=0 if zero else 999_000,
                hourly_remaining=0 if zero else -1,
                daily_remaining=0 if zero else 12,
                lane="" if zero else "standard",
                message="" if zero else "admitted",
                duplicate=bool(i % 2),
                pricing_multiplier=1.0 if i % 2 else 1.25,
                queue_wait_ns=0 if zero else 999,
                degradation=degradation,
                shadow_reason=0 if zero else int(Reason.CONCURRENCY),
                pressure=pressure,
                retryable=not admit and not zero,
                admission_token=b"" if zero or not admit else bytes(range(40)),
            )
        )
    return out


def test_same_bytes_as_the_keyword_constructor() -> None:
    for d in decisions():
        ours, ref = decision_to_pb(d), reference(d)
        assert ours == ref, d
        assert ours.SerializeToString(deterministic=True) == ref.SerializeToString(
            deterministic=True
        ), d
        assert ours.HasField("remaining") and ours.HasField("pressure") == (d.pressure is not None)
        assert ours.HasField("degradation") == (d.degradation is not None)
