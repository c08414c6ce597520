"""Batches written at the same time on PostgreSQL (the writer's pipeline; a
spool replay beside a write that timed out): every key is stored once,
exactly one of the writers answers it as already recorded, and a deadlock
between two of them is redone by the merge instead of failing the batch."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

from controlplane.domain.ledger_records import COLUMNS, Key, LedgerRecord
from controlplane.store.db import upgrade
from controlplane.store.ledger import LedgerStore
from controlplane.store.ledger_write import ledger_engine
from tests.integration.ledger.test_binary_copy import rec


def _pg(url: str) -> str:
    return url.replace("postgresql+psycopg", "postgresql")


@pytest.fixture
def store(pg_url: str) -> Iterator[LedgerStore]:
    upgrade(pg_url)
    engine = ledger_engine(pg_url)
    yield LedgerStore(engine)
    engine.dispose()


def _insert_all(store: LedgerStore, batches: list[list[LedgerRecord]]) -> list[set[Key]]:
    results: list[set[Key] | BaseException] = [set() for _ in batches]
    start = threading.Barrier(len(batches))

    def one(i: int) -> None:
        start.wait()
        try:
            results[i] = store.insert(batches[i])
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return [r for r in results if isinstance(r, set)]


@pytest.mark.parametrize("round_", range(3))
def test_overlapping_batches_at_once_store_each_key_once(store: LedgerStore, round_: int) -> None:
    x = [rec(f"k{i}", price_id=1) for i in range(600)]
    y = [rec(f"k{i}", price_id=2) for i in reversed(range(300, 900))]  # opposite order
    conf_x, conf_y = _insert_all(store, [x, y])
    shared = {rec(f"k{i}").key for i in range(300, 600)}
    assert conf_x | conf_y == shared and not conf_x & conf_y
    stored = store.fetch_many(r.key for r in x + y)
    assert len(stored) == 900
    for r in x:
        if r.key not in conf_x:
            assert stored[r.key] == r
    for r in y:
        if r.key not in conf_y:
            assert stored[r.key] == r


def test_deadlock_is_redone_by_the_merge(pg_url: str, store: LedgerStore) -> None:
    # The store's backends look for deadlocks after 3 s, the other session's
    # only after a minute: PostgreSQL aborts the store's transaction.
    with psycopg.connect(_pg(pg_url), autocommit=True) as admin:
        admin.execute(f"ALTER DATABASE \"{make_url(pg_url).database}\" SET deadlock_timeout = '3s'")
    store.engine.dispose()
    a, b = rec("A", price_id=1), rec("B", price_id=1)
    theirs = {r.key: r._replace(price_id=9) for r in (a, b)}
    insert = (
        f"INSERT INTO ledger_records ({', '.join(COLUMNS)}) "
        f"VALUES ({', '.join(['%s'] * len(COLUMNS))})"
    )
    result: dict[str, Any] = {}
    with psycopg.connect(_pg(pg_url)) as other, psycopg.connect(_pg(pg_url)) as watch:
        other.execute("SET deadlock_timeout = '60s'")
        other.execute(insert, tuple(theirs[a.key]))  # holds A, uncommitted

        def write() -> None:
            try:
                result["conflicts"] = store.insert([b, a])  # takes B, then waits for A
            except BaseException as exc:
                result["error"] = exc

        t = threading.Thread(target=write)
        t.start()
        deadline = time.monotonic() + 30
        while not watch.execute("SELECT count(*) FROM pg_locks WHERE NOT granted").fetchone()[0]:  # type: ignore[index]
            assert time.monotonic() < deadline, "the store never waited for A"
            time.sleep(0.01)
        # B waits for the store, the store waits for A: a deadlock; the
        # store's backend is aborted, its merge then waits for this commit.
        other.execute(insert, tuple(theirs[b.key]))
        other.commit()
        t.join(60)
    assert "error" not in result, result.get("error")
    assert result["conflicts"] == {a.key, b.key}
    stored = store.fetch_many([a.key, b.key])
    assert stored == theirs
