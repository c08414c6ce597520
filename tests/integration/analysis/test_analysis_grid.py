"""Timestamps on a coarse grid (docs/analysis.md, "Bins and the timestamps'
grid"): the grid is detected, rates are binned at whole steps of it (or at
``--bin-seconds``), the log is analysed rather than refused, every finding
is in the HTML summary and its "Data quality", and no burst is listed
shorter than the rule's minimum.

The traces are synthetic, from known processes: Poisson arrivals whose rate
swells and ebbs over minutes, timestamps in milliseconds since the start (a
Mooncake-shaped JSON Lines log), rounded down to a grid or not."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import typer

from controlplane.analysis.bursts import BurstRule, detect_bursts
from controlplane.analysis.grid import choose_binning, timestamp_grid_us
from tests.integration.analysis.conftest import run

MS = 1_000  # µs
SPAN_S = 1_800


def arrivals_ms(seed: int, span_s: int = SPAN_S, mean_rate: float = 6.0) -> np.ndarray:
    """Arrival times (ms since start) of a Poisson process whose rate swells
    between 0.4x and 1.6x the mean over a 5-minute period."""
    rng = np.random.default_rng(seed)
    t = np.sort(rng.uniform(0.0, span_s, int(mean_rate * span_s * 1.6)))
    swell = 1.0 + 0.6 * np.sin(2 * np.pi * t / 300.0)
    kept = t[rng.uniform(0.0, 1.6, t.size) < swell]  # thinning: rate mean_rate * swell
    return np.floor(kept * 1000).astype(np.int64)


def on_grid(ms: np.ndarray, grid_ms: int) -> np.ndarray:
    return ms // grid_ms * grid_ms


def write_trace(path: Path, ms: np.ndarray) -> Path:
    rng = np.random.default_rng(7)
    with path.open("w") as out:
        for t in ms:
            prompt, output = int(rng.integers(100, 3000)), int(rng.integers(10, 500))
            out.write(json.dumps({"timestamp": int(t), "input_length": prompt,
                                  "output_length": output, "hash_ids": [1, 2]}) + "\n")  # fmt: skip
    return path


def cv_at(ms: np.ndarray, bin_s: int) -> float:
    """CV of requests/s in bins of ``bin_s`` from the first arrival, directly."""
    bins = (ms - ms.min()) // (bin_s * 1000)
    counts = np.bincount(bins).astype(np.float64)
    return float(counts.std() / counts.mean())


def analyze(app: typer.Typer, *args: str) -> tuple[dict[str, Any], str]:
    code, out, err = run(app, "analyze", *args, "--json")
    assert code == 0, err
    return json.loads(out), err


@pytest.fixture(scope="module")
def grid3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, np.ndarray]:
    """(log, true arrivals, logged arrivals) on a 3-s grid, 0.3% of rows off it."""
    true = arrivals_ms(seed=3)
    logged = on_grid(true, 3_000)
    rng = np.random.default_rng(4)
    off = rng.choice(logged.size, size=logged.size * 3 // 1000, replace=False)
    logged[off] += rng.integers(1, 2_999, off.size)  # a few rows logged to the ms
    logged.sort()
    return write_trace(tmp_path_factory.mktemp("grid") / "conv.jsonl", logged), true, logged


def test_the_grid_is_found_despite_a_few_rows_off_it(grid3: Any) -> None:
    _, true, logged = grid3
    assert timestamp_grid_us(logged * MS) == 3_000_000
    assert timestamp_grid_us(true * MS) == 1_000  # milliseconds: the unit itself
    assert timestamp_grid_us(on_grid(true, 250) * MS) == 250_000
    # random microseconds: no grid at all
    rng = np.random.default_rng(1)
    assert timestamp_grid_us(np.cumsum(rng.integers(1, 400_000, 5_000))) == 1


def test_bins_are_whole_seconds_of_whole_grid_steps() -> None:
    assert choose_binning(3_000_000).bin_seconds == 3
    assert choose_binning(3_000_000, 4).bin_seconds == 6  # 4-s bins would alias a 3-s grid
    assert choose_binning(3_000_000, 9).bin_seconds == 9
    assert choose_binning(1_500_000).bin_seconds == 3
    assert choose_binning(1_000).bin_seconds == 1 and not choose_binning(1_000).widened
    assert choose_binning(1_000, 10).bin_seconds == 10


def test_a_3s_grid_is_binned_at_3s_and_reports_the_traffics_cv(
    app: typer.Typer, grid3: Any
) -> None:
    path, true, logged = grid3
    doc, err = analyze(app, str(path))  # no --force: a recognised format is never refused
    assert doc["binning"] == {"grid_s": 3.0, "requested_bin_seconds": 1, "bin_seconds": 3,
                              "note": doc["binning"]["note"]}  # fmt: skip
    assert "3 s grid" in doc["binning"]["note"] and "bins: the timestamps sit on" in err
    cv = doc["overall"]["rates"]["requests_per_s"]["cv"]
    assert cv == pytest.approx(cv_at(logged, 3), rel=1e-9)  # the figure at the grid's resolution
    assert cv == pytest.approx(cv_at(true, 3), abs=0.05)  # which is the traffic's
    inflated = cv_at(logged, 1)
    assert inflated > 1.3 and cv < 0.6 * inflated  # not the 1-s figure the grid inflates
    # rates stay per second: the mean is requests over the span
    assert doc["overall"]["rates"]["requests_per_s"]["mean"] == pytest.approx(
        logged.size / doc["span"]["seconds"]
    )
    codes = {f["code"]: f["fatal"] for f in doc["input"]["findings"]}
    assert codes == {"zero_gaps": False, "timestamp_grid": False} and not doc["input"]["forced"]
    assert all(w["seconds"] == 600 for w in doc["overall"]["windows"][:-1])


def test_bin_seconds_is_honoured_and_widened_to_the_grid(app: typer.Typer, grid3: Any) -> None:
    path, true, logged = grid3
    doc, _ = analyze(app, str(path), "--bin-seconds", "4")
    assert doc["binning"]["bin_seconds"] == 6 and doc["parameters"]["bin_seconds"] == 6
    assert doc["overall"]["rates"]["requests_per_s"]["cv"] == pytest.approx(cv_at(logged, 6))
    fine = write_trace(path.with_name("fine.jsonl"), true)
    doc, err = analyze(app, str(fine))  # 1-ms timestamps: one-second bins, as always
    assert doc["binning"]["bin_seconds"] == 1 and doc["binning"]["note"] is None
    assert doc["input"]["findings"] == [] and "bins:" not in err
    assert doc["overall"]["rates"]["requests_per_s"]["cv"] == pytest.approx(cv_at(true, 1))
    doc, _ = analyze(app, str(fine), "--bin-seconds", "10")
    assert doc["binning"] == {"grid_s": 0.001, "requested_bin_seconds": 10, "bin_seconds": 10,
                              "note": None}  # fmt: skip
    assert doc["overall"]["rates"]["requests_per_s"]["cv"] == pytest.approx(cv_at(true, 10))
    assert doc["span"]["seconds"] % 10 == 0
    for bad in ("0", "-3"):
        code, _, err = run(app, "analyze", str(fine), "--bin-seconds", bad)
        assert code == 2 and err.startswith("error: --bin-seconds must be a whole number")
        assert "Traceback" not in err


def test_the_html_shows_every_finding_in_the_summary_and_data_quality(
    app: typer.Typer, grid3: Any, tmp_path: Path
) -> None:
    path, _, _ = grid3
    report = tmp_path / "r.html"
    code, _, err = run(app, "analyze", str(path), "--html", str(report))
    assert code == 0, err
    html = report.read_text()
    embedded = json.loads(re.search(r'id="burstgate-data">(.*?)</script>', html, re.S)[1])  # type: ignore[index]
    codes = [f["code"] for f in embedded["input"]["findings"]] + ["bins"]
    summary = html.split('<section id="summary">')[1].split("</section>")[0]
    quality = html.split('<section id="data-quality">')[1].split("</section>")[0]
    for section in (summary, quality):
        assert re.findall(r'data-finding="([a-z_]+)"', section) == codes
    for finding in embedded["input"]["findings"]:
        assert finding["message"].replace("'", "&#x27;") in quality
    assert "3-second bins" in html and "3-s peak" not in summary


def test_no_burst_is_shorter_than_the_minimum(app: typer.Typer, tmp_path: Path) -> None:
    """Short sharp spikes (2 s at 8x) that the rule catches through its 5-s
    average are listed at least 5 s long, at 1-s and at 3-s bins."""
    rng = np.random.default_rng(11)
    base = arrivals_ms(seed=5, span_s=1_200, mean_rate=4.0)
    spikes = [np.sort(rng.uniform(s, s + 2, 64)) for s in (400, 700, 1000)]
    ms = np.sort(np.concatenate([base, *(np.floor(s * 1000).astype(np.int64) for s in spikes)]))
    series = np.bincount((ms - ms[0]) // 1000).astype(np.float64)
    found = detect_bursts(series, BurstRule(min_seconds=5))
    assert len(found) >= 3 and all(b.duration >= 5 for b in found)
    for name, logged, minimum in (("fine", ms, 5), ("grid", on_grid(ms, 3_000), 5)):
        doc, _ = analyze(app, str(write_trace(tmp_path / f"{name}.jsonl", logged)),
                         "--burst-min-seconds", str(minimum))  # fmt: skip
        incidents = doc["incidents"]
        assert len(incidents) >= 3, name
        assert all(i["duration_s"] >= minimum for i in incidents), incidents
        assert all(b["duration_s"] >= minimum for b in doc["overall"]["bursts"])
