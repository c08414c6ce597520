"""Complete of a request a sidecar admitted while the control plane was
unreachable (CompleteRequest.offline) over real gRPC, SQLite and
PostgreSQL: booked once, billed once, charged to the bucket whatever its
level; repeats (also after the settled-id window) are duplicates; bad
offline fields name the field and change nothing. And GetLimits."""

from __future__ import annotations

import grpc
from burstgate_client.protoclient import pb

from tests.integration.ledger.conftest import NS, Served, complete, ledger_rows, rpc_code


def offline(**kw: str) -> pb.OfflineAdmission:
    return pb.OfflineAdmission(**kw)


def test_an_offline_admission_is_booked_and_billed_once(served: Served, clock: object) -> None:
    c = served.client
    before = c.stub.GetLimits(pb.GetLimitsRequest(tenant_id="acme"), timeout=10)
    first = complete(c, "acme", "off-1", prompt_tokens=1000, generated_tokens=300,
                     offline=offline(lane="premium", model="m", pool="p"))  # fmt: skip
    assert first.offline_booked and not first.duplicate
    # billed as an admitted premium request: (1000 x 2.00 + 300 x 8.00) / 1e6 x 1.5
    assert first.user_charge == "0.006600000" and first.lane_multiplier == "1.500000"
    assert (first.reserved_tokens, first.actual_tokens, first.refunded_tokens) == (1300, 1300, 0)
    (row,) = ledger_rows(served.url)
    assert (row.request_id, row.lane, row.model, row.pool) == ("off-1", "premium", "m", "p")
    assert (row.prompt_tokens, row.output_tokens) == (1000, 300)
    after = c.stub.GetLimits(pb.GetLimitsRequest(tenant_id="acme"), timeout=10)
    assert before.bucket_tokens - after.bucket_tokens == 1300  # the clock stood still
    assert after.inflight_requests == 0  # settled at once
    # a repeat (the sidecar's answer was lost) is a duplicate, not a second bill
    again = complete(c, "acme", "off-1", prompt_tokens=1000, generated_tokens=300,
                     offline=offline(lane="premium", model="m", pool="p"))  # fmt: skip
    assert again.duplicate and not again.offline_booked
    assert again.user_charge == first.user_charge
    # ... also after the server forgot the id (settled-id window): the ledger knows it
    clock.advance(3600 * NS)  # type: ignore[attr-defined]
    late = complete(c, "acme", "off-1", prompt_tokens=1000, generated_tokens=300,
                    offline=offline(lane="premium"))  # fmt: skip
    assert late.duplicate and not late.offline_booked
    assert len(ledger_rows(served.url)) == 1


def test_offline_books_past_an_empty_bucket(served: Served) -> None:
    c = served.client
    limits = c.stub.GetLimits(pb.GetLimitsRequest(tenant_id="beta"), timeout=10)
    for i in range(limits.burst_tokens // 10_000_000):  # (10^7: the most one request may use)
        full = complete(c, "beta", f"big-{i}", prompt_tokens=10_000_000, offline=offline())
        assert full.offline_booked
    r = complete(c, "beta", "over", prompt_tokens=0, generated_tokens=5_000, offline=offline())
    assert r.offline_booked
    now = c.stub.GetLimits(pb.GetLimitsRequest(tenant_id="beta"), timeout=10)
    assert now.bucket_tokens == -5_000 and now.bucket_full_in_ms > 0  # in debt
    # and the debt binds the next online request (a batch: answered at once,
    # where a unary Admit would wait for a refill the test's clock never makes)
    b = pb.AdmitBatch(batch_id=1, tenant_id=["beta"], request_id=["next"], prompt_tokens=[10],
                      max_tokens=[10])  # fmt: skip
    (res,) = c.admit_stream(iter([b]))
    assert res.decision[0] == pb.DECISION_REJECT and res.reason[0] == pb.REASON_TOKEN_RATE
    # the refusal's answer may never have reached a sidecar, which then let
    # the request run under its fail-open policy: its offline Complete books it
    ran = complete(c, "beta", "next", prompt_tokens=10, generated_tokens=4, offline=offline())
    assert ran.offline_booked and ran.actual_tokens == 14


def test_offline_is_ignored_when_the_request_was_admitted_online(served: Served) -> None:
    c = served.client
    c.admit("acme", "on", prompt_tokens=100, max_tokens=100)
    r = complete(c, "acme", "on", prompt_tokens=100, generated_tokens=20, offline=offline())
    assert not r.offline_booked and r.refunded_tokens == 80
    assert len(ledger_rows(served.url)) == 1


def test_bad_offline_fields_are_refused_naming_the_field(served: Served) -> None:
    c = served.client
    cases = [
        (offline(lane="gold"), grpc.StatusCode.INVALID_ARGUMENT, "lane: "),
        (offline(model="m" * 257), grpc.StatusCode.INVALID_ARGUMENT, "model: "),
        (offline(pool="p" * 129), grpc.StatusCode.INVALID_ARGUMENT, "pool: "),
    ]
    # and the Complete's own fields are checked before anything is booked
    over = pb.CompleteRequest(tenant_id="acme", request_id="bad", prompt_tokens=1,
                              cached_prompt_tokens=2, offline=offline())  # fmt: skip
    assert rpc_code(lambda: c.stub.Complete(over, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
    for off, code, prefix in cases:
        req = pb.CompleteRequest(tenant_id="acme", request_id="bad", prompt_tokens=1,
                                 generated_tokens=1, offline=off)  # fmt: skip
        try:
            c.stub.Complete(req, timeout=10)
        except grpc.RpcError as err:
            assert err.code() == code and err.details().startswith(prefix), err.details()
        else:
            raise AssertionError(f"{off} was accepted")
    unknown = pb.CompleteRequest(tenant_id="nobody", request_id="x", prompt_tokens=1,
                                 offline=offline())  # fmt: skip
    assert rpc_code(lambda: c.stub.Complete(unknown, timeout=10)) == grpc.StatusCode.NOT_FOUND
    assert ledger_rows(served.url) == []
    assert served.srv.on_loop(lambda: served.srv.plane.service.views.record("acme", "bad")) is None


def test_get_limits_reports_the_tenants_configuration_and_state(served: Served) -> None:
    c = served.client
    c.admit("acme", "a", prompt_tokens=1000, max_tokens=0)
    lim = c.stub.GetLimits(pb.GetLimitsRequest(tenant_id="acme"), timeout=10)
    assert lim.tenant_id == "acme" and lim.token_rate == "1000000"
    assert lim.burst_tokens == 100_000_000 and lim.bucket_tokens == 100_000_000 - 1000
    assert lim.bucket_full_in_ms == 1  # 1000 tokens at 10^6/s: 1 ms
    assert (lim.hourly_quota, lim.hourly_remaining, lim.max_concurrency) == (-1, -1, -1)
    assert lim.inflight_requests == 1
    assert 0 < lim.hour_resets_in_ms <= 3_600_000 and 0 < lim.day_resets_in_ms <= 86_400_000
    for tenant_id, code in (("nobody", grpc.StatusCode.NOT_FOUND),
                            ("", grpc.StatusCode.INVALID_ARGUMENT)):  # fmt: skip
        req = pb.GetLimitsRequest(tenant_id=tenant_id)

        def call(req: pb.GetLimitsRequest = req) -> object:
            return c.stub.GetLimits(req, timeout=10)

        assert rpc_code(call) == code
