"""Coordinators on one PostgreSQL (controlplane/ha/coordinator.py): three
in-process replicas with a 1 s TTL spread cells by rendezvous hashing; one
killed (kill -9) loses its cells to the others after expiry; one paused past
the TTL (SIGSTOP) stops owning before anyone else starts, then rejoins; one
drained (SIGTERM) hands off without waiting for expiry; and, over a seeded
random schedule of pauses, kills and drains, no cell ever has two owners.

Ownership is checked two ways on the shared monotonic clock: a sweep of
every member's owns() every few milliseconds, and the exact validity
intervals every coordinator recorded (valid from the acquire's answer to
the deadline, the release, or the expiry seen by owns())."""

from __future__ import annotations

import asyncio
import random

import pytest
from sqlalchemy import text

from controlplane.domain.rendezvous import assignment
from controlplane.ha.coordinator import DRAIN, EXPIRED, HANDOFF, Coordinator
from tests.integration.ha.harness import Checker, Member, overlaps, until

pytestmark = pytest.mark.postgres

TTL_S, MARGIN_S = 1.0, 0.25
CELLS = [f"pool-{i}" for i in range(8)]


def spread_as_hashed(members: list[Member]) -> bool:
    """Every cell owned by its rendezvous owner among ``members``, and by
    nobody else."""
    want = assignment(CELLS, [m.name for m in members])
    return all(set(m.coord.owned()) == {c for c in CELLS if want[c] == m.name} for m in members)


def assert_one_owner_at_a_time(checker: Checker) -> None:
    assert checker.violations == [], checker.violations[:5]
    assert checker.samples > 100
    bad = overlaps(checker.intervals())
    assert bad == [], bad[:3]


def test_validation_names_the_setting(ha_url: str) -> None:
    from controlplane.store.db import make_engine
    from controlplane.store.leases import HaStore

    engine = make_engine(ha_url)
    store = HaStore(engine)
    with pytest.raises(ValueError, match="margin_s must be in"):
        Coordinator(store, "a", "a:1", CELLS, ttl_s=1.0, margin_s=1.0)
    with pytest.raises(ValueError, match="tick_s must be in"):
        Coordinator(store, "a", "a:1", CELLS, ttl_s=1.0, margin_s=0.5, tick_s=0.6)
    with pytest.raises(ValueError, match="member_id"):
        Coordinator(store, "", "a:1", CELLS)
    engine.dispose()


def test_spread_kill_pause_and_drain(ha_url: str) -> None:
    asyncio.run(_spread_kill_pause_and_drain(ha_url))


async def _spread_kill_pause_and_drain(url: str) -> None:
    a, b, c = (Member(url, n, CELLS, ttl_s=TTL_S, margin_s=MARGIN_S) for n in "abc")
    checker = Checker([a, b, c], CELLS)
    checker.start()
    try:
        for m in (a, b, c):
            m.start()
        await until(lambda: spread_as_hashed([a, b, c]), "cells spread by HRW over a, b, c")

        # kill -9 c: its cells go to a and b once its lease and heartbeat age out
        c_cells = set(c.coord.owned())
        assert c_cells, "HRW gave c no cell of 8: pick other names"
        await c.kill()
        failover = await until(lambda: spread_as_hashed([a, b]), "c's cells taken by a and b")

        # SIGSTOP b past the TTL: it self-fences; a takes everything
        b_cells = set(b.coord.owned())
        b.pause()
        await until(lambda: set(a.coord.owned()) == set(CELLS), "a to own every cell")
        assert all(b.coord.owns(cell) is None for cell in b_cells)
        assert b.coord.counts[EXPIRED] >= len(b_cells)

        # SIGCONT: b rejoins and gets its cells back by handoff
        b.resume()
        await until(lambda: spread_as_hashed([a, b]), "b back with its cells")
        assert a.coord.counts[HANDOFF] >= 1

        # SIGTERM b: drain frees its cells in the database at once (no expiry
        # to wait for), and a takes them on its next tick
        b_leases = b.coord.owned()
        await b.drain()
        assert b.coord.counts[DRAIN] == len(b_leases)
        assert b.coord.owned() == {}
        after = b.store.owners()
        for cell in b_leases:  # released or already a's: never b's any more
            assert after[cell].owner in (None, "a")
            assert after[cell].owner == "a" or after[cell].expired
        handoff = await until(lambda: set(a.coord.owned()) == set(CELLS), "a to take b's cells")
        print(f"kill -9 -> cells re-owned {failover:.2f} s; drain -> handed off {handoff:.2f} s")
        with a.engine.begin() as conn:
            left = conn.execute(text("SELECT member_id FROM ha_members ORDER BY 1")).scalars()
            assert list(left) == ["a", "c"]  # b left; c (killed) never did
    finally:
        await checker.stop()
        for m in (a, b, c):
            if not m.killed:
                await m.drain()
        checker.sweep()
        for m in (a, b, c):
            m.close()
    assert_one_owner_at_a_time(checker)


def test_random_pauses_kills_and_drains_never_give_a_cell_two_owners(ha_url: str) -> None:
    asyncio.run(_random_schedule(ha_url, random.Random(1616), events=14))


async def _random_schedule(url: str, rng: random.Random, events: int) -> None:
    names = iter(f"m{i}" for i in range(100))
    live: list[Member] = []
    everyone: list[Member] = []

    def spawn() -> None:
        m = Member(url, next(names), CELLS, ttl_s=TTL_S, margin_s=MARGIN_S)
        live.append(m)
        everyone.append(m)
        m.start()

    for _ in range(3):
        spawn()
    checker = Checker(everyone, CELLS)
    checker.start()
    resume_at: dict[str, float] = {}
    loop = asyncio.get_running_loop()
    done: list[str] = []
    try:
        await until(lambda: spread_as_hashed(live), "the first spread")
        for _ in range(events):
            await asyncio.sleep(rng.uniform(0.2, 0.7))
            for m in live:
                if m.paused and loop.time() >= resume_at[m.name]:
                    m.resume()
            running = [m for m in live if not m.paused]
            kind = rng.choice(["pause", "pause", "kill", "drain"])
            if len(running) < 2:
                kind = "spawn"
            if kind == "pause":
                victim = rng.choice(running)
                victim.pause()  # sometimes shorter than the TTL, mostly longer
                resume_at[victim.name] = loop.time() + rng.uniform(0.3, 2.0)
            elif kind in ("kill", "drain"):
                victim = rng.choice(running)
                live.remove(victim)
                await (victim.kill() if kind == "kill" else victim.drain())
                spawn()
            else:
                spawn()
            done.append(kind)
        for m in live:
            m.resume()
        await until(lambda: spread_as_hashed(live), "the last spread, every member resumed")
    finally:
        await checker.stop()
        for m in everyone:
            m.resume()
            if not m.killed:
                await m.drain()
        checker.sweep()
        for m in everyone:
            m.close()
    counts = sum((m.coord.counts for m in everyone), start=type(everyone[0].coord.counts)())
    print(f"events {done}; lease outcomes {dict(counts)}; samples {checker.samples}")
    assert counts[EXPIRED] >= 1 and counts[HANDOFF] >= 1 and counts[DRAIN] >= 1
    assert_one_owner_at_a_time(checker)
