"""Sidecar keys bound to their tenants and pools, key expiry and last use:
over real gRPC against PostgreSQL (the store-level parts on SQLite too)."""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import admin_pb2 as apb
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from burstgate_client.admin import AdminClient, authenticated_channel
from google.protobuf.timestamp_pb2 import Timestamp
from sqlalchemy import column, select, table, update

from controlplane.domain import TenantConfig
from controlplane.domain.audit import Actor
from controlplane.domain.keys import Role
from controlplane.rpc.errors import DOMAIN
from controlplane.store.audit import aware
from controlplane.store.config import ConfigRepository
from controlplane.store.db import make_engine, upgrade
from controlplane.store.keys import KeyStore
from controlplane.store.models import ApiKey
from tests.conftest import ServerThread
from tests.integration.admin.conftest import start_server
from tests.support import add_tenants, error_details, wait_until

UNAUTH = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED
ACTOR = Actor("local:test", "local")


@dataclass
class Scoped:
    url: str
    srv: ServerThread
    store: KeyStore
    scoped: str  # acme, gamma, team-* / pool-a
    every: str  # * / *
    admin: str
    ids: dict[str, str]

    @property
    def plane(self) -> Any:
        return self.srv.plane

    def stub(self, key: str) -> pb_grpc.AdmissionServiceStub:
        return pb_grpc.AdmissionServiceStub(authenticated_channel(self.srv.target, key))

    def admit(self, key: str, tenant: str, rid: str, **kw: Any) -> pb.AdmitResponse:
        kw.setdefault("prompt_tokens", 100)
        r: pb.AdmitResponse = self.stub(key).Admit(
            pb.AdmitRequest(tenant_id=tenant, request_id=rid, **kw), timeout=10
        )
        return r

    def record(self, tenant: str, rid: str) -> Any:
        return self.srv.on_loop(lambda: self.plane.service.views.record(tenant, rid))


@pytest.fixture
def env(pg_url: str) -> Iterator[Scoped]:
    """acme serves on pool-a, beta on pool-b; gamma has no pool of its own
    (its lane's: standard -> pool-a, batch -> pool-b) and long requests of
    it are moved to the batch lane; public is the default tenant (pool-a)."""
    upgrade(pg_url)
    add_tenants(
        pg_url,
        TenantConfig("acme", Decimal(1000), 100_000, pool="pool-a"),
        TenantConfig("beta", Decimal(1000), 100_000, pool="pool-b"),
        TenantConfig("gamma", Decimal(1000), 100_000, long_request_tokens=1000),
        TenantConfig("public", Decimal(1000), 100_000, pool="pool-a"),
    )
    engine = make_engine(pg_url)
    repo = ConfigRepository(engine)
    repo.update_lane("standard", {"pool": "pool-a"})
    repo.update_lane("batch", {"pool": "pool-b"})
    store = KeyStore(engine)
    made = {
        "scoped": store.create_key("pool-a-sidecar", Role.SIDECAR, ACTOR,
                                   tenants=["acme", "gamma", "team-*"], pools=["pool-a"]),
        "every": store.create_key("any", Role.SIDECAR, ACTOR, tenants=["*"], pools=["*"]),
        "admin": store.create_key("ops", Role.ADMIN, ACTOR),
    }  # fmt: skip
    srv = start_server(pg_url, admission_auth=True, default_tenant="public")
    try:
        yield Scoped(
            pg_url, srv, store, made["scoped"][0], made["every"][0], made["admin"][0],
            {name: info.key_id for name, (_, info) in made.items()},
        )  # fmt: skip
    finally:
        srv.stop()
        engine.dispose()


def refused(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str, Any]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    err: Any = info.value
    return err.code(), err.details(), error_details(err)


def test_a_scoped_key_admits_only_for_its_tenants_and_pools(env: Scoped) -> None:
    key = env.scoped
    assert env.admit(key, "acme", "a1").decision == pb.DECISION_ADMIT  # acme -> pool-a
    assert env.admit(key, "gamma", "g1").decision == pb.DECISION_ADMIT  # standard -> pool-a
    cases: list[tuple[str, dict[str, Any], str, str]] = [
        ("beta", {}, "tenant_id", "tenant_id: tenant 'beta' is outside this key's tenants"),
        ("acme", {"pool": "pool-b"}, "pool", "pool: this request's pool 'pool-b' is outside"),
        # No pool named: the one the server resolves counts. The batch lane's
        # pool ...
        ("gamma", {"lane": "batch"}, "pool", "this request's pool 'pool-b'"),
        # ... and a long request moved to the batch lane (length-aware
        # placement) is checked after the move.
        ("gamma", {"prompt_tokens": 900, "max_tokens": 200}, "pool", "pool 'pool-b'"),
        # An id the key's patterns match but no tenant has would be charged
        # to the default tenant, which the key does not serve.
        ("team-x", {}, "tenant_id", "would be charged to the default tenant 'public'"),
        ("zed", {}, "tenant_id", "tenant 'zed' is outside"),
    ]
    for tenant, kw, field, text in cases:
        code, details, d = refused(lambda: env.admit(key, tenant, "d1", **kw))  # noqa: B023
        assert (code, text in details) == (DENIED, True), (tenant, kw, details)
        assert (d.info.reason, d.info.domain, d.info.metadata["field"]) == (
            "PERMISSION_DENIED", DOMAIN, field,
        )  # fmt: skip
        assert env.record(tenant, "d1") is None  # nothing decided, nothing remembered
    # The same requests with the key for every tenant and pool are decided.
    assert env.admit(env.every, "beta", "b1").decision == pb.DECISION_ADMIT
    long = env.admit(env.every, "gamma", "g2", prompt_tokens=900, max_tokens=200)
    assert (long.decision, long.lane) == (pb.DECISION_ADMIT, "batch")
    assert env.admit(env.every, "team-x", "t1").decision == pb.DECISION_ADMIT  # as 'public'
    # A name from the caller is quoted short in the refusal.
    code, details, _ = refused(lambda: env.admit(key, "t" * 5000, "d2"))
    assert code == DENIED and len(details) < 200 and "(5000 characters)" in details
    counts = env.srv.on_loop(lambda: dict(env.plane.service.stats.decision_counts))
    assert sum(counts.values()) == 5  # the refusals above reached no decision


def test_complete_and_load_reports_are_scoped(env: Scoped) -> None:
    key = env.scoped
    a1 = env.admit(key, "acme", "a1")
    # acme's request sent to pool-b through the key for every pool
    b_side = env.admit(env.every, "acme", "on-b", pool="pool-b")
    assert b_side.decision == pb.DECISION_ADMIT
    beta = env.admit(env.every, "beta", "b1")
    stub = env.stub(key)
    done = stub.Complete(
        pb.CompleteRequest(tenant_id="acme", request_id="a1", reservation_id=a1.reservation_id,
                           prompt_tokens=100),
        timeout=10,
    )  # fmt: skip
    assert done.actual_tokens == 100
    for req, text in (
        (pb.CompleteRequest(tenant_id="beta", request_id="b1", prompt_tokens=1),
         "tenant_id: tenant 'beta' is outside"),
        (pb.CompleteRequest(tenant_id="acme", request_id="on-b", prompt_tokens=1),
         "pool: the reservation's pool 'pool-b' is outside"),
    ):  # fmt: skip
        code, details, _ = refused(lambda: stub.Complete(req, timeout=10))  # noqa: B023
        assert (code, text in details) == (DENIED, True), details
    # Neither reservation was settled by the refused calls.
    assert env.record("beta", "b1").state == env.record("acme", "on-b").state == 0  # OPEN
    # A replay of a request admitted to a pool outside the key is refused
    # too (it would hand over the reservation id).
    code, details, _ = refused(lambda: env.admit(key, "acme", "on-b"))
    assert code == DENIED and "the pool this request was admitted to 'pool-b'" in details
    assert beta.reservation_id and b_side.reservation_id

    def report(pool: str) -> Any:
        return stub.ReportLoad(
            pb.LoadReport(pool=pool, engine_id="e1", batch_tokens=10, max_batch_tokens=100,
                          queue_depth=0, queue_capacity=10),
            timeout=10,
        )  # fmt: skip

    assert report("pool-a").engines_reporting == 1
    code, details, _ = refused(lambda: report("pool-b"))
    assert code == DENIED and details == "pool: pool 'pool-b' is outside this key's pools"
    assert "pool-b" not in env.srv.on_loop(lambda: env.plane.service.views.pools)


def test_reannounce_is_scoped_by_the_signed_pool(env: Scoped) -> None:
    """Reannounce's scope is Complete's, judged on what the admission was
    signed for: a token for pool-b does not pass a pool-a key by naming no
    pool (or pool-a) in the clear. The tokens are signed with the server's
    key, as another replica of the deployment signs them."""
    signer = env.plane.service.signer
    now = env.srv.on_loop(env.plane.service.clock)

    def entry(tenant: str, rid: str, signed_pool: str, pool: str = "") -> pb.OpenReservation:
        token = signer.sign(tenant, rid, "", "standard", signed_pool, 10, 5, 0, 1.0, 0, now)
        return pb.OpenReservation(
            tenant_id=tenant, request_id=rid, pool=pool, prompt_tokens=10, max_tokens=5,
            reserved_tokens=15, granted_max_tokens=5, admission_token=token,
        )  # fmt: skip

    stub = env.stub(env.scoped)

    def call(*entries: pb.OpenReservation) -> pb.ReannounceResponse:
        res: pb.ReannounceResponse = stub.Reannounce(
            pb.ReannounceRequest(reservations=entries), timeout=10
        )
        return res

    for entries, field in (
        ((entry("acme", "in", "pool-a"), entry("acme", "b-side", "pool-b")),
         "reservations[1].pool"),
        ((entry("acme", "in", "pool-a"), entry("beta", "b1", "pool-b")),
         "reservations[1].tenant_id"),
    ):  # fmt: skip
        code, details, _ = refused(lambda: call(*entries))  # noqa: B023
        assert code == DENIED and details.startswith(f"{field}: "), details
        assert env.record("acme", "in") is None  # nothing of the call was taken
    # naming pool-a in the clear for a pool-b admission: altered, not restored
    lied = call(entry("acme", "b-side", "pool-b", pool="pool-a"))
    assert list(lied.outcome) == [pb.REANNOUNCE_OUTCOME_REFUSED], lied
    assert lied.detail[0].startswith("signature does not match: pool 'pool-a'"), lied.detail
    assert env.record("acme", "b-side") is None
    got = call(entry("acme", "in", "pool-a"))
    assert list(got.outcome) == [pb.REANNOUNCE_OUTCOME_RESTORED], got
    replicas = env.plane.service.replicas
    assert env.srv.on_loop(lambda: replicas.reservation_pool("acme", "in")) == "pool-a"
    # the key for every pool restores the pool-b one
    every = env.stub(env.every).Reannounce(
        pb.ReannounceRequest(reservations=[entry("acme", "b-side", "pool-b")]), timeout=10
    )
    assert list(every.outcome) == [pb.REANNOUNCE_OUTCOME_RESTORED], every


def test_admit_stream_refuses_a_batch_with_an_entry_outside_the_scope(env: Scoped) -> None:
    # Consistent with a bad entry: the batch fails as a whole (nothing of
    # it decided) and ends the stream; the batches answered before stand.
    outbox: queue.Queue[pb.AdmitBatch | None] = queue.Queue()

    def batches() -> Any:
        while (b := outbox.get(timeout=10)) is not None:
            yield b

    def batch(i: int, tenants: list[str], **kw: Any) -> pb.AdmitBatch:
        n = len(tenants)
        return pb.AdmitBatch(
            batch_id=i, tenant_id=tenants, request_id=[f"s{i}-{j}" for j in range(n)],
            prompt_tokens=kw.pop("prompt_tokens", [10] * n), max_tokens=[0] * n, **kw,
        )  # fmt: skip

    answers = env.stub(env.scoped).AdmitStream(batches(), timeout=20)
    outbox.put(batch(1, ["acme", "gamma", "acme"]))
    assert list(next(answers).decision) == [pb.DECISION_ADMIT] * 3
    outbox.put(batch(2, ["acme", "gamma", "beta"]))
    code, details, d = refused(lambda: next(answers))
    assert code == DENIED and details.startswith(
        "batch 2: tenant_id[2]: tenant 'beta' is outside this key's tenants"
    ), details
    assert (d.info.metadata["field"], d.info.metadata["batch_id"]) == ("tenant_id[2]", "2")
    outbox.put(None)
    assert env.record("acme", "s2-0") is None and env.record("acme", "s1-0") is not None
    # Resolved per entry: a long request moved to the batch lane (pool-b),
    # the batch's own pool, an unknown id charged to the default tenant.
    for bad, text in (
        (batch(3, ["acme", "gamma"], prompt_tokens=[10, 2000]),
         "batch 3: pool: entry 1's pool 'pool-b' is outside"),
        (batch(4, ["acme"], pool="pool-b"), "batch 4: pool: entry 0's pool 'pool-b'"),
        (batch(5, ["acme", "team-q"]),
         "batch 5: tenant_id[1]: unknown tenant 'team-q' would be charged to the default"),
    ):  # fmt: skip
        stream = env.stub(env.scoped).AdmitStream(iter([bad]), timeout=20)
        code, details, _ = refused(lambda: list(stream))  # noqa: B023
        assert code == DENIED and details.startswith(text), details
        assert env.record("acme", f"s{bad.batch_id}-0") is None
    # The key for every tenant and pool decides the same batches.
    ok = list(env.stub(env.every).AdmitStream(iter([batch(6, ["acme", "beta", "team-q"])])))
    assert list(ok[0].decision) == [pb.DECISION_ADMIT] * 3


def test_expiry_reaches_unary_calls_and_open_streams(env: Scoped) -> None:
    # The expiry is checked against the clock on every call and every batch
    # of an open stream: no refresh of the key cache is involved (the poll
    # is 600 s here).
    soon = datetime.now(UTC) + timedelta(seconds=3)
    key, info = env.store.create_key("short", Role.SIDECAR, ACTOR, tenants=["*"], pools=["*"],
                                     expires_at=soon)  # fmt: skip
    admin_key, _ = env.store.create_key("short-ops", Role.ADMIN, ACTOR, expires_at=soon)
    env.srv._run(env.plane.poll_once())  # the key, made DB-direct, reaches the cache
    outbox: queue.Queue[pb.AdmitBatch | None] = queue.Queue()

    def batches() -> Any:
        while (b := outbox.get(timeout=10)) is not None:
            yield b

    stream = env.stub(key).AdmitStream(batches(), timeout=20)
    outbox.put(pb.AdmitBatch(batch_id=1, tenant_id=["acme"], request_id=["e1"],
                             prompt_tokens=[1], max_tokens=[0]))  # fmt: skip
    assert list(next(stream).decision) == [pb.DECISION_ADMIT]
    assert env.admit(key, "acme", "u1").decision == pb.DECISION_ADMIT
    with AdminClient(env.srv.target, admin_key) as ops:
        assert ops.list_tenants()
        wait_until(lambda: datetime.now(UTC) > soon, message="the key to expire", timeout=10)
        code, details, _ = refused(ops.list_tenants)
        assert (code, details) == (UNAUTH, "expired API key")
    outbox.put(pb.AdmitBatch(batch_id=2, tenant_id=["acme"], request_id=["e2"],
                             prompt_tokens=[1], max_tokens=[0]))  # fmt: skip
    code, details, _ = refused(lambda: next(stream))
    assert (code, details) == (UNAUTH, "expired API key")
    outbox.put(None)
    assert env.record("acme", "e2") is None
    code, details, _ = refused(lambda: env.admit(key, "acme", "u2"))
    assert (code, details) == (UNAUTH, "expired API key")
    [listed] = [k for k in env.store.list() if k.key_id == info.key_id]
    assert listed.expires_at == soon


def test_last_use_is_kept_in_memory_and_written_once_per_poll(env: Scoped) -> None:
    plane = env.plane

    def last_used() -> dict[str, datetime | None]:
        return {k.key_id: k.last_used_at for k in env.store.list()}

    for i in range(5):
        env.admit(env.scoped, "acme", f"u{i}")
    with AdminClient(env.srv.target, env.admin) as ops:
        ops.list_tenants()
        # No SQL write per call: nothing in the database until the poll.
        assert set(last_used().values()) == {None}
        refreshes = plane.key_cache.refreshes
        before = datetime.now(UTC)
        env.srv._run(plane.poll_once())
        used = last_used()
        assert used[env.ids["every"]] is None
        for name in ("scoped", "admin"):
            stamp = used[env.ids[name]]
            assert stamp is not None and stamp >= before - timedelta(seconds=1), name
        # Writing last use leaves updated_at alone: no server reloads its keys for it.
        assert plane.key_cache.refreshes == refreshes
        [shown] = [
            k for k in ops.call("ListApiKeys", apb.ListApiKeysRequest()).keys
            if k.key_id == env.ids["scoped"]
        ]  # fmt: skip
        assert shown.HasField("last_used_time") and list(shown.tenants) == [
            "acme", "gamma", "team-*",
        ]  # fmt: skip
        assert list(shown.pools) == ["pool-a"] and not shown.HasField("expire_time")


def test_a_failed_last_use_write_stops_no_other_poll_step(env: Scoped) -> None:
    plane = env.plane
    env.admit(env.scoped, "acme", "u1")
    real = plane.key_store.touch_last_used

    def broken(*_a: Any, **_k: Any) -> None:
        raise RuntimeError("database gone")

    plane.key_store.touch_last_used = broken
    try:
        env.store.revoke_key(env.ids["every"], ACTOR)  # by another process
        add_tenants(env.url, TenantConfig("delta", Decimal(10), 1_000))
        env.srv._run(plane.poll_once())
        assert plane.key_use_failures == 1
        assert "delta" in env.srv.on_loop(plane.service.views.tenant_ids)  # config applied
        code, _, _ = refused(lambda: env.admit(env.every, "acme", "u2"))
        assert code == UNAUTH  # the revocation too
    finally:
        plane.key_store.touch_last_used = real
    env.srv._run(plane.poll_once())  # kept, and written at the next poll
    assert {k.key_id: k.last_used_at for k in env.store.list()}[env.ids["scoped"]] is not None


def test_create_api_key_checks_scope_and_expiry(env: Scoped) -> None:
    ops = AdminClient(env.srv.target, env.admin)
    future = Timestamp(seconds=int(time.time()) + 86_400)
    created = ops.call(
        "CreateApiKey",
        apb.CreateApiKeyRequest(name="edge", role="sidecar", tenants=["acme", "team-*", "acme"],
                                pools=["pool-a"], expire_time=future),
    )  # fmt: skip
    assert list(created.key.tenants) == ["acme", "team-*"]  # duplicates dropped
    assert created.key.expire_time.seconds == future.seconds
    # The new key works at once, within its scope.
    assert env.admit(created.secret, "acme", "n1").decision == pb.DECISION_ADMIT
    code, _, _ = refused(lambda: env.admit(created.secret, "beta", "n2"))
    assert code == DENIED
    [event] = [
        e for e in ops.call("ListAuditEvents", apb.ListAuditEventsRequest()).events
        if e.action == "key.create" and e.target == f"key:{created.key.key_id}"
    ]  # fmt: skip
    after = json.loads(event.after_json)
    assert (after["tenants"], after["pools"]) == (["acme", "team-*"], ["pool-a"])
    assert after["expires_at"].startswith(
        datetime.fromtimestamp(future.seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    )
    past = Timestamp(seconds=int(time.time()) - 10)
    far = Timestamp(seconds=int(time.time()) + 3651 * 86_400)
    bad: list[tuple[apb.CreateApiKeyRequest, str]] = [
        (apb.CreateApiKeyRequest(name="x", role="sidecar", pools=["*"]),
         "tenants: a sidecar key must name the tenants it serves"),
        (apb.CreateApiKeyRequest(name="x", role="sidecar", tenants=["*"]),
         "pools: a sidecar key must name the pools it serves"),
        (apb.CreateApiKeyRequest(name="x", role="viewer", tenants=["acme"]),
         "tenants: only sidecar keys are scoped"),
        (apb.CreateApiKeyRequest(name="x", role="sidecar", tenants=["acme", ""], pools=["*"]),
         "tenants[1]: must not be empty"),
        (apb.CreateApiKeyRequest(name="x", role="sidecar", tenants=["a"], pools=["p" * 129]),
         "pools[0]: longer than 128"),
        (apb.CreateApiKeyRequest(name="x", role="sidecar", tenants=[str(i) for i in range(65)],
                                 pools=["*"]), "tenants: at most 64 entries"),
        (apb.CreateApiKeyRequest(name="x", role="admin", expire_time=past),
         "expire_time: must be in the future"),
        (apb.CreateApiKeyRequest(name="x", role="admin", expire_time=far),
         "expire_time: at most 3650 days ahead"),
        (apb.CreateApiKeyRequest(name="x", role="admin", expire_time=Timestamp(seconds=2**40)),
         "expire_time: is not a valid timestamp"),
    ]  # fmt: skip
    keys_before = len(env.store.list())
    for req, text in bad:
        code, details, d = refused(lambda: ops.call("CreateApiKey", req))  # noqa: B023
        assert (code, details.startswith(text)) == (grpc.StatusCode.INVALID_ARGUMENT, True), details
        assert d.bad_request is not None
    assert len(env.store.list()) == keys_before
    ops.close()


OLD_KEY = ("key_id", "name", "role", "salt", "secret_hash", "created_by", "created_at",
           "updated_at")  # fmt: skip


def test_migration_keeps_old_sidecar_keys_serving_everything(db_url: str) -> None:
    # Sidecar keys made before scopes existed served every tenant and pool:
    # after the migration they still do, said explicitly.
    upgrade(db_url, "0005")
    engine = make_engine(db_url)
    now = datetime.now(UTC)
    rows = [dict(zip(OLD_KEY, (kid, kid, role, "00" * 16, "x", "t", now, now), strict=True))
            for kid, role in (("side", "sidecar"), ("ops", "admin"))]  # fmt: skip
    with engine.begin() as conn:
        conn.execute(table("api_keys", *(column(c) for c in OLD_KEY)).insert(), rows)
    upgrade(db_url)
    store = KeyStore(engine)
    infos = {k.key_id: k for k in store.list()}
    assert (infos["side"].tenants, infos["side"].pools) == (("*",), ("*",))
    assert (infos["ops"].tenants, infos["ops"].pools) == ((), ())
    verifiers = store.verifiers()
    assert verifiers["side"].principal.scope is None  # not limited
    # A sidecar row without a scope (an older writer) may act for nothing.
    with engine.begin() as conn:
        conn.execute(update(ApiKey).where(ApiKey.key_id == "side").values(tenants=None))
    scope = store.verifiers()["side"].principal.scope
    assert scope is not None and "acme" not in scope.tenants
    # Last use: one UPDATE for many keys, only ever moving forward.
    later = now + timedelta(minutes=5)
    store.touch_last_used({"side", "ops"}, later)
    store.touch_last_used({"side"}, now)  # older: ignored
    with engine.connect() as conn:
        got = dict(conn.execute(select(ApiKey.key_id, ApiKey.last_used_at)).all())
    assert {k: v and aware(v) for k, v in got.items()} == {"side": later, "ops": later}
    engine.dispose()
