"""Input checks through the real CLI: warnings, refusals (exit 2), --force,
and the time-unit decision rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer

from controlplane.analysis.timeunits import TimeUnit, decide, epoch_unit
from tests.integration.analysis.conftest import run
from tests.integration.analysis.synth import T0_US, iso, write_csv, write_jsonl

US = 1_000_000


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# --------------------------------------------------------------------------- tokens


@pytest.fixture()
def no_tokens(tmp_path: Path) -> Path:
    rows = [(iso(T0_US + i * 200_000, zone=True), ("a", "b")[i % 2]) for i in range(3000)]
    return write_csv(tmp_path / "requests.csv", ("arrival_ts", "tenant"), rows)


def test_missing_token_columns_refused_unless_forced(app: typer.Typer, no_tokens: Path) -> None:
    for command in ("analyze", "forecast"):
        code, out, err = run(app, command, str(no_tokens))
        assert code == 2 and out == "", command
        (line,) = errors(err)
        assert "no token columns" in line and "--prompt-col/--output-col" in line
        assert "found arrival_ts, tenant" in line and line.endswith("--force analyses anyway")
    code, out, err = run(app, "analyze", str(no_tokens), "--force", "--json")
    assert code == 0 and "warning (--force): no token columns" in err
    doc = json.loads(out)
    assert doc["input"]["forced"] is True and doc["overall"]["rates"]["tokens_per_s"] is None
    assert doc["overall"]["rates"]["requests_per_s"]["mean"] == 5.0
    # Planning in requests/s needs no tokens: not refused, not even a fatal finding.
    code, out, err = run(app, "plan", str(no_tokens), "--rps", "2", "--json")
    assert code == 0 and "warning: no token columns" in err
    assert json.loads(out)["input"]["forced"] is False


def test_one_token_column_is_a_warning(app: typer.Typer, tmp_path: Path) -> None:
    rows = [(1_700_000_000 + i, 100) for i in range(10)]
    path = write_csv(tmp_path / "p.csv", ("ts", "prompt_tokens"), rows)
    code, _, err = run(app, "analyze", str(path))
    assert code == 0
    expected = "no output token column: output tokens count as 0 (name it with --output-col)"
    assert f"warning: {expected}" in err


# --------------------------------------------------------------------------- span


def test_sparse_dated_log_refused(app: typer.Typer, tmp_path: Path) -> None:
    """1,000 requests over 20 days: per-second figures would measure noise."""
    rows = [(iso(T0_US + i * 1_728 * US, zone=True), 10, 1) for i in range(1000)]
    path = write_csv(tmp_path / "month.csv", ("arrival_ts", "prompt_tokens", "output_tokens"), rows)
    code, _, err = run(app, "analyze", str(path))
    (line,) = errors(err)
    assert code == 2 and "1,000 requests over 20.0 days (dates) is 0.000579 req/s" in line
    assert "sparse" in line


def test_too_fast_reading_suggests_a_coarser_unit(app: typer.Typer, tmp_path: Path) -> None:
    rows = [{"ts": i, "prompt_tokens": 1, "output_tokens": 1} for i in range(2000)]
    path = write_jsonl(tmp_path / "ticks.jsonl", rows)
    code, _, err = run(app, "analyze", str(path), "--time-unit", "us")
    (line,) = errors(err)
    assert code == 2 and "implausible" in line and "--time-unit s" in line


def test_epoch_numbers_with_a_wrong_unit_refused(app: typer.Typer, tmp_path: Path) -> None:
    rows = [(1_700_000_000 + i, 1, 1) for i in range(20)]
    path = write_csv(tmp_path / "epoch.csv", ("ts", "prompt_tokens", "output_tokens"), rows)
    code, _, err = run(app, "analyze", str(path), "--time-unit", "ms")
    (line,) = errors(err)
    assert code == 2 and "2023-11-14 in epoch seconds: use --time-unit s" in line
    code, _, err = run(app, "analyze", str(path), "--time-unit", "s")
    assert code == 0 and "timestamps: epoch seconds (--time-unit; 2023-11-14)" in err


def test_span_beyond_limit_refused_even_forced(app: typer.Typer, tmp_path: Path) -> None:
    rows = [(n, 1, 1) for n in (0, 5 * 10**8, 10**9)]  # ns offsets read as s: 31 years
    path = write_csv(tmp_path / "ns.csv", ("ts", "prompt_tokens", "output_tokens"), rows)
    code, _, err = run(app, "analyze", str(path), "--time-unit", "s", "--force")
    (line,) = errors(err)
    assert code == 2 and "more than the 366 days" in line and "--force" not in line
    code, _, err = run(app, "analyze", str(path))  # inferred: 2 req/s in ns
    assert code == 0 and "nanoseconds since start (inferred" in err


def test_early_dates_warn(app: typer.Typer, tmp_path: Path) -> None:
    rows = [(iso(i * 500_000, zone=True), 1, 1) for i in range(20)]
    header = ("arrival_ts", "prompt_tokens", "output_tokens")
    path = write_csv(tmp_path / "epoch0.csv", header, rows)
    code, _, err = run(app, "analyze", str(path))
    assert code == 0 and "warning: the dates start before 2000" in err


# --------------------------------------------------------------------------- gaps


def test_mostly_zero_gaps_warn_and_are_analysed(app: typer.Typer, tmp_path: Path) -> None:
    """Timestamps on a 2-ms grid, 3,000 requests in 2 s: the gaps are mostly
    zero, which the report says, but the log is analysed (never refused)."""
    rows = [(1_700_000_000_000 + (i // 3) * 2, 1, 1) for i in range(3000)]
    path = write_csv(tmp_path / "ms.csv", ("ts", "prompt_tokens", "output_tokens"), rows)
    code, out, err = run(app, "analyze", str(path), "--json")
    assert code == 0 and not errors(err)
    assert "warning: 67% of inter-arrival gaps are zero: the timestamps (2 ms steps)" in err
    doc = json.loads(out)
    (finding,) = doc["input"]["findings"]
    assert (finding["code"], finding["fatal"]) == ("zero_gaps", False)
    assert doc["input"]["forced"] is False
    assert doc["input"]["grid_s"] == 0.002 and doc["binning"]["bin_seconds"] == 1


def test_clean_log_has_no_findings_and_no_progress_noise(app: typer.Typer, tmp_path: Path) -> None:
    rows = [(iso(T0_US + i * 250_000, zone=True), 10, 2) for i in range(4000)]
    path = write_csv(tmp_path / "ok.csv", ("arrival_ts", "prompt_tokens", "output_tokens"), rows)
    code, out, err = run(app, "analyze", str(path), "--json")
    assert code == 0 and json.loads(out)["input"]["findings"] == []
    assert err.splitlines() == [
        "input: columns by name (timestamp=arrival_ts, prompt_tokens=prompt_tokens, "
        "output_tokens=output_tokens)",
        "timestamps: dates (ISO 8601)",
    ]  # and no progress bar: stderr is not a terminal


# --------------------------------------------------------------------------- decisions


def test_epoch_ranges_do_not_overlap() -> None:
    assert epoch_unit(1.7e9) is TimeUnit.s and epoch_unit(1.7e12) is TimeUnit.ms
    assert epoch_unit(1.7e15) is TimeUnit.us and epoch_unit(1.7e18) is TimeUnit.ns
    assert epoch_unit(3.6e6) is None and epoch_unit(5e10) is None


def test_unit_inference_rule() -> None:
    def unit_for(values: list[object]) -> tuple[str, str, str]:
        d = decide(values, unit=None, preset_unit=None, preset_name=None)
        return d.kind, d.unit.value, d.source

    # 0.3 req/s in seconds (BurstGPT-like) stays seconds; 6 req/s in ms does not.
    assert unit_for([i * 3.3 for i in range(100)]) == ("relative", "s", "inferred")
    assert unit_for([i * 166 for i in range(100)]) == ("relative", "ms", "inferred")
    assert unit_for([i * 166_000 for i in range(100)]) == ("relative", "us", "inferred")
    assert unit_for([i * 10**8 for i in range(100)]) == ("relative", "ns", "inferred")
    assert unit_for(["2023-11-16 18:15:46", "2023-11-16 18:15:47"]) == ("dates", "s", "data")
    assert unit_for(["1700000000", "1700000001"]) == ("epoch", "s", "magnitude")
    assert unit_for([5]) == ("relative", "s", "default")
    mooncake = decide(
        [i * 3.3 for i in range(100)], unit=None, preset_unit=TimeUnit.ms, preset_name="mooncake"
    )
    assert (mooncake.unit, mooncake.source) == (TimeUnit.ms, "preset")
    assert "span/row count suggests seconds" in mooncake.notes[0]
    stated = decide(["2023-11-16"], unit=TimeUnit.ms, preset_unit=None, preset_name=None)
    assert stated.kind == "dates" and "--time-unit ms ignored" in stated.notes[0]


def test_token_plan_without_tokens_cannot_be_forced(app: typer.Typer, no_tokens: Path) -> None:
    for extra in ((), ("--force",)):
        code, _, err = run(app, "plan", str(no_tokens), "--prefill-tps", "1000",
                           "--decode-tps", "100", *extra)  # fmt: skip
        assert code == 2
        assert errors(err) == [
            "error: the log has no token columns; name them with --prompt-col/--output-col, "
            "or plan with --rps"
        ]
