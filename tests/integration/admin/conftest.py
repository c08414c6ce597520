"""Fixtures for the admin API: keys of every role (created DB-direct, as the
bootstrap CLI does), tenants, and a running server whose config poll is
slow, so that anything live after an admin call was applied by the call."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import admin_pb2 as apb
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from burstgate_client.admin import AdminClient, authenticated_channel

from controlplane.domain import TenantConfig
from controlplane.domain.audit import Actor
from controlplane.domain.keys import Role
from controlplane.settings import Settings
from controlplane.store.db import make_engine
from controlplane.store.keys import KeyStore
from tests.conftest import ServerThread
from tests.support import add_tenants

# Long enough that no poll happens during a test: changes must be applied by
# the admin call itself.
SLOW_POLL_S = 600.0


@dataclass
class Keys:
    admin: str
    viewer: str
    sidecar: str
    ids: dict[str, str]


def make_keys(url: str) -> Keys:
    engine = make_engine(url)
    store = KeyStore(engine)
    actor = Actor("local:test", "local")
    # The sidecar key serves every tenant and pool (said explicitly, as it must be).
    made = {
        role: store.create_key(
            f"test-{role.value}", role, actor,
            tenants=["*"] if role is Role.SIDECAR else [],
            pools=["*"] if role is Role.SIDECAR else [],
        )
        for role in Role
    }  # fmt: skip
    engine.dispose()
    return Keys(
        admin=made[Role.ADMIN][0],
        viewer=made[Role.VIEWER][0],
        sidecar=made[Role.SIDECAR][0],
        ids={role.value: info.key_id for role, (_, info) in made.items()},
    )


@dataclass
class Env:
    url: str
    srv: Any
    keys: Keys
    admin: AdminClient
    viewer: AdminClient

    @property
    def target(self) -> str:
        return str(self.srv.target)

    def client(self, key: str) -> AdminClient:
        return AdminClient(self.target, key)

    def admission(self, key: str | None = None) -> pb_grpc.AdmissionServiceStub:
        channel = (
            authenticated_channel(self.target, key)
            if key is not None
            else grpc.insecure_channel(self.target)
        )
        return pb_grpc.AdmissionServiceStub(channel)

    def admit(
        self, tenant: str, rid: str, prompt: int = 100, max_tokens: int = 0, **kw: Any
    ) -> pb.AdmitResponse:
        stub = self.admission(kw.pop("key", None))
        resp: pb.AdmitResponse = stub.Admit(
            pb.AdmitRequest(
                tenant_id=tenant, request_id=rid, prompt_tokens=prompt, max_tokens=max_tokens
            ),
            timeout=10,
        )
        return resp

    def tenant(self, tenant_id: str) -> apb.Tenant:
        t: apb.Tenant = self.admin.call("GetTenant", apb.GetTenantRequest(tenant_id=tenant_id))
        return t

    def audit(self, **kw: Any) -> list[apb.AuditEvent]:
        resp = self.admin.call("ListAuditEvents", apb.ListAuditEventsRequest(**kw))
        return list(resp.events)


def start_server(url: str, **overrides: Any) -> ServerThread:
    """Like the ``make_server`` fixture, but any setting may be overridden
    (metrics port, TLS, ...); the caller stops it."""
    values: dict[str, Any] = {
        "database_url": url,
        "host": "127.0.0.1",
        "port": 0,
        "metrics_port": -1,
        "admission_auth": False,
        "config_poll_s": SLOW_POLL_S,
    }
    return ServerThread(Settings(**(values | overrides)), time.time_ns)


@pytest.fixture
def env(migrated_url: str, request: pytest.FixtureRequest) -> Iterator[Env]:
    """Two tenants, keys of every role and a server; parametrise indirectly
    with a dict of settings overrides."""
    add_tenants(
        migrated_url,
        TenantConfig("acme", Decimal(1000), 10_000, hourly_quota=1_000_000, max_concurrency=50),
        TenantConfig("beta", Decimal(1), 5_000),
    )
    keys = make_keys(migrated_url)
    srv = start_server(migrated_url, **getattr(request, "param", {}))
    try:
        with (
            AdminClient(srv.target, keys.admin) as admin,
            AdminClient(srv.target, keys.viewer) as viewer,
        ):
            yield Env(migrated_url, srv, keys, admin, viewer)
    finally:
        srv.stop()


def code_of(fn: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    """Call ``fn`` expecting an RpcError; return (code, details)."""
    with pytest.raises(grpc.RpcError) as info:
        fn()
    err: Any = info.value
    return err.code(), err.details()
