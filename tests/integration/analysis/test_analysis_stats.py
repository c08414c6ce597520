"""Statistics against hand-computed values on small synthetic logs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.analysis.jsonout import analysis_to_dict
from controlplane.analysis.reader import read_log
from controlplane.analysis.stats import ks_distance_exponential
from controlplane.analysis.summary import Analysis, AnalysisParams, analyze
from tests.integration.analysis.synth import AZURE_HEADER, azure_rows, write_csv


def _analyse(
    tmp_path: Path, offsets: list[float], prompt: list[int], output: list[int]
) -> Analysis:
    path = write_csv(tmp_path / "log.csv", AZURE_HEADER, azure_rows(offsets, prompt, output))
    return analyze(read_log(path))


def test_small_log_by_hand(tmp_path: Path) -> None:
    # Arrivals at +0.1, +0.5, +1.2, +3.9 s: bins from the first arrival are
    # [0.1, 1.1) [1.1, 2.1) [2.1, 3.1) [3.1, 4.1) -> counts [2, 1, 0, 1].
    a = _analyse(tmp_path, [0.1, 0.5, 1.2, 3.9], [10, 20, 30, 40], [1, 2, 3, 4])
    assert a.timeline is not None and a.timeline.n_bins == 4
    assert a.series is not None and a.series.requests.tolist() == [2, 1, 0, 1]
    r = a.overall.requests_per_s
    assert r is not None
    assert r.mean == 1.0 and r.total == 4
    assert r.std == pytest.approx(math.sqrt(0.5))  # deviations 1, 0, -1, 0
    assert r.cv == pytest.approx(math.sqrt(0.5))
    assert r.max == 2 and r.peak_to_mean == 2.0
    # Linear interpolation on sorted [0, 1, 1, 2]: P95 at rank 2.85 -> 1.85.
    assert r.p50 == 1.0 and r.p95 == pytest.approx(1.85) and r.p99 == pytest.approx(1.97)
    # Prompt tokens per second [30, 30, 0, 40]: mean 25, peak 40.
    p = a.overall.prompt_tokens_per_s
    assert p is not None and p.mean == 25.0 and p.max == 40.0 and p.peak_to_mean == 1.6
    t = a.overall.tokens_per_s
    assert t is not None and t.total == 110.0  # 100 prompt + 10 output

    ia = a.overall.interarrival
    assert ia is not None
    # Gaps 0.4, 0.7, 2.7 s: mean 3.8/3, squared deviations sum to 3.126667.
    mean = 3.8 / 3
    assert ia.count == 3 and ia.mean_s == pytest.approx(mean)
    assert ia.p50_s == pytest.approx(0.7) and ia.p99_s == pytest.approx(2.66)
    assert ia.max_s == pytest.approx(2.7)
    assert ia.std_s == pytest.approx(math.sqrt(3.126667 / 3), rel=1e-6)
    assert ia.cv == pytest.approx(0.805961, rel=1e-5)
    assert ia.exponential_p99_s == pytest.approx(mean * math.log(100))
    # KS by hand: F(x) = 1 - exp(-x/mean) = 0.27079, 0.42457, 0.88133 against
    # steps 1/3, 2/3, 1: the largest gap is F(0.4) - 0 = 0.27079 (below the first step).
    assert ia.ks_distance == pytest.approx(0.270787, rel=1e-5)
    assert ia.count_dispersion == pytest.approx(0.5)  # var 0.5 / mean 1

    lengths = a.overall.prompt_tokens
    assert lengths is not None
    assert (lengths.count, lengths.mean, lengths.p50, lengths.max) == (4, 25.0, 25.0, 40.0)
    assert lengths.p90 == pytest.approx(37.0)  # rank 2.7 between 30 and 40


def test_ks_distance_of_exponential_quantiles_is_small() -> None:
    n = 2000
    quantiles = -np.log1p(-(np.arange(n) + 0.5) / n)  # mean ~1 exponential grid
    d = ks_distance_exponential(quantiles)
    assert d is not None and d < 0.01
    assert ks_distance_exponential(np.zeros(5)) is None


def test_empty_log(tmp_path: Path) -> None:
    a = _analyse(tmp_path, [], [], [])
    assert a.timeline is None and a.overall.requests == 0
    assert a.overall.requests_per_s is None and a.incidents == []
    doc = analysis_to_dict(a)
    json.dumps(doc, allow_nan=False)
    assert doc["overall"]["rates"]["requests_per_s"] is None
    assert doc["span"] == {"start": None, "end": None, "seconds": 0}


def test_one_request(tmp_path: Path) -> None:
    a = _analyse(tmp_path, [5.0], [100], [10])
    r = a.overall.requests_per_s
    assert r is not None
    assert (r.seconds, r.mean, r.std, r.max, r.cv, r.peak_to_mean) == (1, 1.0, 0.0, 1.0, 0.0, 1.0)
    assert a.overall.interarrival is None  # no gap to measure
    assert a.incidents == []
    assert len(a.overall.windows) == 1 and a.overall.windows[0].requests == 1


def test_all_requests_in_one_second(tmp_path: Path) -> None:
    a = _analyse(tmp_path, [0.0, 0.2, 0.4, 0.6, 0.8], [1] * 5, [1] * 5)
    r = a.overall.requests_per_s
    assert r is not None and (r.seconds, r.mean, r.std, r.cv) == (1, 5.0, 0.0, 0.0)
    ia = a.overall.interarrival
    assert (
        ia is not None and ia.mean_s == pytest.approx(0.2) and ia.cv == pytest.approx(0.0, abs=1e-9)
    )


def test_identical_timestamps_have_no_gap_ratios(tmp_path: Path) -> None:
    a = _analyse(tmp_path, [1.0, 1.0, 1.0], [1] * 3, [1] * 3)
    ia = a.overall.interarrival
    assert ia is not None and ia.mean_s == 0.0
    assert ia.cv is None and ia.ks_distance is None and ia.p99_vs_exponential is None
    json.dumps(analysis_to_dict(a), allow_nan=False)


def test_ten_minute_windows(tmp_path: Path) -> None:
    # One request per second for 1500 s, plus 60 extra in second 700.
    offsets = [float(s) for s in range(1500)] + [700.5] * 60
    a = _analyse(tmp_path, offsets, [1] * len(offsets), [1] * len(offsets))
    windows = a.overall.windows
    assert [(w.index, w.seconds, w.requests) for w in windows] == [
        (0, 600, 600),
        (1, 600, 660),
        (2, 300, 300),
    ]
    assert windows[1].requests_per_s.max == 61 and windows[1].requests_per_s.p50 == 1
    assert windows[1].start_us - windows[0].start_us == 600_000_000


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=120, allow_nan=False), min_size=2, max_size=60))
def test_order_does_not_matter(offsets: list[float]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        ordered = sorted(offsets)
        tokens = [int(10 * o) for o in ordered]
        a = analyze(
            read_log(write_csv(base / "a.csv", AZURE_HEADER, azure_rows(ordered, tokens, tokens)))
        )
        shuffled = list(zip(ordered, tokens, strict=True))[::-1]
        b = analyze(
            read_log(
                write_csv(
                    base / "b.csv",
                    AZURE_HEADER,
                    azure_rows(
                        [o for o, _ in shuffled], [t for _, t in shuffled], [t for _, t in shuffled]
                    ),
                )
            )
        )
    assert a.overall.requests_per_s == b.overall.requests_per_s
    assert a.overall.interarrival == b.overall.interarrival
    assert a.overall.prompt_tokens == b.overall.prompt_tokens
    assert a.out_of_order_rows == 0
    assert a.series is not None and a.series.requests.sum() == len(offsets)


def test_unsorted_log_counts_out_of_order_rows(tmp_path: Path) -> None:
    a = _analyse(tmp_path, [3.0, 1.0, 2.0, 0.0], [1] * 4, [1] * 4)
    assert a.out_of_order_rows == 2
    assert a.series is not None and a.series.requests.tolist() == [1, 1, 1, 1]


def test_per_tenant_figures_use_the_log_timeline(tmp_path: Path) -> None:
    rows = [(1700000000.0 + s, "busy" if s % 2 else "quiet", 10, 1) for s in range(10)]
    rows += [(1700000005.5, "busy", 10, 1)] * 4
    path = write_csv(tmp_path / "t.csv", ("ts", "tenant", "prompt_tokens", "output_tokens"), rows)
    a = analyze(read_log(path))
    by_name = {t.tenant: t for t in a.tenants}
    assert [t.tenant for t in a.tenants] == ["busy", "quiet"]  # most requests first
    busy = by_name["busy"].requests_per_s
    assert busy is not None and busy.seconds == 10 and busy.total == 9 and busy.max == 5
    assert a.overall.requests == 14
    none = analyze(read_log(path), AnalysisParams(per_tenant=False))
    assert none.tenants == []
    capped = analyze(read_log(path), AnalysisParams(max_tenants=1))
    assert len(capped.tenants) == 1 and capped.tenants_not_shown == 1
