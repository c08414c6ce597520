"""An unreachable control plane (a TCP proxy in front of a real one, cut or
silenced): per-lane FailPolicy, marked offline; fail fast once known down;
back to the server when it is reachable again."""

from __future__ import annotations

import asyncio
import socket

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.sdk import AsyncAdmissionClient, FailPolicy

from tests.integration.sdk.conftest import SLOW_OK, Plane, until

POLICY = {"": FailPolicy.CLOSED, "batch": FailPolicy.OPEN}


async def admit(c: AsyncAdmissionClient, rid: str, lane: str = "standard") -> object:
    return await c.admit("acme", rid, prompt_tokens=10, max_tokens=64, lane=lane)


def test_cut_per_lane_policy_fail_fast_and_back(plane: Plane) -> None:
    assert plane.proxy is not None
    proxy = plane.proxy

    async def run() -> None:
        async with AsyncAdmissionClient(
            plane.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK, fail_policy=POLICY
        ) as c:
            assert (await c.admit("acme", "warm", prompt_tokens=1, max_tokens=1)).admitted
            proxy.cut()
            closed = await c.admit("acme", "s1", prompt_tokens=10, max_tokens=64)
            assert not closed.admitted and closed.offline and closed.reason == "unavailable"
            assert closed.retryable and closed.retry_after_ms > 0
            assert not c.up
            sent = c.counters.streamed + c.counters.unary_admits
            opened = await c.admit("acme", "b1", prompt_tokens=10, max_tokens=64, lane="batch")
            assert opened.admitted and opened.offline and opened.granted_max_tokens == 64
            assert opened.reservation_id == 0 and opened.pricing_multiplier == ""
            for i in range(20):  # known down: answered without touching the network
                await c.admit("acme", f"fast{i}", prompt_tokens=1, max_tokens=1)
            assert c.counters.streamed + c.counters.unary_admits == sent
            assert c.counters.breaker_trips == 1
            assert c.counters.offline_admits == 1 and c.counters.offline_refusals == 21
            proxy.restore()
            await until(lambda: c.up, "the breaker to close")
            back = await c.admit("acme", "back", prompt_tokens=1, max_tokens=1)
            assert back.admitted and not back.offline
            assert c.counters.stream_opens == 2  # a new AdmitStream

    asyncio.run(run())


def test_silence_costs_a_deadline_then_fails_fast(plane: Plane) -> None:
    """A control plane that stops answering (the connection stays up, as
    for a hung host): callers get their lane's FailPolicy at their deadline;
    once the stream has read nothing for a second while owing an answer,
    the breaker trips, the stream is dropped, and later callers are
    answered at once."""
    assert plane.proxy is not None
    proxy = plane.proxy

    async def run() -> None:
        async with AsyncAdmissionClient(
            plane.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK, fail_policy=POLICY
        ) as c:
            assert (await c.admit("acme", "warm", prompt_tokens=1, max_tokens=1)).admitted
            proxy.hang()
            got = await asyncio.gather(
                *(c.admit("acme", f"h{i}", prompt_tokens=1, max_tokens=1, deadline_s=0.2,
                          lane="batch" if i % 2 else "premium")
                  for i in range(6))
            )  # fmt: skip
            assert all(a.offline for a in got)
            assert [a.admitted for a in got] == [False, True] * 3
            # past the second of silence: this caller's deadline trips the breaker
            late = await c.admit("acme", "late", prompt_tokens=1, max_tokens=1, deadline_s=1.5)
            assert late.offline and not c.up
            await until(lambda: c.counters.stream_failures == 1, "the silent stream dropped")
            sent = c.counters.streamed
            fast = await c.admit("acme", "fast", prompt_tokens=1, max_tokens=1)
            assert fast.offline and c.counters.streamed == sent  # not sent: known down
            proxy.restore()
            await until(lambda: c.up, "the breaker to close")
            assert (await c.admit("acme", "back", prompt_tokens=1, max_tokens=1)).admitted

    asyncio.run(run())


def test_nothing_listening_at_start() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def run() -> None:
        async with AsyncAdmissionClient(f"127.0.0.1:{port}", fail_policy=POLICY) as c:
            a = await c.admit("acme", "r", prompt_tokens=1, max_tokens=1, lane="batch")
            assert a.admitted and a.offline and not c.up
            report = pb.LoadReport(pool="p", engine_id="e", max_batch_tokens=1)
            assert await c.report_load(report) is None
            assert await c.limits("acme") is None
            assert c.counters.report_load_failures == 1 and c.counters.limits_failures == 1
            done = await c.complete("acme", "r", prompt_tokens=1, generated_tokens=1)
            assert not done.delivered and c.pending_completions == 1

    asyncio.run(run())
