"""The engine model's prefix cache (sim/prefixcache.py, sim/engine.py): a
hit skips prefill, cached blocks live in free KV memory and are evicted when
running requests need it, the block arithmetic always balances."""

from __future__ import annotations

import random

import pytest

from controlplane.sim.engine import Engine, EngineParams, SimRequest
from controlplane.sim.prefixcache import MissMeter, PrefixCache

UNIT = 64  # tokens per block id: 4 of the engine's 16-token blocks


def _params(kv_tokens: int = 400_000) -> EngineParams:
    return EngineParams(kv_capacity_tokens=kv_tokens, max_num_batched_tokens=2_048)


def _run(engine: Engine, start_ns: int = 0) -> int:
    """Step until idle; returns the end time."""
    now = start_ns
    while engine.busy:
        end = engine.start_step(now)
        assert end is not None
        engine.finish_step(end)
        _check_blocks(engine)
        now = end
    return now


def _check_blocks(engine: Engine) -> None:
    """Every KV block is free or held: privately, or as a cached unit
    counted once however many requests share it; cached free units fit in
    the free blocks."""
    c = engine.cache
    assert c is not None
    k = c.unit_blocks
    private = sum(r.blocks - len(r.held) * k for r in engine.running)
    assert engine.free_blocks + private + len(c.refs) * k == engine.p.kv_blocks
    assert len(c.lru) * k <= engine.free_blocks
    assert all(n > 0 for n in c.refs.values())
    assert not set(c.refs) & set(c.lru)


def _cache(engine: Engine) -> PrefixCache:
    assert engine.cache is not None
    return engine.cache


def _req(key: int, ids: range | tuple[int, ...], prompt: int, output: int = 4) -> SimRequest:
    return SimRequest(key, prompt, output, 0, tuple(ids))


def test_a_repeated_prefix_skips_its_prefill_and_comes_sooner() -> None:
    engine = Engine(0, _params(), UNIT)
    first = _req(1, range(40), 40 * UNIT + 10)  # 40 whole blocks and a bit
    engine.submit(first, 0)
    t = _run(engine)
    second = _req(2, (*range(30), 999), 31 * UNIT)  # shares the first 30 blocks
    engine.submit(second, t)
    _run(engine, t)
    assert first.cached_tokens == 0 and first.prefill_computed == first.prompt
    assert second.cached_tokens == 30 * UNIT
    assert second.prefill_computed == UNIT  # only the block it did not share
    assert second.first_token_ns - t < first.first_token_ns
    cache = _cache(engine)
    assert (cache.queries, cache.hits) == (first.prompt + second.prompt, 30 * UNIT)


def test_a_prompt_cached_whole_still_computes_its_last_token() -> None:
    engine = Engine(0, _params(), UNIT)
    engine.submit(_req(1, range(3), 3 * UNIT), 0)
    t = _run(engine)
    again = _req(2, range(3), 3 * UNIT)
    engine.submit(again, t)
    _run(engine, t)
    # as vLLM: at most all but the last token, in whole blocks: two of three
    assert again.cached_tokens == 2 * UNIT
    assert again.prefill_computed == UNIT


def test_only_the_leading_run_counts() -> None:
    engine = Engine(0, _params(), UNIT)
    engine.submit(_req(1, (1, 2, 3, 4), 4 * UNIT + 1), 0)
    t = _run(engine)
    hole = _req(2, (1, 9, 3, 4), 4 * UNIT + 1)  # block 2 differs: 3 and 4 are another prefix
    engine.submit(hole, t)
    _run(engine, t)
    assert hole.cached_tokens == UNIT


def test_requests_running_together_share_a_prefix_without_copying_it() -> None:
    engine = Engine(0, _params(), UNIT)
    system = tuple(range(100, 132))  # 32 shared blocks
    a = _req(1, (*system, 1), 33 * UNIT, output=200)
    engine.submit(a, 0)
    now = 0
    while a.computed < a.prompt:  # a's prompt is computed (and cached), a still decodes
        end = engine.start_step(now)
        assert end is not None
        engine.finish_step(end)
        now = end
    free_before = engine.free_blocks
    b = _req(2, (*system, 2), 33 * UNIT, output=200)
    engine.submit(b, now)
    end = engine.start_step(now)
    assert end is not None
    engine.finish_step(end)
    _check_blocks(engine)
    assert b.cached_tokens == 32 * UNIT
    # b took memory for its own block (and a's next decode token), not for the shared 32
    assert free_before - engine.free_blocks <= 2 * PrefixCache(UNIT, 16).unit_blocks
    _run(engine, end)
    assert not _cache(engine).refs  # all let go; cached, evictable
    assert len(_cache(engine).lru) == 34


def test_memory_pressure_evicts_cached_prefixes() -> None:
    # 64 units of KV: a finished prompt's 40 cached units survive a small
    # neighbour, not a big one
    small_kv = 64 * UNIT
    for other_units, hit in ((10, True), (50, False)):
        engine = Engine(0, _params(small_kv), UNIT)
        engine.submit(_req(1, range(40), 40 * UNIT + 1), 0)
        t = _run(engine)
        engine.submit(_req(2, range(1000, 1000 + other_units), other_units * UNIT + 1), t)
        t = _run(engine, t)
        again = _req(3, range(40), 40 * UNIT + 1)
        engine.submit(again, t)
        _run(engine, t)
        assert (again.cached_tokens == 40 * UNIT) is hit, other_units
        assert (_cache(engine).evictions > 0) is not hit
        if not hit:  # a prompt's tail is evicted first: its head still hits
            assert 0 < again.cached_tokens < 40 * UNIT


def test_block_arithmetic_balances_under_preemption_and_aborts() -> None:
    rng = random.Random(7)
    engine = Engine(0, _params(kv_tokens=60 * UNIT), UNIT)  # small: preemptions happen
    prefixes = [tuple(range(p * 100, p * 100 + 12)) for p in range(3)]
    now, key = 0, 0
    for _ in range(300):
        if rng.random() < 0.4:
            key += 1
            own = tuple(range(10_000 + key * 50, 10_000 + key * 50 + rng.randint(0, 8)))
            ids = rng.choice(prefixes)[: rng.randint(1, 12)] + own
            engine.submit(_req(key, ids, len(ids) * UNIT + rng.randint(0, UNIT - 1),
                               output=rng.randint(1, 300)), now)  # fmt: skip
        if engine.running and rng.random() < 0.05:
            engine.abort(rng.choice(engine.running))
        end = engine.start_step(now)
        if end is not None:
            engine.finish_step(end)
            now = end
        _check_blocks(engine)
    _run(engine, now)
    assert engine.preemptions > 0 and _cache(engine).hits > 0
    assert engine.free_blocks == engine.p.kv_blocks and not _cache(engine).refs


def test_without_block_ids_the_cache_changes_nothing() -> None:
    def times(cache: int | None) -> list[tuple[int, int]]:
        engine = Engine(0, _params(kv_tokens=30_000), cache)
        reqs = [SimRequest(i, 500 + 37 * i, 50 + i, 0) for i in range(60)]
        for r in reqs:
            engine.submit(r, 0)
        now = 0
        while engine.busy:
            end = engine.start_step(now)
            assert end is not None
            engine.finish_step(end)
            now = end
        return [(r.first_token_ns, r.done_ns) for r in reqs]

    assert times(UNIT) == times(None)


def test_block_tokens_must_be_whole_engine_blocks() -> None:
    with pytest.raises(ValueError, match=r"--block-tokens: .*multiple of the engine's block_size"):
        Engine(0, _params(), 100)


def test_the_sidecar_miss_rate_is_windowed_over_the_counters() -> None:
    s = 1_000_000_000
    meter = MissMeter(5 * s)
    assert meter.rate(0, 0, 0) is None  # nothing looked up yet
    assert meter.rate(1 * s, 1_000, 800) == pytest.approx(0.2)
    assert meter.rate(2 * s, 2_000, 1_000) == pytest.approx(0.5)
    # past the window only the last 5 s count: 1,000 tokens looked up, none found
    assert meter.rate(7 * s, 3_000, 1_000) == pytest.approx(1.0)
    assert meter.rate(8 * s, 3_000, 1_000) == pytest.approx(1.0)
    assert meter.rate(20 * s, 3_000, 1_000) is None  # no lookup in the last 5 s
