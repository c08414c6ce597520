"""``Metering``: a Complete recorded in the dual ledger exactly once and
acknowledged only once durable.

Long because: the exactly-once path is one object (prepare, figures,
durable write, apply, the answer from memory, spool or database); its
margin checks and takeover rebuild live in margin_windows.py and takeover.py.

    prepare (memory, no change) -> figures -> durable write -> apply (memory)

1. ``AdmissionService.settlement.prepare`` validates against the in-memory
   record and changes nothing.
2. The ledger record is built: the multiplier and window locked at
   admission, the price catalog, the request's miss rate (else the pool's).
3. ``LedgerWriter`` makes it durable: committed, or fsynced to the spool.
4. Only then ``AdmissionService.settlement.apply`` refunds the unused
   reservation and marks the request settled.

A failure before 4 leaves memory as it was, so the client's retry is a new
attempt, never a ``duplicate=true`` without a ledger row. Concurrent
Completes of one request share the same in-flight settlement (the later ones
answer ``duplicate=true`` with its figures). The settlement runs in its own
task, so a client that gives up mid-write does not leave it half done.

A Complete whose in-memory record is gone (after ``reservation_ttl_s``, or
a restart) is answered from the ledger: the recent-records cache, the
spool's pending records, then the database; NOT_FOUND only when none has it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from sqlalchemy.engine import make_url  # URL parsing only (where the spool lives)

from controlplane.aiotime import within
from controlplane.domain import Settlement
from controlplane.domain.catalog import (
    PriceCatalog,
    actual_cost,
    pricing_gaps,
    user_charge,
    zero_price,
)
from controlplane.domain.errors import FailedPrecondition, LedgerUnavailable, NotFound, excerpt
from controlplane.domain.ledger_records import REBOOK_KEYS, Key, LedgerRecord, rebooked_id
from controlplane.domain.money import ppm_decimal, rate_ppm, to_nanos
from controlplane.domain.units import PPM
from controlplane.ledger.fencing import Fencing, StaleWrites, WindowWriter, no_fencing
from controlplane.ledger.margin_windows import check_window, margin_report
from controlplane.ledger.pricing import PricingBook
from controlplane.ledger.spool import Spool
from controlplane.ledger.takeover import CountedUsage, Rebuilt, rebuild_usage, take_over
from controlplane.ledger.writer import LedgerWriter, Outcome, Row
from controlplane.service import AdmissionService, RecordView
from controlplane.settings import Settings, sqlalchemy_url
from controlplane.store.db import dispose_when_idle
from controlplane.store.ledger import LedgerStore, MarginWarning
from controlplane.store.ledger_write import ledger_engine

log = structlog.get_logger("burstgate.ledger")

# Settled records remembered for duplicate answers without a database read.
RECENT_LIMIT = 100_000
# How often open pricing windows are saved and closed windows checked.
FLUSH_INTERVAL_S = 2.0


@dataclass(frozen=True, slots=True)
class CompleteResult:
    settlement: Settlement
    record: LedgerRecord | None  # None only with the ledger disabled
    duplicate: bool

    def as_duplicate(self) -> CompleteResult:
        s = self.settlement
        dup = Settlement(s.request_id, s.reserved_tokens, s.actual_tokens, s.refunded_tokens, True)
        return CompleteResult(dup, self.record, True)


def default_spool_dir(database_url: str) -> Path:
    url = make_url(sqlalchemy_url(database_url))
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        return Path(url.database + ".ledger-spool")
    name = f"{url.host or 'local'}-{url.port or 5432}-{url.database or 'db'}"
    return Path("var") / "ledger-spool" / re.sub(r"[^A-Za-z0-9_.-]", "_", name)


class Metering:
    def __init__(
        self,
        service: AdmissionService,
        settings: Settings,
        pricing: PricingBook,
        *,
        clock: Callable[[], int] | None = None,
        on_health: Callable[[bool], None] | None = None,
        fencing: Fencing = no_fencing,
    ) -> None:
        """``fencing``: pool -> this replica's lease of the pool's cell (see
        controlplane/ledger/fencing.py); the default writes unfenced."""
        self.svc = service
        self.settings = settings
        self.clock = clock or service.clock
        # The book the service quotes Admit multipliers from (given to both
        # at construction: see pricing_book); Complete feeds its windows.
        self.pricing = pricing
        self.steps = pricing.steps
        self.catalog = PriceCatalog()
        self.engine = ledger_engine(settings.database_url)
        self.store = LedgerStore(self.engine)
        spool_dir = settings.ledger_spool_dir or default_spool_dir(settings.database_url)
        self.spool = Spool(spool_dir, settings.ledger_spool_max_bytes)
        self._on_health = on_health
        self.writer = LedgerWriter(
            self.store,
            self.spool,
            batch_max=settings.ledger_batch_max,
            db_timeout_s=settings.ledger_db_timeout_s,
            hang_after_s=settings.ledger_hang_after_s,
            retry_s=settings.ledger_retry_s,
            on_state=self._db_state,
        )
        # Scale-out (docs/ha.md): pricing-window writes fenced by the lease,
        # and what the quota counters hold as settled records (takeover.py).
        self.stale_writes = StaleWrites()
        self.windows = WindowWriter(self.store, pricing, fencing, self.stale_writes)
        self.usage = CountedUsage()
        self._inflight: dict[Key, asyncio.Task[CompleteResult]] = {}
        # Plain tuples, not LedgerRecords: see writer.Row (GC).
        self._recent: OrderedDict[Key, Row] = OrderedDict()
        self._catalog_fp: tuple[Any, ...] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self._next_margin_window: int | None = None
        # Plain counters for metrics.
        self.completes = 0
        self.duplicates = 0
        self.unpriced = 0
        self._unpriced_warned: set[tuple[str, str]] = set()  # (tenant, model), bounded
        self.margin_warnings_total = 0
        self.last_margin_tenants = 0
        self.window_flush_failures = 0

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Replay the spool, load the catalog and the stored windows; start
        the background loops."""
        await self.writer.start()
        try:
            await self.reload_catalog()
        except Exception as exc:
            log.warning("price catalog not loaded; pricing at zero until it is", error=str(exc))
        index = self.pricing.window_index(self.clock())
        try:
            rows = await asyncio.to_thread(
                self.store.load_windows, self.pricing.window_start_s(index - 1)
            )
            self.pricing.restore(rows)
        except Exception as exc:
            log.warning("pricing windows not restored", error=str(exc))
        self._next_margin_window = index - 1  # re-check the window a restart cut
        self._stopping = asyncio.Event()
        self._tasks = [asyncio.create_task(self._background(), name="ledger-background")]

    async def stop(self) -> None:
        for settling in list(self._inflight.values()):
            with contextlib.suppress(Exception):
                await asyncio.shield(settling)
        # Let the background loop finish its step (a thread mid-query would
        # otherwise hand its connection back to a disposed pool).
        self._stopping.set()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.writer.stop()
        with contextlib.suppress(Exception):
            await self.flush_windows()
        # (a takeover rebuild cancelled by the server's stop may still hold one)
        await dispose_when_idle(self.engine, "ledger")

    def _db_state(self, ok: bool) -> None:
        if self._on_health is not None:
            self._on_health(ok)

    @property
    def healthy(self) -> bool:
        return self.writer.db_ok

    # -------------------------------------------------------------- complete

    async def complete(
        self,
        tenant_id: str,
        request_id: str,
        reservation_id: int,
        prompt_tokens: int,
        generated_tokens: int,
        cached_prompt_tokens: int = 0,
        kv_cache_miss_rate: float = 0.0,
        *,
        miss_rate_reported: bool | None = None,
        exec_start_ns: int = 0,
        exec_end_ns: int = 0,
        first_token_ns: int = 0,
        correlation_id: str = "",
    ) -> CompleteResult:
        """Settle and record one request (the module docstring); ``miss_rate_reported``
        None means "reported when non-zero"; times were checked by ``check_exec_times``;
        ``correlation_id``: the caller's own id, recorded as it is ("" = none)."""
        key = (tenant_id, request_id)
        running = self._inflight.get(key)
        if running is not None:
            result = await asyncio.shield(running)
            self.duplicates += 1
            return result.as_duplicate()
        try:
            prepared = self.svc.settlement.prepare(
                tenant_id, request_id, reservation_id, prompt_tokens, generated_tokens,
                cached_prompt_tokens, kv_cache_miss_rate,
            )  # fmt: skip
        except NotFound:
            found = await self.find_admission(key, reservation_id)
            if found is None:
                raise
            self.duplicates += 1
            return CompleteResult(_settlement_of(found), found, duplicate=True)
        if isinstance(prepared, Settlement):
            self.duplicates += 1
            rec = self.svc.views.record(tenant_id, request_id)
            found = await self.find_admission(key, rec.rid if rec is not None else 0)
            return CompleteResult(prepared, found, duplicate=True)
        reported = kv_cache_miss_rate > 0 if miss_rate_reported is None else miss_rate_reported
        record = self.build_record(
            key, prepared, prompt_tokens, cached_prompt_tokens, generated_tokens,
            kv_cache_miss_rate if reported else None, exec_start_ns, exec_end_ns,
            correlation_id,
        )  # fmt: skip
        task = asyncio.create_task(
            self._settle(key, prepared, record, prompt_tokens + generated_tokens, first_token_ns)
        )
        self._inflight[key] = task
        task.add_done_callback(lambda t: self._done(key, t))
        return await asyncio.shield(task)

    def _done(self, key: Key, task: asyncio.Task[CompleteResult]) -> None:
        self._inflight.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved here too: the caller may have gone

    async def _settle(
        self, key: Key, prepared: RecordView, record: LedgerRecord, actual: int, first: int
    ) -> CompleteResult:
        record, outcome = await self._book(record)
        settlement = self.svc.settlement.apply(key, prepared, actual, first_token_ns=first)
        if outcome is Outcome.EXISTS:
            original = record
            log.warning(
                "this admission is in the ledger already; the stored record stands",
                tenant_id=key[0],
                request_id=record.request_id,
                reservation_id=record.reservation_id,
            )
            self.duplicates += 1
            return CompleteResult(
                Settlement(key[1], settlement.reserved_tokens, settlement.actual_tokens,
                           settlement.refunded_tokens, True),
                original,
                duplicate=True,
            )  # fmt: skip
        self.completes += 1
        # In the quota counters now (apply_complete): a rebuild must not add it.
        self.usage.settled(key[0], record.pool, actual, record.settled_ns, self.clock())
        self.svc.stats.count_spend(  # per-tenant spend metrics
            prepared, record.currency, record.user_charge_nanos, record.actual_cost_nanos
        )
        if record.miss_rate_source == "request" and self.windows.fencing(record.pool) is not None:
            # (not owned here: the owner's windows measure the pool)
            self.pricing.observe_completion(
                record.pool, record.model, record.prompt_tokens,
                int(record.kv_cache_miss_rate * PPM), record.settled_ns,
            )  # fmt: skip
        self._remember(record)
        return CompleteResult(settlement, record, duplicate=False)

    async def _book(self, record: LedgerRecord) -> tuple[LedgerRecord, Outcome]:
        """Make ``record`` durable under the key of its own admission: the
        request id, or, when the ledger holds that id for another admission
        (an id admitted again once the settled one was forgotten,
        ``settled_id_window_s``), ``rebooked_id`` (docs/ledger.md, "A
        reused request id"). Returns the record as stored and how: EXISTS
        with the stored record when its admission is in the ledger already
        (a repeated Complete). Raises LedgerUnavailable as the writer and
        ``find`` do, before anything is written for a rebooked key."""
        base = record.request_id
        for n in range(REBOOK_KEYS + 1):
            if n:
                record = record._replace(
                    request_id=rebooked_id(base, record.reservation_id, n)
                )
            stored = self._known(record.key)
            if stored is None:
                outcome = await self.writer.submit(record)
                if outcome is not Outcome.EXISTS:
                    return record, outcome
                stored = await self.find(record.key)
                if stored is None:  # (gone again: retention) as the writer said
                    return record, outcome
            if stored.reservation_id == record.reservation_id:
                return stored, Outcome.EXISTS
        raise LedgerUnavailable(
            f"request_id: {excerpt(base)} and the {REBOOK_KEYS} keys derived from it are "
            "all in the ledger under other admissions; nothing was recorded"
        )

    def _known(self, key: Key) -> LedgerRecord | None:
        """The record of ``key`` this plane wrote or spooled lately (no I/O)."""
        row = self._recent.get(key)
        if row is None:
            row = self.writer.pending.get(key)
        return None if row is None else LedgerRecord._make(row)

    def _remember(self, record: LedgerRecord) -> None:
        self._recent[record.key] = tuple(record)
        if len(self._recent) > RECENT_LIMIT:
            self._recent.popitem(last=False)

    def build_record(
        self,
        key: Key,
        rec: RecordView,
        prompt_tokens: int,
        cached_tokens: int,
        output_tokens: int,
        miss_rate: float | None,
        exec_start_ns: int,
        exec_end_ns: int,
        correlation_id: str = "",
    ) -> LedgerRecord:
        """Both ledgers of one request (pure: reads memory, changes nothing)."""
        now = self.clock()
        tenant_id, request_id = key
        lane, pool, model = rec.lane, rec.pool, rec.model
        if miss_rate is not None:
            miss_ppm, source = rate_ppm(miss_rate), "request"
        else:
            window_rate = self.pricing.current_rate_ppm(pool, model, now)
            miss_ppm, source = (0, "none") if window_rate is None else (window_rate, "window")
        miss = ppm_decimal(miss_ppm)
        price = self.catalog.resolve(tenant_id, model)
        if price is None:
            self.unpriced += 1
            self._warn_unpriced(tenant_id, model)
            price = zero_price(self.settings.ledger_default_currency)
        multiplier = self.pricing.multiplier_decimal(rec.multiplier)
        lane_multiplier = price.lane_multiplier(lane)
        user = user_charge(
            price, prompt_tokens, cached_tokens, output_tokens, multiplier, lane_multiplier
        )
        cost = actual_cost(price, prompt_tokens, output_tokens, miss)
        arrival = rec.arrived_ns
        return LedgerRecord(
            tenant_id=tenant_id,
            request_id=request_id,
            reservation_id=rec.rid,
            lane=lane,
            model=model,
            pool=pool,
            arrival_ns=arrival,
            queue_start_ns=arrival,
            exec_start_ns=exec_start_ns or rec.decided_ns,
            end_ns=exec_end_ns or now,
            settled_ns=now,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            output_tokens=output_tokens,
            reserved_tokens=rec.reserved,
            kv_cache_miss_rate=miss,
            miss_rate_source=source,
            pricing_multiplier=multiplier,
            pricing_window=rec.window,
            lane_multiplier=lane_multiplier,
            currency=price.currency,
            user_charge_nanos=to_nanos(user),
            actual_cost_nanos=to_nanos(cost),
            price_id=price.id,
            correlation_id=correlation_id or None,
        )

    async def find_admission(self, key: Key, reservation_id: int) -> LedgerRecord | None:
        """The ledger record of ``key``'s admission ``reservation_id`` (0 =
        whichever has the request id): under the request id, or under
        the key ``_book`` derived for it. Raises as ``find``."""
        found = await self.find(key)
        n = 0
        while (
            found is not None and reservation_id and found.reservation_id != reservation_id
            and n < REBOOK_KEYS
        ):  # fmt: skip
            n += 1
            found = await self.find((key[0], rebooked_id(key[1], reservation_id, n)))
        return found

    async def find(self, key: Key) -> LedgerRecord | None:
        """The ledger record of ``key``: recent cache, spool, then database.
        Raises LedgerUnavailable if the database cannot be asked."""
        row = self._recent.get(key)
        if row is not None:
            return LedgerRecord._make(row)
        rec = self.writer.pending_record(key)
        if rec is not None:
            return rec
        try:
            # Bounded like a ledger write: a hung database answers "retry
            # later", not after the outage.
            return await within(
                asyncio.to_thread(self.store.fetch, key), self.writer.db_timeout_s
            )
        except Exception as exc:
            raise LedgerUnavailable(
                f"request_id: cannot look {excerpt(key[1])} up in the ledger "
                f"({type(exc).__name__}); retry later"
            ) from exc

    # -------------------------------------------------------------- prices

    def check_priced(self, tenant_id: str, model: str) -> None:
        """The service's ``price_check`` with BURSTGATE_LEDGER_UNPRICED=refuse:
        FailedPrecondition naming ``model`` when the catalog cannot price
        this (tenant, model). A dict lookup (memoised)."""
        if self.catalog.resolve(tenant_id, model) is None:
            raise FailedPrecondition(
                f"model: no price for tenant {excerpt(tenant_id)} and model "
                f"{excerpt(model) if model else repr('')} in the price catalog, and no default "
                "('*', '*') price; unpriced requests are refused "
                "(BURSTGATE_LEDGER_UNPRICED=refuse)"
            )

    def _warn_unpriced(self, tenant_id: str, model: str) -> None:
        """Loud, once per (tenant, model): a record booked at 0."""
        key = (tenant_id[:128], model[:128])
        if key in self._unpriced_warned or len(self._unpriced_warned) >= 1024:
            return
        self._unpriced_warned.add(key)
        log.warning(
            "unpriced request booked at 0: the price catalog has no price for this tenant "
            "and model, and no default ('*', '*') price (burstgate_ledger_unpriced_records_total "
            "counts them; BURSTGATE_LEDGER_UNPRICED=refuse refuses them at Admit)",
            tenant_id=key[0], model=key[1],
        )  # fmt: skip

    # ----------------------------------------------------------- background

    async def reload_catalog(self) -> bool:
        fp = await asyncio.to_thread(self.store.catalog_fingerprint)
        if fp == self._catalog_fp:
            return False
        entries = await asyncio.to_thread(self.store.load_catalog)
        self.catalog = PriceCatalog(entries)
        self._catalog_fp = fp
        self._unpriced_warned.clear()  # a new catalog: warn again of what it leaves unpriced
        log.info("price catalog loaded", entries=len(entries))
        for gap in pricing_gaps(self.catalog, self.svc.views.tenant_ids()):
            log.warning("PRICING GAP: " + gap, unpriced=self.settings.ledger_unpriced)
        return True

    async def _background(self) -> None:
        last_catalog = last_flush = 0.0
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await within(self._stopping.wait(), 0.25)
            if self._stopping.is_set():
                return
            mono = time.monotonic()
            if mono - last_catalog >= self.settings.config_poll_s:
                last_catalog = mono
                try:
                    await self.reload_catalog()
                except Exception as exc:
                    log.warning("price catalog poll failed; keeping the last one", error=str(exc))
            if mono - last_flush >= FLUSH_INTERVAL_S:
                last_flush = mono
                await self.flush_windows()
                with contextlib.suppress(LedgerUnavailable):
                    await self.close_margin_windows()

    async def flush_windows(self) -> None:
        """Store closed windows and the open ones as they stand, each pool's
        under its cell's lease (fencing.py)."""
        batches = self.windows.plan(self.pricing.snapshot(self.clock()))
        result = await asyncio.to_thread(self.windows.write, batches)
        retry = self.windows.settle(result)
        if result.error is not None:
            self.window_flush_failures += 1
            # Keep the closed ones for the next attempt (bounded).
            self.pricing.closed[:0] = retry[-100_000:]
            log.warning("pricing windows not saved; will retry", error=str(result.error))

    # -------------------------------------------------------------- scale-out

    async def take_over(self, pools: Iterable[str]) -> Rebuilt:
        """This replica now owns ``pools`` (its coordinator's ``on_acquired``
        for their cell): continue their pricing windows and count the quota
        usage the ledger holds for them. Idempotent; raises if the database
        cannot be read (nothing of those pools is written until it ran)."""
        return await take_over(self, pools)

    def release_pools(self, pools: Iterable[str]) -> None:
        """This replica no longer owns ``pools`` (``on_lost``): their windows
        are dropped, and none of their rows is written."""
        self.windows.forget(pools)

    async def rebuild_usage(self, pools: Iterable[str] | None = None) -> tuple[int, int, int]:
        """Quota usage from the ledger (of ``pools``, or all): at start, and
        in ``take_over``; (tenants, hour tokens, day tokens) added."""
        return await rebuild_usage(self, pools)

    async def close_margin_windows(self) -> list[MarginWarning]:
        """Check every ended window not checked yet, once every record settled
        in it is in the database (nothing in flight, queued or spooled)."""
        if self._next_margin_window is None:
            return []
        current = self.pricing.window_index(self.clock())
        found: list[MarginWarning] = []
        while self._next_margin_window < current:
            if self._inflight or self.writer.busy:
                break
            w = self._next_margin_window
            found.extend(await self.check_window(w))
            self._next_margin_window = w + 1
        return found

    async def check_window(self, index: int) -> list[MarginWarning]:
        warnings = await check_window(
            self.store, self.settings.pricing_window_s, self.settings.margin_warning_ratio,
            index, self.clock(),
        )  # fmt: skip
        self.margin_warnings_total += len(warnings)
        self.last_margin_tenants = len({w.tenant_id for w in warnings})
        return warnings

    def margin_report(self, start_ns: int, end_ns: int, tenants: list[str]) -> list[Any]:
        """On demand, over any period (blocking: call in a thread)."""
        return margin_report(self.store, self.settings.margin_warning_ratio, start_ns, end_ns,
                             tenants)  # fmt: skip


def _settlement_of(r: LedgerRecord) -> Settlement:
    actual = r.prompt_tokens + r.output_tokens
    return Settlement(
        r.request_id, r.reserved_tokens, actual, max(0, r.reserved_tokens - actual), True
    )
