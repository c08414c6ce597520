"""The shared Azure conversation trace, end to end, against an independent
plain-NumPy computation and the trace README's published figures."""

from __future__ import annotations

import base64
import csv
import html as html_lib
import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from controlplane.analysis.cli import register
from controlplane.analysis.forecast import forecast_axis
from controlplane.analysis.reader import read_log
from controlplane.analysis.report import write_report
from controlplane.analysis.summary import Analysis, analyze
from controlplane.analysis.terminal import num

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Oracle:
    """Figures recomputed from the raw CSV without the analysis package."""

    counts: np.ndarray
    tokens: np.ndarray
    gaps: np.ndarray
    prompt: np.ndarray
    output: np.ndarray


@pytest.fixture(scope="module")
def oracle(azure_trace: Path) -> Oracle:
    with azure_trace.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    epoch = datetime(1970, 1, 1)
    # Integer microseconds, like the reader, but via a separate code path.
    ts = np.array(
        [
            (datetime.fromisoformat(r["TIMESTAMP"]) - epoch) // np.timedelta64(1, "us").item()
            for r in rows
        ],
        dtype=np.int64,
    )
    prompt = np.array([int(r["ContextTokens"]) for r in rows])
    output = np.array([int(r["GeneratedTokens"]) for r in rows])
    bins = (ts - ts.min()) // 1_000_000
    return Oracle(
        counts=np.bincount(bins).astype(float),
        tokens=np.bincount(bins, weights=prompt + output),
        gaps=np.diff(np.sort(ts)) / 1e6,
        prompt=prompt,
        output=output,
    )


@pytest.fixture(scope="module")
def analysis(azure_trace: Path) -> Analysis:
    return analyze(read_log(azure_trace))


@pytest.fixture(scope="module")
def report(analysis: Analysis, tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_report(analysis, tmp_path_factory.mktemp("azure") / "report.html").read_text()


def test_matches_the_trace_readme(analysis: Analysis) -> None:
    assert len(analysis.log) == 19_366 and analysis.log.bad_row_count == 0
    r = analysis.overall.requests_per_s
    assert r is not None and r.cv is not None and r.peak_to_mean is not None
    # README: mean 5.53 req/s, CV 0.50, peak-to-mean 2.9 over per-second bins.
    assert round(r.mean, 2) == 5.53
    assert round(r.cv, 2) == 0.50
    assert round(r.peak_to_mean, 1) == 2.9
    # README: prompt median 1,020 (P99 4,142), generated median 129 (P99 601).
    p, g = analysis.overall.prompt_tokens, analysis.overall.output_tokens
    assert p is not None and g is not None
    assert (p.p50, p.p99, g.p50, g.p99) == (1020, 4142, 129, 601)


def test_matches_an_independent_computation(analysis: Analysis, oracle: Oracle) -> None:
    assert analysis.series is not None
    np.testing.assert_array_equal(analysis.series.requests, oracle.counts)
    np.testing.assert_allclose(analysis.series.tokens, oracle.tokens)
    r = analysis.overall.requests_per_s
    assert r is not None
    assert r.mean == pytest.approx(oracle.counts.mean())
    assert r.std == pytest.approx(oracle.counts.std())
    assert r.p95 == pytest.approx(np.percentile(oracle.counts, 95))
    assert r.p99 == pytest.approx(np.percentile(oracle.counts, 99))
    assert r.max == oracle.counts.max()
    ia = analysis.overall.interarrival
    assert ia is not None
    assert ia.mean_s == pytest.approx(oracle.gaps.mean())
    assert ia.p99_s == pytest.approx(np.percentile(oracle.gaps, 99))
    assert ia.cv == pytest.approx(oracle.gaps.std() / oracle.gaps.mean())
    windows = [w.requests for w in analysis.overall.windows]
    assert windows == [
        int(oracle.counts[i : i + 600].sum()) for i in range(0, oracle.counts.size, 600)
    ]


def _metrics(report: str) -> dict[str, str]:
    return dict(re.findall(r'data-metric="([^"]+)">([^<]*)<', report))


def test_report_sections_and_images(report: str) -> None:
    for section in (
        "summary",
        "rates",
        "interarrival",
        "lengths",
        "windows",
        "tenants",
        "incidents",
        "data-quality",
        "method",
    ):
        assert f'<section id="{section}">' in report
    assert "Post-incident reports" in report
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', report)
    assert len(images) >= 4  # rates, inter-arrivals, lengths, windows (+ incidents)
    for image in images:
        assert base64.b64decode(image).startswith(PNG_MAGIC)
    assert "no tenant column" in report  # the Azure trace has none


def test_report_figures_agree_with_oracle(report: str, oracle: Oracle) -> None:
    shown = _metrics(report)
    c = oracle.counts
    expected = {
        "overall.requests_per_s.mean": c.mean(),
        "overall.requests_per_s.std": c.std(),
        "overall.requests_per_s.p95": np.percentile(c, 95),
        "overall.requests_per_s.p99": np.percentile(c, 99),
        "overall.requests_per_s.max": c.max(),
        "overall.requests_per_s.cv": c.std() / c.mean(),
        "overall.requests_per_s.peak_to_mean": c.max() / c.mean(),
        "overall.tokens_per_s.mean": oracle.tokens.mean(),
        "overall.tokens_per_s.p99": np.percentile(oracle.tokens, 99),
        "overall.lengths.prompt_tokens.p50": np.median(oracle.prompt),
        "overall.lengths.prompt_tokens.p99": np.percentile(oracle.prompt, 99),
        "overall.lengths.output_tokens.p50": np.median(oracle.output),
        "overall.lengths.output_tokens.p99": np.percentile(oracle.output, 99),
        "windows.2.requests": int(c[1200:1800].sum()),
        "windows.2.requests_per_s.p95": np.percentile(c[1200:1800], 95),
    }
    for key, value in expected.items():
        display = num(int(value) if isinstance(value, int) else float(value))
        assert shown[key] == display, key
    assert shown["overall.interarrival.p99_s"] == f"{np.percentile(oracle.gaps, 99):.3f}"
    # The embedded machine-readable copy carries full precision.
    data = re.search(
        r'<script type="application/json" id="burstgate-data">(.*?)</script>', report, re.S
    )
    assert data is not None
    doc = json.loads(html_lib.unescape(data.group(1)))
    assert doc["overall"]["rates"]["requests_per_s"]["mean"] == pytest.approx(c.mean())
    assert doc["rows"]["analysed"] == 19_366


def test_report_shows_why_the_only_burst_is_one(report: str, oracle: Oracle) -> None:
    """The trace's one burst is on tokens alone: the table must show the token
    average over its threshold and the request average under its own."""
    shown = _metrics(report)
    assert re.findall(r'<tr id="burst-(\d+)">', report) == ["1"]
    assert 'href="#burst-1"' in report and 'class="band"' in report
    assert shown["incidents.1.start"] == "2023-11-16 18:58:03"
    assert shown["incidents.1.axes"] == "tokens"
    value = {
        k: float(v.replace(",", ""))
        for k, v in shown.items()
        if k.startswith("incidents.1.") and k.endswith(("smoothed", "threshold"))
    }
    assert value["incidents.1.tokens_per_s.smoothed"] > value["incidents.1.tokens_per_s.threshold"]
    assert (
        value["incidents.1.requests_per_s.smoothed"]
        <= value["incidents.1.requests_per_s.threshold"]
    )
    # The 1-second token peak inside the burst, recomputed from the raw CSV.
    start = int(
        (datetime(2023, 11, 16, 18, 58, 3) - datetime(2023, 11, 16, 18, 15, 46)).total_seconds()
    )
    assert shown["incidents.1.tokens_per_s.peak"] == num(
        int(oracle.tokens[start : start + 7].max())
    )


def test_cli_on_the_trace(azure_trace: Path) -> None:
    app = typer.Typer()
    register(app)
    result = CliRunner().invoke(app, ["analyze", str(azure_trace)])
    assert result.exit_code == 0
    assert "19,366 analysed, 0 bad" in result.stdout
    assert re.search(
        r"requests/s\s+5\.53\s+2\.77\s+5\.00\s+11\.00\s+13\.00\s+16\.00\s+0\.50\s+2\.89",
        result.stdout,
    )


def test_forecast_evaluation_on_the_trace(analysis: Analysis) -> None:
    assert analysis.series is not None
    result = forecast_axis("requests", analysis.series.requests, analysis.params.rule, 1.0)
    evaluation = result.evaluation
    assert evaluation is not None
    assert result.train_seconds + result.test_seconds == analysis.series.requests.size
    test = evaluation.test
    assert test.seconds == result.test_seconds
    for ratio in (test.recall, test.precision, test.false_alarm_ratio, test.quiet_alarm_rate):
        assert ratio is None or 0.0 <= ratio <= 1.0
