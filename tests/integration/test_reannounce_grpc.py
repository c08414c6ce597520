"""Reannounce's input over gRPC on one server (the move between replicas:
tests/integration/ha/test_reannounce.py): every time field is checked
against the window Complete's are, so that nothing restored can break a
later export. SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

import grpc
import pytest

from controlplane._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from controlplane.client import AdmissionClient, pb
from controlplane.domain import TenantConfig
from tests.support import add_tenants

YEAR_10000 = 253_402_300_800  # 10000-01-01 in Unix seconds


def entry(rid: str, **kw: object) -> pb.OpenReservation:
    fields: dict[str, object] = {
        "tenant_id": "acme", "request_id": rid, "prompt_tokens": 10, "max_tokens": 20,
        "reserved_tokens": 30, "granted_max_tokens": 20, "pricing_multiplier": "1.000000",
    }  # fmt: skip
    return pb.OpenReservation(**(fields | kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("window", [YEAR_10000, 1])
def test_a_pricing_window_outside_the_admission_window_is_refused(
    migrated_url: str, make_server: Callable[..., Any], clock: Any, window: int
) -> None:
    add_tenants(migrated_url, TenantConfig("acme", Decimal(1000), 10_000))
    srv = make_server(migrated_url, clock=clock)
    now_s = clock() // 10**9
    with grpc.insecure_channel(srv.target) as ch:
        stub = pb_grpc.AdmissionServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Reannounce(pb.ReannounceRequest(reservations=[
                entry("ok"), entry("far", pricing_window=window)]), timeout=10)  # fmt: skip
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith("reservations[1].pricing_window: ")
        assert srv.on_loop(lambda: srv.plane.service.record("acme", "ok")) is None  # nothing taken
        # a window of this clock's is restored, then settled and exported as any other
        got = stub.Reannounce(pb.ReannounceRequest(reservations=[
            entry("near", pricing_window=now_s - 60)]), timeout=10)  # fmt: skip
        assert got.restored == 1
    with AdmissionClient(srv.target) as c:
        done = c.complete("acme", "near", prompt_tokens=10, generated_tokens=5)
        assert done.actual_tokens == 15 and not done.duplicate
