"""The auth matrix: each refusal has the right status and changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import admin_pb2 as apb
from burstgate_client._proto.burstgate.v1 import admin_pb2_grpc as apb_grpc
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.admin import AdminClient
from google.protobuf.field_mask_pb2 import FieldMask
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from controlplane.domain import TenantConfig
from controlplane.domain.audit import Actor
from controlplane.rpc.errors import DOMAIN
from controlplane.store.db import make_engine
from controlplane.store.keys import KeyStore
from tests.integration.admin.conftest import Env, code_of
from tests.support import add_tenants, error_details, wait_until

UNAUTH = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED


def _write(client: Any) -> Any:
    return client.call(
        "UpdateTenant",
        apb.UpdateTenantRequest(
            tenant=apb.Tenant(tenant_id="acme", burst_tokens=1),
            update_mask=FieldMask(paths=["burst_tokens"]),
        ),
    )


def _revoke_db_direct(url: str, key_id: str) -> None:
    engine = make_engine(url)
    KeyStore(engine).revoke_key(key_id, Actor("local:test", "local"))
    engine.dispose()


# The credential x RPC matrix (every service the server mounts, generated
# from the role table of docs/operating.md) is test_credential_matrix.py.


@pytest.mark.parametrize("env", [{"config_poll_s": 0.2}], indirect=True)
def test_revoked_keys_are_refused(env: Env) -> None:
    viewer_id = env.keys.ids["viewer"]
    assert env.viewer.list_tenants()
    # Revoked by another process (the DB-direct CLI): the key cache every
    # call is checked against picks it up at the next config poll.
    _revoke_db_direct(env.url, viewer_id)

    def refused() -> bool:
        try:
            env.viewer.list_tenants()
        except grpc.RpcError as exc:
            assert exc.code() == UNAUTH and "revoked" in (exc.details() or "")
            return True
        return False

    wait_until(refused, message="the revoked viewer key to be refused", timeout=5)
    # Revoked through this server: refused from the very next call.
    # Revoke the admin key through the API with a second admin key.
    other = env.admin.call("CreateApiKey", apb.CreateApiKeyRequest(name="ops2", role="admin"))
    with AdminClient(env.target, other.secret) as second:
        second.call("RevokeApiKey", apb.RevokeApiKeyRequest(key_id=env.keys.ids["admin"]))
        code, _ = code_of(lambda: _write(env.admin))
        assert code == UNAUTH
        assert (
            second.call("GetTenant", apb.GetTenantRequest(tenant_id="acme")).burst_tokens == 10_000
        )


def test_health_and_reflection_need_no_key(env: Env) -> None:
    channel = grpc.insecure_channel(env.target)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "burstgate.v1.AdminService", "burstgate.v1.AdmissionService"):
        r = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    # List too (grpc's asyncio servicer has none: it answered UNIMPLEMENTED
    # and logged a traceback per call).
    listed = health.List(health_pb2.HealthListRequest(), timeout=5).statuses
    assert listed["burstgate.v1.AdmissionService"].status == health_pb2.HealthCheckResponse.SERVING
    assert "" in listed and "burstgate.v1.AdminService" in listed
    # Both reflection protocols (their messages are the same on the wire).
    for version in ("v1", "v1alpha"):
        info = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        [listing] = info(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in listing.list_services_response.service}
        assert "burstgate.v1.AdminService" in names, version


@pytest.mark.parametrize("env", [{"admission_auth": True}], indirect=True)
def test_admission_tokens(env: Env) -> None:
    code, details = code_of(lambda: env.admit("acme", "r1"))
    assert code == UNAUTH and "missing credentials" in details
    code, details = code_of(lambda: env.admit("acme", "r1", key=env.keys.admin))
    assert code == DENIED and "role 'admin'" in details
    code, _ = code_of(lambda: env.admit("acme", "r1", key=env.keys.sidecar[:-2] + "zz"))
    assert code == UNAUTH
    ok = env.admit("acme", "r1", key=env.keys.sidecar)
    assert ok.decision == pb.DECISION_ADMIT
    # Streams are checked too.
    stub = env.admission()
    code, _ = code_of(lambda: list(stub.AdmitStream(iter([pb.AdmitBatch(batch_id=1)]))))
    assert code == UNAUTH
    streamed = list(
        env.admission(env.keys.sidecar).AdmitStream(
            iter(
                [
                    pb.AdmitBatch(
                        batch_id=7, tenant_id=["acme"], request_id=["s1"],
                        prompt_tokens=[10], max_tokens=[0],
                    )
                ]
            )
        )
    )  # fmt: skip
    assert [r.batch_id for r in streamed] == [7]
    # None of the refused calls reached the service.
    counts = env.srv.on_loop(lambda: dict(env.srv.plane.service.stats.decision_counts))
    assert sum(counts.values()) == 2
    # A sidecar token revoked through the API is refused at once.
    env.admin.call("RevokeApiKey", apb.RevokeApiKeyRequest(key_id=env.keys.ids["sidecar"]))
    code, _ = code_of(lambda: env.admit("acme", "r2", key=env.keys.sidecar))
    assert code == UNAUTH
    # A new one, created through the API, works at once.
    fresh = env.admin.call(
        "CreateApiKey",
        apb.CreateApiKeyRequest(name="pool-b", role="sidecar", tenants=["acme"], pools=["*"]),
    )
    assert env.admit("acme", "r3", key=fresh.secret).decision == pb.DECISION_ADMIT


def _error(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


@pytest.mark.parametrize("env", [{"admission_auth": True}], indirect=True)
def test_refusals_carry_error_info(env: Env) -> None:
    # The interceptor's refusals have the same structured details as the
    # servicers' errors (docs/api.md, "Errors"): admission, streams and admin.
    raw = apb_grpc.AdminServiceStub(grpc.insecure_channel(env.target))
    cases: list[tuple[Callable[[], Any], grpc.StatusCode, str]] = [
        (lambda: env.admit("acme", "r1"), UNAUTH, "missing credentials"),
        (lambda: env.admit("acme", "r1", key=env.keys.sidecar[:-2] + "zz"), UNAUTH, "invalid"),
        (lambda: env.admit("acme", "r1", key=env.keys.admin), DENIED, "role 'admin'"),
        (
            lambda: list(env.admission().AdmitStream(iter([pb.AdmitBatch(batch_id=1)]))),
            UNAUTH,
            "missing credentials",
        ),
        (lambda: raw.ListTenants(apb.ListTenantsRequest()), UNAUTH, "missing credentials"),
        (lambda: _write(env.viewer), DENIED, "role 'viewer'"),
    ]
    for call, code, text in cases:
        err = _error(call)
        assert (err.code(), text in (err.details() or "")) == (code, True), err
        d = error_details(err)
        assert (d.info.reason, d.info.domain) == (code.name, DOMAIN), err
        assert d.bad_request is None and d.retry is None


# The poll alone (no NOTIFY): a notified reload would also meet the broken
# apply, and run the steps this test counts.
@pytest.mark.parametrize("env", [{"admission_auth": True, "listen_notify": False}], indirect=True)
def test_a_config_that_cannot_apply_does_not_stop_revocations(env: Env) -> None:
    # The config poll's steps are independent: a config change that fails to
    # apply (the plane keeps serving its last config) must not keep a sidecar
    # key revoked by another process (the database-direct CLI) working.
    plane = env.srv.plane
    assert env.admit("acme", "r1", key=env.keys.sidecar).decision == pb.DECISION_ADMIT
    _revoke_db_direct(env.url, env.keys.ids["sidecar"])
    add_tenants(env.url, TenantConfig("gamma", Decimal(10), 1_000))  # a config change

    def broken_apply(*_args: Any, **_kwargs: Any) -> None:
        raise ValueError("this config cannot apply")

    plane.service.apply_config = broken_apply
    failures = plane.config_reload_failures
    env.srv._run(plane.poll_once())
    assert plane.config_reload_failures == failures + 1  # the config did not apply ...
    assert "gamma" not in env.srv.on_loop(plane.service.views.tenant_ids)
    code, details = code_of(lambda: env.admit("acme", "r2", key=env.keys.sidecar))
    assert code == UNAUTH, details  # ... and the revocation took effect anyway
    assert plane.key_refresh_failures == 0


@pytest.mark.parametrize("env", [{"admission_auth": True}], indirect=True)
def test_a_revoked_key_ends_its_open_admit_streams(env: Env) -> None:
    # A stream opened before the revocation is checked again per batch: the
    # next batch after RevokeApiKey ends it UNAUTHENTICATED, nothing decided.
    import queue

    outbox: queue.Queue[pb.AdmitBatch | None] = queue.Queue()

    def batches() -> Any:
        while (b := outbox.get(timeout=10)) is not None:
            yield b

    def batch(i: int) -> pb.AdmitBatch:
        return pb.AdmitBatch(
            batch_id=i, tenant_id=["acme"], request_id=[f"s{i}"], prompt_tokens=[10],
            max_tokens=[0],
        )  # fmt: skip

    answers = env.admission(env.keys.sidecar).AdmitStream(batches(), timeout=20)
    outbox.put(batch(1))
    assert next(answers).decision == [pb.DECISION_ADMIT]
    env.admin.call("RevokeApiKey", apb.RevokeApiKeyRequest(key_id=env.keys.ids["sidecar"]))
    outbox.put(batch(2))
    with pytest.raises(grpc.RpcError) as info:
        next(answers)
    assert info.value.code() == UNAUTH, info.value.details()
    outbox.put(None)
    # the second batch was never decided
    record = env.srv.on_loop(lambda: env.srv.plane.service.views.record("acme", "s2"))
    assert record is None
