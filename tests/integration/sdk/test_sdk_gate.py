"""Requests burstgate holds in its queue (the gate): the SDK's awaitable
resolves when the server releases them, honours the request's deadline, and
survives a stream that breaks under them or answers too late."""

from __future__ import annotations

import asyncio
from typing import Any

from burstgate_client.protoclient import ProtoClient as UnaryClient
from burstgate_client.sdk import AsyncAdmissionClient, FailPolicy

from tests.integration.sdk.conftest import SLOW_OK, Plane, tenant, until


def gated(plane_factory: Any) -> Plane:
    """Tenant g runs one request at a time; others wait (up to a minute)."""
    p: Plane = plane_factory(tenant("g", max_concurrency=1, max_wait_ms=60_000, max_queued=100))
    return p


async def hold_slot(c: AsyncAdmissionClient) -> None:
    assert (await c.admit("g", "holder", prompt_tokens=10, max_tokens=10)).admitted


def test_a_queued_request_resolves_when_released(plane_factory: Any) -> None:
    p = gated(plane_factory)

    async def run() -> None:
        async with AsyncAdmissionClient(p.target, deadline_s=20) as c:
            await hold_slot(c)
            waiting = asyncio.create_task(
                c.admit("g", "next", prompt_tokens=10, max_tokens=10, lane="batch")
            )
            await until(lambda: c.counters.queued == 1, "the server to hold the request")
            assert not waiting.done()
            await c.complete("g", "holder", prompt_tokens=10, generated_tokens=10)
            a = await waiting
            assert a.admitted and not a.offline and a.queue_wait_ms > 0

    asyncio.run(run())


def test_the_server_answers_queue_timeout_within_the_deadline(plane_factory: Any) -> None:
    p = gated(plane_factory)

    async def run() -> None:
        async with AsyncAdmissionClient(
            p.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK
        ) as c:
            await hold_slot(c)
            a = await c.admit("g", "next", prompt_tokens=10, max_tokens=10, deadline_s=1.0)
            assert not a.admitted and a.reason == "queue_timeout" and not a.offline
            assert c.counters.queued == 1
            assert c.counters.gate_timeouts == 0  # the server's answer, not the SDK's

    asyncio.run(run())


def test_queued_entries_of_a_broken_stream_get_the_fail_policy(plane_factory: Any) -> None:
    p = gated(plane_factory)
    assert p.proxy is not None and p.srv is not None
    proxy, srv = p.proxy, p.srv

    async def run() -> None:
        policy = {"": FailPolicy.CLOSED, "batch": FailPolicy.OPEN}
        async with AsyncAdmissionClient(p.target, deadline_s=30, fail_policy=policy) as c:
            await hold_slot(c)
            held = [
                asyncio.create_task(c.admit("g", f"w{i}", prompt_tokens=1, max_tokens=1, lane=lane))
                for i, lane in enumerate(["batch", "standard"])
            ]
            await until(lambda: c.counters.queued == 2, "the server to hold both")
            proxy.cut()
            opened, closed = await asyncio.gather(*held)
            assert opened.admitted and opened.offline
            assert not closed.admitted and closed.offline and closed.reason == "unavailable"
            # the server took the cancelled stream's entries out of its queue
            await until(lambda: srv.on_loop(lambda: srv.plane.service.waiting) == 0, "dequeue")

    asyncio.run(run())


def test_a_late_release_is_settled_not_leaked(plane_factory: Any) -> None:
    """The server admits a held request after its caller's deadline (the
    release sat in a silent network): the caller was refused, so the SDK
    settles the reservation at once (a Complete of nothing) instead of
    holding the tenant's slot until the reservation TTL."""
    p = gated(plane_factory)
    assert p.proxy is not None and p.srv is not None
    proxy, srv = p.proxy, p.srv

    async def run() -> None:
        async with AsyncAdmissionClient(
            p.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK
        ) as c:
            await hold_slot(c)
            waiting = asyncio.create_task(
                c.admit("g", "next", prompt_tokens=1, max_tokens=1, deadline_s=1.0)
            )
            await until(lambda: c.counters.queued == 1, "the server to hold it")
            proxy.hang()
            with UnaryClient(p.direct) as other:  # the slot frees: the server admits "next"
                other.complete("g", "holder", prompt_tokens=10, generated_tokens=10)
            a = await waiting
            assert not a.admitted and a.reason == "queue_timeout" and not a.offline
            assert c.counters.gate_timeouts == 1
            assert a.retry_after_ms >= a.queue_wait_ms > 0  # never "retry at once"
            proxy.restore()
            await until(lambda: c.counters.late_releases == 1, "the late release")
            await until(lambda: srv.on_loop(lambda: srv.plane.service.views.open_reservations) == 0,
                        "the late admission to be settled")  # fmt: skip

    asyncio.run(run())


def test_without_waiting_in_the_gate_the_refusal_comes_at_once(plane_factory: Any) -> None:
    p = gated(plane_factory)

    async def run() -> None:
        async with AsyncAdmissionClient(
            p.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK, wait_in_gate=False
        ) as c:
            await hold_slot(c)
            a = await c.admit("g", "next", prompt_tokens=1, max_tokens=1, lane="batch")
            assert not a.admitted and a.reason == "concurrency" and a.retryable
            assert c.counters.queued == 0 and not a.offline

    asyncio.run(run())
