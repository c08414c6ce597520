"""The pool gate over real gRPC: vLLM's load fields in ReportLoad, their
validation at the edge, and a waiting Admit released by the next report."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import grpc
import pytest
from burstgate_client.protoclient import ProtoClient, make_batch, pb

from controlplane.domain import TenantConfig
from controlplane.domain.policy import Policy
from tests.support import add_tenants, wait_until


def load(**fields: Any) -> pb.LoadReport:
    base: dict[str, Any] = {
        "pool": "gpu-a", "engine_id": "e0", "batch_tokens": 0, "max_batch_tokens": 8192,
        "queue_depth": 0, "queue_capacity": 256, "kv_cache_miss_rate": 0.0,
        "gpu_utilization": 0.0,
    }  # fmt: skip
    return pb.LoadReport(**(base | fields))


def test_gate_holds_a_call_until_a_report_shows_room(
    migrated_url: str, make_server: Callable[..., Any]
) -> None:
    add_tenants(
        migrated_url, TenantConfig(tenant_id="acme", token_rate=Decimal(1000), burst_tokens=10**6)
    )
    srv = make_server(migrated_url, policy=Policy(pool_gate=True))
    with ProtoClient(srv.target, timeout=10) as c:
        # the engine is full (no free sequence slot) and 5 requests wait in it
        c.report_load(load(queue_depth=5, requests_running=256, max_num_seqs=256))
        result: list[pb.AdmitResponse] = []

        def admit() -> None:
            result.append(c.admit("acme", "held", prompt_tokens=10, max_tokens=10, pool="gpu-a"))

        call = threading.Thread(target=admit)
        call.start()
        wait_until(lambda: srv.on_loop(lambda: srv.plane.service.waiting) == 1,
                   message="the call to wait in burstgate")  # fmt: skip
        time.sleep(0.2)
        assert not result, "released while the pool had no room"
        c.report_load(load(queue_depth=0, requests_running=100, max_num_seqs=256))
        call.join(timeout=10)
    assert result and result[0].decision == pb.DECISION_ADMIT
    assert result[0].queue_wait_ms >= 200


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"requests_running": -1}, "requests_running"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"kv_cache_usage": 1.5}, "kv_cache_usage"),
        ({"kv_cache_usage": float("nan")}, "kv_cache_usage"),
    ],
)
def test_bad_vllm_load_fields_are_refused_and_nothing_is_stored(
    migrated_url: str, make_server: Callable[..., Any], fields: dict[str, Any], field: str
) -> None:
    srv = make_server(migrated_url)
    with ProtoClient(srv.target) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.report_load(load(**fields))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"{field}:")
        assert srv.on_loop(lambda: srv.plane.service.views.pools) == {}  # nothing stored
        ack = c.report_load(load(requests_running=3, max_num_seqs=256, kv_cache_usage=0.5))
        assert ack.engines_reporting == 1


def test_refusals_carry_retryable_over_grpc(
    migrated_url: str, make_server: Callable[..., Any]
) -> None:
    # max_wait_ms 0: refused at once rather than held for the refill
    add_tenants(
        migrated_url,
        TenantConfig(tenant_id="acme", token_rate=Decimal(1000), burst_tokens=1_000,
                     max_wait_ms=0),
        TenantConfig(tenant_id="slow", token_rate=Decimal(1), burst_tokens=1_000, max_wait_ms=0),
    )  # fmt: skip
    srv = make_server(migrated_url)
    with ProtoClient(srv.target) as c:
        assert not c.admit("acme", "a", prompt_tokens=900, max_tokens=0).retryable  # admitted
        short = c.admit("acme", "b", prompt_tokens=900, max_tokens=0)  # refills in 0.8 s
        assert short.reason == pb.REASON_TOKEN_RATE and short.retryable
        # 800 s of refill: long past the standard lane's 3 s SLO, so a retry
        # cannot get its first token in time (it is late: docs/gate.md)
        c.admit("slow", "a", prompt_tokens=900, max_tokens=0)
        late = c.admit("slow", "b", prompt_tokens=900, max_tokens=0)
        assert late.reason == pb.REASON_TOKEN_RATE and not late.retryable
        assert late.retry_after_ms > 700_000  # the exact refill, still
        huge = c.admit("acme", "c", prompt_tokens=5_000, max_tokens=0)
        assert huge.reason == pb.REASON_MAX_TOKENS and not huge.retryable
        unknown = c.admit("nobody", "d", prompt_tokens=1, max_tokens=1)
        assert unknown.reason == pb.REASON_UNKNOWN_TENANT and not unknown.retryable
        batch = pb.AdmitBatch(batch_id=1, tenant_id=["acme", "acme", "nobody"],
                              request_id=["e", "f", "g"], prompt_tokens=[900, 5_000, 1],
                              max_tokens=[0, 0, 1])  # fmt: skip
        (result,) = list(c.admit_stream(iter([batch])))
        assert list(result.retryable) == [True, False, False]


def test_load_report_answers_with_eviction_advice(
    migrated_url: str, make_server: Callable[..., Any]
) -> None:
    srv = make_server(migrated_url)
    with ProtoClient(srv.target) as c:
        idle = c.report_load(load())
        assert (idle.load, idle.evict_below_reuse_per_s) == (0.0, 0.30)
        busy = c.report_load(load(batch_tokens=8192, queue_depth=512, queue_capacity=256,
                                  kv_cache_miss_rate=0.9))  # fmt: skip
        assert busy.load > 0.85 and busy.evict_below_reuse_per_s == 0.05
        # the advice is the pool's: a second, idle engine halves its load
        half = c.report_load(load(engine_id="e1"))
        assert 0.5 < half.load < 0.85 and half.evict_below_reuse_per_s == 0.15


# ------------------------------------------------ regressions of the API contract


def test_a_queue_timeout_reports_the_pool_as_it_is(
    migrated_url: str, make_server: Callable[..., Any]
) -> None:
    # it was answered with the pool UNKNOWN / fail-open although the pool had
    # just reported (an Admit right after showed it FRESH)
    add_tenants(migrated_url, TenantConfig(tenant_id="acme", token_rate=Decimal(1000),
                                           burst_tokens=10**6, max_wait_ms=100))  # fmt: skip
    srv = make_server(migrated_url)
    with ProtoClient(srv.target, timeout=10) as c:
        c.report_load(load(queue_depth=5, requests_running=256, max_num_seqs=256))
        d = c.admit("acme", "held", prompt_tokens=10, max_tokens=10, pool="gpu-a")
        assert d.reason == pb.REASON_QUEUE_TIMEOUT
        assert d.pressure.freshness == pb.POOL_FRESHNESS_FRESH
        assert d.pressure.score > 0


def test_a_batch_of_only_repeated_ids_still_reports_its_pool(
    migrated_url: str, make_server: Callable[..., Any]
) -> None:
    add_tenants(
        migrated_url, TenantConfig(tenant_id="acme", token_rate=Decimal(1000), burst_tokens=10**6)
    )
    srv = make_server(migrated_url)
    with ProtoClient(srv.target) as c:
        c.report_load(load(queue_depth=0, requests_running=10, max_num_seqs=256))
        batch = make_batch(1, ["acme", "acme"], ["a", "b"], [10, 10], [10, 10], pool="gpu-a")
        first = next(c.admit_stream([batch]))
        again = next(c.admit_stream([batch]))
        assert list(again.duplicate) == [True, True]
        for result in (first, again):
            assert result.HasField("pressure")
            assert result.pressure.freshness == pb.POOL_FRESHNESS_FRESH


def test_an_unknown_pool_is_refused_naming_the_declared_ones(
    migrated_url: str, make_server: Callable[..., Any]
) -> None:
    # a misspelt or wrong-case pool silently turned backpressure off
    add_tenants(
        migrated_url, TenantConfig(tenant_id="acme", token_rate=Decimal(1000), burst_tokens=10**6)
    )
    srv = make_server(migrated_url, policy=Policy(known_pools=["gpu-a"]))
    with ProtoClient(srv.target) as c:
        calls: list[Callable[[], Any]] = [
            lambda: c.admit("acme", "x", prompt_tokens=1, max_tokens=1, pool="GPU-A"),
            lambda: next(c.admit_stream([make_batch(1, ["acme"], ["y"], [1], [1], pool="gpu-b")])),
            lambda: c.report_load(load(pool="gpu-b")),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # a stream's error names its batch first
            assert err.value.details().removeprefix("batch 1: ").startswith("pool: unknown pool")
            assert "gpu-a" in err.value.details()
        assert srv.on_loop(lambda: srv.plane.service.views.pools) == {}  # nothing stored
        assert c.admit("acme", "ok", prompt_tokens=1, max_tokens=1, pool="gpu-a").decision == (
            pb.DECISION_ADMIT
        )
    # a declared pool nobody reports for says so (freshness UNKNOWN) and
    # gets the gate's fallback concurrency (one server per database: the
    # first one stops); an undeclared one is refused with or without the list
    srv.stop()
    srv2 = make_server(migrated_url)  # declares the test pools (tests/support.py)
    with ProtoClient(srv2.target) as c:
        d = c.admit("acme", "z", prompt_tokens=1, max_tokens=1, pool="gpu-b")
        assert d.decision == pb.DECISION_ADMIT
        assert d.pressure.freshness == pb.POOL_FRESHNESS_UNKNOWN
        with pytest.raises(grpc.RpcError) as err:
            c.admit("acme", "z2", prompt_tokens=1, max_tokens=1, pool="GPU-A")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
