"""``LedgerWriter``: makes ledger records durable in batches, off the Admit
path, and tells each submitter when its record is durable.

One task takes everything queued (at most ``batch_max`` records) and writes
it as one transaction in a worker thread — a group commit: while one batch
commits the next one accumulates, so batching adds no waiting of its own.
When the queue grows past ``overlap_min`` records while a batch is being
written (the database is the bottleneck), up to ``pipeline`` batches are
written at once, each in its own transaction on its own connection, so one
batch's COPY overlaps another's commit; each future still resolves only
after the COMMIT of its own batch.

- Database healthy: COPY / executemany + COMMIT; each future resolves after
  the commit (``WRITTEN``; ``EXISTS`` for a key that was already recorded).
- The write fails, or takes longer than ``hang_deadline()`` (by default
  0.5 s, more when recent batches were slow, at most ``db_timeout_s``):
  the batch is appended to the spool and fsynced, its futures resolve
  (``SPOOLED``), and
  every later batch goes to the spool too until the drainer has replayed
  the spool into a database that answers again.
- The spool is full: the futures fail with ``LedgerUnavailable`` (nothing
  was written anywhere; the caller changes nothing and the client retries).

The drainer seals the spool's current segment and replays the sealed ones
with ``INSERT ... ON CONFLICT DO NOTHING`` semantics (a record that reached
the database twice — e.g. a write that timed out but did commit — is kept
once), deleting each segment after its commit.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import enum
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import structlog

from controlplane.aiotime import within
from controlplane.domain.errors import LedgerUnavailable
from controlplane.domain.ledger_records import REBOOK_KEYS, Key, LedgerRecord, rebooked_id
from controlplane.ledger.spool import CorruptSegment, Spool, SpoolFull
from controlplane.store.ledger import LedgerStore

log = structlog.get_logger("burstgate.ledger.writer")

# Batches written at once when the database is the bottleneck, and the
# queue that makes a second one start while one is in flight (below it,
# one batch at a time: a group commit, the fewest transactions).
PIPELINE = 3
OVERLAP_MIN = 1_000
# A batch slower than HANG_FACTOR x the median of the last RECENT_BATCHES
# (and than hang_after_s) is taken for a hung database (see hang_deadline).
HANG_FACTOR = 4.0
RECENT_BATCHES = 33
# Bounds (seconds) of the batch-duration histogram: a group commit takes a few
# ms when healthy; the hang deadline is 0.5 s by default, at most db_timeout_s.
BATCH_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

P = ParamSpec("P")
T = TypeVar("T")


class Outcome(enum.Enum):
    WRITTEN = "written"  # committed to the database
    SPOOLED = "spooled"  # fsynced to the local spool
    EXISTS = "exists"  # the database already had a record for this key


WRITTEN = Outcome.WRITTEN

# A LedgerRecord's values as a plain tuple: what is kept for a while (the
# spool's pending index here, Metering's recent records). A tuple of str,
# int and Decimal leaves the garbage collector's lists at its first
# collection; a named tuple never does, so every full collection would walk
# each one (with 100,000 kept: ~5x the pause of plain tuples, measured).
Row = tuple[Any, ...]


@dataclass
class WriterStats:
    """Plain counters read by the metrics collector (event-loop writes only)."""

    written: int = 0
    spooled: int = 0
    replayed: int = 0
    conflicts: int = 0
    rejected_spool_full: int = 0
    db_failures: int = 0
    batches: int = 0
    batch_seconds: float = 0.0
    # Committed batches per duration bucket (BATCH_BUCKETS_S, then +Inf): with
    # ``batches`` and ``batch_seconds``, the histogram of their durations.
    batch_buckets: list[int] = field(default_factory=lambda: [0] * (len(BATCH_BUCKETS_S) + 1))
    last_error: str = ""
    db_ok_since: float = field(default_factory=time.time)


class LedgerWriter:
    def __init__(
        self,
        store: LedgerStore,
        spool: Spool,
        *,
        batch_max: int = 10_000,
        db_timeout_s: float = 5.0,
        hang_after_s: float = 0.5,
        retry_s: float = 1.0,
        on_state: Callable[[bool], None] | None = None,
        pipeline: int = PIPELINE,
        overlap_min: int = OVERLAP_MIN,
    ) -> None:
        self.store = store
        self.spool = spool
        self.batch_max = batch_max
        self.db_timeout_s = db_timeout_s
        self.hang_after_s = min(hang_after_s, db_timeout_s)
        self._recent_batch_s: deque[float] = deque(maxlen=RECENT_BATCHES)
        self.retry_s = retry_s
        self.pipeline = max(1, pipeline)
        self.overlap_min = max(1, overlap_min)
        self._on_state = on_state
        # The queue: records and their futures side by side. A batch is a
        # slice of each; the records slice goes to COPY as it is.
        self._records: list[LedgerRecord] = []
        self._futures: list[asyncio.Future[Outcome]] = []
        self._batches: set[asyncio.Task[None]] = set()
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        # Database writes may hang on a dead network: a thread per batch in
        # flight and more, so hung ones do not stop the drainer's probes.
        # Spool I/O is serial.
        self._db_pool = ThreadPoolExecutor(
            max_workers=self.pipeline + 3, thread_name_prefix="ledger-db"
        )
        self._spool_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger-spool")
        self.db_ok = True
        # Records in the spool and not (known to be) in the database yet, as
        # plain tuples (``pending_record`` makes the LedgerRecord): see ``Row``.
        self.pending: dict[Key, Row] = {}
        self.stats = WriterStats()
        self._tasks: list[asyncio.Task[None]] = []
        self._writing = 0

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Replay what an earlier run left in the spool, then start writing.
        With the database down the spooled records stay pending (and are
        known to duplicate checks) and the drainer keeps trying."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        left = await self._in_spool_thread(self.spool.read_all)
        for r in left:
            self.pending[r.key] = tuple(r)
        self.spool.records = len(left)
        if left:
            log.info(
                "ledger spool found at start", records=len(left), dir=str(self.spool.directory)
            )
            self._set_db_ok(False, "replaying the spool left by an earlier run")
            await self.drain_once()
        self._tasks = [
            asyncio.create_task(self._run(), name="ledger-writer"),
            asyncio.create_task(self._drainer(), name="ledger-drainer"),
        ]

    async def stop(self) -> None:
        """Write what is queued (spooling it if the database is down), then stop."""
        await self.flush()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self.db_ok and self.spool.bytes:
            with contextlib.suppress(Exception):
                await self.drain_once()
        await self._in_spool_thread(self.spool.close)
        # Wait for database threads: one still running would return its
        # connection to a pool the caller is about to dispose.
        await asyncio.to_thread(self._db_pool.shutdown, True, cancel_futures=True)
        self._spool_pool.shutdown(wait=True)

    async def flush(self) -> None:
        """Wait until everything submitted so far is durable (or failed)."""
        assert self._idle is not None
        while self._records or self._writing:
            self._idle.clear()
            await self._idle.wait()

    # ---------------------------------------------------------------- submit

    def submit(self, record: LedgerRecord) -> asyncio.Future[Outcome]:
        """Queue ``record``; the future resolves once it is durable."""
        fut: asyncio.Future[Outcome] = self._loop.create_future()
        self._records.append(record)
        self._futures.append(fut)
        assert self._wake is not None
        self._wake.set()
        return fut

    def pending_record(self, key: Key) -> LedgerRecord | None:
        """The spooled record of ``key``, if it is pending."""
        row = self.pending.get(key)
        return None if row is None else LedgerRecord._make(row)

    @property
    def queued(self) -> int:
        return len(self._records)

    @property
    def busy(self) -> bool:
        return bool(self._records or self._writing or self.pending)

    # ----------------------------------------------------------------- loop

    async def _run(self) -> None:
        """Start batches: one whenever records are queued and none is being
        written (group commit); more, up to ``pipeline``, only while at
        least ``overlap_min`` records wait behind the ones in flight."""
        assert self._wake is not None and self._idle is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._records and (
                not self._batches
                or (len(self._batches) < self.pipeline and len(self._records) >= self.overlap_min)
            ):
                records = self._records[: self.batch_max]
                futures = self._futures[: self.batch_max]
                del self._records[: self.batch_max]
                del self._futures[: self.batch_max]
                self._writing += len(records)
                task = asyncio.create_task(self._batch(records, futures), name="ledger-batch")
                self._batches.add(task)
                task.add_done_callback(self._batch_done)

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        self._batches.discard(task)
        assert self._wake is not None and self._idle is not None
        if self._records:
            self._wake.set()  # the next batch
        elif not self._writing:
            self._idle.set()

    async def _batch(
        self, records: list[LedgerRecord], futures: list[asyncio.Future[Outcome]]
    ) -> None:
        try:
            await self._write(records, futures)
        except Exception as exc:  # never leave a submitter hanging
            log.exception("ledger batch failed")
            for fut in futures:
                if not fut.done():
                    fut.set_exception(LedgerUnavailable(f"ledger write failed: {exc}"))
        finally:
            self._writing -= len(records)

    async def _write(
        self, records: list[LedgerRecord], futures: list[asyncio.Future[Outcome]]
    ) -> None:
        loop = self._loop
        t0 = time.perf_counter()
        if self.db_ok:
            job = loop.run_in_executor(self._db_pool, self.store.insert, records)
            try:
                conflicts = await within(asyncio.shield(job), self.hang_deadline())
            except Exception as exc:
                # A timed-out write may still commit later: the spool replay
                # is idempotent, so the record ends up stored once either way.
                job.add_done_callback(_swallow)
                self.stats.db_failures += 1
                reason = "timeout" if isinstance(exc, TimeoutError) else str(exc).splitlines()[0]
                self._set_db_ok(False, reason)
            else:
                took = time.perf_counter() - t0
                self._recent_batch_s.append(took)
                self.stats.batches += 1
                self.stats.batch_seconds += took
                self.stats.batch_buckets[bisect.bisect_left(BATCH_BUCKETS_S, took)] += 1
                self.stats.written += len(records) - len(conflicts)
                self.stats.conflicts += len(conflicts)
                if conflicts:
                    for r, fut in zip(records, futures, strict=True):
                        if not fut.done():
                            fut.set_result(Outcome.EXISTS if r.key in conflicts else WRITTEN)
                else:
                    for fut in futures:
                        if not fut.done():
                            fut.set_result(WRITTEN)
                return
        try:
            await self._in_spool_thread(self.spool.append, records)
        except SpoolFull as exc:
            self.stats.rejected_spool_full += len(records)
            log.error("ledger spool full; refusing completions", error=str(exc))
            for fut in futures:
                if not fut.done():
                    fut.set_exception(
                        LedgerUnavailable(
                            "ledger: database unreachable and the local spool is full; "
                            "nothing was recorded, retry later"
                        )
                    )
            return
        self.stats.spooled += len(records)
        for r, fut in zip(records, futures, strict=True):
            self.pending[r.key] = tuple(r)
            if not fut.done():
                fut.set_result(Outcome.SPOOLED)

    def hang_deadline(self) -> float:
        """How long a batch may take before the database counts as hung and
        the batch is spooled: ``hang_after_s``, or 4x the median of the
        last batches when the database is merely busy, never more than
        ``db_timeout_s``. A Complete waits at most this (plus an fsync)
        through the first moments of an outage, and not at all after."""
        recent = self._recent_batch_s
        typical = sorted(recent)[len(recent) // 2] if recent else 0.0
        return min(self.db_timeout_s, max(self.hang_after_s, HANG_FACTOR * typical))

    def _set_db_ok(self, ok: bool, reason: str = "") -> None:
        if ok == self.db_ok:
            return
        self.db_ok = ok
        if ok:
            self.stats.db_ok_since = time.time()
            log.info("ledger database reachable again; writing to it")
        else:
            self.stats.last_error = reason
            log.warning("ledger database unavailable; spooling", reason=reason)
        if self._on_state is not None:
            self._on_state(ok)

    # -------------------------------------------------------------- drainer

    async def _drainer(self) -> None:
        while True:
            await asyncio.sleep(self.retry_s)
            if self.db_ok and not self.spool.bytes:
                continue
            try:
                await self.drain_once()
            except Exception as exc:
                self.stats.db_failures += 1
                self._set_db_ok(False, str(exc).splitlines()[0] if str(exc) else repr(exc))

    async def drain_once(self) -> int:
        """Replay every sealed spool segment into the database; on success
        the writer goes back to writing to the database. Returns the records
        replayed. Raises if the database fails (the segment stays)."""
        loop = asyncio.get_running_loop()
        segments = await self._in_spool_thread(self.spool.seal)
        replayed = 0
        for seg in segments:
            replayed += await within(
                loop.run_in_executor(self._db_pool, self._replay_segment, seg),
                max(self.db_timeout_s * 4, 30.0),
            )
        if not segments:
            # Nothing spooled: probe the database before trusting it again.
            await within(
                loop.run_in_executor(self._db_pool, self.store.ping), self.db_timeout_s
            )
        self.stats.replayed += replayed
        self._set_db_ok(True)
        return replayed

    def _replay_segment(self, seg: Path) -> int:
        records: list[LedgerRecord] = []
        corrupt: CorruptSegment | None = None
        try:
            for frame in self.spool.read(seg):
                records.extend(frame)
        except CorruptSegment as exc:
            corrupt = exc
        self._insert_replayed(records)
        if corrupt is not None:
            self.spool.quarantine(seg, corrupt.target, len(records))
        else:
            self.spool.remove(seg, len(records))
        # Drop from the pending index on the loop thread.
        keys = [r.key for r in records]
        asyncio.run_coroutine_threadsafe(self._forget(keys), self._loop).result()
        return len(records)

    def _insert_replayed(self, records: list[LedgerRecord]) -> None:
        """Insert spooled records. One whose key is stored already for the
        same admission (reservation id) is a record that reached the
        database twice: the stored one is kept. One whose key is stored for
        another admission (a request id admitted again after the settled one
        was forgotten, spooled while the database could not say so) is
        booked under the key derived from its admission, as Metering books
        it (``rebooked_id``), never dropped."""
        base = {r.key: r.request_id for r in records}
        batch, n = records, 0
        while batch:
            conflicts = self.store.insert(batch)
            if not conflicts:
                return
            existing = self.store.fetch_many(conflicts)
            retry: list[LedgerRecord] = []
            for mine in batch:
                stored = existing.get(mine.key) if mine.key in conflicts else None
                if stored is None or stored.reservation_id == mine.reservation_id:
                    if stored is not None and stored != mine:
                        log.warning(
                            "spooled record differs from the one already in the ledger; "
                            "the stored one is kept",
                            tenant_id=mine.tenant_id,
                            request_id=mine.request_id,
                            spooled_user_charge_nanos=mine.user_charge_nanos,
                            spooled_actual_cost_nanos=mine.actual_cost_nanos,
                        )
                    continue
                if n >= REBOOK_KEYS:
                    raise RuntimeError(
                        f"ledger: {mine.request_id[:64]!r} and the keys derived from it are "
                        "stored for other admissions; the segment stays in the spool"
                    )
                first = base.get(mine.key, mine.request_id)
                again = mine._replace(request_id=rebooked_id(first, mine.reservation_id, n + 1))
                base[again.key] = first
                retry.append(again)
            batch, n = retry, n + 1

    async def _forget(self, keys: list[Key]) -> None:
        for k in keys:
            self.pending.pop(k, None)

    async def _in_spool_thread(self, fn: Callable[P, T], *args: P.args, **kw: P.kwargs) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            self._spool_pool, lambda: fn(*args, **kw)
        )


def _swallow(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
