"""``LedgerWriter``: makes ledger records durable in batches, off the Admit
path, and tells each submitter when its record is durable.

One task takes everything queued (at most ``batch_max`` records) and writes
it as one transaction in a worker thread — a group commit: while one batch
commits the next one accumulates, so batching adds no waiting of its own.

- Database healthy: COPY / executemany + COMMIT; each future resolves after
  the commit (``WRITTEN``; ``EXISTS`` for a key that was already recorded).
- The write fails or takes longer than ``db_timeout_s``: the batch is
  appended to the spool and fsynced, its futures resolve (``SPOOLED``), and
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
import contextlib
import enum
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import structlog

from controlplane.domain.errors import LedgerUnavailable
from controlplane.domain.ledger_records import Key, LedgerRecord
from controlplane.ledger.spool import CorruptSegment, Spool, SpoolFull
from controlplane.store.ledger import LedgerStore

log = structlog.get_logger("burstgate.ledger.writer")

P = ParamSpec("P")
T = TypeVar("T")


class Outcome(enum.Enum):
    WRITTEN = "written"  # committed to the database
    SPOOLED = "spooled"  # fsynced to the local spool
    EXISTS = "exists"  # the database already had a record for this key


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
        retry_s: float = 1.0,
        on_state: Callable[[bool], None] | None = None,
    ) -> None:
        self.store = store
        self.spool = spool
        self.batch_max = batch_max
        self.db_timeout_s = db_timeout_s
        self.retry_s = retry_s
        self._on_state = on_state
        self._queue: list[tuple[LedgerRecord, asyncio.Future[Outcome]]] = []
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        # Database writes may hang on a dead network: several threads so a
        # hung one does not stop the drainer's probes. Spool I/O is serial.
        self._db_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ledger-db")
        self._spool_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger-spool")
        self.db_ok = True
        # Records in the spool and not (known to be) in the database yet.
        self.pending: dict[Key, LedgerRecord] = {}
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
            self.pending[r.key] = r
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
        while self._queue or self._writing:
            self._idle.clear()
            await self._idle.wait()

    # ---------------------------------------------------------------- submit

    def submit(self, record: LedgerRecord) -> asyncio.Future[Outcome]:
        """Queue ``record``; the future resolves once it is durable."""
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._queue.append((record, fut))
        assert self._wake is not None
        self._wake.set()
        return fut

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return bool(self._queue or self._writing or self.pending)

    # ----------------------------------------------------------------- loop

    async def _run(self) -> None:
        assert self._wake is not None and self._idle is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch = self._queue[: self.batch_max]
                del self._queue[: self.batch_max]
                self._writing = len(batch)
                try:
                    await self._write(batch)
                except Exception as exc:  # never leave a submitter hanging
                    log.exception("ledger batch failed")
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(LedgerUnavailable(f"ledger write failed: {exc}"))
                finally:
                    self._writing = 0
            self._idle.set()

    async def _write(self, batch: list[tuple[LedgerRecord, asyncio.Future[Outcome]]]) -> None:
        records = [r for r, _ in batch]
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        if self.db_ok:
            job = loop.run_in_executor(self._db_pool, self.store.insert, records)
            try:
                conflicts = await asyncio.wait_for(asyncio.shield(job), self.db_timeout_s)
            except Exception as exc:
                # A timed-out write may still commit later: the spool replay
                # is idempotent, so the record ends up stored once either way.
                job.add_done_callback(_swallow)
                self.stats.db_failures += 1
                reason = "timeout" if isinstance(exc, TimeoutError) else str(exc).splitlines()[0]
                self._set_db_ok(False, reason)
            else:
                self.stats.batches += 1
                self.stats.batch_seconds += time.perf_counter() - t0
                self.stats.written += len(records) - len(conflicts)
                self.stats.conflicts += len(conflicts)
                for r, fut in batch:
                    if not fut.done():
                        fut.set_result(Outcome.EXISTS if r.key in conflicts else Outcome.WRITTEN)
                return
        try:
            await self._in_spool_thread(self.spool.append, records)
        except SpoolFull as exc:
            self.stats.rejected_spool_full += len(records)
            log.error("ledger spool full; refusing completions", error=str(exc))
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(
                        LedgerUnavailable(
                            "ledger: database unreachable and the local spool is full; "
                            "nothing was recorded, retry later"
                        )
                    )
            return
        self.stats.spooled += len(records)
        for r, fut in batch:
            self.pending[r.key] = r
            if not fut.done():
                fut.set_result(Outcome.SPOOLED)

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
            replayed += await asyncio.wait_for(
                loop.run_in_executor(self._db_pool, self._replay_segment, seg),
                max(self.db_timeout_s * 4, 30.0),
            )
        if not segments:
            # Nothing spooled: probe the database before trusting it again.
            await asyncio.wait_for(
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
        conflicts = self.store.insert(records)
        if conflicts:
            existing = self.store.fetch_many(conflicts)
            for key in conflicts:
                mine = next(r for r in records if r.key == key)
                if existing.get(key) != mine:
                    log.warning(
                        "spooled record differs from the one already in the ledger; "
                        "the stored one is kept",
                        tenant_id=key[0],
                        request_id=key[1],
                        spooled_user_charge_nanos=mine.user_charge_nanos,
                        spooled_actual_cost_nanos=mine.actual_cost_nanos,
                    )
        if corrupt is not None:
            self.spool.quarantine(seg, corrupt.target, len(records))
        else:
            self.spool.remove(seg, len(records))
        # Drop from the pending index on the loop thread.
        keys = [r.key for r in records]
        asyncio.run_coroutine_threadsafe(self._forget(keys), self._loop).result()
        return len(records)

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
