"""Complete over real gRPC writes the dual ledger (SQLite and PostgreSQL)."""

from __future__ import annotations

import threading
from decimal import Decimal
from typing import Any

import grpc
import pytest
from burstgate_client.protoclient import pb

from tests.integration.ledger.conftest import NS, Served, complete, ledger_rows, rpc_code


def test_complete_records_both_ledgers_with_cached_price(served: Served) -> None:
    c = served.client
    d = c.admit("acme", "r1", prompt_tokens=1000, max_tokens=500, model="m", pool="p")
    assert d.decision == pb.DECISION_ADMIT and d.pricing_multiplier == "1.000000"
    r = complete(
        c, "acme", "r1", prompt_tokens=1000, generated_tokens=300, cached_prompt_tokens=400,
        kv_cache_miss_rate=0.2,
    )  # fmt: skip
    # user: (600 x 2.00 + 400 x 0.50 + 300 x 8.00) / 1e6 = 0.003800
    assert r.user_charge == "0.003800000" and r.currency == "USD"
    # cost: 1000 x (1 + 0.2 x 0.5) x 1.00 / 1e6 + 300 x 4.00 / 1e6 + 0.0001 = 0.0024
    assert r.actual_cost == "0.002400000"
    assert (r.pricing_multiplier, r.lane_multiplier, r.miss_rate_source) == (
        "1.000000", "1.000000", pb.MISS_RATE_SOURCE_REQUEST
    )  # fmt: skip
    assert not r.duplicate and r.refunded_tokens == 1500 - 1300
    (row,) = ledger_rows(served.url)
    assert (row.tenant_id, row.request_id, row.model, row.pool) == ("acme", "r1", "m", "p")
    assert (row.prompt_tokens, row.cached_tokens, row.output_tokens) == (1000, 400, 300)
    assert (row.user_charge_nanos, row.actual_cost_nanos) == (3_800_000, 2_400_000)
    assert Decimal(str(row.kv_cache_miss_rate)) == Decimal("0.2")
    # Cached tokens at the cached price: the same request uncached costs more.
    c.admit("acme", "r2", prompt_tokens=1000, max_tokens=500)
    r2 = complete(c, "acme", "r2", prompt_tokens=1000, generated_tokens=300)
    assert Decimal(r2.user_charge) - Decimal(r.user_charge) == Decimal("0.000600000")


def test_premium_lane_multiplier_and_default_price(served: Served) -> None:
    c = served.client
    c.admit("acme", "p1", prompt_tokens=1000, max_tokens=0, lane="premium")
    r = complete(c, "acme", "p1", prompt_tokens=1000, generated_tokens=0)
    assert r.lane_multiplier == "1.500000" and r.user_charge == "0.003000000"
    # beta has no entry and there is no default: priced at zero in the default currency
    c.admit("beta", "b1", prompt_tokens=10, max_tokens=10)
    r = complete(c, "beta", "b1", prompt_tokens=10, generated_tokens=10)
    assert (r.user_charge, r.actual_cost, r.currency) == ("0.000000000", "0.000000000", "USD")


def test_duplicate_returns_original_figures(served: Served) -> None:
    c = served.client
    c.admit("acme", "r1", prompt_tokens=100, max_tokens=100)
    first = complete(c, "acme", "r1", prompt_tokens=100, generated_tokens=50)
    again = complete(c, "acme", "r1", prompt_tokens=999, generated_tokens=999)
    assert again.duplicate and not first.duplicate
    assert (again.user_charge, again.actual_cost) == (first.user_charge, first.actual_cost)
    assert again.actual_tokens == first.actual_tokens == 150
    assert len(ledger_rows(served.url)) == 1


def test_concurrent_duplicate_completes_record_exactly_once(served: Served) -> None:
    c = served.client
    n_requests, n_dupes = 20, 8
    for i in range(n_requests):
        c.admit("acme", f"r{i}", prompt_tokens=100, max_tokens=100)
    results: list[Any] = []
    lock = threading.Lock()
    barrier = threading.Barrier(n_dupes)

    def worker() -> None:
        barrier.wait()
        for i in range(n_requests):
            r = complete(c, "acme", f"r{i}", prompt_tokens=100, generated_tokens=i)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=worker) for _ in range(n_dupes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    by_id: dict[str, list[Any]] = {}
    for r in results:
        by_id.setdefault(r.request_id, []).append(r)
    for rid, rs in by_id.items():
        assert sum(not r.duplicate for r in rs) == 1, rid  # exactly one settled it
        assert len({(r.user_charge, r.actual_cost, r.actual_tokens) for r in rs}) == 1
    rows = ledger_rows(served.url)
    assert len(rows) == n_requests
    assert served.srv.on_loop(lambda: served.srv.plane.service.views.open_reservations) == 0


def test_expired_record_is_answered_from_the_ledger(served: Served, clock: Any) -> None:
    c = served.client
    c.admit("acme", "old", prompt_tokens=100, max_tokens=100)
    first = complete(c, "acme", "old", prompt_tokens=100, generated_tokens=10)
    clock.advance(601 * NS)  # past reservation_ttl_s: memory forgets the request
    served.srv.on_loop(served.srv.plane.service.expire)
    served.srv.on_loop(lambda: served.srv.plane.metering._recent.clear())
    again = complete(c, "acme", "old", prompt_tokens=100, generated_tokens=10)
    assert again.duplicate and again.user_charge == first.user_charge
    assert rpc_code(lambda: complete(c, "acme", "never", prompt_tokens=1)) == (
        grpc.StatusCode.NOT_FOUND
    )


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"prompt_tokens": -1}, "prompt_tokens"),
        ({"generated_tokens": -5}, "generated_tokens"),
        ({"cached_prompt_tokens": 200}, "cached_prompt_tokens"),
        ({"generated_tokens": 5_000_000}, "generated_tokens"),  # reserved 100: absurd
        ({"prompt_tokens": 9_000_000}, "prompt_tokens"),
        ({"kv_cache_miss_rate": 1.5}, "kv_cache_miss_rate"),
        ({"exec_start_unix_ns": 10, "exec_end_unix_ns": 5}, "exec_end"),
        ({"correlation_id": "x" * 129}, "correlation_id"),
        ({"correlation_id": "a\r\nb"}, "correlation_id"),
    ],
)
def test_bad_complete_is_invalid_argument_and_changes_nothing(
    served: Served, kw: dict[str, Any], field: str
) -> None:
    c = served.client
    c.admit("acme", "r1", prompt_tokens=100, max_tokens=100)
    args: dict[str, Any] = {"prompt_tokens": 100, "generated_tokens": 10} | kw
    with pytest.raises(grpc.RpcError) as err:
        complete(c, "acme", "r1", **args)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field), err.value.details()
    assert ledger_rows(served.url) == []
    assert served.srv.on_loop(lambda: served.srv.plane.service.views.open_reservations) == 1
    ok = complete(c, "acme", "r1", prompt_tokens=100, generated_tokens=10)
    assert not ok.duplicate


def test_unknown_and_refused_requests(served: Served) -> None:
    c = served.client
    code = rpc_code(lambda: complete(c, "acme", "nope", prompt_tokens=1, generated_tokens=1))
    assert code == grpc.StatusCode.NOT_FOUND
    d = c.admit("ghost", "g1", prompt_tokens=1, max_tokens=1)
    assert d.decision == pb.DECISION_REJECT
    code = rpc_code(lambda: complete(c, "ghost", "g1", prompt_tokens=1, generated_tokens=1))
    assert code == grpc.StatusCode.FAILED_PRECONDITION


def test_the_callers_correlation_id_is_recorded_and_exported(served: Served) -> None:
    c = served.client
    for rid, correlation in (("c1", "client-42"), ("c2", "client-42"), ("c3", "")):
        c.admit("acme", rid, prompt_tokens=10, max_tokens=10)
        complete(c, "acme", rid, prompt_tokens=10, generated_tokens=1, correlation_id=correlation)
    got = {r.request_id: r.correlation_id for r in ledger_rows(served.url)}
    assert got == {"c1": "client-42", "c2": "client-42", "c3": None}  # not a key; NULL = none
    from burstgate_client._proto.burstgate.v1 import ledger_pb2 as lpb

    rec = served.ledger().GetLedgerRecord(
        lpb.GetLedgerRecordRequest(tenant_id="acme", request_id="c1"), timeout=10
    )
    assert rec.correlation_id == "client-42"


def test_sidecar_timestamps_are_recorded(served: Served, clock: Any) -> None:
    c = served.client
    t0 = clock()
    c.admit("acme", "t1", prompt_tokens=10, max_tokens=10)
    complete(
        c, "acme", "t1", prompt_tokens=10, generated_tokens=10,
        exec_start_unix_ns=t0 + 5, exec_end_unix_ns=t0 + 99,
    )  # fmt: skip
    (row,) = ledger_rows(served.url)
    assert (row.arrival_ns, row.queue_start_ns) == (t0, t0)
    assert (row.exec_start_ns, row.end_ns, row.settled_ns) == (t0 + 5, t0 + 99, t0)


@pytest.mark.parametrize("cached", [True, False], ids=["recent", "database"])
def test_an_id_admitted_again_past_the_settled_window_is_billed_under_its_own_key(
    served: Served, clock: Any, cached: bool
) -> None:
    # Issue 30 item 4: once the settled id is forgotten (settled_id_window_s),
    # the same id is admitted anew; its Complete was answered duplicate=true
    # against the first admission's row and never billed.
    c, srv = served.client, served.srv
    first_admit = c.admit("acme", "again", prompt_tokens=100, max_tokens=100)
    first = complete(c, "acme", "again", prompt_tokens=100, generated_tokens=10)
    clock.advance(121 * NS)  # past settled_id_window_s (120 s)
    srv.on_loop(srv.plane.service.expire)
    if not cached:  # only the database knows the first row (a restart, a busy plane)
        srv.on_loop(lambda: srv.plane.metering._recent.clear())
    d = c.admit("acme", "again", prompt_tokens=100, max_tokens=100)
    assert d.decision == pb.DECISION_ADMIT and not d.duplicate
    assert d.reservation_id != first_admit.reservation_id
    second = complete(c, "acme", "again", prompt_tokens=100, generated_tokens=40)
    assert not second.duplicate and second.actual_tokens == 140
    assert Decimal(second.user_charge) > Decimal(first.user_charge)
    # a genuine retry of the same Complete is still exactly once
    retry = complete(c, "acme", "again", prompt_tokens=100, generated_tokens=40)
    assert retry.duplicate and retry.user_charge == second.user_charge
    rows = {r.request_id: r for r in ledger_rows(served.url)}
    assert set(rows) == {"again", f"again#{d.reservation_id}"}, rows
    assert rows["again"].output_tokens == 10 and rows["again"].reservation_id == (
        first_admit.reservation_id
    )
    rebilled = rows[f"again#{d.reservation_id}"]
    assert (rebilled.output_tokens, rebilled.reservation_id) == (40, d.reservation_id)
    assert rebilled.user_charge_nanos == int(Decimal(second.user_charge) * NS)
    # forgotten again, the retry is answered from the ledger, still once
    clock.advance(121 * NS)
    srv.on_loop(srv.plane.service.expire)
    srv.on_loop(lambda: srv.plane.metering._recent.clear())
    late = complete(c, "acme", "again", prompt_tokens=100, generated_tokens=40)
    assert late.duplicate and len(ledger_rows(served.url)) == 2
