"""A usage larger than one request may use is refused before anything
changes, on every door that books usage (issue 30, item 9): an offline
Complete and Envoy's response path. Before, the quota was charged, then the
settlement failed (INTERNAL) and the reservation stayed open. A real server
on a free port, SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

import grpc
import pytest
from burstgate_client.protoclient import ProtoClient, pb

from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2 as rls
from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2_grpc as rls_grpc
from controlplane.domain import TenantConfig
from tests.support import add_tenants

HALF = 6_000_000  # two of these: more than the 10,000,000 one request may use


@pytest.fixture
def served(
    migrated_url: str, make_server: Callable[..., Any], tmp_path: Any, clock: Any
) -> Any:
    add_tenants(migrated_url, TenantConfig("acme", Decimal(1000), 10_000,
                                           hourly_quota=10**9))  # fmt: skip
    mapping = tmp_path / "burstgate-envoy.yaml"
    mapping.write_text("domain: burstgate\n")
    return make_server(migrated_url, clock=clock, envoy_rls_config=mapping)


def state(srv: Any) -> dict[str, int]:
    out: dict[str, int] = srv.on_loop(lambda: srv.plane.service.views.tenant_state("acme"))
    return out


def test_an_offline_complete_too_large_is_refused_before_it_is_booked(served: Any) -> None:
    before = state(served)
    with ProtoClient(served.target) as c, pytest.raises(grpc.RpcError) as err:
        c.stub.Complete(pb.CompleteRequest(
            tenant_id="acme", request_id="big", prompt_tokens=HALF, generated_tokens=HALF,
            offline=pb.OfflineAdmission()), timeout=10)  # fmt: skip
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("generated_tokens: ")
    assert state(served) == before  # no quota charged, nothing left open
    assert served.on_loop(lambda: served.plane.service.views.record("acme", "big")) is None


def test_envoys_response_path_too_large_is_bad_input_and_books_nothing(served: Any) -> None:
    before = state(served)
    req = rls.RateLimitRequest(domain="burstgate")
    d = req.descriptors.add()
    for key, value in (("tenant", "acme"), ("request_id", "big"), ("phase", "response"),
                       ("prompt_tokens", str(HALF)), ("completion_tokens", str(HALF))):
        d.entries.add(key=key, value=value)
    d.hits_addend.value = 2 * HALF
    with grpc.insecure_channel(served.target) as ch:
        resp = rls_grpc.RateLimitServiceStub(ch).ShouldRateLimit(req, timeout=10)
    headers = {h.key: h.value for h in resp.response_headers_to_add}
    assert headers["x-burstgate-error"].startswith("generated_tokens: ")
    assert state(served) == before
