"""Memory protection: caps on open (admitted, unsettled) reservations, overall
(BURSTGATE_MAX_OPEN_RESERVATIONS) and per tenant (..._PER_TENANT). At a cap an
Admit is refused with OPEN_RESERVATIONS, a reason of its own, and a place frees
when a reservation is settled, released or expires. Injected clock, no I/O."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from controlplane.domain import Decision
from fastpath import Reason

from .conftest import LANES, UnitPolicy, tenant

MS = 1_000_000
NS = 1_000_000_000
OPEN = Reason.OPEN_RESERVATIONS
BIG: dict[str, Any] = {"token_rate": Decimal(10**6), "burst_tokens": 10**8}


def test_per_tenant_cap_refuses_with_its_own_reason_and_a_hint(make_service: Any) -> None:
    svc = make_service(
        tenant("acme", **BIG), tenant("beta", **BIG),
        max_open_reservations_per_tenant=3, concurrency_retry_ms=400,
    )  # fmt: skip
    for i in range(3):
        assert svc.admit("acme", f"r{i}", "", 10, 10).decision == Decision.ADMIT
    d = svc.admit("acme", "r3", "", 10, 10)
    assert (d.decision, d.reason) == (Decision.REJECT, OPEN)
    assert d.retry_after_ns == 400 * MS and d.retryable
    assert d.reserved_tokens == 0 and d.reservation_id == 0
    assert "open reservations" in d.message
    # another tenant has a cap of its own
    assert svc.admit("beta", "r0", "", 10, 10).decision == Decision.ADMIT
    assert svc.views.open_reservations == 4
    assert svc.views.tenant_state("acme")["inflight"] == 3


def test_overall_cap_counts_every_tenant(make_service: Any) -> None:
    svc = make_service(tenant("acme", **BIG), tenant("beta", **BIG), max_open_reservations=3)
    assert svc.admit("acme", "a0", "", 1, 1).decision == Decision.ADMIT
    assert svc.admit("beta", "b0", "", 1, 1).decision == Decision.ADMIT
    assert svc.admit("beta", "b1", "", 1, 1).decision == Decision.ADMIT
    assert svc.admit("acme", "a1", "", 1, 1).reason == OPEN
    assert svc.admit("beta", "b2", "", 1, 1).reason == OPEN
    assert svc.views.open_reservations == 3


def test_a_replayed_request_id_does_not_take_a_second_place(make_service: Any) -> None:
    svc = make_service(tenant(**BIG), max_open_reservations_per_tenant=2)
    first = svc.admit("acme", "r0", "", 10, 10)
    for _ in range(5):
        again = svc.admit("acme", "r0", "", 10, 10)
        assert again.duplicate and again.reservation_id == first.reservation_id
    assert svc.views.open_reservations == 1
    assert svc.admit("acme", "r1", "", 10, 10).decision == Decision.ADMIT
    assert svc.admit("acme", "r2", "", 10, 10).reason == OPEN
    # the refusal replays as such (duplicate), it took nothing either
    assert svc.admit("acme", "r2", "", 10, 10).duplicate
    assert svc.views.open_reservations == 2


def test_complete_and_expiry_free_a_place(make_service: Any, clock: Any) -> None:
    svc = make_service(
        tenant(**BIG), max_open_reservations_per_tenant=2, reservation_ttl_s=60,
        rejection_replay_s=0,
    )  # fmt: skip
    svc.admit("acme", "r0", "", 10, 10)
    svc.admit("acme", "r1", "", 10, 10)
    assert svc.admit("acme", "r2", "", 10, 10).reason == OPEN
    svc.complete("acme", "r0", 0, 10, 5)
    assert svc.admit("acme", "r2", "", 10, 10).decision == Decision.ADMIT
    assert svc.admit("acme", "r3", "", 10, 10).reason == OPEN
    clock.advance(61 * NS)  # r1 and r2 pass their TTL without a Complete
    assert svc.expire() == 2
    assert svc.views.open_reservations == 0
    assert svc.admit("acme", "r3", "", 10, 10).decision == Decision.ADMIT
    assert svc.admit("acme", "r4", "", 10, 10).decision == Decision.ADMIT


def test_a_refusal_at_the_cap_is_answered_at_once_not_queued(make_service: Any) -> None:
    svc = make_service(tenant(**BIG), max_open_reservations_per_tenant=1)
    svc.admit("acme", "r0", "", 10, 10)
    out = svc.admit_or_wait("acme", "r1", "", 10, 10, deadline_ns=svc.clock() + 10 * NS)
    assert out.reason == OPEN  # an AdmitDecision, not a Waiter
    assert svc.waiting == 0


def test_a_waiting_request_that_meets_the_cap_is_answered_with_it(
    make_service: Any, clock: Any
) -> None:
    """Queued for its bucket's refill; meanwhile the plane fills up: when the bucket
    has refilled it is answered OPEN_RESERVATIONS at once, not kept waiting."""
    svc = make_service(
        tenant("acme", token_rate=Decimal(1000), burst_tokens=100), tenant("beta", **BIG),
        max_open_reservations=2,
    )  # fmt: skip
    assert svc.admit("acme", "a0", "", 100, 0).decision == Decision.ADMIT  # bucket empty
    waiter = svc.admit_or_wait("acme", "a1", "", 50, 0, deadline_ns=clock() + 10 * NS)
    assert not hasattr(waiter, "reason")  # queued for 50 ms of refill
    answers: list[Any] = []
    waiter.on_done = answers.append
    assert svc.admit("beta", "b0", "", 10, 10).decision == Decision.ADMIT  # the plane is full
    clock.advance(60 * MS)
    svc.tick()
    assert [a.reason for a in answers] == [OPEN]
    assert svc.waiting == 0 and svc.views.open_reservations == 2


def test_shadow_mode_is_refused_at_the_cap_too(make_service: Any) -> None:
    """Shadow mode admits whatever a tenant's limits say, but not past the memory cap:
    that protects the plane, not a tenant's limit to observe."""
    svc = make_service(tenant(shadow_mode=True, max_concurrency=1, **BIG),
                       max_open_reservations_per_tenant=2)  # fmt: skip
    assert svc.admit("acme", "r0", "", 10, 10).decision == Decision.ADMIT
    over = svc.admit("acme", "r1", "", 10, 10)  # over max_concurrency: shadow admits
    assert (over.decision, over.shadow_reason) == (Decision.ADMIT, Reason.CONCURRENCY)
    d = svc.admit("acme", "r2", "", 10, 10)
    assert (d.decision, d.reason, d.shadow_reason) == (Decision.REJECT, OPEN, 0)
    r = svc.batches.admit(["acme"] * 2, ["b0", "b1"], [], [10, 10], [10, 10])
    assert r.reason == [OPEN, OPEN] and r.decision == [Decision.REJECT] * 2
    assert r.shadow_reason == [0, 0]
    assert svc.views.open_reservations == 2


def test_a_batch_is_refused_from_the_entry_that_meets_the_cap(make_service: Any) -> None:
    svc = make_service(
        tenant("acme", **BIG), tenant("beta", **BIG),
        max_open_reservations_per_tenant=3, max_open_reservations=5, concurrency_retry_ms=300,
    )  # fmt: skip
    svc.admit("acme", "a0", "", 10, 10)
    tenants = ["acme", "acme", "beta", "acme", "beta", "beta", "acme"]
    ids = ["a0", "a1", "b0", "a2", "b1", "b2", "a3"]
    r = svc.batches.admit(tenants, ids, [], [10] * 7, [10] * 7)
    # a0 is a replay (takes nothing); acme fills its 3 with a1, a2; beta gets two of
    # the plane's 5 places; then the plane is full
    assert r.duplicate == [True, False, False, False, False, False, False]
    assert r.reason == [0, 0, 0, 0, 0, OPEN, OPEN]
    assert r.retry_after_ms == [0, 0, 0, 0, 0, 300, 300]
    assert r.retryable[-2:] == [True, True]
    assert svc.views.open_reservations == 5
    assert svc.stats.decision_counts[(int(Decision.REJECT), int(OPEN))] == 2
    # a Complete frees a place for the next batch (b2's refusal replays until its
    # retry_after has passed: a new id)
    svc.complete("beta", "b0", 0, 10, 5)
    r = svc.batches.admit(["beta", "acme"], ["b3", "a4"], [], [10, 10], [10, 10])
    assert r.reason == [0, OPEN]


def test_unary_and_batch_decide_alike_at_the_cap(make_service: Any) -> None:
    unary = make_service(tenant(**BIG), max_open_reservations_per_tenant=4)
    batched = make_service(tenant(**BIG), max_open_reservations_per_tenant=4)
    ids = [f"r{i}" for i in range(7)]
    one_by_one = [unary.admit("acme", i, "", 5, 5).reason for i in ids]
    r = batched.batches.admit(["acme"] * 7, ids, [], [5] * 7, [5] * 7)
    assert r.reason == [int(x) for x in one_by_one] == [0, 0, 0, 0, OPEN, OPEN, OPEN]


def test_zero_turns_the_caps_off(make_service: Any) -> None:
    svc = make_service(tenant(**BIG), max_open_reservations=0, max_open_reservations_per_tenant=0)
    # 0 is "no cap", not "no place" (50: under the pool gate's fallback of 64)
    for i in range(50):
        assert svc.admit("acme", f"r{i}", "", 1, 1).decision == Decision.ADMIT


def test_defaults_are_stated() -> None:
    from controlplane.settings import Settings

    s = Settings()
    assert (s.max_open_reservations, s.max_open_reservations_per_tenant) == (1_000_000, 100_000)


@pytest.mark.parametrize("name", ["max_open_reservations", "max_open_reservations_per_tenant"])
def test_a_negative_cap_is_a_settings_error(name: str) -> None:
    from pydantic import ValidationError

    from controlplane.settings import Settings

    bad: dict[str, Any] = {name: -1}
    with pytest.raises(ValidationError, match=name):
        Settings(**bad)


def test_the_gate_counts_nothing_for_a_refusal_at_the_cap(make_service: Any) -> None:
    svc = make_service(tenant(**BIG), max_open_reservations_per_tenant=1)
    svc.apply_config([tenant(**BIG)], LANES, UnitPolicy(pool_gate=True))
    svc.admit("acme", "r0", "", 10, 10, pool="p")
    assert svc.admit("acme", "r1", "", 10, 10, pool="p").reason == OPEN
    assert svc._gate.inflight("p") == 1  # only the admission went to the pool
