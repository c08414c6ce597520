"""The decision's two entry points are twins (service/decider.py): a unary
Admit and the same request as an AdmitStream batch of one are decided
alike, field for field, whatever the rules in play - the tenant screen,
shadow mode, the pool's backpressure and degradation, the pool gate and its
lanes, length-aware placement, premium borrowing from its bucket, quotas,
concurrency, per-request caps, late refusals. Two services see the same
random history (admissions, completions, load reports, time passing); one
decides every request alone, the other in batches of one."""

from __future__ import annotations

import random
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.domain import AdmitDecision, Decision
from controlplane.service.answers import BatchResult

from .conftest import LANES, UnitPolicy, tenant

MS = 1_000_000
TENANTS = [
    # small bucket, a concurrency cap, a per-request cap, an hourly quota
    tenant("acme", token_rate=Decimal(500), burst_tokens=6000, max_concurrency=4,
           max_tokens_per_request=2500, hourly_quota=9_000),
    # premium by default: borrows from its bucket while the pool has room
    tenant("vip", token_rate=Decimal(1000), burst_tokens=3000, default_lane="premium"),
    # shadow mode: decided and counted, always admitted
    tenant("shade", burst_tokens=2000, shadow_mode=True),
    # long requests placed in the batch lane, in a pool of its own
    tenant("long", burst_tokens=20_000, long_request_tokens=2000, pool="q"),
    tenant("off", enabled=False),
]
SIZES = [0, 1, 100, 400, 900, 1500, 2100, 2600, 3400, 4000]
NAMES = ["acme", "vip", "shade", "long", "off", "ghost"]
POLICY = UnitPolicy(
    gate_waiting_per_engine=2, gate_fallback_inflight=6, degrade_queue_depth=40,
    degrade_max_tokens=300, queue_limit=10_000,
)  # fmt: skip

admit_op = st.tuples(
    st.just("admit"),
    st.sampled_from(["acme", "acme", "acme", "vip", "vip", *NAMES[2:]]),
    st.integers(0, 15),  # request id: small, so that ids repeat
    st.sampled_from(["", "premium", "standard", "batch"]),
    # token counts, drawn evenly (hypothesis's integers favour the smallest)
    st.sampled_from(SIZES),  # prompt tokens
    st.sampled_from(SIZES),  # max tokens
    st.sampled_from(["", "p", "q"]),
    st.sampled_from(["", "", "k1", "k2"]),  # retry key ("" = the request id)
    st.sampled_from([0, 0, 1, 2]),  # attempt
)
load_op = st.tuples(
    st.just("load"),
    st.sampled_from(["p", "q"]),
    st.sampled_from(["e1", "e2"]),
    st.integers(0, 60),  # waiting
    st.integers(0, 300),  # running (of 256 sequences)
    st.sampled_from([None, 0.2, 0.95]),  # KV cache usage
)
ops = st.lists(
    st.one_of(
        admit_op, admit_op, admit_op, admit_op,
        load_op,
        st.tuples(st.just("advance"), st.integers(1, 1500)),  # ms
        st.tuples(st.just("complete"), st.integers(0, 63), st.integers(0, 500)),
        # one of the open admissions, with this many generated tokens
        st.tuples(st.just("complete"), st.integers(0, 63), st.integers(0, 500)),
    ),
    min_size=20,
    max_size=120,
)


def unary_answer(d: AdmitDecision) -> tuple[Any, ...]:
    return (
        int(d.decision), int(d.reason), -(-d.retry_after_ns // MS), d.reserved_tokens,
        d.reservation_id, d.granted_max_tokens, d.bucket_remaining, d.hourly_remaining,
        d.daily_remaining, d.duplicate, d.retryable, d.degradation is not None,
        int(d.shadow_reason), d.pricing_multiplier,
    )  # fmt: skip


def batch_answer(r: BatchResult) -> tuple[Any, ...]:
    assert r.retryable is not None  # the service always fills it
    return (
        r.decision[0], r.reason[0], r.retry_after_ms[0], r.reserved_tokens[0],
        r.reservation_id[0], r.granted_max_tokens[0], r.bucket_remaining[0],
        r.hourly_remaining[0], r.daily_remaining[0], r.duplicate[0], r.retryable[0],
        r.degraded[0], r.shadow_reason[0], r.pricing_multiplier,
    )  # fmt: skip


def run_twins(
    make_service: Any, clock: Any, history: list[tuple[Any, ...]], gate: bool
) -> None:
    """Drive both services through ``history``, comparing every answer."""
    unary, batched = make_service(), make_service()
    policy = POLICY.model_copy(update={"pool_gate": gate})  # off: the bucket's limits bind more
    for svc in (unary, batched):
        svc.apply_config(TENANTS, LANES, policy)
    admitted: dict[tuple[str, str], int] = {}
    for op in history:
        kind = op[0]
        if kind == "advance":
            clock.advance(op[1] * MS)
        elif kind == "load":
            _, pool, engine, waiting, running, kv = op
            for svc in (unary, batched):
                svc.report_load(pool, engine, 1000, 8192, waiting, 0, 0.1, 0.5,
                                requests_running=running, max_num_seqs=256,
                                kv_cache_usage=kv)  # fmt: skip
        elif kind == "complete":
            _, k, generated = op
            if admitted:
                (t, rid), reservation = list(admitted.items())[k % len(admitted)]
                del admitted[t, rid]
                a = unary.complete(t, rid, reservation, 0, generated)
                assert a == batched.complete(t, rid, reservation, 0, generated)
        else:
            _, t, i, lane, prompt, maxt, pool, key, attempt = op
            rid = f"r{i}"
            one = unary.admit_or_wait(t, rid, lane, prompt, maxt, pool=pool, wait=False,
                                      retry_key=key, attempt=attempt)  # fmt: skip
            assert isinstance(one, AdmitDecision)  # wait=False: never queued
            many = batched.batches.admit([t], [rid], [lane], [prompt], [maxt], pool=pool,
                                       retry_keys=[key], attempts=[attempt])  # fmt: skip
            assert unary_answer(one) == batch_answer(many), op
            assert unary.views.record(t, rid) == batched.views.record(t, rid), op
            if one.decision == Decision.ADMIT and not one.duplicate:
                admitted[t, rid] = one.reservation_id
    for t in NAMES[:4]:
        assert unary.views.tenant_state(t) == batched.views.tenant_state(t)
    for pool in ("p", "q"):
        assert unary.views.gate_inflight(pool) == batched.views.gate_inflight(pool)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(history=ops, gate=st.booleans())
def test_a_unary_admit_and_a_batch_of_one_are_decided_alike(
    make_service: Any, clock: Any, history: list[tuple[Any, ...]], gate: bool
) -> None:
    run_twins(make_service, clock, history, gate)


def busy_history(seed: int, length: int = 400) -> list[tuple[Any, ...]]:
    """A long history drawn evenly (hypothesis's own lists stay short and
    favour small values): the buckets empty, quotas and concurrency bind,
    retries come back past their deadlines."""
    rnd = random.Random(seed)
    history: list[tuple[Any, ...]] = []
    for _ in range(length):
        x = rnd.random()
        if x < 0.6:
            history.append((
                "admit", rnd.choice(["acme", "acme", "vip", "vip", *NAMES[2:]]),
                rnd.randrange(40), rnd.choice(["", "", "premium", "standard", "batch"]),
                rnd.choice(SIZES), rnd.choice(SIZES), rnd.choice(["", "", "p", "q"]),
                rnd.choice(["", "", "", "k1", "k2", "k3"]), rnd.choice([0, 0, 1, 2]),
            ))  # fmt: skip
        elif x < 0.7:
            history.append(("load", rnd.choice("pq"), rnd.choice(["e1", "e2"]),
                            rnd.randrange(60), rnd.randrange(300),
                            rnd.choice([None, 0.2, 0.95])))  # fmt: skip
        elif x < 0.85:
            history.append(("advance", rnd.randrange(1, 1500)))
        else:
            history.append(("complete", rnd.randrange(64), rnd.randrange(500)))
    return history


@pytest.mark.parametrize("seed", range(24))
def test_twins_stay_alike_through_long_busy_histories(
    make_service: Any, clock: Any, seed: int
) -> None:
    """Half with the gate off."""
    run_twins(make_service, clock, busy_history(seed), seed % 2 == 0)
