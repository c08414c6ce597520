"""The synthetic traces are what their names promise, for every seed tried,
deterministic, and round-trip exactly through the Azure CSV layout."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest

from controlplane.sim.synthetic import generate, parse_spec, per_second_stats, write_azure_csv
from controlplane.sim.trace import TraceRequest, load_trace

SEEDS = range(5)


@pytest.mark.parametrize("seed", SEEDS)
def test_heavy_burst_is_code_completion_in_rare_intense_bursts(seed: int) -> None:
    trace = generate("heavy-burst", seed=seed)
    shape = per_second_stats(trace)
    assert shape.cv > 2  # per-second arrivals: strongly bursty
    assert shape.peak_to_mean > 20  # the busiest second holds 20x the mean
    prompts = [r.prompt_tokens for r in trace]
    outputs = [r.output_tokens for r in trace]
    assert min(prompts) >= 1_500 and max(prompts) <= 2_500
    assert 1_800 < statistics.fmean(prompts) < 2_200
    assert 10 <= statistics.fmean(outputs) < 100  # tens of tokens
    # rare: most seconds are quiet (below twice the median second)
    counts = [0] * (shape.seconds)
    for r in trace:
        counts[r.t_ns // 1_000_000_000] += 1
    median = statistics.median(counts)
    assert sum(c > 2 * median for c in counts) < 0.05 * shape.seconds


@pytest.mark.parametrize("seed", SEEDS)
def test_long_prompt_has_long_heavy_tailed_prompts_that_fit_an_engine(seed: int) -> None:
    trace = generate("long-prompt", seed=seed)
    prompts = [r.prompt_tokens for r in trace]
    outputs = [r.output_tokens for r in trace]
    assert statistics.fmean(prompts) > 10_000
    assert statistics.median(prompts) < 0.75 * statistics.fmean(prompts)  # heavy right tail
    # capped well under a 128k context and an engine's 400k tokens of KV
    assert max(p + o for p, o in zip(prompts, outputs, strict=True)) <= 66_000
    assert 100 < statistics.fmean(outputs) < 1_000  # a few hundred tokens
    shape = per_second_stats(trace)
    assert shape.cv < 1.5  # gently modulated, not bursty: the lengths are the point


def test_generation_is_deterministic_and_seeded() -> None:
    a = generate("heavy-burst", seed=3, duration_s=120)
    assert a == generate("heavy-burst", seed=3, duration_s=120)
    assert a != generate("heavy-burst", seed=4, duration_s=120)
    assert a[0].t_ns == 0 and all(x.t_ns <= y.t_ns for x, y in itertools.pairwise(a))
    assert [r.row for r in a] == list(range(len(a)))
    assert max(r.t_ns for r in a) < 120 * 1_000_000_000


def test_the_azure_csv_reads_back_exactly(tmp_path: Path) -> None:
    trace = generate("long-prompt", seed=1, duration_s=300)
    path = tmp_path / "long.csv"
    write_azure_csv(trace, path)
    assert path.read_text().splitlines()[0] == "TIMESTAMP,ContextTokens,GeneratedTokens"
    back = load_trace(path)  # the Azure layout, datetimes: no options needed

    def key(rs: list[TraceRequest]) -> list[tuple[int, int, int]]:
        return [(r.t_ns, r.prompt_tokens, r.output_tokens) for r in rs]

    assert key(back) == key(trace)


def test_specs_parse_and_bad_ones_are_refused_clearly() -> None:
    assert parse_spec("trace.csv") is None
    assert parse_spec("synthetic:heavy-burst") == ("heavy-burst", 0, None)
    assert parse_spec("synthetic:long-prompt:7:900") == ("long-prompt", 7, 900.0)
    for bad, message in [
        ("synthetic:", "expected synthetic:NAME"),
        ("synthetic:heavy-burst:x", "SEED must be an integer"),
        ("synthetic:flood", "unknown synthetic trace 'flood'; known: heavy-burst, long-prompt"),
        ("synthetic:heavy-burst:1:2:3", "expected synthetic:NAME"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_spec(bad)
    with pytest.raises(ValueError, match="duration must be > 0"):
        generate("heavy-burst", duration_s=0)


@pytest.mark.parametrize("seed", range(3))
def test_diurnal_swings_over_minutes_and_is_chat_sized(seed: int) -> None:
    trace = generate("diurnal", seed=seed, duration_s=3_600)
    minutes = [0] * 60
    for r in trace:
        minutes[min(59, r.t_ns // (60 * 1_000_000_000))] += 1
    ranked = sorted(minutes)
    # the busiest minutes carry over twice the quietest ones' requests (a
    # trough of a quarter of the peak, waves on top): an autoscaler's job
    assert ranked[-3] > 2 * ranked[2]
    # but no single second dominates: swings, not bursts
    assert per_second_stats(trace).peak_to_mean < 6
    assert 900 < statistics.mean(r.prompt_tokens for r in trace) < 1_500
    assert 150 < statistics.mean(r.output_tokens for r in trace) < 300
    assert max(r.prompt_tokens for r in trace) <= 16_000
