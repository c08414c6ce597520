"""Pricing windows over gRPC with an injected clock, margin warnings, and
the operators' LedgerService (authenticated like AdminService)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import ledger_pb2 as lpb
from burstgate_client._proto.burstgate.v1 import ledger_pb2_grpc as lpb_grpc
from burstgate_client.admin import authenticated_channel
from burstgate_client.protoclient import pb

from controlplane.domain.keys import Role
from tests.integration.ledger.conftest import NS, Served, admin_key, complete, rpc_code
from tests.support import wait_until

WINDOW_NS = 300 * NS


def _to_boundary(clock: Any) -> int:
    """Advance the fake clock to the start of the next pricing window."""
    nxt: int = (clock() // WINDOW_NS + 1) * WINDOW_NS
    clock.advance(nxt - clock())
    return nxt


def test_multiplier_switches_exactly_at_the_window_boundary(served: Served, clock: Any) -> None:
    c = served.client
    start = _to_boundary(clock)
    # Window k: a miss rate of 0.5 measured from completions (> 0.30).
    c.admit("acme", "a", prompt_tokens=100, max_tokens=10, model="m", pool="p")
    complete(c, "acme", "a", prompt_tokens=100, generated_tokens=10, kv_cache_miss_rate=0.5)
    clock.advance(WINDOW_NS - 1)  # the last nanosecond of window k: still 1.0
    last = c.admit("acme", "b", prompt_tokens=100, max_tokens=10, model="m", pool="p")
    assert last.pricing_multiplier == "1.000000"
    clock.advance(1)  # window k+1 starts: the multiplier window k's rate set
    first = c.admit("acme", "c", prompt_tokens=100, max_tokens=10, model="m", pool="p")
    assert first.pricing_multiplier == "1.200000"
    other = c.admit("acme", "o", prompt_tokens=1, max_tokens=1, model="other", pool="p")
    assert other.pricing_multiplier == "1.000000"  # per pool *and* model
    # Locked at admission: "b" was admitted at 1.0 and is billed at 1.0 now.
    rb = complete(c, "acme", "b", prompt_tokens=100, generated_tokens=10)
    rc = complete(c, "acme", "c", prompt_tokens=100, generated_tokens=10)
    assert rb.pricing_multiplier == "1.000000" and rc.pricing_multiplier == "1.200000"
    assert rb.pricing_window == start // NS and rc.pricing_window == start // NS + 300
    from decimal import Decimal

    assert Decimal(rc.user_charge) == Decimal(rb.user_charge) * Decimal("1.2")
    # "b" did not report a miss rate: the pool's current window rate was used.
    assert rb.miss_rate_source == pb.MISS_RATE_SOURCE_WINDOW
    # Window k+1 measured nothing (no reported rates, no load): k+2 is back to 1.0.
    clock.advance(WINDOW_NS)
    assert c.admit("acme", "d", prompt_tokens=1, max_tokens=1, model="m", pool="p")\
        .pricing_multiplier == "1.000000"  # fmt: skip


def test_load_reports_feed_the_pool_window(served: Served, clock: Any) -> None:
    c = served.client
    _to_boundary(clock)
    for engine in ("e1", "e2"):
        c.report_load(
            pb.LoadReport(
                pool="gpu",
                engine_id=engine,
                batch_tokens=1,
                max_batch_tokens=10,
                queue_depth=0,
                queue_capacity=10,
                kv_cache_miss_rate=0.4,
                gpu_utilization=0.5,
            )
        )
    clock.advance(WINDOW_NS)
    d = c.admit("acme", "x", prompt_tokens=1, max_tokens=1, model="any", pool="gpu")
    assert d.pricing_multiplier == "1.200000"
    # Windows are stored.
    windows = (
        served.ledger()
        .ListPricingWindows(
            lpb.ListPricingWindowsRequest(pool="gpu", start_unix_ns=clock() - 2 * WINDOW_NS),
            timeout=10,
        )
        .windows
    )
    closed = [w for w in windows if w.closed]
    assert closed and closed[0].miss_rate == "0.400000"
    assert closed[0].next_multiplier == "1.200000"
    assert closed[0].load_reports == 2 and closed[0].window_ms == 300_000


def test_margin_warning_per_window_and_on_demand(served: Served, clock: Any) -> None:
    c = served.client
    start = _to_boundary(clock)
    # acme: price 2/M input, 8/M output; cost 1/M prefill x (1 + miss/2), 4/M decode
    # + 0.0001 per request: tiny requests are dominated by the overhead.
    for i in range(3):
        c.admit("acme", f"s{i}", prompt_tokens=1, max_tokens=1)
        complete(c, "acme", f"s{i}", prompt_tokens=1, generated_tokens=1)
    clock.advance(WINDOW_NS)
    m = served.srv.plane.metering
    found = served.srv.on_loop(lambda: asyncio.ensure_future(m.close_margin_windows()))
    warnings = asyncio.run_coroutine_threadsafe(_wait(found), served.srv.loop).result(10)
    assert [(w.tenant_id, w.window_start) for w in warnings] == [("acme", start // NS)]
    listed = (
        served.ledger()
        .ListMarginWarnings(lpb.ListMarginWarningsRequest(start_unix_ns=start), timeout=10)
        .warnings
    )
    assert [(w.tenant_id, w.currency, w.requests, w.window_ms) for w in listed] == [
        ("acme", "USD", 3, 300_000)
    ]
    report = served.ledger().GetMarginReport(
        lpb.GetMarginReportRequest(start_unix_ns=start - WINDOW_NS), timeout=10
    )
    assert [(t.tenant_id, t.warning) for t in report.tenants] == [("acme", True)]
    assert report.ratio == "1.15"


def test_list_margin_warnings_refuses_a_negative_limit(served: Served) -> None:
    """Found by tests/integration/fuzz: a negative limit reached SQL (LIMIT
    must not be negative) and answered INTERNAL."""
    with pytest.raises(grpc.RpcError) as err:
        served.ledger().ListMarginWarnings(lpb.ListMarginWarningsRequest(limit=-1), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("limit")
    assert (
        not served.ledger()
        .ListMarginWarnings(lpb.ListMarginWarningsRequest(limit=0), timeout=10)
        .warnings
    )


async def _wait(fut: Any) -> Any:
    return await fut


def test_ledger_service_needs_an_operator_key(served: Served) -> None:
    anonymous = lpb_grpc.LedgerServiceStub(grpc.insecure_channel(served.srv.target))
    code = rpc_code(lambda: anonymous.GetLedgerStatus(lpb.GetLedgerStatusRequest(), timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    status = served.ledger().GetLedgerStatus(lpb.GetLedgerStatusRequest(), timeout=5)
    assert status.enabled and status.database_ok and status.spool_bytes == 0


def _unless_unauthenticated(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            return None
        raise


def test_a_viewer_may_read_and_export_but_not_change_prices(served: Served) -> None:
    # What ledger.proto promises: Get*/List*/Export* for viewers, writes for admins.
    channel = authenticated_channel(served.srv.target, admin_key(served.url, Role.VIEWER))
    viewer = lpb_grpc.LedgerServiceStub(channel)
    # The key was written a moment ago: the server learns it on its next key
    # re-read (forced by the first call, bounded in time). On a loaded host
    # that re-read can outlast the first call's wait, so the roles are
    # checked once the key is known, not on how fast it became known.
    list_prices = lambda: viewer.ListPrices(lpb.ListPricesRequest(), timeout=5)  # noqa: E731
    prices = wait_until(
        lambda: _unless_unauthenticated(list_prices),
        message="the server to know the new viewer key",
    )
    assert prices.prices
    chunks = list(viewer.ExportLedger(lpb.ExportLedgerRequest(), timeout=10))
    assert chunks and chunks[-1].manifest_json
    set_price = lpb.SetPriceRequest(price=lpb.Price(tenant_id="beta", currency="GBP"))
    assert rpc_code(lambda: viewer.SetPrice(set_price, timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    delete = lpb.DeletePriceRequest(tenant_id="acme")
    assert rpc_code(lambda: viewer.DeletePrice(delete, timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )


def test_complete_names_the_wire_field_of_bad_exec_times(served: Served) -> None:
    c = served.client
    c.admit("acme", "t", prompt_tokens=10, max_tokens=10)
    with pytest.raises(grpc.RpcError) as err:
        complete(c, "acme", "t", prompt_tokens=10, generated_tokens=1,
                 exec_start_unix_ns=2 * NS, exec_end_unix_ns=NS)  # fmt: skip
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("exec_end_unix_ns")
    # nothing was settled: the right times are accepted afterwards
    assert not complete(c, "acme", "t", prompt_tokens=10, generated_tokens=1).duplicate


def test_prices_records_and_usage_through_the_api(served: Served, clock: Any) -> None:
    ledger = served.ledger()
    price = ledger.SetPrice(
        lpb.SetPriceRequest(
            price=lpb.Price(
                tenant_id="beta", model="*", currency="GBP", input_per_mtok="1",
                cached_input_per_mtok="0.1", output_per_mtok="3", gpu_prefill_per_mtok="0.5",
                gpu_decode_per_mtok="1", gpu_overhead_per_request="0",
                lane_multipliers={"premium": "2"},
            )
        ),
        timeout=10,
    )  # fmt: skip
    assert price.id > 0 and price.currency == "GBP"
    code = rpc_code(
        lambda: ledger.SetPrice(
            lpb.SetPriceRequest(price=lpb.Price(tenant_id="beta", currency="gbp")), timeout=5
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    c = served.client
    c.admit("beta", "b1", prompt_tokens=1_000_000, max_tokens=1_000_000)
    r = complete(c, "beta", "b1", prompt_tokens=1_000_000, generated_tokens=1_000_000)
    assert (r.currency, r.user_charge) == ("GBP", "4.000000000")
    rec = ledger.GetLedgerRecord(
        lpb.GetLedgerRecordRequest(tenant_id="beta", request_id="b1"), timeout=5
    )
    assert rec.user_charge == "4.000000000" and rec.price_id == price.id
    # No rate reported and none measured for the pool: the enum, not text.
    assert rec.miss_rate_source == pb.MISS_RATE_SOURCE_NONE
    clock.advance(1)  # periods are half-open: [start, end)
    usage = ledger.GetUsage(lpb.GetUsageRequest(start_unix_ns=clock() - NS), timeout=5)
    assert [(u.tenant_id, u.currency, u.requests) for u in usage.rows] == [("beta", "GBP", 1)]
    assert usage.totals[0].user_charge == "4.000000000"
    prices = ledger.ListPrices(lpb.ListPricesRequest(), timeout=5).prices
    assert {p.tenant_id for p in prices} == {"acme", "beta"}
    assert ledger.DeletePrice(lpb.DeletePriceRequest(tenant_id="beta"), timeout=5).deleted
    pricing = ledger.GetPricing(lpb.GetPricingRequest(), timeout=5)
    assert pricing.window_ms == 300_000 and pricing.steps[0].multiplier == "1.20"
