"""The SDK against a real control plane (SQLite and PostgreSQL): answers,
micro-batching, the synchronous client across threads, errors."""

from __future__ import annotations

import asyncio
import threading
from decimal import Decimal
from typing import Any

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.sdk import AdmissionClient, AsyncAdmissionClient, Backoff

from tests.integration.sdk.conftest import SLOW_OK, Plane, tenant


def test_admit_complete_round_trip(plane: Plane) -> None:
    async def run() -> None:
        async with AsyncAdmissionClient(
            plane.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK
        ) as c:
            a = await c.admit("acme", "r1", prompt_tokens=100, max_tokens=50, lane="premium")
            assert a.admitted and not a.offline and a.reason == ""
            assert a.reservation_id > 0 and a.granted_max_tokens == 50
            assert a.pricing_multiplier == "1.000000"
            assert a.bucket_remaining == 100_000_000 - 150
            done = await c.complete("acme", "r1", prompt_tokens=100, generated_tokens=20)
            assert done.delivered and not done.duplicate and done.currency
            again = await c.complete("acme", "r1", prompt_tokens=100, generated_tokens=20)
            assert again.delivered and again.duplicate  # the server's replay: billed once
            assert c.counters.batches == 1 and c.counters.streamed == 1

    asyncio.run(run())


def test_concurrent_admits_coalesce_into_few_batches(plane: Plane) -> None:
    n = 2000

    async def run() -> None:
        async with AsyncAdmissionClient(
            plane.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK, batch_max=256
        ) as c:
            got = await asyncio.gather(
                *(c.admit("acme", f"r{i}", prompt_tokens=10, max_tokens=10) for i in range(n))
            )
            assert all(a.admitted for a in got)
            assert [a.request_id for a in got] == [f"r{i}" for i in range(n)]
            assert len({a.reservation_id for a in got}) == n
            assert c.counters.streamed == n and c.counters.admits == n
            # flushed early at batch_max: at least n / 256 batches, and far fewer than n
            assert n // 256 <= c.counters.batches <= n // 16
            assert c.counters.stream_opens == 1

    asyncio.run(run())


def test_the_same_request_in_flight_twice_is_asked_once(plane: Plane) -> None:
    async def run() -> None:
        async with AsyncAdmissionClient(
            plane.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK
        ) as c:
            a, b = await asyncio.gather(
                c.admit("acme", "same", prompt_tokens=10, max_tokens=10),
                c.admit("acme", "same", prompt_tokens=10, max_tokens=10),
            )
            assert a == b and a.admitted
            assert c.counters.joined == 1 and c.counters.streamed == 1

    asyncio.run(run())


def test_refusals_are_answers(plane: Plane) -> None:
    async def run() -> None:
        async with AsyncAdmissionClient(
            plane.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK
        ) as c:
            unknown = await c.admit("nobody", "r", prompt_tokens=1, max_tokens=1)
            assert not unknown.admitted and unknown.reason == "unknown_tenant"
            assert not unknown.retryable and not unknown.offline

    asyncio.run(run())


def test_quota_exhausted_is_flagged(plane_factory: Any) -> None:
    p: Plane = plane_factory(tenant("q", hourly_quota=100))

    async def run() -> None:
        async with AsyncAdmissionClient(
            p.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK
        ) as c:
            assert (await c.admit("q", "a", prompt_tokens=60, max_tokens=0)).admitted
            b = await c.admit("q", "b", prompt_tokens=60, max_tokens=0)
            assert b.reason == "hourly_quota" and b.quota_exhausted and b.retry_after_ms > 0

    asyncio.run(run())


def test_sync_client_from_many_threads(plane: Plane) -> None:
    threads, per_thread = 16, 50
    results: list[Any] = []
    lock = threading.Lock()
    with AdmissionClient(plane.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK) as c:

        def work(t: int) -> None:
            for i in range(per_thread):
                a = c.admit("acme", f"t{t}-{i}", prompt_tokens=5, max_tokens=5)
                done = c.complete("acme", f"t{t}-{i}", prompt_tokens=5, generated_tokens=1)
                with lock:
                    results.append((a, done))

        pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join()
        assert len(results) == threads * per_thread
        assert all(a.admitted and done.delivered for a, done in results)
        assert c.counters.streamed == threads * per_thread
        assert c.counters.batches < threads * per_thread  # threads' admits shared batches


def test_bad_arguments_raise_value_error_naming_them(plane: Plane) -> None:
    with AdmissionClient(plane.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK) as c:
        with pytest.raises(ValueError, match=r"^prompt_tokens: must be >= 0"):
            c.admit("acme", "r", prompt_tokens=-1, max_tokens=1)
        with pytest.raises(ValueError, match=r"^deadline_s: must be > 0"):
            c.admit("acme", "r", prompt_tokens=1, max_tokens=1, deadline_s=0)
        with pytest.raises(ValueError, match=r"^cached_prompt_tokens: 5 exceeds"):
            c.complete("acme", "r", prompt_tokens=1, generated_tokens=1, cached_prompt_tokens=5)
        assert c.counters.streamed == 0  # nothing was sent
    with pytest.raises(ValueError, match=r"^batch_max: must be between 1 and 10000"):
        AdmissionClient(plane.target, batch_max=0)


def test_an_unknown_lane_fails_its_caller_alone(plane: Plane) -> None:
    """Only the server knows its lanes: an unknown one ends the AdmitStream
    (INVALID_ARGUMENT naming lane[i]); the batch's other callers are asked
    again unary and admitted, the bad one gets the server's ValueError, and
    the lane goes unary for a while so it does not break the next stream."""

    async def run() -> None:
        async with AsyncAdmissionClient(
            plane.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK, batch_window_s=0.01
        ) as c:
            got = await asyncio.gather(
                *(
                    c.admit("acme", f"r{i}", prompt_tokens=1, max_tokens=1,
                            lane="gold" if i == 3 else "standard")
                    for i in range(8)
                ),
                return_exceptions=True,
            )  # fmt: skip
            assert isinstance(got[3], ValueError) and "lane" in str(got[3])
            assert all(not isinstance(a, BaseException) and a.admitted
                       for i, a in enumerate(got) if i != 3)  # fmt: skip
            assert c.counters.stream_failures == 1 and c.counters.unary_admits == 8
            with pytest.raises(ValueError, match="lane"):
                await c.admit("acme", "again", prompt_tokens=1, max_tokens=1, lane="gold")
            assert c.counters.stream_failures == 1  # went unary: the stream was spared
            ok = await c.admit("acme", "after", prompt_tokens=1, max_tokens=1)
            assert ok.admitted and c.up

    asyncio.run(run())


def test_report_load(plane: Plane) -> None:
    async def run() -> None:
        async with AsyncAdmissionClient(
            plane.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK
        ) as c:
            report = pb.LoadReport(pool="p", engine_id="e1", max_batch_tokens=8192, queue_depth=3)
            ack = await c.report_load(report)
            assert ack is not None and ack.pool == "p" and ack.engines_reporting == 1
            with pytest.raises(ValueError, match="max_batch_tokens"):
                await c.report_load(pb.LoadReport(pool="p", engine_id="e1"))

    asyncio.run(run())


def test_auth_errors_reach_the_caller(plane_factory: Any) -> None:
    p: Plane = plane_factory(admission_auth=True)

    async def run() -> None:
        async with AsyncAdmissionClient(
            p.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK, api_key="bg_wrong"
        ) as c:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.admit("acme", "r", prompt_tokens=1, max_tokens=1)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert c.counters.offline_admits + c.counters.offline_refusals == 0
            assert c.up  # the server answered: it is reachable

    asyncio.run(run())


def test_the_api_key_comes_from_the_environment(
    plane_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from controlplane.domain.keys import Role
    from controlplane.store.db import make_engine
    from controlplane.store.keys import KeyStore

    p: Plane = plane_factory(admission_auth=True)
    engine = make_engine(p.url)
    key, _ = KeyStore(engine).create_key("sdk", Role.SIDECAR, tenants=["acme"], pools=["*"])
    engine.dispose()
    p.stop()  # keys are read at the start (then at each config poll)
    p.start()
    monkeypatch.setenv("BURSTGATE_API_KEY", key)

    async def run() -> None:
        async with AsyncAdmissionClient(
            p.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK
        ) as c:
            assert (await c.admit("acme", "r", prompt_tokens=1, max_tokens=1)).admitted
            # a tenant outside the key's scope: the server's answer, raised
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.admit("beta", "r", prompt_tokens=1, max_tokens=1)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED

    asyncio.run(run())


def test_limits_cached_for_their_ttl(plane_factory: Any) -> None:
    p: Plane = plane_factory(tenant("acme", burst_tokens=10_000, hourly_quota=50_000))

    async def run() -> None:
        async with AsyncAdmissionClient(
            p.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK, limits_ttl_s=600
        ) as c:
            first = await c.limits("acme")
            assert first is not None and first.tenant_id == "acme"
            assert (first.burst_tokens, first.hourly_quota, first.daily_quota) == (
                10_000,
                50_000,
                -1,
            )
            assert first.token_rate == 1_000_000.0 and first.max_concurrency == -1
            assert (await c.admit("acme", "r", prompt_tokens=1000, max_tokens=0)).admitted
            assert await c.limits("acme") == first  # from the cache: the admission not seen
            assert await c.limits("nobody") is None
        async with AsyncAdmissionClient(
            p.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK, limits_ttl_s=0
        ) as fresh:
            now = await fresh.limits("acme")
            assert now is not None and now.hourly_remaining == 49_000 and now.inflight_requests == 1

    asyncio.run(run())


def test_backoff_retries_a_retryable_refusal_until_admitted(plane_factory: Any) -> None:
    """A tenant that may not wait in the queue (max_wait_ms 0) is refused
    TOKEN_RATE with retry_after_ms; Backoff waits at least that long and
    the same request id is admitted once the bucket refilled. A refusal
    that is not retryable is returned at once."""
    p: Plane = plane_factory(
        tenant("slow", token_rate=Decimal(2000), burst_tokens=1000, max_wait_ms=0)
    )

    async def run() -> None:
        async with AsyncAdmissionClient(
            p.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK
        ) as c:
            assert (await c.admit("slow", "a", prompt_tokens=1000, max_tokens=0)).admitted
            refused = await c.admit("slow", "b", prompt_tokens=500, max_tokens=0)
            assert refused.reason == "token_rate" and refused.retryable
            b = Backoff(base_s=0.01, cap_s=0.05, deadline_s=30)
            got = await b.admit(c, "slow", "b", prompt_tokens=500, max_tokens=0)
            assert got.admitted and got.request_id == "b"
            never = Backoff(deadline_s=30)
            too_big = await never.admit(c, "slow", "c", prompt_tokens=5000, max_tokens=0)
            assert too_big.reason == "max_tokens" and not too_big.retryable
            assert never.attempts == 0

    asyncio.run(run())
