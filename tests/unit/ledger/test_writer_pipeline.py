"""LedgerWriter with several batches in flight: a future resolves only after
its own batch committed (or was spooled), batches overlap only when the
queue is long, and a batch that fails beside others loses nothing. A fake
store stands in for the database (a sleep per batch, failures on demand);
no timing is asserted."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path

from controlplane.domain.ledger_records import Key, LedgerRecord
from controlplane.ledger.spool import Spool
from controlplane.ledger.writer import LedgerWriter, Outcome


def rec(i: int) -> LedgerRecord:
    return LedgerRecord(
        "acme", f"r{i}", i, "standard", "m", "p", 1, 1, 2, 3, 4, 10, 5, 7, 20,
        Decimal("0.250000"), "request", Decimal("1.200000"), 300, Decimal("1.000000"), "USD",
        12345, 6789, 1,
    )  # fmt: skip


class FakeStore:
    """Commits a batch after ``delay`` s; the calls numbered in ``fail``
    raise instead (nothing committed). Counts the batches in flight."""

    def __init__(
        self, delay: float = 0.02, fail: Sequence[int] = (), exists: set[Key] | None = None
    ) -> None:
        self.delay = delay
        self.fail = set(fail)
        self.exists = exists or set()
        self.lock = threading.Lock()
        self.calls = 0
        self.inflight = 0
        self.max_inflight = 0
        self.committed: set[Key] = set()
        self.sizes: list[int] = []

    def insert(self, records: Sequence[LedgerRecord]) -> set[Key]:
        with self.lock:
            self.calls += 1
            call = self.calls
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            time.sleep(self.delay)
            if call in self.fail:
                raise RuntimeError("database gone")
            with self.lock:
                keys = {r.key for r in records}
                conflicts = keys & self.exists
                self.committed |= keys - conflicts
                self.sizes.append(len(records))
            return conflicts
        finally:
            with self.lock:
                self.inflight -= 1

    def ping(self) -> None:
        raise RuntimeError("database gone")  # the drainer keeps the spool


def run(store: FakeStore, tmp: Path, n: int, **kw: int) -> tuple[LedgerWriter, list[Outcome]]:
    async def main() -> tuple[LedgerWriter, list[Outcome]]:
        writer = LedgerWriter(store, Spool(tmp / "spool", 1 << 24), retry_s=3600, **kw)  # type: ignore[arg-type]
        await writer.start()
        durable_when_resolved: list[bool] = []

        def check(r: LedgerRecord, fut: asyncio.Future[Outcome]) -> None:
            if not fut.exception():
                out = fut.result()
                if out is Outcome.WRITTEN:
                    durable_when_resolved.append(r.key in store.committed)
                elif out is Outcome.SPOOLED:
                    durable_when_resolved.append(r.key in writer.pending)
                else:
                    durable_when_resolved.append(r.key in store.exists)

        futs = []
        for i in range(n):
            r = rec(i)
            fut = writer.submit(r)
            fut.add_done_callback(lambda f, r=r: check(r, f))  # type: ignore[misc]
            futs.append(fut)
        outcomes = list(await asyncio.gather(*futs))
        assert len(durable_when_resolved) == n and all(durable_when_resolved)
        await writer.stop()
        return writer, outcomes

    return asyncio.run(main())


def test_a_long_queue_is_written_by_overlapping_batches(tmp_path: Path) -> None:
    store = FakeStore()
    writer, outcomes = run(store, tmp_path, 1_000, batch_max=100, overlap_min=50, pipeline=3)
    assert outcomes == [Outcome.WRITTEN] * 1_000
    assert store.committed == {rec(i).key for i in range(1_000)}
    assert store.max_inflight == 3
    assert sum(store.sizes) == 1_000 and max(store.sizes) == 100
    assert writer.stats.written == 1_000 and writer.stats.batches == len(store.sizes)


def test_below_overlap_min_one_batch_at_a_time(tmp_path: Path) -> None:
    store = FakeStore()
    _, outcomes = run(store, tmp_path, 1_000, batch_max=100, overlap_min=5_000, pipeline=3)
    assert outcomes == [Outcome.WRITTEN] * 1_000
    assert store.max_inflight == 1


def test_conflicts_in_overlapping_batches_answer_exists(tmp_path: Path) -> None:
    exists = {rec(i).key for i in range(0, 1_000, 7)}
    store = FakeStore(exists=exists)
    writer, outcomes = run(store, tmp_path, 1_000, batch_max=100, overlap_min=50, pipeline=3)
    for i, out in enumerate(outcomes):
        assert out is (Outcome.EXISTS if i % 7 == 0 else Outcome.WRITTEN)
    assert writer.stats.conflicts == len(exists)


def test_a_failing_batch_beside_others_is_spooled_and_nothing_is_lost(tmp_path: Path) -> None:
    store = FakeStore(fail=[2])
    writer, outcomes = run(store, tmp_path, 1_000, batch_max=100, overlap_min=50, pipeline=3)
    written = {rec(i).key for i, o in enumerate(outcomes) if o is Outcome.WRITTEN}
    spooled = {rec(i).key for i, o in enumerate(outcomes) if o is Outcome.SPOOLED}
    assert written == store.committed
    assert written | spooled == {rec(i).key for i in range(1_000)} and not written & spooled
    assert len(spooled) >= 100  # the failed batch and every batch started after it
    assert not writer.db_ok
    # What was spooled is on disk for the next start.
    left = Spool(tmp_path / "spool", 1 << 24).read_all()
    assert {r.key for r in left} == spooled
