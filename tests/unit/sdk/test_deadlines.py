"""One timer for every caller's deadline: who is expired, in what order,
and that answered callers do not pile up."""

from __future__ import annotations

import asyncio

from burstgate_client.sdk.deadlines import COMPACT_MIN, Deadlines
from burstgate_client.sdk.entries import Entry
from burstgate_client.sdk.model import Admission


def entry(i: int) -> Entry:
    return Entry("acme", f"r{i}", "", 1, 1, "", "", 0.0)


def test_only_callers_still_waiting_expire_in_deadline_order() -> None:
    async def run() -> list[str]:
        loop = asyncio.get_running_loop()
        expired: list[str] = []

        def expire(e: Entry, fut: asyncio.Future[Admission]) -> None:
            expired.append(e.request_id)
            fut.cancel()

        d = Deadlines(loop, expire)
        futs: list[asyncio.Future[Admission]] = [loop.create_future() for _ in range(4)]
        now = loop.time()
        for i, at in enumerate([0.03, 0.01, 0.02, 0.04]):  # added out of order
            d.add(now + at, entry(i), futs[i])
        futs[2].cancel()  # answered (here: its caller left) before its deadline
        await asyncio.gather(*futs, return_exceptions=True)
        assert len(d) == 0
        d.close()
        return expired

    assert asyncio.run(run()) == ["r1", "r0", "r3"]


def cancel(e: Entry, fut: asyncio.Future[Admission]) -> None:
    fut.cancel()


def test_answered_callers_with_long_deadlines_are_compacted_away() -> None:
    async def run() -> int:
        loop = asyncio.get_running_loop()
        d = Deadlines(loop, cancel)
        far: list[asyncio.Future[Admission]] = [
            loop.create_future() for _ in range(2 * COMPACT_MIN)
        ]
        for i, fut in enumerate(far):
            d.add(loop.time() + 3600, entry(i), fut)
        for fut in far:
            fut.cancel()  # all done long before their hour is up
        near: asyncio.Future[Admission] = loop.create_future()
        d.add(loop.time() + 0.001, entry(-1), near)
        await asyncio.gather(near, return_exceptions=True)
        left = len(d)
        d.close()
        return left

    assert asyncio.run(run()) == 0
