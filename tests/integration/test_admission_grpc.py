"""AdmissionService over a real gRPC server on a free port, backed by SQLite
and by a real PostgreSQL (the ``migrated_url`` fixture runs both)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import grpc
import pytest
from burstgate_client.protoclient import ProtoClient, make_batch, pb
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from controlplane.domain import TenantConfig
from controlplane.domain.policy import Policy
from controlplane.store.config import ConfigRepository
from controlplane.store.db import make_engine
from tests.support import add_tenants, wait_until

NS = 1_000_000_000


def acme(**kw: Any) -> TenantConfig:
    kw.setdefault("token_rate", Decimal(1000))
    kw.setdefault("burst_tokens", 10_000)
    return TenantConfig(tenant_id=kw.pop("tenant_id", "acme"), **kw)


@pytest.fixture
def served(migrated_url: str, make_server: Callable[..., Any], clock: Any) -> Any:
    add_tenants(
        migrated_url,
        acme(max_concurrency=50, hourly_quota=1_000_000),
        acme(tenant_id="beta", burst_tokens=2000, max_wait_ms=0),
    )
    # These tests are about the tenants' own limits: admitted requests are
    # not completed, so the pool gate's fallback (no load reports) must not
    # be what refuses them (the gate over gRPC: test_gate_grpc.py).
    srv = make_server(
        migrated_url, clock=clock, config_poll_s=0.05, policy=Policy(gate_fallback_inflight=10_000)
    )
    with ProtoClient(srv.target) as client:
        yield srv, client


def test_admit_complete_round_trip(served: Any, clock: Any) -> None:
    _, c = served
    d = c.admit(
        "acme",
        "req-1",
        prompt_tokens=1000,
        max_tokens=2000,
        lane="premium",
        model="llama-3-8b",
        pool="a100",
    )
    assert d.decision == pb.DECISION_ADMIT
    assert d.reason == pb.REASON_UNSPECIFIED
    assert d.reserved_tokens == 3000 and d.granted_max_tokens == 2000
    assert d.remaining.bucket_tokens == 7000
    assert d.remaining.hourly_tokens == 997_000 and d.remaining.daily_tokens == -1
    assert d.lane == "premium" and d.reservation_id > 0
    s = c.complete(
        "acme", "req-1", prompt_tokens=1000, generated_tokens=500, reservation_id=d.reservation_id
    )
    assert (s.reserved_tokens, s.actual_tokens, s.refunded_tokens, s.duplicate) == (
        3000,
        1500,
        1500,
        False,
    )
    again = c.complete("acme", "req-1", prompt_tokens=1000, generated_tokens=500)
    assert again.duplicate and again.refunded_tokens == 1500
    after = c.admit("acme", "req-2", prompt_tokens=0, max_tokens=0)
    assert after.remaining.bucket_tokens == 10_000 - 1500


def test_denial_is_a_reply_with_retry_after_from_the_bucket(served: Any) -> None:
    _, c = served
    assert c.admit("beta", "a", prompt_tokens=1500, max_tokens=0).decision == pb.DECISION_ADMIT
    # 3,000 tokens, more than the 2,000-token burst: it needs a full bucket,
    # 1,500 short at 1,000 tokens/s; beta does not wait (max_wait_ms 0), so
    # a standard request is refused at once, retry_after from the bucket
    d = c.admit("beta", "b", prompt_tokens=3000, max_tokens=0)
    assert d.decision == pb.DECISION_REJECT
    assert d.reason == pb.REASON_TOKEN_RATE
    assert d.retry_after_ms == 1500
    assert d.queue_wait_ms == 0
    assert "bucket" in d.message
    dup = c.admit("beta", "b", prompt_tokens=3000, max_tokens=0)
    assert dup.duplicate and dup.reason == pb.REASON_TOKEN_RATE
    # premium is protected by priority: while the pool has room it borrows
    # from its bucket instead (docs/gate.md, rule 8), charged in full
    p = c.admit("beta", "p", prompt_tokens=3000, max_tokens=0, lane="premium")
    assert p.decision == pb.DECISION_ADMIT and p.reserved_tokens == 3000
    unknown = c.admit("nobody", "x", prompt_tokens=1, max_tokens=1)
    assert unknown.reason == pb.REASON_UNKNOWN_TENANT


def test_retry_after_ms_is_rounded_up_alike_in_unary_and_batch_answers(
    migrated_url: str, make_server: Callable[..., Any], clock: Any
) -> None:
    # 3 tokens/s: one token short is a third of a second, not a whole number
    # of milliseconds; both answers round it up, so a client that waits
    # retry_after_ms is never early.
    add_tenants(
        migrated_url,
        acme(tenant_id="u", token_rate=Decimal(3), burst_tokens=10, max_wait_ms=0),
        acme(tenant_id="b", token_rate=Decimal(3), burst_tokens=10),
    )
    srv = make_server(migrated_url, clock=clock)
    with ProtoClient(srv.target) as c:
        assert c.admit("u", "a", prompt_tokens=10, max_tokens=0).decision == pb.DECISION_ADMIT
        # (the standard lane: premium would borrow from its bucket)
        d = c.admit("u", "b", prompt_tokens=1, max_tokens=0)
        assert (d.reason, d.retryable) == (pb.REASON_TOKEN_RATE, True)
        short = srv.on_loop(lambda: srv.plane.service.admit("u", "c", "", 1, 0))
        assert short.retry_after_ns % 1_000_000 != 0  # the case worth testing
        assert d.retry_after_ms == -(-short.retry_after_ns // 1_000_000) == 334
        (r,) = c.admit_stream(
            [make_batch(1, ["b", "b"], ["a", "b"], [10, 1], [0, 0])]
        )
        assert list(r.reason) == [pb.REASON_UNSPECIFIED, pb.REASON_TOKEN_RATE]
        assert list(r.retry_after_ms) == [0, d.retry_after_ms]
        assert r.pricing_multiplier == d.pricing_multiplier == "1.000000"


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        ({"tenant_id": ""}, "tenant_id"),
        ({"request_id": "r" * 129}, "request_id"),
        ({"prompt_tokens": -10}, "prompt_tokens"),
        ({"max_tokens": 50_000_000}, "max_tokens"),
        ({"lane": "platinum"}, "lane"),
        ({"pool": "p" * 200}, "pool"),
    ],
)
def test_bad_admit_is_invalid_argument_naming_field(
    served: Any, request_kwargs: dict[str, Any], field: str
) -> None:
    srv, c = served
    before = srv.on_loop(lambda: srv.plane.service.views.tenant_state("acme"))
    req: dict[str, Any] = {
        "tenant_id": "acme",
        "request_id": "r1",
        "prompt_tokens": 10,
        "max_tokens": 10,
        "lane": "",
        "model": "",
        "pool": "",
    } | request_kwargs
    with pytest.raises(grpc.RpcError) as err:
        c.stub.Admit(pb.AdmitRequest(**req), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field)
    assert srv.on_loop(lambda: srv.plane.service.views.tenant_state("acme")) == before


def test_bad_complete_statuses(served: Any) -> None:
    srv, c = served
    with pytest.raises(grpc.RpcError) as err:
        c.complete("acme", "never-admitted", prompt_tokens=1, generated_tokens=1)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "request_id" in err.value.details()
    c.admit("acme", "ok", prompt_tokens=10, max_tokens=10)
    with pytest.raises(grpc.RpcError) as err:
        c.complete("acme", "ok", prompt_tokens=-1, generated_tokens=1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("prompt_tokens")
    c.admit("beta", "huge", prompt_tokens=5000, max_tokens=0)  # refused: bigger than the burst
    with pytest.raises(grpc.RpcError) as err:
        c.complete("beta", "huge", prompt_tokens=1, generated_tokens=1)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # nothing was settled by the failed calls
    assert srv.on_loop(lambda: srv.plane.service.views.open_reservations) == 1


def test_oversized_message_is_refused_and_server_keeps_serving(
    migrated_url: str, make_server: Callable[..., Any]
) -> None:
    add_tenants(migrated_url, acme())
    srv = make_server(migrated_url, max_message_bytes=64 * 1024)
    with ProtoClient(srv.target) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.stub.Admit(
                pb.AdmitRequest(tenant_id="acme", request_id="r", model="m" * 100_000), timeout=5
            )
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert c.admit("acme", "r", prompt_tokens=1, max_tokens=1).decision == pb.DECISION_ADMIT


def test_admit_stream_answers_batches_in_order(served: Any) -> None:
    _, c = served
    batches = [
        make_batch(
            b,
            ["acme"] * 100,
            [f"s{b}-{i}" for i in range(100)],
            [10] * 100,
            [10] * 100,
            lanes=["batch"],
        )
        for b in range(1, 6)
    ]
    results = list(c.admit_stream(batches))
    assert [r.batch_id for r in results] == [1, 2, 3, 4, 5]
    decisions = [d for r in results for d in r.decision]
    # concurrency 50: the first 50 of the stream are admitted, the rest refused
    assert decisions.count(pb.DECISION_ADMIT) == 50
    assert decisions[:50] == [pb.DECISION_ADMIT] * 50
    reasons = [x for r in results for x in r.reason]
    assert set(reasons[50:]) == {pb.REASON_CONCURRENCY}
    assert all(ms == 250 for r in results[1:] for ms in r.retry_after_ms)
    rids = [x for r in results for x in r.reservation_id if x]
    assert len(set(rids)) == 50


def test_admit_stream_empty_batch_is_answered_empty_and_the_stream_goes_on(served: Any) -> None:
    """A batch of N = 0 entries is valid (admission.proto): its answer echoes
    the batch id with empty columns, and later batches are decided. (Found by
    tests/integration/fuzz: it ended the stream with UNKNOWN, an IndexError.)"""
    srv, c = served
    empty = pb.AdmitBatch(batch_id=7, model="m", pool="p")
    good = make_batch(8, ["acme"], ["after-empty"], [1], [1])
    first, second = list(c.admit_stream([empty, good]))
    assert first.batch_id == 7 and list(first.decision) == [] and list(first.reason) == []
    assert second.batch_id == 8 and list(second.decision) == [pb.DECISION_ADMIT]
    assert srv.on_loop(lambda: srv.plane.service.views.open_reservations) == 1


def test_admit_stream_bad_batch_ends_stream_after_earlier_answers(served: Any) -> None:
    srv, c = served
    good = make_batch(1, ["acme"] * 3, ["a", "b", "c"], [1, 1, 1], [1, 1, 1])
    bad = make_batch(2, ["acme"] * 2, ["d", "e"], [1, -1], [1, 1])
    stream = c.admit_stream([good, bad])
    first = next(stream)
    assert list(first.decision) == [pb.DECISION_ADMIT] * 3
    with pytest.raises(grpc.RpcError) as err:
        next(stream)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_tokens[1]" in err.value.details()
    assert srv.on_loop(lambda: srv.plane.service.views.open_reservations) == 3


def test_report_load(served: Any) -> None:
    _, c = served
    ack = c.report_load(
        pb.LoadReport(
            pool="a100",
            engine_id="vllm-0",
            batch_tokens=1000,
            max_batch_tokens=8192,
            queue_depth=3,
            queue_capacity=256,
            kv_cache_miss_rate=0.2,
            gpu_utilization=0.7,
        )
    )
    assert (ack.pool, ack.engines_reporting) == ("a100", 1)
    for bad, field in (
        ({"queue_capacity": -1}, "queue_capacity"),
        # allowed by the proto, beyond any engine: refused at the edge, not
        # failed inside the score (INTERNAL) with the report kept
        ({"queue_capacity": 2**63 - 1}, "queue_capacity"),
        ({"kv_cache_miss_rate": 1.5}, "kv_cache_miss_rate"),
    ):
        with pytest.raises(grpc.RpcError) as err:
            c.report_load(pb.LoadReport(pool="a100", engine_id="vllm-0", max_batch_tokens=8192,
                                        **bad))  # fmt: skip
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field)
    # vLLM: an unbounded queue (0) and no miss rate are a valid report
    ack = c.report_load(pb.LoadReport(pool="a100", engine_id="vllm-1", max_batch_tokens=8192))
    assert ack.engines_reporting == 2


def test_health_and_reflection(served: Any) -> None:
    _, c = served
    health = health_pb2_grpc.HealthStub(c.channel)
    for service in ("", "burstgate.v1.AdmissionService"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(c.channel)
    answers = list(
        refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
    )
    names = {s.name for s in answers[0].list_services_response.service}
    assert {"burstgate.v1.AdmissionService", "grpc.health.v1.Health"} <= names


def test_tenant_change_in_database_reaches_running_server(served: Any, migrated_url: str) -> None:
    _, c = served
    assert c.admit("gamma", "r0", prompt_tokens=1, max_tokens=1).reason == pb.REASON_UNKNOWN_TENANT
    add_tenants(migrated_url, acme(tenant_id="gamma"))
    repo = ConfigRepository(make_engine(migrated_url))
    ids = itertools.count(1)

    def admit_gamma() -> Any:
        return c.admit("gamma", f"r{next(ids)}", prompt_tokens=1, max_tokens=1)

    # wait for the poller (50 ms here); bounded, not asserted on time
    wait_until(
        lambda: admit_gamma().decision == pb.DECISION_ADMIT,
        message="the config poller to load the new tenant",
    )
    repo.set_enabled("gamma", False)
    wait_until(
        lambda: admit_gamma().reason == pb.REASON_TENANT_DISABLED,
        message="the config poller to disable the tenant",
    )
    repo.engine.dispose()


def test_concurrent_unary_calls_admit_exactly_what_the_bucket_holds(
    migrated_url: str, make_server: Callable[..., Any], clock: Any
) -> None:
    # frozen clock: no refill, so exactly burst / cost requests fit; a tenant
    # max wait of 0 answers refusals at once instead of queueing them
    add_tenants(migrated_url, acme(burst_tokens=10_000, max_wait_ms=0))
    # nothing completes: the pool gate's fallback must not be the limit
    srv = make_server(migrated_url, clock=clock, policy=Policy(gate_fallback_inflight=1_000))
    admitted: list[int] = []
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            with ProtoClient(srv.target) as c:
                for i in range(25):
                    d = c.admit("acme", f"w{w}-{i}", prompt_tokens=60, max_tokens=40)
                    admitted.append(d.decision == pb.DECISION_ADMIT)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(admitted) == 200
    assert sum(admitted) == 100  # 10,000 tokens / 100 per request


def test_reservations_expire_over_grpc(
    migrated_url: str, make_server: Callable[..., Any], clock: Any
) -> None:
    add_tenants(migrated_url, acme(max_concurrency=1, max_wait_ms=0))
    srv = make_server(migrated_url, clock=clock, reservation_ttl_s=30)
    with ProtoClient(srv.target) as c:
        assert c.admit("acme", "a", prompt_tokens=1, max_tokens=1).decision == pb.DECISION_ADMIT
        assert c.admit("acme", "b", prompt_tokens=1, max_tokens=1).reason == pb.REASON_CONCURRENCY
        clock.advance(31 * NS)
        wait_until(  # the expiry task runs every 0.5 s
            lambda: srv.on_loop(lambda: srv.plane.service.views.open_reservations) == 0,
            message="the expiry task to drop the expired reservation",
        )
        assert c.admit("acme", "c", prompt_tokens=1, max_tokens=1).decision == pb.DECISION_ADMIT
        with pytest.raises(grpc.RpcError) as err:
            c.complete("acme", "a", prompt_tokens=1, generated_tokens=1)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
