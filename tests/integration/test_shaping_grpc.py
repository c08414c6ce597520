"""Burst shaping over real gRPC: many concurrent waiting Admit calls,
cancellation, deadlines and backpressure, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import grpc
import pytest
from burstgate_client.protoclient import ProtoClient, pb

from controlplane.domain import TenantConfig
from controlplane.domain.policy import Policy
from tests.support import add_tenants, wait_until


def test_many_waiting_calls_are_admitted_as_slots_free(
    migrated_url: str, make_server: Callable[..., Any]
) -> None:
    add_tenants(
        migrated_url,
        TenantConfig(tenant_id="acme", token_rate=Decimal(10**6), burst_tokens=10**9,
                     max_concurrency=4, max_queued=500, max_wait_ms=60_000),
    )  # fmt: skip
    srv = make_server(migrated_url)
    n = 60
    results: list[Any] = [None] * n

    def call(i: int) -> None:
        with ProtoClient(srv.target, timeout=60) as c:
            results[i] = c.admit("acme", f"r{i}", prompt_tokens=10, max_tokens=10, lane="batch")

    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(call, i) for i in range(n)]
        settled: set[int] = set()
        with ProtoClient(srv.target) as sidecar:
            # act as the engine: finish whatever is admitted, freeing slots
            while len(settled) < n:
                wait_until(
                    lambda: any(r is not None and i not in settled for i, r in enumerate(results)),
                    message="an admitted request to settle",
                )
                for i, r in enumerate(results):
                    if r is not None and i not in settled:
                        assert r.decision == pb.DECISION_ADMIT, r
                        sidecar.complete("acme", f"r{i}", prompt_tokens=10, generated_tokens=5)
                        settled.add(i)
        for f in futures:
            f.result()
    waited = [r for r in results if r.queue_wait_ms > 0]
    assert len(waited) >= n - 4  # all but the first few had to wait
    assert srv.on_loop(lambda: srv.plane.service.waiting) == 0
    assert srv.on_loop(lambda: srv.plane.service.views.open_reservations) == 0


def test_cancelled_call_leaves_the_queue(
    migrated_url: str, make_server: Callable[..., Any]
) -> None:
    add_tenants(
        migrated_url,
        TenantConfig(tenant_id="acme", token_rate=Decimal(1000), burst_tokens=10**6,
                     max_concurrency=1, max_wait_ms=60_000),
    )  # fmt: skip
    srv = make_server(migrated_url)
    with ProtoClient(srv.target) as c:
        assert c.admit("acme", "hold", prompt_tokens=1, max_tokens=1).decision == pb.DECISION_ADMIT
        fut = c.stub.Admit.future(
            pb.AdmitRequest(tenant_id="acme", request_id="w", prompt_tokens=1, max_tokens=1,
                            lane="batch"),
            timeout=60,
        )  # fmt: skip
        wait_until(
            lambda: srv.on_loop(lambda: srv.plane.service.waiting) == 1,
            message="the call to queue",
        )
        fut.cancel()
        wait_until(
            lambda: srv.on_loop(lambda: srv.plane.service.waiting) == 0,
            message="the queue to empty",
        )
        with pytest.raises(grpc.FutureCancelledError):
            fut.result()
        c.complete("acme", "hold", prompt_tokens=1, generated_tokens=1)
        assert srv.on_loop(lambda: srv.plane.service.views.open_reservations) == 0


def test_deadline_is_answered_with_queue_timeout_before_it_passes(
    migrated_url: str, make_server: Callable[..., Any]
) -> None:
    add_tenants(
        migrated_url,
        TenantConfig(tenant_id="acme", token_rate=Decimal(1000), burst_tokens=10**6,
                     max_concurrency=1),
    )  # fmt: skip
    srv = make_server(migrated_url)
    with ProtoClient(srv.target, timeout=1.0) as c:
        c.admit("acme", "hold", prompt_tokens=1, max_tokens=1)
        # batch lane would wait 5 s; the call's own 1 s deadline wins
        d = c.admit("acme", "w", prompt_tokens=1, max_tokens=1, lane="batch")
        assert d.reason == pb.REASON_QUEUE_TIMEOUT
        assert 0 < d.queue_wait_ms <= 1000  # ms, rounded up
    assert srv.on_loop(lambda: srv.plane.service.waiting) == 0


def test_backpressure_over_grpc(migrated_url: str, make_server: Callable[..., Any]) -> None:
    # the SPEC's score thresholds alone (the pool gate off: above the hard
    # threshold non-premium is refused, premium fails open)
    add_tenants(
        migrated_url, TenantConfig(tenant_id="acme", token_rate=Decimal(1000), burst_tokens=10**6)
    )
    srv = make_server(migrated_url, policy=Policy(pool_gate=False))
    with ProtoClient(srv.target) as c:
        c.report_load(pb.LoadReport(pool="gpu-a", engine_id="e0", batch_tokens=8000,
                                    max_batch_tokens=8000, queue_depth=100, queue_capacity=100,
                                    kv_cache_miss_rate=0.9, gpu_utilization=0.99))  # fmt: skip
        d = c.admit("acme", "s", prompt_tokens=10, max_tokens=10, lane="standard", pool="gpu-a")
        assert d.decision == pb.DECISION_REJECT and d.reason == pb.REASON_BACKPRESSURE
        assert d.pressure.score == pytest.approx(0.97)
        assert d.pressure.freshness == pb.POOL_FRESHNESS_FRESH
        assert d.pressure.stale_policy == pb.STALE_POLICY_UNSPECIFIED  # fresh: none applied
        assert d.retry_after_ms > 0
        p = c.admit("acme", "p", prompt_tokens=10, max_tokens=10, lane="premium", pool="gpu-a")
        assert p.decision == pb.DECISION_ADMIT
        assert not p.degradation.active  # premium is not degradable
        assert p.HasField("pressure")


def test_stale_policy_is_an_enum_over_grpc(
    migrated_url: str, make_server: Callable[..., Any], clock: Any
) -> None:
    add_tenants(
        migrated_url, TenantConfig(tenant_id="acme", token_rate=Decimal(1000), burst_tokens=10**6)
    )
    srv = make_server(
        migrated_url, clock=clock, policy=Policy(pool_gate=False, stale_policy="fail_closed")
    )
    with ProtoClient(srv.target) as c:
        c.report_load(pb.LoadReport(pool="gpu-a", engine_id="e0", batch_tokens=100,
                                    max_batch_tokens=8000, gpu_utilization=0.1))  # fmt: skip
        clock.advance(11 * 1_000_000_000)  # past load_report_stale_s (10 s)
        # premium (fail-open) is admitted whatever the score; the answer says why
        d = c.admit("acme", "p", prompt_tokens=10, max_tokens=10, lane="premium", pool="gpu-a")
        assert d.decision == pb.DECISION_ADMIT
        assert d.pressure.freshness == pb.POOL_FRESHNESS_STALE
        assert d.pressure.stale_policy == pb.STALE_POLICY_FAIL_CLOSED
        assert d.pressure.score == 1.0  # fail-closed: a stale pool counts as fully loaded
