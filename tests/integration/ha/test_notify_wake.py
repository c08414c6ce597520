"""A released cell is taken by the member it is assigned to at once: the
release's NOTIFY reaches that member's listener, whose callback runs
``Coordinator.wake()``. Member B's own tick timer never fires here (its
sleep never returns), so every tick after its first is one a wake caused:
the test does not depend on timing."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import Engine

from controlplane.domain.rendezvous import assignment
from controlplane.ha.coordinator import Coordinator
from controlplane.store.leases import HaStore
from controlplane.store.notify import LEASES_CHANNEL, Listener

pytestmark = pytest.mark.postgres

CELLS = [f"pool-{i}" for i in range(6)]
TTL_S = 30.0  # nothing expires during the test: every move is a release


class CountingStore(HaStore):
    """The real store, counting heartbeats (one per tick)."""

    beats = 0

    def heartbeat(self, member_id: str, address: str, draining: bool = False) -> None:
        super().heartbeat(member_id, address, draining)
        self.beats += 1


async def never(seconds: float) -> None:
    await asyncio.Event().wait()


async def until(predicate: Any, what: str, timeout_s: float = 20.0) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}") from None


def test_released_cells_are_taken_at_once_by_their_assignee(engine: Engine, ha_url: str) -> None:
    async def scenario() -> None:
        a = Coordinator(HaStore(engine), "a", "a:1", CELLS, ttl_s=TTL_S)
        b_store = CountingStore(engine)
        b = Coordinator(b_store, "b", "b:1", CELLS, ttl_s=TTL_S, sleep=never)
        listener = Listener(ha_url)
        listener.on(LEASES_CHANNEL, lambda cell: b.wake())
        listener.start()
        try:
            await until(lambda: listener.connected, "the listener to connect")
            await a.tick()  # alone: a takes every cell
            assert set(a.owned()) == set(CELLS)
            b.start()  # first tick: b joins, finds its cells held, then sleeps for ever
            await until(lambda: b.members == ["a", "b"], "b's first tick")
            assert b.owned() == {}
            beats = b_store.beats

            # a's next tick hands b its cells: each release wakes b, which takes them.
            mine = {c for c, m in assignment(CELLS, ["a", "b"]).items() if m == "b"}
            assert mine and mine != set(CELLS)
            await a.tick()
            assert set(a.owned()) == set(CELLS) - mine
            await until(lambda: set(b.owned()) == mine, "b to take its cells")
            assert b_store.beats > beats  # woken: its timer never fires

            # a drains: one statement releases the rest, b takes them too.
            await a.drain()
            await until(lambda: set(b.owned()) == set(CELLS), "b to take a's cells")
            assert b.counts["acquired"] == len(CELLS)

            # Wakes before a tick starts coalesce into that one tick.
            await until(lambda: not b._wake.is_set() and not b._tick_lock.locked(), "b idle")
            beats = b_store.beats
            for _ in range(5):
                b.wake()
            await until(lambda: b_store.beats >= beats + 1, "the woken tick")
            b.wake()
            await until(lambda: b_store.beats >= beats + 2, "the next woken tick")
            await asyncio.sleep(0.2)
            assert b_store.beats == beats + 2, "five wakes made more than one tick"
        finally:
            await listener.stop()
            await b.stop()

    asyncio.run(scenario())
