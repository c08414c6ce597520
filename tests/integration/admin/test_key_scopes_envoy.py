"""The key-scope matrix on Envoy's rate-limit service (issue 30: "Every RLS
call is scoped exactly like Admit; test the key-scope matrix on the Envoy
service too"). Over real gRPC against PostgreSQL, with the shipped mapping
(deploy/envoy/burstgate-envoy.yaml): a sidecar key bound to tenants and
pools admits, checks and settles only inside them, whichever way the pool is
reached (named, the tenant's, the lane's); an admin or viewer key is not a
sidecar key; no key is no call. A refusal changes nothing: no reservation,
no ledger row, no quota spent."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import grpc
import pytest
from burstgate_client.admin import authenticated_channel

from controlplane._proto.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2 as rl
from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2 as rls
from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2_grpc as rls_grpc
from controlplane.domain import TenantConfig
from controlplane.domain.audit import Actor
from controlplane.domain.keys import Role
from controlplane.store.config import ConfigRepository
from controlplane.store.db import make_engine, upgrade
from controlplane.store.keys import KeyStore
from tests.conftest import ServerThread
from tests.integration.admin.conftest import start_server
from tests.integration.ledger.conftest import ledger_rows
from tests.support import add_tenants, wait_until

pytestmark = pytest.mark.postgres

MAPPING = Path(__file__).parents[3] / "deploy" / "envoy" / "burstgate-envoy.yaml"
OK, OVER = rls.RateLimitResponse.OK, rls.RateLimitResponse.OVER_LIMIT
ACTOR = Actor("local:test", "local")


@dataclass
class Env:
    url: str
    srv: ServerThread
    keys: dict[str, str]  # scoped (acme, gamma / pool-a), every (* / *), admin, viewer

    def stub(self, key: str) -> rls_grpc.RateLimitServiceStub:
        return rls_grpc.RateLimitServiceStub(authenticated_channel(self.srv.target, key))

    def call(self, key: str, **entries: str) -> rls.RateLimitResponse:
        hits = int(entries.pop("hits", "100"))
        d = rl.RateLimitDescriptor(
            entries=[rl.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries.items()]
        )
        out: rls.RateLimitResponse = self.stub(key).ShouldRateLimit(
            rls.RateLimitRequest(domain="burstgate", descriptors=[d], hits_addend=hits),
            timeout=10,
        )
        return out

    def record(self, tenant: str, rid: str) -> Any:
        return self.srv.on_loop(lambda: self.srv.plane.service.views.record(tenant, rid))

    def in_flight(self, tenant: str) -> int:
        return int(self.srv.on_loop(lambda: self.srv.plane.service.views.tenant_limits(tenant))
                   .inflight_requests)  # fmt: skip


def error(resp: rls.RateLimitResponse) -> str:
    return next((h.value for h in resp.response_headers_to_add
                 if h.key == "x-burstgate-error"), "")  # fmt: skip


@pytest.fixture
def env(pg_url: str) -> Iterator[Env]:
    """As test_key_scopes.py: acme on pool-a, beta on pool-b, gamma on its
    lane's pool (standard -> pool-a, batch -> pool-b)."""
    upgrade(pg_url)
    add_tenants(
        pg_url,
        TenantConfig("acme", Decimal(1000), 100_000, pool="pool-a"),
        TenantConfig("beta", Decimal(1000), 100_000, pool="pool-b"),
        TenantConfig("gamma", Decimal(1000), 100_000),
    )
    engine = make_engine(pg_url)
    repo = ConfigRepository(engine)
    repo.update_lane("standard", {"pool": "pool-a"})
    repo.update_lane("batch", {"pool": "pool-b"})
    store = KeyStore(engine)
    keys = {
        "scoped": store.create_key("pool-a-envoy", Role.SIDECAR, ACTOR,
                                   tenants=["acme", "gamma"], pools=["pool-a"])[0],
        "every": store.create_key("any", Role.SIDECAR, ACTOR, tenants=["*"], pools=["*"])[0],
        "admin": store.create_key("ops", Role.ADMIN, ACTOR)[0],
        "viewer": store.create_key("look", Role.VIEWER, ACTOR)[0],
    }  # fmt: skip
    srv = start_server(pg_url, admission_auth=True, envoy_rls_config=MAPPING)
    try:
        yield Env(pg_url, srv, keys)
    finally:
        srv.stop()
        engine.dispose()


def rid() -> str:
    return uuid.uuid4().hex


@pytest.mark.parametrize(
    ("entries", "allowed", "named"),
    [
        ({"tenant": "acme"}, True, ""),                          # its tenant, its pool
        ({"tenant": "gamma"}, True, ""),                         # standard lane -> pool-a
        ({"tenant": "beta"}, False, "'beta' is outside"),        # another tenant
        ({"tenant": "acme", "pool": "pool-b"}, False, "pool"),   # its tenant, another pool
        ({"tenant": "gamma", "lane": "batch"}, False, "pool"),   # the lane's pool is outside
    ],
    ids=["own-tenant", "own-via-lane", "other-tenant", "named-pool", "lane-pool"],
)
def test_the_request_path_is_scoped_as_admit_is(
    env: Env, entries: dict[str, str], allowed: bool, named: str
) -> None:
    tenant = entries["tenant"]
    r = rid()
    resp = env.call(env.keys["scoped"], request_id=r, **entries)
    if allowed:
        assert resp.overall_code == OK, error(resp)
        assert env.record(tenant, r) is not None
        return
    assert resp.overall_code == OVER
    assert named in error(resp), error(resp)
    assert env.record(tenant, r) is None and env.in_flight(tenant) == 0
    # The unscoped key is let through with the same request: the scope refused it.
    assert env.call(env.keys["every"], request_id=rid(), **entries).overall_code == OK


def test_a_check_only_call_is_scoped_too(env: Env) -> None:
    resp = env.call(env.keys["scoped"], tenant="beta", hits="0")
    assert resp.overall_code == OVER and "'beta' is outside" in error(resp)
    assert env.call(env.keys["scoped"], tenant="acme", hits="0").overall_code == OK


def test_the_response_path_settles_only_inside_the_scope(env: Env) -> None:
    """A key cannot settle (refund, or book usage to) a tenant outside it:
    beta's reservation stays open after the scoped key's stream-done call,
    and is settled by a key that serves beta."""
    r = rid()
    assert env.call(env.keys["every"], tenant="beta", request_id=r).overall_code == OK
    usage = {"phase": "response", "prompt_tokens": "30", "completion_tokens": "20",
             "usage": "reported", "hits": "50"}  # fmt: skip
    env.call(env.keys["scoped"], tenant="beta", request_id=r, **usage)
    assert env.in_flight("beta") == 1  # still open: not settled by the outsider
    assert not ledger_rows(env.url, f"request_id = '{r}'")
    # Usage booked under a fresh id by an outsider is not booked either.
    stray = rid()
    env.call(env.keys["scoped"], tenant="beta", request_id=stray, **usage)
    env.call(env.keys["every"], tenant="beta", request_id=r, **usage)
    [row] = wait_until(lambda: ledger_rows(env.url, f"request_id = '{r}'") or None,
                       message="beta's row")  # fmt: skip
    assert (row.tenant_id, row.prompt_tokens, row.output_tokens) == ("beta", 30, 20)
    assert not ledger_rows(env.url, f"request_id = '{stray}'")


@pytest.mark.parametrize("role", ["admin", "viewer"])
def test_only_a_sidecar_key_opens_the_envoy_door(env: Env, role: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        env.call(env.keys[role], tenant="acme", request_id=rid())
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()


def test_no_key_or_a_bogus_key_is_no_call(env: Env) -> None:
    for key in ("", "bgk_nope_nope"):
        stub = rls_grpc.RateLimitServiceStub(grpc.insecure_channel(env.srv.target))
        md = [("authorization", f"Bearer {key}")] if key else []
        with pytest.raises(grpc.RpcError) as err:
            stub.ShouldRateLimit(
                rls.RateLimitRequest(domain="burstgate", descriptors=[rl.RateLimitDescriptor(
                    entries=[rl.RateLimitDescriptor.Entry(key="tenant", value="acme")])]),
                timeout=10, metadata=md,
            )  # fmt: skip
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
