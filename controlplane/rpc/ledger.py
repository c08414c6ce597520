"""burstgate.v1.LedgerService: protobuf <-> metering. Authentication is the
server interceptor's (controlplane/rpc/interceptor.py): any service other
than admission needs an admin or viewer key, viewers Get*/List* only."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import grpc
import structlog
from burstgate_client._proto.burstgate.v1 import ledger_pb2 as lpb
from burstgate_client._proto.burstgate.v1 import ledger_pb2_grpc as lpb_grpc

from controlplane.domain.catalog import PRICE_FIELDS, PriceEntry, parse_lane_multipliers
from controlplane.domain.errors import (
    DatabaseUnavailable,
    DomainError,
    InvalidArgument,
    NotFound,
    excerpt,
)
from controlplane.domain.ledger_records import LedgerRecord
from controlplane.domain.money import format_fixed, format_nanos, ppm_decimal
from controlplane.domain.units import NS_PER_S
from controlplane.ledger.export import (
    ExportResult,
    ExportSpec,
    export,
    manifest_json,
)
from controlplane.ledger.metering import Metering
from controlplane.ledger.usage import usage
from controlplane.rpc.auth import current_actor
from controlplane.rpc.convert import MISS_RATE_SOURCE
from controlplane.rpc.dbcall import DbCaller
from controlplane.rpc.errors import abort, error_status, internal_status, unary_errors

_FORMATS = {0: "csv", 1: "csv", 2: "jsonl", 3: "parquet"}
_GRANULARITY = {0: "request", 1: "request", 2: "daily"}
T = TypeVar("T")
log = structlog.get_logger("burstgate.ledger.rpc")
MS_PER_S = 1000  # window lengths are kept in seconds, sent in ms (every duration on the wire is)


def record_to_pb(r: LedgerRecord) -> lpb.LedgerRecord:
    return lpb.LedgerRecord(
        tenant_id=r.tenant_id,
        request_id=r.request_id,
        reservation_id=r.reservation_id,
        lane=r.lane,
        model=r.model,
        pool=r.pool,
        arrival_unix_ns=r.arrival_ns,
        queue_start_unix_ns=r.queue_start_ns,
        exec_start_unix_ns=r.exec_start_ns,
        end_unix_ns=r.end_ns,
        settled_unix_ns=r.settled_ns,
        prompt_tokens=r.prompt_tokens,
        cached_tokens=r.cached_tokens,
        output_tokens=r.output_tokens,
        reserved_tokens=r.reserved_tokens,
        kv_cache_miss_rate=format_fixed(r.kv_cache_miss_rate, 6),
        miss_rate_source=MISS_RATE_SOURCE[r.miss_rate_source],
        pricing_multiplier=format_fixed(r.pricing_multiplier, 6),
        pricing_window=r.pricing_window,
        lane_multiplier=format_fixed(r.lane_multiplier, 6),
        currency=r.currency,
        user_charge=format_nanos(r.user_charge_nanos),
        actual_cost=format_nanos(r.actual_cost_nanos),
        price_id=r.price_id,
        correlation_id=r.correlation_id or "",
    )


def price_to_pb(e: PriceEntry) -> lpb.Price:
    return lpb.Price(
        tenant_id=e.tenant_id,
        model=e.model,
        currency=e.currency,
        lane_multipliers={k: str(v) for k, v in sorted(e.lane_multipliers.items())},
        id=e.id,
        **{name: str(getattr(e, name)) for name in PRICE_FIELDS},
    )


def price_from_pb(p: lpb.Price) -> PriceEntry:
    from controlplane.domain.catalog import validate_entry
    from controlplane.domain.money import MAX_PRICE, PRICE_DECIMALS, parse_decimal

    prices = {
        name: parse_decimal(
            name, getattr(p, name) or "0", decimals=PRICE_DECIMALS, maximum=MAX_PRICE
        )
        for name in PRICE_FIELDS
    }
    lanes = parse_lane_multipliers(f"{k}={v}" for k, v in sorted(p.lane_multipliers.items()))
    return validate_entry(
        PriceEntry(
            tenant_id=p.tenant_id or "*",
            model=p.model or "*",
            currency=p.currency or "USD",
            input_per_mtok=prices["input_per_mtok"],
            cached_input_per_mtok=prices["cached_input_per_mtok"],
            output_per_mtok=prices["output_per_mtok"],
            gpu_prefill_per_mtok=prices["gpu_prefill_per_mtok"],
            gpu_decode_per_mtok=prices["gpu_decode_per_mtok"],
            gpu_overhead_per_request=prices["gpu_overhead_per_request"],
            lane_multipliers=lanes,
        )
    )


class LedgerServicer(lpb_grpc.LedgerServiceServicer):
    def __init__(
        self,
        metering: Metering,
        clock: Callable[[], int] = time.time_ns,
        db: DbCaller | None = None,
    ) -> None:
        self.m = metering
        self.clock = clock
        # Every database call: bounded, UNAVAILABLE past it (rpc/dbcall.py).
        self.db = db or DbCaller(metering.settings.operator_db_timeout_s)

    def _period(self, start: int, end: int) -> tuple[int, int]:
        end = end or self.clock()
        if start < 0:
            raise InvalidArgument("start_unix_ns", "must be >= 0 (1970-01-01)")
        if end <= start:
            raise InvalidArgument("end_unix_ns", "the period must be non-empty (end after start)")
        return start, end

    async def _db(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.db.run(fn, *args)

    # ----------------------------------------------------------------- export

    async def ExportLedger(
        self, request: lpb.ExportLedgerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[lpb.ExportLedgerChunk]:
        try:
            start, end = self._period(request.start_unix_ns, request.end_unix_ns)
            spec = ExportSpec(
                start, end, tuple(request.tenant_ids),
                _FORMATS.get(int(request.format), "?"),
                _GRANULARITY.get(int(request.granularity), "?"),
            ).validate()  # fmt: skip
        except DomainError as exc:
            await abort(context, error_status(exc))
        result = ExportResult()
        chunks: Iterator[bytes] = export(self.m.engine, spec, result)
        done = object()
        hung = False
        try:
            while True:
                # One chunk per thread hop: the event loop never waits on SQL;
                # each hop is bounded (a hung database ends the export
                # UNAVAILABLE instead of holding it open).
                try:
                    data = await self.db.run(next, chunks, done)
                except DatabaseUnavailable:
                    hung = True
                    raise
                if data is done:
                    break
                assert isinstance(data, bytes)
                yield lpb.ExportLedgerChunk(data=data)
        except DomainError as exc:
            await abort(context, error_status(exc))
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("export failed")
            await abort(context, internal_status())
        finally:
            if not hung:  # else its thread may still be inside next(): leave it be
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(chunks.close)  # type: ignore[attr-defined]
        yield lpb.ExportLedgerChunk(manifest_json=manifest_json(result))

    # ---------------------------------------------------------------- queries

    @unary_errors
    async def GetLedgerRecord(
        self, request: lpb.GetLedgerRecordRequest, context: grpc.aio.ServicerContext
    ) -> lpb.LedgerRecord:
        rec = await self.m.find((request.tenant_id, request.request_id))
        if rec is None:
            raise NotFound(
                "request_id",
                f"no ledger record for tenant {excerpt(request.tenant_id)} "
                f"request {excerpt(request.request_id)}",
            )
        return record_to_pb(rec)

    @unary_errors
    async def GetUsage(
        self, request: lpb.GetUsageRequest, context: grpc.aio.ServicerContext
    ) -> lpb.GetUsageResponse:
        start, end = self._period(request.start_unix_ns, request.end_unix_ns)
        rows, totals = await self._db(usage, self.m.engine, start, end, list(request.tenant_ids))
        return lpb.GetUsageResponse(
            rows=[lpb.UsageRow(**r) for r in rows],
            totals=[lpb.CurrencyTotals(**t) for t in totals],
        )

    @unary_errors
    async def ListMarginWarnings(
        self, request: lpb.ListMarginWarningsRequest, context: grpc.aio.ServicerContext
    ) -> lpb.ListMarginWarningsResponse:
        start, end = self._period(request.start_unix_ns, request.end_unix_ns)
        if request.limit < 0:  # (SQL refuses a negative LIMIT)
            raise InvalidArgument("limit", f"must be >= 0 (0 = 1000), got {request.limit}")
        found = await self._db(
            self.m.store.list_margin_warnings,
            start // NS_PER_S,
            -(-end // NS_PER_S),
            list(request.tenant_ids),
            request.limit or 1000,
        )
        return lpb.ListMarginWarningsResponse(
            warnings=[
                lpb.MarginWarning(
                    tenant_id=w.tenant_id,
                    window_start=w.window_start,
                    window_ms=w.window_s * MS_PER_S,
                    currency=w.currency,
                    requests=w.requests,
                    user_charge=format_nanos(w.user_charge_nanos),
                    actual_cost=format_nanos(w.actual_cost_nanos),
                    ratio=str(w.ratio),
                )
                for w in found
            ]
        )

    @unary_errors
    async def GetMarginReport(
        self, request: lpb.GetMarginReportRequest, context: grpc.aio.ServicerContext
    ) -> lpb.GetMarginReportResponse:
        start, end = self._period(request.start_unix_ns, request.end_unix_ns)
        report = await self._db(self.m.margin_report, start, end, list(request.tenant_ids))
        return lpb.GetMarginReportResponse(
            ratio=str(self.m.settings.margin_warning_ratio),
            tenants=[
                lpb.TenantMargin(
                    tenant_id=s.tenant_id,
                    currency=s.currency,
                    requests=s.requests,
                    user_charge=format_nanos(s.user_charge_nanos),
                    actual_cost=format_nanos(s.actual_cost_nanos),
                    warning=warn,
                )
                for s, warn in report
            ],
        )

    @unary_errors
    async def ListPricingWindows(
        self, request: lpb.ListPricingWindowsRequest, context: grpc.aio.ServicerContext
    ) -> lpb.ListPricingWindowsResponse:
        start, end = self._period(request.start_unix_ns, request.end_unix_ns)
        await self.m.flush_windows()
        rows = await self._db(
            self.m.store.load_windows, start // NS_PER_S, -(-end // NS_PER_S), request.pool
        )
        return lpb.ListPricingWindowsResponse(
            windows=[
                lpb.PricingWindow(
                    pool=w.pool,
                    model=w.model,
                    window_start=w.window_start_s,
                    window_ms=w.window_s * MS_PER_S,
                    completions=w.completions,
                    load_reports=w.load_reports,
                    miss_rate=""
                    if w.miss_rate_ppm is None
                    else format_fixed(ppm_decimal(w.miss_rate_ppm), 6),
                    multiplier=format_fixed(w.multiplier, 6),
                    next_multiplier=format_fixed(w.next_multiplier, 6),
                    closed=w.closed,
                )
                for w in rows
            ]
        )

    @unary_errors
    async def GetPricing(
        self, request: lpb.GetPricingRequest, context: grpc.aio.ServicerContext
    ) -> lpb.PricingState:
        book = self.m.pricing
        return lpb.PricingState(
            window_ms=book.window_s * MS_PER_S,
            steps=[
                lpb.PricingStep(above_miss_rate=str(t), multiplier=str(m))
                for t, m in self.m.settings.pricing_steps
            ],
            in_force=[
                lpb.MultiplierInForce(
                    pool=p,
                    model=model,
                    multiplier=format_fixed(m, 6),
                    previous_window_miss_rate="" if r is None else format_fixed(ppm_decimal(r), 6),
                )
                for p, model, m, r in book.in_force()
            ],
            margin_warning_ratio=str(self.m.settings.margin_warning_ratio),
        )

    # ---------------------------------------------------------------- catalog

    @unary_errors
    async def ListPrices(
        self, request: lpb.ListPricesRequest, context: grpc.aio.ServicerContext
    ) -> lpb.ListPricesResponse:
        entries = await self._db(self.m.store.load_catalog)
        return lpb.ListPricesResponse(prices=[price_to_pb(e) for e in entries])

    @unary_errors
    async def SetPrice(
        self, request: lpb.SetPriceRequest, context: grpc.aio.ServicerContext
    ) -> lpb.Price:
        entry = price_from_pb(request.price)
        saved = await self._db(self.m.store.upsert_price, entry, current_actor())
        await self.m.reload_catalog()
        return price_to_pb(saved)

    @unary_errors
    async def DeletePrice(
        self, request: lpb.DeletePriceRequest, context: grpc.aio.ServicerContext
    ) -> lpb.DeletePriceResponse:
        deleted = await self._db(
            self.m.store.delete_price, request.tenant_id or "*", request.model or "*",
            current_actor(),
        )  # fmt: skip
        if not deleted:
            raise NotFound(
                "tenant_id", f"no price for {excerpt(request.tenant_id)} / {excerpt(request.model)}"
            )
        await self.m.reload_catalog()
        return lpb.DeletePriceResponse(deleted=True)

    # ----------------------------------------------------------------- status

    @unary_errors
    async def GetLedgerStatus(
        self, request: lpb.GetLedgerStatusRequest, context: grpc.aio.ServicerContext
    ) -> lpb.LedgerStatus:
        w = self.m.writer
        return lpb.LedgerStatus(
            enabled=True,
            database_ok=w.db_ok,
            spool_bytes=self.m.spool.bytes,
            spool_max_bytes=self.m.spool.max_bytes,
            spool_records=len(w.pending),
            queued=w.queued,
            written=w.stats.written,
            spooled=w.stats.spooled,
            replayed=w.stats.replayed,
            rejected_spool_full=w.stats.rejected_spool_full,
            last_error=w.stats.last_error,
            spool_dir=str(self.m.spool.directory),
        )
