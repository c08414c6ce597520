"""AdmissionService.replicas.restore_reservation and hold_pools (docs/ha.md,
"Re-announcing open reservations"): a reservation another replica of the
deployment admitted (signed with the deployment's key: the entries here are
signed by the service's own signer, as a replica sharing its key would) is
counted here, charged by force but never past the tenant's concurrency
cap, and settled by its Complete with a refund, at the multiplier locked
(signed) at its admission; the pool gate counts it and holds a taken-over
pool until a load report or the hold's end. An unsigned or altered entry
is refused and changes nothing."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from controlplane.domain import AdmitDecision, Decision
from controlplane.domain.errors import InvalidArgument, PermissionDenied
from controlplane.domain.scope import KeyScope
from controlplane.service import AdmissionService, OpenReservation
from controlplane.service import records as R
from controlplane.service.queueing import Waiter
from controlplane.service.restore import KNOWN, REFUSED, RESTORED
from fastpath import Reason

from .conftest import LANES, UnitPolicy, tenant

S = 1_000_000_000
WINDOW = 1_700_000_100


def held(
    request_id: str = "r1", prompt: int = 60, granted: int = 40, **kw: Any
) -> OpenReservation:
    """An unsigned entry (``signed`` adds the token)."""
    fields: dict[str, Any] = {
        "tenant_id": "acme", "request_id": request_id, "prompt_tokens": prompt,
        "max_tokens": granted, "reserved_tokens": prompt + granted,
        "granted_max_tokens": granted, "pricing_multiplier": "1.500000", "pool": "p",
        "reservation_id": 77, "pricing_window": WINDOW,
    }  # fmt: skip
    return OpenReservation(**(fields | kw))


def signed(
    svc: AdmissionService, r: OpenReservation, *, lane: str = "standard", pool: str = "p",
    multiplier: float = 1.5, window: int = WINDOW, issued_ns: int | None = None,
) -> OpenReservation:  # fmt: skip
    """``r`` with the token its Admit answer would carry (the facts it
    signs: lane, pool, multiplier, window and admission time as given)."""
    token = svc.signer.sign(
        r.tenant_id, r.request_id, r.model, lane, pool, r.prompt_tokens, r.granted_max_tokens,
        r.reservation_id, multiplier, window, svc.clock() if issued_ns is None else issued_ns,
    )  # fmt: skip
    return dataclasses.replace(r, admission_token=token)


def test_a_restored_reservation_is_debited_and_its_complete_refunds_at_the_locked_multiplier(
    make_service: Any, clock: Any
) -> None:
    svc = make_service(tenant(hourly_quota=10_000))
    before = svc.views.tenant_state("acme")
    done = svc.replicas.restore_reservation(signed(svc, held(), issued_ns=clock() - 5 * S))
    assert (done.outcome, done.pool) == (RESTORED, "p")
    after = svc.views.tenant_state("acme")
    assert after["inflight"] == before["inflight"] + 1
    assert after["hour_used"] == before["hour_used"] + 100
    rec = svc.views.record("acme", "r1")
    assert rec is not None and rec.state == R.OPEN
    assert (rec.multiplier, rec.window, rec.rid) == (1.5, 1_700_000_100, 77)
    assert (rec.reserved, rec.granted, rec.pool) == (100, 40, "p")
    assert rec.arrived_ns == clock() - 5 * S  # the ledger's arrival: the signed admission
    s = svc.complete("acme", "r1", 77, 60, 10)
    assert (s.reserved_tokens, s.actual_tokens, s.refunded_tokens) == (100, 70, 30)
    assert not s.duplicate
    end = svc.views.tenant_state("acme")
    assert end["inflight"] == before["inflight"]
    assert end["hour_used"] == before["hour_used"] + 70
    assert svc.stats.restored_total == 1


def test_restoring_is_idempotent_open_or_settled(make_service: Any) -> None:
    svc = make_service()
    entry = signed(svc, held())
    assert svc.replicas.restore_reservation(entry).outcome == RESTORED
    state = svc.views.tenant_state("acme")
    assert svc.replicas.restore_reservation(entry).outcome == KNOWN
    assert svc.views.tenant_state("acme") == state
    svc.complete("acme", "r1", 0, 60, 40)
    assert svc.replicas.restore_reservation(entry).outcome == KNOWN
    assert svc.views.open_reservations == 0
    # an id this replica admitted itself is known too, with its answer's token
    own = svc.admit("acme", "own", "", 10, 10, pool="p")
    assert own.decision == Decision.ADMIT and own.admission_token
    mine = held("own", 10, 10, reservation_id=own.reservation_id, pricing_multiplier="",
                pricing_window=0, admission_token=own.admission_token)  # fmt: skip
    assert svc.replicas.restore_reservation(mine).outcome == KNOWN


def test_it_is_charged_by_force_and_quota_overshoot_stays_zero(make_service: Any) -> None:
    svc = make_service(tenant(max_concurrency=2, hourly_quota=1_000, burst_tokens=500))
    assert svc.admit("acme", "mine", "", 100, 100, pool="p").decision == Decision.ADMIT
    # the burst cannot hold 600: restored anyway (it runs), the bucket in debt
    assert svc.replicas.restore_reservation(signed(svc, held("r1", 300, 300))).outcome == RESTORED
    state = svc.views.tenant_state("acme")
    assert state["inflight"] == 2 and state["level_mtok"] < 0
    # 800 of the hour's 1,000 are reserved: a 300-token request would pass the quota
    svc.complete("acme", "mine", 0, 100, 100)
    d = svc.admit("acme", "next", "", 150, 150, pool="p")
    assert (d.decision, d.reason) == (Decision.REJECT, Reason.HOURLY_QUOTA)


def test_a_restore_never_takes_a_tenant_past_its_concurrency_cap(make_service: Any) -> None:
    # issue 30: 51 re-announced reservations of a concurrency-1 tenant were all
    # restored (counted by force); now the cap binds, whatever is re-announced
    svc = make_service(tenant(max_concurrency=1))
    restore = svc.replicas.restore_reservation
    outcomes = [restore(signed(svc, held(f"r{i}", 1, 1))) for i in range(51)]
    assert [o.outcome for o in outcomes].count(RESTORED) == 1
    refused = [o for o in outcomes if o.outcome == REFUSED]
    assert len(refused) == 50 and all("concurrency cap" in o.detail for o in refused)
    assert svc.views.tenant_state("acme")["inflight"] == 1 and svc.views.open_reservations == 1
    # a slot freed: the next one is restored
    svc.complete("acme", "r0", 0, 1, 1)
    assert svc.replicas.restore_reservation(signed(svc, held("r1", 1, 1))).outcome == RESTORED


def test_the_gate_counts_restored_requests_in_flight(make_service: Any) -> None:
    svc = make_service()
    svc.apply_config([tenant()], LANES, UnitPolicy(gate_fallback_inflight=3))
    for i in range(2):
        assert svc.replicas.restore_reservation(signed(svc, held(f"r{i}"))).outcome == RESTORED
    assert svc.views.gate_inflight("p") == 2
    assert svc.admit("acme", "a", "", 10, 10, pool="p").decision == Decision.ADMIT
    d = svc.admit("acme", "b", "", 10, 10, pool="p")  # 2 restored + 1 = the fallback's 3
    assert (d.decision, d.reason) == (Decision.REJECT, Reason.BACKPRESSURE)
    svc.complete("acme", "r0", 0, 10, 10)
    assert svc.views.gate_inflight("p") == 2
    assert svc.admit("acme", "c", "", 10, 10, pool="p").decision == Decision.ADMIT


def test_a_held_pool_releases_nothing_until_the_hold_ends(make_service: Any, clock: Any) -> None:
    svc = make_service()
    svc.replicas.hold_pools(["p"], 1.0)
    w = svc.admit_or_wait("acme", "w", "", 10, 10, pool="p", deadline_ns=clock() + 5 * S)
    assert isinstance(w, Waiter) and not w.done
    other = svc.admit("acme", "q", "", 10, 10, pool="q")  # another pool is not held
    assert other.decision == Decision.ADMIT
    refused = svc.admit("acme", "now", "", 10, 10, pool="p")
    assert refused.reason == Reason.BACKPRESSURE and 0 < refused.retry_after_ns <= S
    assert svc.next_wakeup_ns() == clock() + S  # the hold's end
    clock.advance(S - 1)
    svc.tick()
    assert not w.done
    clock.advance(1)
    svc.tick()
    assert w.done and isinstance(w.result, AdmitDecision) and w.result.decision == Decision.ADMIT


def test_a_load_report_after_the_takeover_lifts_the_hold(make_service: Any, clock: Any) -> None:
    svc = make_service()
    svc.replicas.hold_pools(["p"], 1.0)
    w = svc.admit_or_wait("acme", "w", "", 10, 10, pool="p", deadline_ns=clock() + 5 * S)
    assert isinstance(w, Waiter) and not w.done
    svc.report_load("p", "e1", 0, 8192, 0, 0, None, 0.0, requests_running=3, max_num_seqs=8)
    assert w.done and isinstance(w.result, AdmitDecision) and w.result.decision == Decision.ADMIT


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"reserved_tokens": 99}, "reserved_tokens"),
        ({"granted_max_tokens": 41, "reserved_tokens": 101}, "granted_max_tokens"),
        ({"pricing_multiplier": "abc"}, "pricing_multiplier"),
        ({"admission_token": b"x" * 1025}, "admission_token"),
        ({"pricing_multiplier": "0"}, "pricing_multiplier"),
        ({"pricing_multiplier": "1.0000001"}, "pricing_multiplier"),
        ({"prompt_tokens": -1}, "prompt_tokens"),
        ({"request_id": ""}, "request_id"),
        ({"lane": "nope"}, "lane"),
        ({"pool": "x" * 129}, "pool"),
        ({"pricing_window": -1}, "pricing_window"),
        ({"admitted_ns": 1}, "admitted_unix_ns"),
    ],
)
def test_bad_input_names_the_field_and_changes_nothing(
    make_service: Any, change: dict[str, Any], field: str
) -> None:
    svc = make_service()
    state = svc.views.tenant_state("acme")
    with pytest.raises(InvalidArgument) as err:
        svc.replicas.restore_reservation(dataclasses.replace(signed(svc, held()), **change))
    assert err.value.field == field
    assert svc.views.tenant_state("acme") == state and svc.views.open_reservations == 0


def test_refusals_keep_nothing(make_service: Any) -> None:
    svc = make_service(max_open_reservations_per_tenant=1)
    done = svc.replicas.restore_reservation(signed(svc, held(tenant_id="ghost")))
    assert done.outcome == REFUSED and "unknown tenant" in done.detail
    assert svc.replicas.restore_reservation(signed(svc, held("r1"))).outcome == RESTORED
    capped = svc.replicas.restore_reservation(signed(svc, held("r2")))
    assert capped.outcome == REFUSED and "cap" in capped.detail
    assert svc.views.open_reservations == 1


def test_a_scoped_key_restores_only_its_tenants_and_pools(make_service: Any) -> None:
    svc = make_service(tenant(), tenant("beta"))
    scope = KeyScope(["acme"], ["p"])
    assert svc.replicas.restore_reservation(signed(svc, held()), scope).outcome == RESTORED
    with pytest.raises(PermissionDenied) as err:
        svc.replicas.restore_reservation(signed(svc, held("r2", pool="q"), pool="q"), scope)
    assert err.value.field == "pool"
    # the pool judged is the signed one: naming none does not hide it
    with pytest.raises(PermissionDenied) as err:
        svc.replicas.restore_reservation(signed(svc, held("r2", pool=""), pool="q"), scope)
    assert err.value.field == "pool"
    with pytest.raises(PermissionDenied) as err:
        svc.replicas.restore_reservation(signed(svc, held("r3", tenant_id="beta")), scope)
    assert err.value.field == "tenant_id"


def test_a_restored_reservation_expires_a_ttl_after_the_reannounce(
    make_service: Any, clock: Any
) -> None:
    svc = make_service(reservation_ttl_s=10)
    svc.replicas.restore_reservation(signed(svc, held(), issued_ns=clock() - 9 * S))
    clock.advance(9 * S)
    assert svc.expire() == 0
    clock.advance(S)
    assert svc.expire() == 1
    assert svc.views.tenant_state("acme")["inflight"] == 0


@pytest.mark.parametrize(
    ("change", "says"),
    [
        # what issue 30 found: ids never admitted, a multiplier of the caller's
        ({"admission_token": b""}, "unsigned"),
        ({"pricing_multiplier": "0.000001"}, "signature does not match: pricing_multiplier"),
        ({"pricing_window": WINDOW + 60}, "signature does not match: pricing_window"),
        ({"pool": "q"}, "signature does not match: pool"),
        # each signed fact the entry states in the clear
        ({"request_id": "other"}, "signature does not match"),
        ({"tenant_id": "beta"}, "signature does not match"),
        ({"model": "gpt"}, "signature does not match"),
        ({"prompt_tokens": 59, "reserved_tokens": 99}, "signature does not match"),
        ({"granted_max_tokens": 39, "reserved_tokens": 99}, "signature does not match"),
        ({"reservation_id": 78}, "signature does not match"),
    ],
)
def test_an_unsigned_or_altered_entry_is_refused_and_changes_nothing(
    make_service: Any, change: dict[str, Any], says: str
) -> None:
    svc = make_service(tenant(), tenant("beta"))
    state = svc.views.tenant_state("acme"), svc.views.tenant_state("beta")
    done = svc.replicas.restore_reservation(dataclasses.replace(signed(svc, held()), **change))
    assert done.outcome == REFUSED and done.detail.startswith(says), done
    assert (svc.views.tenant_state("acme"), svc.views.tenant_state("beta")) == state
    assert svc.views.open_reservations == 0 and svc.stats.restored_total == 0


def test_a_tampered_token_is_refused(make_service: Any) -> None:
    svc = make_service()
    good = signed(svc, held())
    token = good.admission_token
    for bad in (
        token[:-1], token + b"\0", token[:10], bytes([2]) + token[1:], b"\x01" * len(token),
        *(token[:i] + bytes([token[i] ^ 1]) + token[i + 1 :] for i in range(len(token))),
    ):
        done = svc.replicas.restore_reservation(dataclasses.replace(good, admission_token=bad))
        assert done.outcome == REFUSED and done.detail.startswith("signature does not match")
    assert svc.views.open_reservations == 0
    assert svc.replicas.restore_reservation(good).outcome == RESTORED


def test_the_restore_uses_the_signed_facts(make_service: Any, clock: Any) -> None:
    # the clear fields left empty (as the SDK sends them): the token's are used
    svc = make_service()
    entry = signed(svc, held(pricing_multiplier="", pricing_window=0, pool="", lane="premium"),
                   lane="batch", pool="gpu-b", multiplier=2.25, issued_ns=clock() - S)  # fmt: skip
    assert svc.replicas.restore_reservation(entry).outcome == RESTORED
    rec = svc.views.record("acme", "r1")
    assert rec is not None
    assert (rec.lane, rec.pool, rec.multiplier, rec.window) == (
        "batch", "gpu-b", 2.25, WINDOW
    )
    assert rec.arrived_ns == clock() - S


def test_an_admission_older_than_the_ttl_is_refused(make_service: Any, clock: Any) -> None:
    svc = make_service(reservation_ttl_s=10)
    done = svc.replicas.restore_reservation(signed(svc, held(), issued_ns=clock() - 11 * S))
    assert done.outcome == REFUSED and done.detail.startswith("expired")
    assert svc.views.open_reservations == 0


def test_another_deployments_key_and_rotation(make_service: Any) -> None:
    a, b = make_service(), make_service()  # each with a random key of its own
    entry = signed(a, held())
    done = b.replicas.restore_reservation(entry)
    assert done.outcome == REFUSED and "key this plane does not hold" in done.detail
    # b rotates onto a's key: a's tokens verify; after one more rotation
    # (a's key now the previous one) still; after two, no more
    old = b"\x11" * 32
    b.signer.install([a_key := bytes(32), old])
    a.signer.install([a_key])
    entry = signed(a, held("r2"))
    assert b.replicas.restore_reservation(entry).outcome == RESTORED
    b.signer.install([b"\x22" * 32, a_key])
    assert b.replicas.restore_reservation(signed(a, held("r3"))).outcome == RESTORED
    b.signer.install([b"\x33" * 32, b"\x22" * 32])
    assert b.replicas.restore_reservation(signed(a, held("r4"))).detail.startswith(
        "signature does not match"
    )
