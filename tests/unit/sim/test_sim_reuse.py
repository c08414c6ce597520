"""Prefix reuse in ``simulate``: the chat-sessions generator, block ids in
traces and bursts, and the run's reuse and billing-drift report: in an
injected burst the hit rate falls, prefill costs more, and the plane's
multiplier follows the engines' reported miss rate."""

from __future__ import annotations

import itertools
import json
import statistics
from collections import defaultdict
from decimal import Decimal
from pathlib import Path

import pytest

from controlplane.domain.catalog import actual_cost, user_charge
from controlplane.domain.money import to_nanos
from controlplane.sim.reuse import DEFAULT_PRICE, WindowReuse
from controlplane.sim.run import Burst, SimSpec, prepare_trace, simulate
from controlplane.sim.synthetic import bind_system_prompts, generate
from controlplane.sim.trace import (
    ColumnMap,
    TraceError,
    TraceRequest,
    assign_tenants,
    inject_burst,
    load_trace,
)

SHARES = {"premium": 0.2, "standard": 0.5, "batch": 0.3}


def _sessions(seed: int = 0) -> list[TraceRequest]:
    trace = assign_tenants(generate("chat-sessions", seed=seed, duration_s=200), SHARES, seed=1)
    return bind_system_prompts("chat-sessions", seed, trace, 64)


def test_chat_sessions_repeat_their_prefixes_turn_after_turn() -> None:
    trace = _sessions()
    assert trace == _sessions()  # deterministic
    by_session: dict[int, list[TraceRequest]] = defaultdict(list)
    for r in trace:
        by_session[r.session].append(r)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert len(multi) > len(by_session) / 4
    for turns in by_session.values():
        assert len({t.tenant for t in turns}) == 1  # one conversation, one tenant
        for before, after in itertools.pairwise(turns):
            assert after.t_ns > before.t_ns
            # the next prompt holds the previous one and its answer
            assert after.prompt_tokens >= before.prompt_tokens + before.output_tokens
            whole = before.prompt_tokens // 64
            assert after.blocks[:whole] == before.blocks[:whole]
    # every request starts with its tenant's system prompt, and only its tenant's
    system: dict[str, tuple[int, ...]] = {}
    for r in trace:
        assert r.shared_blocks > 0 and len(r.blocks) == -(-r.prompt_tokens // 64)
        assert (
            system.setdefault(r.tenant, r.blocks[: r.shared_blocks]) == r.blocks[: r.shared_blocks]
        )
    assert len(set(system.values())) == len(SHARES)


def test_a_bursts_copies_are_new_users_of_the_same_tenant() -> None:
    trace = _sessions()
    burst = inject_burst(trace, "standard", 4, 50, 40, seed=3)
    copies = [r for r in burst if r.row > max(t.row for t in trace)]
    assert copies
    seen = {b for r in trace for b in r.blocks}
    fresh: set[int] = set()
    for c in copies:
        keep = c.blocks[: c.shared_blocks]
        assert keep == next(t for t in trace if t.tenant == c.tenant).blocks[: c.shared_blocks]
        new = set(c.blocks[c.shared_blocks :])
        assert not new & seen and not new & fresh  # never seen, never shared between copies
        fresh |= new
        assert c.session == -1


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


MOONCAKE = ColumnMap(time="timestamp", prompt="input_length", output="output_length",
                     time_unit="ms")  # fmt: skip


def test_a_mooncake_trace_brings_its_block_ids(tmp_path: Path) -> None:
    rows: list[dict[str, object]] = [
        {"timestamp": 0, "input_length": 1100, "output_length": 9, "hash_ids": [1, 2, 3]},
        {"timestamp": 5, "input_length": 600, "output_length": 4, "hash_ids": [1, 7]},
    ]
    reqs = load_trace(_jsonl(tmp_path / "m.jsonl", rows), MOONCAKE)
    assert [r.blocks for r in reqs] == [(1, 2, 3), (1, 7)]
    plain = load_trace(_jsonl(tmp_path / "p.jsonl", [{k: v for k, v in r.items()
                       if k != "hash_ids"} for r in rows]), MOONCAKE)  # fmt: skip
    assert [r.blocks for r in plain] == [(), ()]


@pytest.mark.parametrize(
    ("second", "message"),
    [
        ({}, r"missing column 'hash_ids' \(the first row has block ids"),
        ({"hash_ids": "1,2"}, "expected a JSON list of integer block ids"),
        ({"hash_ids": [1, "x"]}, "expected a list of integer block ids"),
        ({"hash_ids": [4, 4]}, "a block id repeats within one request"),
    ],
)
def test_bad_block_ids_are_named(tmp_path: Path, second: dict[str, object], message: str) -> None:
    rows: list[dict[str, object]] = [
        {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 600, "output_length": 4, **second},
    ]
    with pytest.raises(TraceError, match=message):
        load_trace(_jsonl(tmp_path / "bad.jsonl", rows), MOONCAKE)


def test_more_block_ids_than_the_block_size_allows_is_refused(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "m.jsonl", [
        {"timestamp": 0, "input_length": 100, "output_length": 4, "hash_ids": [1, 2, 3]},
        {"timestamp": 9, "input_length": 100, "output_length": 4, "hash_ids": [1]},
    ])  # fmt: skip
    spec = SimSpec(trace=path, columns=MOONCAKE)  # 512-token blocks: 100 tokens are 1
    with pytest.raises(ValueError, match=r"--block-tokens: row 0 has 3 block ids"):
        prepare_trace(spec)
    spec.block_tokens = 32
    assert [len(r.blocks) for r in prepare_trace(spec)] == [3, 1]


def _mean(windows: list[WindowReuse], attr: str) -> float:
    return statistics.fmean(getattr(w, attr) for w in windows)


@pytest.mark.parametrize("seed", [0, 1])
def test_an_injected_burst_drops_the_hit_rate_and_raises_prefill_cost(seed: int) -> None:
    window = 20
    spec = SimSpec(
        trace=f"synthetic:chat-sessions:{seed}:300", policies=("burstgate",), engines=1,
        loads=(0.7,), burst=Burst("standard", 6, 80, 60), pricing_window_s=window,
    )  # fmt: skip
    (run,) = simulate(spec)
    reuse = run.reuse
    assert reuse is not None and reuse.block_tokens == 64
    ws = reuse.windows
    # steady windows: warm (not the first), ended before the burst
    steady = [w for w in ws if w.start_s >= window and w.start_s + window <= 80]
    burst = [w for w in ws if w.start_s in reuse.burst_windows]
    assert len(steady) >= 2 and reuse.burst_windows == [80.0, 100.0, 120.0]
    # the phase change: fewer hits, more prefill work and time per token asked
    assert _mean(burst, "hit_rate") < _mean(steady, "hit_rate") - 0.1
    assert _mean(burst, "computed_over_asked") > _mean(steady, "computed_over_asked") + 0.1
    assert _mean(burst, "prefill_ms_per_ktok") > 1.25 * _mean(steady, "prefill_ms_per_ktok")
    # the engines reported it, and the plane's multiplier followed a window later
    assert _mean(burst, "miss_reported") > _mean(steady, "miss_reported") + 0.1
    steps_above = [w for w in burst[1:] if w.multiplier > 1]
    assert steps_above
    # the ledger: at a fixed price the cost outgrows the charge in the burst
    assert _mean(burst, "drift_fixed") > 0.02
    for w in ws:
        assert w.charge_dynamic >= w.charge_fixed
        if w.settled:
            assert w.ratio_fixed == pytest.approx(w.cost / w.charge_fixed)
    # where the step is in force the dynamic price charges more for the same cost
    assert any(w.charge_dynamic > w.charge_fixed * 1.05 for w in steps_above)
    # lanes: every served request is counted once
    assert sum(g.requests for g in reuse.lanes.values()) == run.overall.served


def test_the_bill_is_the_ledgers_own_formulas() -> None:
    spec = SimSpec(trace="synthetic:chat-sessions:2:120", policies=("fifo",), loads=(0.5,),
                   pricing_window_s=30)  # fmt: skip
    (run,) = simulate(spec)
    assert run.reuse is not None
    # the windows' sums against the catalog's functions on the run's totals
    total_cost = sum(w.cost for w in run.reuse.windows)
    total_fixed = sum(w.charge_fixed for w in run.reuse.windows)
    lanes = run.reuse.lanes
    prompt = sum(g.prompt_tokens for g in lanes.values())
    cached = sum(g.cached_tokens for g in lanes.values())
    assert 0 < cached < prompt
    # fixed price, cached tokens charged as any other (the default price):
    # the charge only depends on the tokens
    out_tokens = run.overall.served_tokens - prompt
    expected = to_nanos(user_charge(DEFAULT_PRICE, prompt, cached, out_tokens,
                                    Decimal(1), Decimal(1)))  # fmt: skip
    assert abs(total_fixed * 1e9 - expected) <= run.overall.served  # per-record rounding
    # the cost lies between all-hit and all-miss prefill
    low = to_nanos(actual_cost(DEFAULT_PRICE, prompt, out_tokens, Decimal(0)))
    high = to_nanos(actual_cost(DEFAULT_PRICE, prompt, out_tokens, Decimal(1)))
    served = run.overall.served
    gpu_overhead = to_nanos(DEFAULT_PRICE.gpu_overhead_per_request)
    assert low + (served - 1) * gpu_overhead < total_cost * 1e9 < high + served * gpu_overhead
