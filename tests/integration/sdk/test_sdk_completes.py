"""Completes made while the control plane is unreachable: buffered (in
memory and on disk), then delivered exactly once: one ledger record each
(metering on, SQLite and PostgreSQL), a redelivery billed nothing."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from burstgate_client.sdk import AsyncAdmissionClient, ControlPlaneUnavailable

from tests.integration.ledger.conftest import ledger_rows
from tests.integration.sdk.conftest import SLOW_OK, Plane, until

N = 10


async def admit_all(c: AsyncAdmissionClient, n: int = N) -> None:
    got = await asyncio.gather(
        *(c.admit("acme", f"r{i}", prompt_tokens=100, max_tokens=50) for i in range(n))
    )
    assert all(a.admitted and not a.offline for a in got)


async def complete_all(c: AsyncAdmissionClient, n: int = N) -> list[bool]:
    done = [
        await c.complete("acme", f"r{i}", prompt_tokens=100, generated_tokens=i) for i in range(n)
    ]
    return [d.delivered for d in done]


def rows_by_request(url: str) -> dict[str, int]:
    """request_id -> output tokens, asserting one ledger record per request."""
    rows = ledger_rows(url)
    ids = [r.request_id for r in rows]
    assert len(ids) == len(set(ids)), f"a request was recorded twice: {sorted(ids)}"
    return {r.request_id: r.output_tokens for r in rows}


def test_buffered_while_down_delivered_exactly_once(plane: Plane) -> None:
    assert plane.proxy is not None
    proxy = plane.proxy

    async def run() -> None:
        async with AsyncAdmissionClient(
            plane.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK
        ) as c:
            await admit_all(c)
            proxy.cut()
            assert await complete_all(c) == [False] * N
            again = await c.complete("acme", "r3", prompt_tokens=100, generated_tokens=3)
            assert not again.delivered and again.duplicate  # buffered once
            assert c.pending_completions == N and c.counters.completes_buffered == N
            assert rows_by_request(plane.url) == {}
            proxy.restore()
            await until(lambda: c.pending_completions == 0, "the spool to drain")
            assert c.counters.completes_delivered_late == N
            # a Complete the caller repeats now is the server's duplicate
            repeat = await c.complete("acme", "r3", prompt_tokens=100, generated_tokens=3)
            assert repeat.delivered and repeat.duplicate

    asyncio.run(run())
    assert rows_by_request(plane.url) == {f"r{i}": i for i in range(N)}


def test_spool_file_survives_a_restart_and_redelivery_bills_nothing(
    plane: Plane, tmp_path: Path
) -> None:
    """The SDK "crashes" with Completes buffered on disk; the next process
    delivers them. A copy of the file delivered again (a crash between
    delivery and the done mark) is answered as duplicates: still one record
    each."""
    assert plane.proxy is not None
    proxy = plane.proxy
    spool = tmp_path / "sdk" / "completes.jsonl"

    async def first() -> None:
        c = AsyncAdmissionClient(
            plane.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK, spool_path=spool
        )
        await admit_all(c)
        proxy.cut()
        await complete_all(c)
        await c.aclose(flush_timeout_s=0.1)  # still down: they stay in the file

    async def deliver(path: Path) -> int:
        async with AsyncAdmissionClient(
            plane.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK, spool_path=path
        ) as c:
            assert c.pending_completions == N  # reloaded
            await c.flush(20)
            assert c.pending_completions == 0
            return c.counters.completes_delivered_late

    asyncio.run(first())
    shutil.copy(spool, tmp_path / "copy.jsonl")
    proxy.restore()
    assert asyncio.run(deliver(spool)) == N
    assert rows_by_request(plane.url) == {f"r{i}": i for i in range(N)}
    assert asyncio.run(deliver(tmp_path / "copy.jsonl")) == N  # answered: duplicates
    assert rows_by_request(plane.url) == {f"r{i}": i for i in range(N)}


def test_a_full_spool_refuses_loudly(plane: Plane, caplog: pytest.LogCaptureFixture) -> None:
    assert plane.proxy is not None
    proxy = plane.proxy

    async def run() -> None:
        async with AsyncAdmissionClient(
            plane.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK, spool_max=3
        ) as c:
            await admit_all(c, 4)
            proxy.cut()
            assert await complete_all(c, 3) == [False] * 3
            with pytest.raises(ControlPlaneUnavailable, match="spool is full"):
                await c.complete("acme", "r3", prompt_tokens=1, generated_tokens=1)
            assert c.counters.completes_spool_full == 1
            proxy.restore()
            await c.flush(20)
            # the refused one is the caller's again: it can complete it now
            late = await c.complete("acme", "r3", prompt_tokens=1, generated_tokens=1)
            assert late.delivered

    asyncio.run(run())
    assert "completion spool full" in caplog.text
