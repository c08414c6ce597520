"""The HTML burst report: bands linked to an incident table, thresholds on
both panels, clock or relative time, and where ``--html`` writes.

The log has four planted bursts: three on request rate and one made of long
prompts only (a token burst at the usual request rate), the case where a
request-only view could not show why it is a burst.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from controlplane.analysis.plots import build_rate_figure, build_windows_figure
from controlplane.analysis.reader import read_log
from controlplane.analysis.summary import Analysis, analyze
from tests.integration.analysis.synth import (
    T0_US,
    burst_rates,
    iso,
    poisson_arrivals,
    write_csv,
)

SECONDS = 3600
REQUEST_BURSTS = [(600, 620, 25.0), (1500, 1508, 40.0), (2400, 2460, 15.0)]
TOKEN_BURST = (3000, 3020)  # same request rate, prompts of 9,000 tokens
HEADER = ("timestamp", "tenant_id", "prompt_tokens", "output_tokens")


def _rows(relative: bool) -> list[tuple[str, str, int, int]]:
    rng = np.random.default_rng(5)
    arrivals = poisson_arrivals(rng, burst_rates(SECONDS, 5.0, REQUEST_BURSTS))
    prompt = rng.integers(200, 1500, arrivals.size)
    long_prompts = (arrivals >= TOKEN_BURST[0]) & (arrivals < TOKEN_BURST[1])
    prompt[long_prompts] = 9000
    output = rng.integers(50, 300, arrivals.size)
    tenants = np.where(rng.random(arrivals.size) < 0.7, "acme", "globex")
    rows = []
    for offset, tenant, p, o in zip(arrivals, tenants, prompt, output, strict=True):
        # Relative logs count seconds from the trace's start (Mooncake-style).
        when = f"{offset:.6f}" if relative else iso(T0_US + round(offset * 1e6), zone=True)
        rows.append((when, str(tenant), int(p), int(o)))
    return rows


@pytest.fixture(scope="module")
def burst_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("report") / "bursts.csv"
    return write_csv(path, HEADER, _rows(relative=False))


@pytest.fixture(scope="module")
def relative_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("report") / "relative.csv"
    return write_csv(path, HEADER, _rows(relative=True))


@pytest.fixture(scope="module")
def analysis(burst_log: Path) -> Analysis:
    return analyze(read_log(burst_log))


@pytest.fixture(scope="module")
def rendered(
    app: typer.Typer, burst_log: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, dict[str, object]]:
    """(HTML, --json document) from one real CLI run."""
    out = tmp_path_factory.mktemp("html") / "report.html"
    result = CliRunner().invoke(app, ["analyze", str(burst_log), "--json", "--html", str(out)])
    assert result.exit_code == 0, result.output
    document: dict[str, object] = json.loads(result.stdout)
    return out.read_text(encoding="utf-8"), document


def _metric(html: str, key: str) -> str:
    found = re.search(rf'data-metric="{re.escape(key)}"[^>]*>(?:<a [^>]*>)?([^<]*)<', html)
    assert found is not None, key
    return found.group(1)


def _offset_s(stamp: str) -> float:
    """Seconds from T0 of an ISO time from the --json output."""
    return datetime.fromisoformat(stamp).timestamp() - T0_US / 1e6


def _number(text: str) -> float:
    return float(text.replace(",", "").removesuffix(" s"))


def test_incident_table_rows_match_the_detected_bursts(
    rendered: tuple[str, dict[str, object]],
) -> None:
    html, document = rendered
    incidents = document["incidents"]
    assert isinstance(incidents, list)
    # Every planted burst was found, at its place (edges within a few seconds).
    planted = [start for start, _, _ in REQUEST_BURSTS] + [TOKEN_BURST[0]]
    starts = [_offset_s(i["start"]) for i in incidents]
    assert len(incidents) == len(planted)
    for expected, found in zip(planted, starts, strict=True):
        assert abs(found - expected) <= 3
    assert incidents[-1]["axes"] == ["tokens"]

    table = html[html.index('id="burst-table"') :]
    table = table[: table.index("</table>")]
    row_numbers = [int(n) for n in re.findall(r'<tr id="burst-(\d+)">', table)]
    assert row_numbers == [i["number"] for i in incidents]
    for inc in incidents:
        n = inc["number"]
        shown = _metric(table, f"incidents.{n}.start")
        assert shown == inc["start"][:19].replace("T", " ")  # UTC, to the second
        assert _metric(table, f"incidents.{n}.duration_s") == f"{inc['duration_s']} s"
        assert _metric(table, f"incidents.{n}.axes") == " + ".join(inc["axes"])
        assert _number(_metric(table, f"incidents.{n}.excess_requests")) == round(
            inc["excess_requests"]
        )
        assert _number(_metric(table, f"incidents.{n}.requests_per_s.peak")) == inc["peak_rps"]
        # The number links on to the post-incident report, which links back.
        assert re.search(rf'<a href="#incident-{n}"[^>]*>{n}</a>', table)
        assert _metric(table, f"incidents.{n}.number") == str(n)
        assert f'id="incident-{n}"' in html and f'href="#burst-{n}"' in html


def test_bands_are_links_laid_over_the_timeline_in_time_order(
    rendered: tuple[str, dict[str, object]],
) -> None:
    html, document = rendered
    incidents = document["incidents"]
    assert isinstance(incidents, list)
    timeline = html[html.index('<div class="timeline">') :]
    timeline = timeline[: timeline.index("</div>")]
    assert 'src="data:image/png;base64,' in timeline
    bands = re.findall(
        r'<a class="band" id="band-(\d+)" href="#burst-(\d+)" title="([^"]*)"[^>]*'
        r'style="left:([\d.]+)%;top:([\d.]+)%;width:([\d.]+)%;height:([\d.]+)%"',
        timeline,
    )
    assert [int(b[0]) for b in bands] == [i["number"] for i in incidents]
    assert all(b[0] == b[1] for b in bands)  # each band links to its own row
    lefts = [float(b[3]) for b in bands]
    assert lefts == sorted(lefts) and len(set(lefts)) == len(lefts)
    for (_, _, title, left, top, width, height), inc in zip(bands, incidents, strict=True):
        assert inc["start"][11:19] in title
        assert 0 < float(left) < 100 and 0 <= float(top) < 20
        assert float(width) >= 1.0 and float(height) > 50  # clickable, spans both panels
    # Where a band sits along the axis follows when its burst started.
    positions = np.array([float(b[3]) + float(b[5]) / 2 for b in bands])
    seconds = np.array([_offset_s(i["start"]) for i in incidents])
    slope = np.polyfit(seconds, positions, 1)
    residual = positions - np.polyval(slope, seconds)
    assert slope[0] > 0 and np.abs(residual).max() < 1.0  # percent of the image width


def test_thresholds_are_shown_and_explain_the_token_burst(
    rendered: tuple[str, dict[str, object]], analysis: Analysis
) -> None:
    html, _ = rendered
    assert analysis.request_baseline is not None and analysis.token_baseline is not None
    for inc in analysis.incidents:
        key = f"incidents.{inc.number}"
        for axis, baseline in (
            ("requests", analysis.request_baseline),
            ("tokens", analysis.token_baseline),
        ):
            # Shown at the second the average stood furthest over its threshold
            # (the warm-up is long past: every second here has a threshold).
            margin = (baseline.smoothed - baseline.threshold)[inc.start : inc.end]
            at = inc.start + int(np.argmax(margin))
            threshold = _number(_metric(html, f"{key}.{axis}_per_s.threshold"))
            average = _number(_metric(html, f"{key}.{axis}_per_s.smoothed"))
            assert threshold == pytest.approx(baseline.threshold[at], rel=5e-3, abs=5e-3)
            assert average == pytest.approx(baseline.smoothed[at], rel=5e-3, abs=5e-3)
            # Why it is a burst: the triggering axis's average crossed its threshold.
            assert (average > threshold) == (axis in inc.axes), (inc.number, axis)
    token_only = analysis.incidents[-1]
    assert token_only.axes == ("tokens",)
    assert (
        f'class="trigger" data-metric="incidents.{token_only.number}.tokens_per_s.smoothed"' in html
    )


def test_timeline_draws_a_threshold_on_both_panels_and_a_utc_axis(analysis: Analysis) -> None:
    fig, axes, spans = build_rate_figure(analysis)
    assert len(axes) == 2 and len(spans) == len(analysis.incidents)
    for ax, baseline in zip(
        axes, (analysis.request_baseline, analysis.token_baseline), strict=True
    ):
        assert baseline is not None
        lines = [
            line for line in ax.get_lines() if str(line.get_label()).startswith("burst threshold")
        ]
        assert len(lines) == 1
        np.testing.assert_array_equal(
            np.asarray(lines[0].get_ydata(), dtype=float), baseline.threshold
        )
    fig.canvas.draw()
    assert axes[-1].get_xlabel() == "time (UTC)"
    ticks = [t.get_text() for t in axes[-1].get_xticklabels() if t.get_text()]
    assert len(ticks) >= 4 and all(re.fullmatch(r"\d\d:\d\d", t) for t in ticks), ticks
    token_ticks = [t.get_text() for t in axes[1].get_yticklabels() if t.get_text()]
    assert any(t.endswith("k") for t in token_ticks), token_ticks  # 20k, not 20000
    # Every burst is wide enough to see, even the 8-second one.
    span = analysis.timeline.n_bins if analysis.timeline else 0
    for _, x0, x1 in spans:
        assert (x1 - x0) * 86_400 >= 0.008 * span - 1e-6


def test_windows_chart_leaves_room_above_the_highest_bar(analysis: Analysis) -> None:
    fig = build_windows_figure(analysis)
    assert fig is not None
    (ax,) = fig.axes
    peak = max(w.requests_per_s.max for w in analysis.overall.windows)
    assert ax.get_ylim()[1] >= 1.2 * peak  # the bar, its value label and the legend fit
    labels = [t.get_text() for t in ax.texts]
    assert f"{peak:.3g}" in labels


def test_relative_timestamps_are_said_and_shown_as_time_since_zero(
    app: typer.Typer, relative_log: Path, tmp_path: Path
) -> None:
    out = tmp_path / "relative.html"
    result = CliRunner().invoke(app, ["analyze", str(relative_log), "--html", str(out)])
    assert result.exit_code == 0, result.output
    html = out.read_text(encoding="utf-8")
    assert "timestamps are relative" in html
    text = re.sub(
        r"data:image/png;base64,[^\"]+", "", html.split('<script type="application/json"')[0]
    )
    assert "1970" not in text  # no epoch-zero clock times anywhere on the page
    start = _metric(html, "incidents.1.start")
    assert re.fullmatch(r"\+0:(09|10):\d\d", start), start  # the burst planted at 600 s
    _fig, axes, _ = build_rate_figure(analyze(read_log(relative_log)))
    assert "relative" in axes[-1].get_xlabel() and "min" in axes[-1].get_xlabel()


# --------------------------------------------------------------------------- --html paths


def _run(app: typer.Typer, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


def test_html_file_path_writes_exactly_that_file(
    app: typer.Typer, burst_log: Path, tmp_path: Path
) -> None:
    target = tmp_path / "out.html"
    code, output = _run(app, "analyze", str(burst_log), "--html", str(target))
    assert code == 0, output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.html"]
    assert target.read_text(encoding="utf-8").startswith("<!doctype html>")
    assert f"HTML report: {target}" in output
    # A name without an extension is a file too, not a directory.
    bare = tmp_path / "report"
    code, _ = _run(app, "analyze", str(burst_log), "--html", str(bare))
    assert code == 0 and bare.is_file()


def test_html_existing_directory_gets_index_html(
    app: typer.Typer, burst_log: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "somedir"
    directory.mkdir()
    code, output = _run(app, "analyze", str(burst_log), "--html", f"{directory}/")
    assert code == 0, output
    assert sorted(p.name for p in directory.iterdir()) == ["index.html"]
    code, _ = _run(app, "analyze", str(burst_log), "--html", str(directory))  # no slash: same
    assert code == 0 and sorted(p.name for p in directory.iterdir()) == ["index.html"]


def test_html_missing_directory_is_a_clear_error(
    app: typer.Typer, burst_log: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "missing"
    code, output = _run(app, "analyze", str(burst_log), "--html", str(missing / "out.html"))
    assert code == 2
    assert f"error: --html {missing / 'out.html'}: directory {missing} does not exist" in output
    assert "Traceback" not in output
    code, output = _run(app, "analyze", str(burst_log), "--html", f"{missing}/")
    assert code == 2 and "no such directory" in output
    assert list(tmp_path.iterdir()) == []  # nothing created
    # Checked before the log is read: a wrong path does not cost the analysis.
    code, output = _run(app, "analyze", str(tmp_path / "no-log.csv"), "--html", f"{missing}/x.html")
    assert code == 2 and "--html" in output
