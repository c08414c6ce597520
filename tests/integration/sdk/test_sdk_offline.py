"""Requests the SDK admitted itself (fail open), and requests whose
reservation the control plane lost (a restart): their Completes carry
CompleteRequest.offline and are booked once; one ledger record each
(metering on, SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio

from burstgate_client.sdk import AsyncAdmissionClient, FailPolicy

from tests.integration.ledger.conftest import ledger_rows
from tests.integration.sdk.conftest import SLOW_OK, Plane, until
from tests.integration.sdk.test_sdk_completes import rows_by_request


def test_fail_open_admissions_are_booked_when_delivered(plane: Plane) -> None:
    assert plane.proxy is not None
    proxy = plane.proxy

    async def run() -> None:
        async with AsyncAdmissionClient(
            plane.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK, fail_policy=FailPolicy.OPEN
        ) as c:
            proxy.cut()
            for i in range(3):
                a = await c.admit("acme", f"o{i}", prompt_tokens=100, max_tokens=10,
                                  lane="batch", model="m1", pool="p1")  # fmt: skip
                assert a.admitted and a.offline
            done = await c.complete("acme", "o0", prompt_tokens=100, generated_tokens=7)
            assert not done.delivered
            proxy.restore()
            await until(lambda: c.up, "the breaker to close")
            # completed once it is back: sent directly, booked all the same
            for i in (1, 2):
                d = await c.complete("acme", f"o{i}", prompt_tokens=100, generated_tokens=7)
                assert d.delivered and not d.duplicate
            await c.flush(20)
            assert c.pending_completions == 0

    asyncio.run(run())
    assert rows_by_request(plane.url) == {"o0": 7, "o1": 7, "o2": 7}
    for row in ledger_rows(plane.url):
        assert (row.lane, row.model, row.pool, row.prompt_tokens) == ("batch", "m1", "p1", 100)
        assert row.exec_start_ns <= row.end_ns  # when it ran, not when it was booked


def test_reservations_lost_to_a_restart_are_still_billed(plane: Plane) -> None:
    """Admitted by the server, which restarts (reservations live in its
    memory) before the Completes: buffered ones (sent while it was down) and
    a direct one (answered NOT_FOUND, then sent with ``offline``) are booked."""

    async def run() -> None:
        async with AsyncAdmissionClient(
            plane.target, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK
        ) as c:
            got = await asyncio.gather(
                *(c.admit("acme", f"r{i}", prompt_tokens=50, max_tokens=50) for i in range(4))
            )
            assert all(a.admitted and not a.offline for a in got)
            await asyncio.to_thread(plane.stop)
            for i in range(3):
                done = await c.complete("acme", f"r{i}", prompt_tokens=50, generated_tokens=i)
                assert not done.delivered
            await asyncio.to_thread(plane.start)  # the same port: the channel reconnects
            await until(lambda: c.up, "the breaker to close")
            await c.flush(20)
            assert c.pending_completions == 0
            direct = await c.complete("acme", "r3", prompt_tokens=50, generated_tokens=3)
            assert direct.delivered

    asyncio.run(run())
    assert rows_by_request(plane.url) == {f"r{i}": i for i in range(4)}
