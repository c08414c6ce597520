"""Burst detector and incident records on series with known bursts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from controlplane.analysis.bursts import (
    BurstInterval,
    BurstRule,
    compute_baseline,
    detect_bursts,
    merge_axes,
    runs,
)
from controlplane.analysis.reader import read_log
from controlplane.analysis.summary import analyze
from tests.integration.analysis.synth import (
    LEDGER_HEADER,
    T0_US,
    burst_rates,
    iso,
    poisson_arrivals,
    write_csv,
)

KNOWN = [(600, 630, 40.0), (1200, 1215, 30.0)]


def _poisson_series(seed: int, rates: np.ndarray) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.poisson(rates).astype(np.float64)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_finds_known_bursts_on_poisson_traffic(seed: int) -> None:
    series = _poisson_series(seed, burst_rates(1800, 10.0, KNOWN))
    found = detect_bursts(series, BurstRule())
    assert len(found) == len(KNOWN)
    for burst, (start, end, _) in zip(found, KNOWN, strict=True):
        # Change-point edges: within a second or two of the true ones.
        assert abs(burst.start - start) <= 2 and abs(burst.end - end) <= 2
        # Detected once the 5-s average has been hot for 5 s: 5-9 s in.
        assert start + 4 <= burst.detected_at < start + 10
        assert burst.baseline == pytest.approx(10.0, abs=1.5)
        assert burst.peak >= burst.mean > burst.threshold > burst.baseline


def test_poisson_noise_alone_is_not_bursty() -> None:
    # Pure Poisson traffic, five hours at each of three rates: the rule may
    # fire on a rare fluctuation (about once in ten hours), not routinely.
    false_bursts = sum(
        len(detect_bursts(_poisson_series(seed, np.full(3600, rate))))
        for seed in range(5)
        for rate in (0.5, 10.0, 100.0)
    )
    assert false_bursts <= 4


def test_constant_and_silent_series() -> None:
    assert detect_bursts(np.full(1000, 7.0)) == []
    assert detect_bursts(np.zeros(1000)) == []
    assert detect_bursts(np.zeros(0)) == []
    one_request = np.zeros(1000)
    one_request[500] = 1.0
    assert detect_bursts(one_request) == []  # floor: one event per window is not a burst
    spike = np.zeros(1000)
    spike[500:505] = 3.0  # 15 requests from silence in five seconds is
    assert [(b.start, b.end) for b in detect_bursts(spike)] == [(500, 505)]


def test_nothing_is_scored_before_warm_up() -> None:
    series = np.full(400, 5.0)
    series[30:40] = 100.0  # inside the first minute: no baseline yet
    assert detect_bursts(series) == []
    base = compute_baseline(series, BurstRule())
    # Ready once 60 baseline windows end before the current one: t - 5 >= 59.
    assert not base.ready[:64].any() and base.ready[64:].all()


def test_baseline_excludes_the_current_window() -> None:
    rule = BurstRule(k=3.0, min_seconds=5, baseline_seconds=100)
    series = np.full(300, 2.0)
    series[200:] = 50.0
    base = compute_baseline(series, rule)
    # At t=204 the 5-s window is all 50s, while the baseline still ends at t=199.
    assert base.smoothed[204] == 50.0 and base.mean[204] == pytest.approx(2.0)


def test_rule_parameters_change_the_answer() -> None:
    series = _poisson_series(7, burst_rates(1800, 10.0, [(900, 903, 25.0)]))
    short_window = detect_bursts(series, BurstRule(min_seconds=2))
    assert any(890 <= b.start <= 905 for b in short_window)
    strict = detect_bursts(series, BurstRule(k=8.0))
    assert strict == []
    with pytest.raises(ValueError):
        BurstRule(k=0)
    with pytest.raises(ValueError):
        BurstRule(min_seconds=0)
    with pytest.raises(ValueError):
        BurstRule(baseline_seconds=1)


def test_nearby_bursts_merge() -> None:
    series = _poisson_series(11, burst_rates(1800, 10.0, [(900, 910, 40.0), (913, 923, 40.0)]))
    found = detect_bursts(series)
    assert len(found) == 1 and found[0].start <= 901 and found[0].end >= 921


def test_runs_and_merge_axes() -> None:
    assert runs(np.array([0, 1, 1, 0, 1], dtype=bool)) == [(1, 3), (4, 5)]
    assert runs(np.zeros(0, dtype=bool)) == []
    req = [BurstInterval(10, 20, 12, 9.0, 8.0, 2.0, 5.0)]
    tok = [BurstInterval(18, 30, 18, 9.0, 8.0, 2.0, 5.0), BurstInterval(100, 105, 101, 1, 1, 0, 0)]
    merged = merge_axes({"requests": req, "tokens": tok}, gap=5)
    assert [(m.start, m.end, m.detected_at, m.axes) for m in merged] == [
        (10, 30, 12, ("requests", "tokens")),
        (100, 105, 101, ("tokens",)),
    ]


def _ledger_with_culprit(tmp_path: Path) -> Path:
    """Three tenants at steady rates; 'noisy' bursts at 20/s for 20 s at 900 s.

    Burst requests wait 400 ms in queue and half of them are refused.
    """
    rng = np.random.default_rng(5)
    rows = []
    steady = {"acme": 4.0, "beta": 3.0, "noisy": 1.0}
    for tenant, rate in steady.items():
        extra = [(900, 920, 20.0)] if tenant == "noisy" else []
        for i, offset in enumerate(poisson_arrivals(rng, burst_rates(1800, rate, extra))):
            arrival = T0_US + round(offset * 1_000_000)
            in_burst = tenant == "noisy" and 900 <= offset < 920
            wait_us = 400_000 if in_burst else 10_000
            decision = "rejected" if in_burst and i % 2 else "admitted"
            rows.append(
                (
                    tenant,
                    f"{tenant}-{i}",
                    "interactive",
                    "m",
                    "p",
                    iso(arrival, zone=True),
                    iso(arrival, zone=True),
                    iso(arrival + wait_us, zone=True),
                    iso(arrival + wait_us + 1_000_000, zone=True),
                    100,
                    0,
                    10,
                    decision,
                )
            )
    rng.shuffle(rows)  # exports need not be sorted
    return write_csv(tmp_path / "ledger.csv", LEDGER_HEADER, rows)


def test_incident_record_names_the_culprit(tmp_path: Path) -> None:
    a = analyze(read_log(_ledger_with_culprit(tmp_path)))
    assert a.timeline is not None
    assert len(a.incidents) == 1
    inc = a.incidents[0]
    assert abs(inc.start - 900) <= 2 and abs(inc.end - 920) <= 2
    assert set(inc.axes) == {"requests", "tokens"}
    top = inc.top_tenants[0]
    assert top.tenant == "noisy" and top.share > 0.6 and top.usual_share < 0.2
    assert inc.queue_wait_ms is not None and inc.queue_wait_ms.p50 == pytest.approx(400.0)
    assert inc.latency_ms is not None and inc.latency_ms.p50 == pytest.approx(1400.0)
    assert set(inc.decisions) == {"admitted", "rejected"}
    assert inc.excess_requests == pytest.approx(inc.requests - inc.baseline_rps * inc.duration_s)
    assert 8.0 - 1.5 < inc.baseline_rps < 8.0 + 1.5
    by_tenant = {t.tenant: t for t in a.tenants}
    assert len(by_tenant["noisy"].bursts) == 1 and by_tenant["acme"].bursts == []


def test_token_only_burst(tmp_path: Path) -> None:
    # Steady 5 requests/s, but prompts grow 20x for 15 s: a token-axis burst.
    rng = np.random.default_rng(9)
    offsets = poisson_arrivals(rng, np.full(1200, 5.0))
    prompts = np.where((offsets >= 700) & (offsets < 715), 4000, 200)
    rows = [
        (iso(T0_US + round(o * 1e6)), int(p), 50) for o, p in zip(offsets, prompts, strict=True)
    ]
    a = analyze(
        read_log(write_csv(tmp_path / "t.csv", ("ts", "prompt_tokens", "output_tokens"), rows))
    )
    assert [i.axes for i in a.incidents] == [("tokens",)]
    inc = a.incidents[0]
    assert abs(inc.start - 700) <= 2 and abs(inc.end - 715) <= 2
    assert inc.peak_tokens_per_s > 5 * inc.baseline_tokens_per_s


def test_edges_ignore_a_lone_noisy_second_before_the_rise() -> None:
    series = np.full(900, 10.0)
    series[596] = 20.0  # a noisy second, three seconds before the burst
    series[600:620] = 50.0
    (burst,) = detect_bursts(series)
    assert (burst.start, burst.end) == (600, 620)
    # A reactive detector knows once the 5-s average has been hot 5 s in a row.
    assert burst.detected_at == 604


@pytest.mark.parametrize(
    "burst",
    [(600, 603, 60.0), (600, 605, 40.0), (600, 610, 25.0)],
    ids=["3s-at-6x", "5s-at-4x", "10s-at-2.5x"],
)
@pytest.mark.parametrize("seed", range(5))
def test_short_real_bursts_are_still_caught(burst: tuple[int, int, float], seed: int) -> None:
    # The "t hot seconds in a row" requirement must not hide short, real bursts.
    series = _poisson_series(seed, burst_rates(1200, 10.0, [burst]))
    found = [b for b in detect_bursts(series) if 590 <= b.start <= burst[1]]
    assert len(found) == 1
