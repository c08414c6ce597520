"""Leases and fencing in PostgreSQL (controlplane/store/leases.py), on a real
database per test: acquire, renew, release, the epoch only rising, takeover
after expiry by the database's clock, stale renews refused, and ``fence``:
a stale write refused and rolled back, and a takeover waiting for a fenced
transaction in flight instead of interleaving with it."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from decimal import Decimal

import pytest
from sqlalchemy import Connection, Engine, func, insert, select, text

from controlplane.store.db import make_engine, upgrade
from controlplane.store.leases import HaStore, HaUnsupported, StaleEpoch, fence
from controlplane.store.models import PricingWindowRow
from tests.support import wait_until

pytestmark = pytest.mark.postgres

CELL = "pool-a"


def expired(store: HaStore, cell: str = CELL) -> bool:
    return store.owners()[cell].expired


def test_acquire_renew_release_and_the_epoch_only_rises(store: HaStore) -> None:
    store.heartbeat("a", "10.0.0.1:50051")
    assert store.acquire(CELL, "a", 30) == 1
    assert store.acquire(CELL, "b", 30) is None  # held, not expired
    got = store.owners()[CELL]
    assert (got.owner, got.epoch, got.address, got.expired) == ("a", 1, "10.0.0.1:50051", False)
    assert store.renew(CELL, "a", 1, 30)
    assert not store.renew(CELL, "b", 1, 30)  # not the owner
    assert not store.renew(CELL, "a", 2, 30)  # not the epoch
    assert not store.release(CELL, "b", 1)  # only the owner releases
    assert store.release(CELL, "a", 1)
    got = store.owners()[CELL]
    assert (got.owner, got.epoch, got.expired) == (None, 1, True)
    assert store.acquire(CELL, "b", 30) == 2  # a handoff: no wait for expiry
    assert not store.renew(CELL, "a", 1, 30)  # the old owner's lease is gone
    assert not store.release(CELL, "a", 1)
    assert store.owners()[CELL].owner == "b"
    # re-acquiring our own live lease raises the epoch (fences what the old one sent)
    assert store.acquire(CELL, "b", 30) == 3


def test_expired_lease_is_taken_over_and_its_renew_refused(store: HaStore) -> None:
    assert store.acquire(CELL, "a", 0.05) == 1
    wait_until(lambda: expired(store), message="the lease to expire by the database clock")
    assert not store.renew(CELL, "a", 1, 30)  # too late: expired
    assert store.acquire(CELL, "b", 30) == 2
    assert not store.renew(CELL, "a", 1, 30)
    assert store.renew(CELL, "b", 2, 30)


def test_members_heartbeat_drain_and_leave(store: HaStore, engine: Engine) -> None:
    store.heartbeat("a", "h1:1")
    store.heartbeat("b", "h2:1")
    with engine.begin() as conn:
        started = conn.execute(text("SELECT started_at FROM ha_members WHERE member_id='a'"))
        first = started.scalar_one()
    store.heartbeat("a", "h1:2")
    assert store.live_members(30) == ["a", "b"]
    store.heartbeat("b", "h2:1", draining=True)
    assert store.live_members(30) == ["a"]  # draining: out of every assignment
    with engine.begin() as conn:
        row = conn.execute(
            text("SELECT started_at, address FROM ha_members WHERE member_id='a'")
        ).one()
    assert (row[0], row[1]) == (first, "h1:2")
    store.leave("b")
    assert wait_until(lambda: store.live_members(0.05) == [], message="a's heartbeat to age")
    with engine.begin() as conn:
        assert conn.execute(text("SELECT count(*) FROM ha_members")).scalar_one() == 1


def test_release_many_frees_only_our_current_leases(store: HaStore) -> None:
    for cell in ("c1", "c2", "c3"):
        assert store.acquire(cell, "a", 30) == 1
    assert store.release_many("a", {"c1": 1, "c2": 7, "c3": 1}) == 2  # c2: wrong epoch
    owners = store.owners()
    assert [owners[c].owner for c in ("c1", "c2", "c3")] == [None, "a", None]
    assert store.release_many("a", {}) == 0


def write_window(conn: Connection, start: int) -> None:
    """A single-writer write: a pricing-window row of the cell's pool."""
    conn.execute(
        insert(PricingWindowRow).values(
            pool=CELL, model="m", window_start=start, window_s=60, completions=0,
            completion_weight=0, completion_weighted_ppm=0, load_reports=0, load_ppm_sum=0,
            multiplier=Decimal(1), next_multiplier=Decimal(1), closed=False,
        )
    )  # fmt: skip


def windows(engine: Engine) -> list[int]:
    with engine.begin() as conn:
        col = PricingWindowRow.window_start
        return list(conn.execute(select(col).order_by(col)).scalars())


def test_fence_refuses_a_stale_epoch_and_rolls_the_write_back(
    store: HaStore, engine: Engine
) -> None:
    assert store.acquire(CELL, "a", 30) == 1
    with engine.begin() as conn:
        fence(conn, CELL, 1)
        write_window(conn, 60)
    assert store.release(CELL, "a", 1)
    assert store.acquire(CELL, "b", 30) == 2
    stale = r"'pool-a': write fenced with epoch 1.*epoch 2"
    with pytest.raises(StaleEpoch, match=stale), engine.begin() as conn:
        write_window(conn, 120)  # written first, then fenced: must still vanish
        fence(conn, CELL, 1)
    with pytest.raises(StaleEpoch, match="has no lease row"), engine.begin() as conn:
        fence(conn, "no-such-cell", 1)
    assert windows(engine) == [60]


def test_takeover_waits_for_a_fenced_transaction_in_flight(store: HaStore, engine: Engine) -> None:
    assert store.acquire(CELL, "a", 0.05) == 1
    wait_until(lambda: expired(store), message="a's lease to expire")
    other = HaStore(make_engine(str(engine.url.render_as_string(hide_password=False))))
    taken: Future[int | None] = Future()
    with engine.connect() as conn:
        tx = conn.begin()
        fence(conn, CELL, 1)  # a, unaware its lease expired, writes under epoch 1
        write_window(conn, 60)
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()

        def take() -> None:
            try:
                taken.set_result(other.acquire(CELL, "b", 30))
            except BaseException as exc:
                taken.set_exception(exc)

        threading.Thread(target=take, daemon=True).start()

        def blocked_by_us() -> bool:
            with engine.begin() as c:
                q = text(
                    "SELECT count(*) FROM pg_stat_activity WHERE :pid = ANY(pg_blocking_pids(pid))"
                )
                return bool(c.execute(q, {"pid": pid}).scalar_one())

        wait_until(blocked_by_us, message="b's acquire to wait on the fenced transaction")
        assert not taken.done()  # it waits: no interleaving with the write
        tx.commit()
    assert taken.result(timeout=20) == 2
    assert windows(engine) == [60]  # the fenced write landed before the takeover
    with pytest.raises(StaleEpoch), engine.begin() as conn:
        fence(conn, CELL, 1)
        write_window(conn, 120)
    assert windows(engine) == [60]
    other.engine.dispose()


def test_ttl_must_be_positive(store: HaStore) -> None:
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="ttl must be > 0"):
            store.acquire(CELL, "a", bad)


def test_sqlite_is_refused_with_the_reason(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    eng = make_engine(sqlite_url)
    try:
        with pytest.raises(HaUnsupported, match="needs a shared PostgreSQL database, not sqlite"):
            HaStore(eng)
        with eng.begin() as conn, pytest.raises(HaUnsupported, match="fence"):
            fence(conn, CELL, 1)
        with eng.begin() as conn:  # the tables exist on SQLite too: one schema
            count = select(func.count()).select_from(text("ha_cell_leases"))
            assert conn.execute(count).scalar() == 0
    finally:
        eng.dispose()
