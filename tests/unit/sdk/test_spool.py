"""The completion spool: bounded, never two of one request, delivered once
each, retried on transport failures, dropped (loudly) on final answers, and
kept across a restart when it has a file. The network is a scripted
``send`` here; tests/integration/sdk has it against a real server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.sdk import ControlPlaneUnavailable
from burstgate_client.sdk.breaker import Breaker
from burstgate_client.sdk.counters import Counters
from burstgate_client.sdk.spool import CompletionSpool
from burstgate_client.sdk.spoolfile import SpoolFile


class FakeBreaker:
    def __init__(self, up: bool = True) -> None:
        self.up = up
        self.listeners: list[Callable[[], None]] = []
        self.failures: list[grpc.StatusCode] = []

    def on_up(self, fn: Callable[[], None]) -> None:
        self.listeners.append(fn)

    def failed(self, exc: grpc.aio.AioRpcError, why: str) -> None:
        self.failures.append(exc.code())
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            self.up = False

    def close(self) -> None:
        self.up = True
        for fn in self.listeners:
            fn()


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Server:
    """``send``: records every delivery; answers from ``fail`` first."""

    def __init__(self) -> None:
        self.got: list[str] = []
        self.fail: dict[str, list[grpc.StatusCode]] = {}

    async def send(self, req: pb.CompleteRequest) -> pb.CompleteResponse:
        await asyncio.sleep(0)
        codes = self.fail.get(req.request_id)
        if codes:
            raise rpc_error(codes.pop(0), f"request_id: {req.request_id}")
        self.got.append(req.request_id)
        return pb.CompleteResponse(request_id=req.request_id)


def req(i: int) -> pb.CompleteRequest:
    return pb.CompleteRequest(tenant_id="acme", request_id=f"r{i}", prompt_tokens=1)


def make(server: Server, breaker: FakeBreaker, **kw: Any) -> tuple[CompletionSpool, Counters]:
    counters = Counters()
    spool = CompletionSpool(
        server.send, cast(Breaker, breaker), counters, max_items=kw.pop("max_items", 100), **kw
    )
    return spool, counters


def test_bounded_refuses_with_a_clear_error_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        spool, counters = make(Server(), FakeBreaker(up=False), max_items=2)
        assert await spool.put(req(1)) and await spool.put(req(2))
        with pytest.raises(ControlPlaneUnavailable, match="spool is full \\(2 pending\\)"):
            await spool.put(req(3))
        assert spool.pending == 2 and counters.completes_spool_full == 1
        await spool.aclose()

    asyncio.run(run())
    assert "completion spool full (2 pending)" in caplog.text and "'r3'" in caplog.text


def test_one_complete_per_request(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        spool, _ = make(Server(), FakeBreaker(up=False))
        assert await spool.put(req(1))
        assert not await spool.put(req(1))  # already buffered: nothing added
        assert spool.pending == 1
        await spool.aclose()

    asyncio.run(run())
    assert "1 Completes undelivered at close, LOST (no spool_path)" in caplog.text


def test_delivered_once_each_when_the_breaker_closes_even_with_flushes_racing() -> None:
    async def run() -> None:
        server, breaker = Server(), FakeBreaker(up=False)
        spool, counters = make(server, breaker)
        for i in range(50):
            await spool.put(req(i))
        assert server.got == []  # down: nothing is tried
        breaker.close()
        handled = await asyncio.gather(spool.flush(5), spool.flush(5), spool.flush(5))
        assert sorted(server.got) == sorted(f"r{i}" for i in range(50))  # once each
        assert spool.pending == 0 and counters.completes_delivered_late == 50
        assert max(handled) == 50
        await spool.aclose()

    asyncio.run(run())


def test_transport_failures_are_retried_final_answers_dropped_loudly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def run() -> None:
        server, breaker = Server(), FakeBreaker()
        server.fail = {
            "r1": [grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL],
            "r2": [grpc.StatusCode.NOT_FOUND],
        }
        spool, counters = make(server, breaker)
        for i in range(3):
            await spool.put(req(i))
        await spool.flush(10)
        assert sorted(server.got) == ["r0", "r1"]
        assert spool.pending == 0
        assert counters.completes_delivered_late == 2
        assert counters.completes_undeliverable == 1
        assert grpc.StatusCode.DEADLINE_EXCEEDED in breaker.failures
        await spool.aclose()

    asyncio.run(run())
    assert "request 'r2' was refused for good (NOT_FOUND" in caplog.text


def test_unavailable_waits_for_the_breaker_then_delivers() -> None:
    async def run() -> None:
        server, breaker = Server(), FakeBreaker()
        server.fail = {"r0": [grpc.StatusCode.UNAVAILABLE]}
        spool, _ = make(server, breaker)
        await spool.put(req(0))
        await spool.flush(0.2)
        assert not breaker.up and spool.pending == 1 and server.got == []
        breaker.close()  # its listener kicks the delivery
        await spool.flush(5)
        assert server.got == ["r0"] and spool.pending == 0
        await spool.aclose()

    asyncio.run(run())


def test_a_restarted_process_delivers_what_the_last_one_buffered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "spool.jsonl"

    async def first() -> None:
        spool, _ = make(Server(), FakeBreaker(up=False), file=SpoolFile(path))
        spool.load()
        for i in range(3):
            await spool.put(req(i))
        await spool.aclose()  # "crash" with three buffered

    async def second() -> list[str]:
        server = Server()
        spool, _ = make(server, FakeBreaker(), file=SpoolFile(path))
        assert spool.load() == 3
        await spool.flush(5)
        await spool.aclose()
        return server.got

    asyncio.run(first())
    assert f"3 Completes undelivered at close, kept in {path}" in caplog.text
    assert asyncio.run(second()) == ["r0", "r1", "r2"]
    assert SpoolFile(path).load() == []  # delivered: not again after the next start
