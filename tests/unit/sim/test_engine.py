"""The engine model's invariants: tokens conserved, the KV cache never over
capacity, every request ends exactly once, FIFO starts, deterministic."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.sim.engine import Engine, EngineParams, Pool, SimRequest

SMALL_KV = EngineParams(kv_capacity_tokens=4_096, block_size=16, max_num_batched_tokens=1_024)


def run_to_idle(engine: Engine, reqs: list[SimRequest], *, check: bool = True) -> list[int]:
    """Submit everything at t=0, step until idle; return the step end times.
    With ``check``, assert the KV and bookkeeping invariants after each step."""
    for r in reqs:
        engine.submit(r, 0)
    now = 0
    ends = []
    while engine.busy:
        end = engine.start_step(now)
        assert end is not None and end > now, "a busy engine always makes progress"
        engine.finish_step(end)
        now = end
        ends.append(end)
        if check:
            held = sum(r.blocks for r in engine.running) + sum(r.blocks for r in engine.waiting)
            assert engine.free_blocks >= 0
            assert held + engine.free_blocks == engine.p.kv_blocks
            assert all(r.blocks * engine.p.block_size >= r.computed for r in engine.running)
            assert len(engine.running) <= engine.p.max_num_seqs
        assert len(ends) < 1_000_000
    return ends


def random_requests(n: int, seed: int) -> list[SimRequest]:
    rng = random.Random(seed)
    return [SimRequest(i, rng.randint(1, 2_000), rng.randint(1, 300), 0) for i in range(n)]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), seed=st.integers(0, 10_000))
def test_every_request_ends_once_with_its_tokens_within_kv_capacity(n: int, seed: int) -> None:
    engine = Engine(0, SMALL_KV)
    reqs = random_requests(n, seed)
    run_to_idle(engine, reqs)
    assert all(r.generated == r.output and r.done_ns > 0 for r in reqs)
    assert engine.finished_total == n
    assert engine.generation_tokens_total == sum(r.output for r in reqs)
    assert engine.free_blocks == SMALL_KV.kv_blocks  # everything given back
    assert engine.outstanding_tokens == 0
    assert all(0 < r.first_token_ns <= r.done_ns for r in reqs)


def test_kv_pressure_preempts_and_recomputes_yet_everything_finishes() -> None:
    engine = Engine(0, SMALL_KV)
    reqs = [SimRequest(i, 600, 400, 0) for i in range(12)]  # 12 x 1,000 tokens >> 4,096
    run_to_idle(engine, reqs)
    assert engine.preemptions > 0
    assert sum(r.preemptions for r in reqs) == engine.preemptions
    assert all(r.generated == r.output for r in reqs)
    # recomputed prefill counts again as prompt tokens
    assert engine.prompt_tokens_total > sum(r.prompt for r in reqs)


def test_waiting_requests_start_in_arrival_order() -> None:
    engine = Engine(0, EngineParams(max_num_seqs=4))
    reqs = [SimRequest(i, 100, 50, 0) for i in range(20)]
    run_to_idle(engine, reqs)
    starts = [r.started_ns for r in reqs]
    assert starts == sorted(starts)
    assert len(set(starts)) > 1  # max_num_seqs held some back


def test_step_times_follow_the_cost_model() -> None:
    p = EngineParams()
    engine = Engine(0, p)
    req = SimRequest("one", 1_000, 3, 0)
    ends = run_to_idle(engine, [req])
    # step 1: the whole prompt in one chunk; steps 2-3: one decode each
    prefill_us = p.step_base_us + p.per_token_us * 1_000 + p.attention_us_per_kv_token * 1_000
    decode_us = p.step_base_us + p.per_token_us + p.attention_us_per_kv_token * 1_001
    assert req.first_token_ns == ends[0] == int(prefill_us * 1_000)
    assert ends[1] - ends[0] == int(decode_us * 1_000)
    assert req.done_ns == ends[-1] and len(ends) == 3


def test_long_prompt_is_prefilled_in_chunks() -> None:
    p = EngineParams(max_num_batched_tokens=512)
    engine = Engine(0, p)
    req = SimRequest("long", 2_000, 1, 0)
    ends = run_to_idle(engine, [req])
    assert len(ends) == 4  # 512 + 512 + 512 + 464: the first token after the 4th chunk
    assert req.first_token_ns == ends[3]


def test_deterministic() -> None:
    def timeline() -> list[tuple[int, int, int]]:
        engine = Engine(0, SMALL_KV)
        reqs = random_requests(40, seed=7)
        run_to_idle(engine, reqs, check=False)
        return [(r.first_token_ns, r.done_ns, r.preemptions) for r in reqs]

    assert timeline() == timeline()


def test_router_picks_least_outstanding_tokens() -> None:
    pool = Pool(3, EngineParams())
    sizes = [900, 100, 500, 50, 50]
    for i, size in enumerate(sizes):
        pool.route().submit(SimRequest(i, size, 10, 0), 0)
    # prompt + output: 910 -> e0, 110 -> e1, 510 -> e2, then the two 60s to
    # e1 (110, then 170: still the least)
    assert [e.outstanding_tokens for e in pool.engines] == [910, 230, 510]


def test_bad_parameters_and_oversized_requests_are_refused() -> None:
    with pytest.raises(ValueError, match=r"engine\.block_size"):
        EngineParams(block_size=0)
    with pytest.raises(ValueError, match="unknown parameter"):
        EngineParams.from_mapping({"max_num_seqs": 8, "warp_drive": 1})
    with pytest.raises(ValueError, match="exceed the engine's KV capacity"):
        Engine(0, SMALL_KV).submit(SimRequest("huge", 5_000, 10, 0), 0)
