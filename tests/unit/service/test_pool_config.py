"""The pool an Admit belongs to (TenantDirectory.pool_for): the request's,
else its tenant's configured pool, else its (final) lane's, else "default";
the same on the unary and the batch path. With the pool gate off, the same
but for the last step: no pool (no backpressure), as before the gate."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from controlplane.domain import Decision
from controlplane.domain.policy import Policy
from controlplane.service import records as R
from controlplane.service.queueing import Waiter
from fastpath import Reason

from .conftest import LANES, UnitPolicy, tenant

# standard routes to "lane-std", batch to "lane-bulk"; premium has no pool
POOL_LANES = [
    LANES[0],
    dataclasses.replace(LANES[1], pool="lane-std"),
    dataclasses.replace(LANES[2], pool="lane-bulk"),
]
TENANTS = [
    tenant("routed", pool="tenant-pool"),  # default lane standard
    tenant("plain"),  # default lane standard
    tenant("vip", default_lane="premium"),
    tenant("short", long_request_tokens=100),  # long requests go to batch
]
GATED = UnitPolicy()  # the gate is on by default
ONE_EACH = UnitPolicy(gate_fallback_inflight=1)  # no reports: one in flight per pool


def service(make_service: Any, policy: Policy = GATED) -> Any:
    svc = make_service(*TENANTS)
    svc.apply_config(TENANTS, POOL_LANES, policy)
    return svc


def pool_of(svc: Any, tenant_id: str, request_id: str) -> str:
    rec = svc.views.record(tenant_id, request_id)
    assert rec is not None and rec.state == R.OPEN, rec
    pool: str = rec.pool
    return pool


# (tenant, lane named, prompt, requested pool) -> pool
ORDER = [
    # the request's pool wins over the tenant's and the lane's
    ("routed", "", 10, "req", "req"),
    # else the tenant's, over its lane's
    ("routed", "", 10, "", "tenant-pool"),
    # else the lane's
    ("plain", "", 10, "", "lane-std"),
    ("plain", "batch", 10, "", "lane-bulk"),
    # else "default"
    ("vip", "", 10, "", "default"),
    ("plain", "premium", 10, "", "default"),
]


@pytest.mark.parametrize(("tenant_id", "lane", "prompt", "requested", "expected"), ORDER)
def test_unary_resolution_order(
    make_service: Any, tenant_id: str, lane: str, prompt: int, requested: str, expected: str
) -> None:
    svc = service(make_service)
    d = svc.admit_or_wait(tenant_id, "r", lane, prompt, 0, pool=requested)
    assert not isinstance(d, Waiter) and d.decision == Decision.ADMIT
    assert pool_of(svc, tenant_id, "r") == expected


def test_unary_uses_the_lane_the_request_was_placed_in(make_service: Any) -> None:
    svc = service(make_service)
    d = svc.admit("short", "long", "standard", 500, 500)  # past 100 tokens: demoted
    assert d.lane == "batch"
    assert pool_of(svc, "short", "long") == "lane-bulk"
    svc.admit("short", "small", "standard", 10, 10)
    assert pool_of(svc, "short", "small") == "lane-std"


def test_a_configured_pool_has_its_own_gate(make_service: Any) -> None:
    svc = service(make_service, ONE_EACH)
    assert svc.admit("routed", "a", "", 10, 0).decision == Decision.ADMIT  # tenant-pool: full
    held = svc.admit("routed", "b", "", 10, 0)
    assert (held.decision, held.reason) == (Decision.REJECT, Reason.BACKPRESSURE)
    # the same lane, another tenant: the lane's pool still has room
    assert svc.admit("plain", "c", "", 10, 0).decision == Decision.ADMIT
    # a waiter keeps the pool it was resolved to, and is released when it frees
    w = svc.admit_or_wait("routed", "d", "", 10, 0)
    assert isinstance(w, Waiter) and w.pool == "tenant-pool"
    svc.complete("routed", "a", 0, 10, 0)
    assert w.done and w.result.decision == Decision.ADMIT
    assert pool_of(svc, "routed", "d") == "tenant-pool"


def test_unary_without_the_gate_has_no_default_pool(make_service: Any) -> None:
    svc = service(make_service, UnitPolicy(pool_gate=False))
    svc.admit("routed", "tenant", "", 10, 0)
    svc.admit("routed", "named", "", 10, 0, pool="req")
    svc.admit("plain", "lane", "batch", 10, 0)
    svc.admit("vip", "none", "", 10, 0)
    got = [pool_of(svc, t, r) for t, r in (("routed", "tenant"), ("routed", "named"),
                                           ("plain", "lane"), ("vip", "none"))]  # fmt: skip
    assert got == ["tenant-pool", "req", "lane-bulk", ""]


@pytest.mark.parametrize("requested", ["", "req"])
def test_batch_resolution_order_per_entry(make_service: Any, requested: str) -> None:
    svc = service(make_service)
    entries = [(t, lane, prompt) for t, lane, prompt, r, _ in ORDER if not r]
    entries.append(("short", "standard", 500))  # demoted to batch
    tenants = [t for t, _, _ in entries]
    ids = [f"b{i}" for i in range(len(entries))]
    r = svc.batches.admit(tenants, ids, [lane for _, lane, _ in entries],
                        [p for _, _, p in entries], [0] * len(entries), pool=requested)  # fmt: skip
    assert r.reason == [Reason.OK] * len(entries)
    got = [pool_of(svc, t, i) for t, i in zip(tenants, ids, strict=True)]
    expected = ["tenant-pool", "lane-std", "lane-bulk", "default", "default", "lane-bulk"]
    assert got == ([requested] * len(entries) if requested else expected)


def test_batch_counts_the_gate_per_resolved_pool(make_service: Any) -> None:
    svc = service(make_service, ONE_EACH)
    r = svc.batches.admit(["routed", "routed", "plain", "plain"], ["a", "b", "c", "d"], [],
                        [10] * 4, [0] * 4)  # fmt: skip
    # tenant-pool and lane-std take one each
    assert r.reason == [Reason.OK, Reason.BACKPRESSURE, Reason.OK, Reason.BACKPRESSURE]
    # a batch naming a pool puts everything in it
    r = svc.batches.admit(["routed", "plain"], ["e", "f"], [], [10] * 2, [0] * 2, pool="req")
    assert r.reason == [Reason.OK, Reason.BACKPRESSURE]


def test_batch_without_the_gate_has_no_default_pool(make_service: Any) -> None:
    svc = service(make_service, UnitPolicy(pool_gate=False))
    svc.batches.admit(["routed", "plain", "vip"], ["a", "b", "c"], [], [10] * 3, [0] * 3)
    svc.batches.admit(["routed"], ["d"], [], [10], [0], pool="req")
    got = [pool_of(svc, t, i) for t, i in (("routed", "a"), ("plain", "b"), ("vip", "c"),
                                           ("routed", "d"))]  # fmt: skip
    assert got == ["tenant-pool", "lane-std", "", "req"]


def test_the_unary_and_batch_paths_agree(make_service: Any) -> None:
    unary = service(make_service)
    batch = service(make_service)
    for i, (t, lane, prompt, requested, _) in enumerate(ORDER):
        unary.admit(t, f"r{i}", lane, prompt, 0, pool=requested)
        batch.batches.admit([t], [f"r{i}"], [lane], [prompt], [0], pool=requested)
        assert pool_of(unary, t, f"r{i}") == pool_of(batch, t, f"r{i}")


def test_an_unknown_tenant_in_a_batch_without_a_standard_lane_is_refused_not_a_crash(
    make_service: Any,
) -> None:
    # the fallback lane of an unknown tenant ("standard") is not configured here
    lanes = [LANES[0], LANES[2]]
    svc = make_service(tenant(default_lane="premium"))
    svc.apply_config([tenant(default_lane="premium")], lanes, GATED)
    r = svc.batches.admit(["nobody", "acme"], ["x", "y"], [], [10, 10], [0, 0])
    assert r.reason == [Reason.UNKNOWN_TENANT, Reason.OK]
    assert svc.admit("nobody", "z", "", 10, 0).reason == Reason.UNKNOWN_TENANT
