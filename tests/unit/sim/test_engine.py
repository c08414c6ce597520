"""The engine model's invariants: tokens conserved, the KV cache never over
capacity, every request ends exactly once, FIFO starts, deterministic."""

from __future__ import annotations

import itertools
import random
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.sim.engine import Engine, EngineParams, SimRequest
from controlplane.sim.pool import Pool

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
    # step 1: the whole prompt in one chunk (1,000 x 1,001 / 2 causal
    # attention pairs); steps 2-3: one decode each
    prefill_us = (
        p.step_base_us + p.prefill_token_us * 1_000
        + p.prefill_attention_us_per_pair * (1_000 * 1_001 // 2)
        + p.attention_us_per_kv_token * 1_000
    )  # fmt: skip
    decode_us = p.step_base_us + p.decode_token_us + p.attention_us_per_kv_token * 1_001
    assert req.first_token_ns == ends[0] == int(prefill_us * 1_000)
    assert ends[1] - ends[0] == int(decode_us * 1_000)
    assert req.done_ns == ends[-1] and len(ends) == 3


def test_a_later_chunk_attends_over_the_chunks_before_it() -> None:
    """Causal attention makes a long prompt cost more than its length: the
    second 512-token chunk attends over 512 cached tokens as well."""
    p = EngineParams(max_num_batched_tokens=512)
    ends = run_to_idle(Engine(0, p), [SimRequest("long", 1_024, 1, 0)])
    first, second = ends[0], ends[1] - ends[0]
    extra_pairs = 512 * 512  # the second chunk's pairs with the first chunk's keys
    extra_us = p.prefill_attention_us_per_pair * extra_pairs + p.attention_us_per_kv_token * 512
    assert second - first == pytest.approx(extra_us * 1_000, abs=2)


def test_prefill_slowdown_slows_prefill_and_nothing_else() -> None:
    base = EngineParams()
    slow = base.with_prefill_slowdown(2.0)
    assert slow.prefill_token_us == 2 * base.prefill_token_us
    assert slow.prefill_attention_us_per_pair == 2 * base.prefill_attention_us_per_pair
    assert (slow.decode_token_us, slow.step_base_us, slow.attention_us_per_kv_token) == (
        base.decode_token_us, base.step_base_us, base.attention_us_per_kv_token
    )  # fmt: skip
    fast_ends = run_to_idle(Engine(0, base), [SimRequest("r", 2_000, 50, 0)])
    slow_ends = run_to_idle(Engine(0, slow), [SimRequest("r", 2_000, 50, 0)])
    # the first token comes later; each decode step after it takes as long
    assert slow_ends[0] > 1.8 * (fast_ends[0] - base.step_base_us * 1_000)
    assert [b - a for a, b in itertools.pairwise(slow_ends[1:])] == [
        b - a for a, b in itertools.pairwise(fast_ends[1:])
    ]
    with pytest.raises(ValueError, match="prefill slowdown: must be > 0"):
        base.with_prefill_slowdown(0)


def test_a_legacy_per_token_cost_sets_prefill_and_decode_alike() -> None:
    p = EngineParams.from_mapping({"per_token_us": 22})
    assert (p.prefill_token_us, p.decode_token_us, p.prefill_attention_us_per_pair) == (22, 22, 0)
    with pytest.raises(ValueError, match=r"engine\.per_token_us: give it or \['decode_token_us'\]"):
        EngineParams.from_mapping({"per_token_us": 22, "decode_token_us": 30})


def test_cancel_waiting_drops_only_requests_that_never_started() -> None:
    engine = Engine(0, EngineParams(max_num_seqs=1))
    first, second = SimRequest("a", 100, 5, 0), SimRequest("b", 100, 5, 0)
    engine.submit(first, 0)
    engine.submit(second, 0)
    end = engine.start_step(0)  # ``first`` starts; ``second`` waits (one sequence at most)
    assert end is not None and engine.stepping
    assert not engine.cancel_waiting(first)  # it started: it stays
    assert engine.cancel_waiting(second)  # mid-step: it holds no blocks, is in no step
    assert not engine.cancel_waiting(second)  # gone already
    assert engine.waiting == deque() and engine.outstanding_tokens == 105
    engine.finish_step(end)
    assert engine.free_blocks + first.blocks == engine.p.kv_blocks


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
