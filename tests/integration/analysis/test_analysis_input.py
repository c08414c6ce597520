"""Input shapes: presets, column options and time units, checked against
independent recomputations, through the real CLI where the figures matter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from controlplane.analysis import arrowread
from controlplane.analysis.presets import ColumnOptions, LogFormat
from controlplane.analysis.reader import LogReadError, read_log
from controlplane.analysis.timeunits import TimeUnit
from controlplane.ledger.export import REQUEST_COLUMNS
from tests.integration.analysis.conftest import run
from tests.integration.analysis.shapes import (
    batch_line,
    ledger_rows,
    mooncake_offsets_ms,
    openai_response,
    write_ledger_export,
    write_mooncake,
)
from tests.integration.analysis.synth import AZURE_HEADER, T0_US, iso, write_csv, write_jsonl

US = 1_000_000


def analyze_json(app: typer.Typer, *args: str) -> tuple[dict[str, Any], str]:
    code, out, err = run(app, "analyze", *args, "--json")
    assert code == 0, err
    return json.loads(out), err


def per_second(ts_us: np.ndarray) -> tuple[int, float, float]:
    """(bins, mean, CV) of requests/s, bins anchored at the first arrival."""
    ts = np.sort(ts_us)
    bins = (ts - ts[0]) // US
    counts = np.bincount(bins, minlength=int(bins[-1]) + 1)
    return int(counts.size), float(counts.mean()), float(counts.std() / counts.mean())


# --------------------------------------------------------------------------- Mooncake


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, np.ndarray]:
    """One hour at 6 req/s: timestamps in ms from the start, as in the FAST'25 traces."""
    ts_ms = mooncake_offsets_ms(6.0, 3600)
    rng = np.random.default_rng(9)
    prompt = rng.integers(100, 20_000, ts_ms.size)
    output = rng.integers(1, 800, ts_ms.size)
    path = tmp_path_factory.mktemp("mooncake") / "conversation_trace.jsonl"
    return write_mooncake(path, ts_ms.tolist(), prompt.tolist(), output.tolist()), ts_ms, prompt


def test_mooncake_is_read_in_milliseconds_with_tokens(
    app: typer.Typer, mooncake: tuple[Path, np.ndarray, np.ndarray]
) -> None:
    path, ts_ms, prompt = mooncake
    doc, err = analyze_json(app, str(path))
    assert "Mooncake trace (--format mooncake, recognised by its columns" in err
    assert "timestamps: milliseconds since start (mooncake preset" in err
    assert doc["input"]["preset"] == "mooncake" and doc["input"]["preset_source"] == "auto"
    assert doc["input"]["time"]["kind"] == "relative" and doc["input"]["time"]["unit"] == "ms"
    assert doc["input"]["findings"] == [] and doc["input"]["forced"] is False
    bins, mean, cv = per_second(ts_ms * 1000)
    rates = doc["overall"]["rates"]["requests_per_s"]
    assert doc["span"]["seconds"] == bins and 3590 <= bins <= 3600  # an hour, not 40 days
    assert rates["mean"] == pytest.approx(mean, rel=1e-12)
    assert rates["cv"] == pytest.approx(cv, rel=1e-9)
    assert 5.7 < mean < 6.3 and 0.35 < cv < 0.47  # Poisson at 6/s: CV 1/sqrt(6) = 0.41
    assert doc["columns"]["prompt_tokens"] == "input_length"
    assert doc["overall"]["lengths"]["prompt_tokens"]["mean"] == pytest.approx(prompt.mean())
    gaps = doc["overall"]["interarrival"]
    assert gaps["mean_s"] == pytest.approx(np.diff(ts_ms).mean() / 1000, rel=1e-9)
    # the text output shows time since the log's zero, never a 1970 date
    code, text, _ = run(app, "analyze", str(path), "--no-progress")
    [span] = [line for line in text.splitlines() if line.startswith("span: ")]
    last = int(ts_ms.max() - ts_ms.min()) // 1000
    assert code == 0 and "1970" not in text
    assert span.startswith(f"span: +0:00:00 to +{last // 3600}:{last % 3600 // 60:02d}:")
    assert "since the log's zero" in span


def test_mooncake_read_as_seconds_is_refused_then_forced(app: typer.Typer, tmp_path: Path) -> None:
    """The issue's failure: ms read as s. 1,200 rows over ~3 minutes become 2 days."""
    ts_ms = mooncake_offsets_ms(6.0, 250)[:1200]
    path = write_mooncake(tmp_path / "m.jsonl", ts_ms.tolist(), [100] * 1200, [10] * 1200)
    code, out, err = run(app, "analyze", str(path), "--time-unit", "s")
    assert code == 2 and out == ""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert "implausible" in errors[0] and "--time-unit ms" in errors[0] and "--force" in errors[0]
    doc, err = analyze_json(app, str(path), "--time-unit", "s", "--force")
    assert "warning (--force):" in err
    assert doc["input"]["forced"] is True
    assert [f["code"] for f in doc["input"]["findings"]] == ["implausible_span"]
    assert doc["span"]["seconds"] == (ts_ms[-1] - ts_ms[0]) + 1  # each ms read as a second
    doc, _ = analyze_json(app, str(path), "--time-unit", "ms")
    assert doc["input"]["time"]["source"] == "option" and doc["span"]["seconds"] < 250


def test_mooncake_shape_with_epoch_nanoseconds(tmp_path: Path) -> None:
    """The same columns with absolute ns timestamps (as strings): epoch by magnitude."""
    rows = [
        {
            "timestamp": str(1_753_780_607_550_317_897 + i * 250_000_000),
            "input_length": 10,
            "output_length": 2,
            "hash_ids": [1],
        }
        for i in range(8)
    ]
    log = read_log(write_jsonl(tmp_path / "lmbench.jsonl", rows))
    assert log.time is not None and (log.time.kind, log.time.unit) == ("epoch", TimeUnit.ns)
    assert log.ts_us[0] == 1_753_780_607_550_317  # truncated to the microsecond
    assert np.diff(log.ts_us).tolist() == [250_000] * 7


# --------------------------------------------------------------------------- Azure, BurstGPT


def test_azure_preset_and_figures(app: typer.Typer, tmp_path: Path) -> None:
    offsets = np.arange(0, 600, 0.25)  # 4 req/s for 10 minutes
    rows = [(iso(T0_US + int(o * US)), 300, 30) for o in offsets]
    doc, err = analyze_json(app, str(write_csv(tmp_path / "azure.csv", AZURE_HEADER, rows)))
    assert "Azure LLM inference trace" in err and "timestamps: dates (ISO 8601)" in err
    assert doc["input"]["preset"] == "azure" and doc["input"]["time"]["kind"] == "dates"
    rates = doc["overall"]["rates"]
    assert doc["span"]["seconds"] == 600 and rates["requests_per_s"]["mean"] == 4.0
    assert rates["requests_per_s"]["cv"] == 0.0 and rates["tokens_per_s"]["mean"] == 4 * 330


def test_burstgpt_preset_reads_integer_seconds(tmp_path: Path) -> None:
    header = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
    rows = [(5 + 7 * i, "ChatGPT", 400, 20, 420, "Conversation log") for i in range(50)]
    log = read_log(write_csv(tmp_path / "BurstGPT_1.csv", header, rows))
    assert log.resolution is not None and log.resolution.preset is not None
    assert log.resolution.preset.name is LogFormat.burstgpt
    assert log.time is not None and (log.time.kind, log.time.unit) == ("relative", TimeUnit.s)
    assert log.ts_us[:2].tolist() == [5 * US, 12 * US] and log.prompt_tokens[0] == 400


# --------------------------------------------------------------------------- OpenAI


def test_openai_responses_one_second_resolution(app: typer.Typer, tmp_path: Path) -> None:
    """``created`` is whole seconds: at 5 req/s most gaps are 0, which is
    reported; a recognised format is analysed all the same (1-s bins hold
    whole seconds)."""
    created = 1_733_000_000
    rows = [openai_response(created + i // 5, 100 + i, 7, user=f"u{i % 2}") for i in range(600)]
    path = write_jsonl(tmp_path / "responses.jsonl", rows)
    doc, err = analyze_json(app, str(path))
    assert "warning: 80% of inter-arrival gaps are zero" in err and "(1 s steps)" in err
    assert doc["input"]["findings"][0]["fatal"] is False and doc["binning"]["bin_seconds"] == 1
    assert doc["input"]["preset"] == "openai" and doc["input"]["time"]["unit"] == "s"
    assert doc["input"]["time"]["kind"] == "epoch" and doc["span"]["seconds"] == 120
    assert doc["overall"]["rates"]["requests_per_s"]["mean"] == 5.0
    assert doc["columns"]["prompt_tokens"] == "usage.prompt_tokens"
    total_prompt = sum(100 + i for i in range(600))
    assert doc["overall"]["rates"]["prompt_tokens_per_s"]["total"] == total_prompt
    assert sorted(t["tenant"] for t in doc["tenants"]) == ["u0", "u1"]


def test_openai_batch_output_lines(tmp_path: Path) -> None:
    rows = [batch_line(openai_response(1_733_000_000 + 2 * i, 50, 5 + i), i) for i in range(30)]
    log = read_log(write_jsonl(tmp_path / "batch_output.jsonl", rows))
    assert log.columns["timestamp"] == "response.body.created"
    assert log.columns["output_tokens"] == "response.body.usage.completion_tokens"
    assert log.output_tokens.tolist() == [5 + i for i in range(30)]
    assert np.diff(log.ts_us).tolist() == [2 * US] * 29


# --------------------------------------------------------------------------- ledger export


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_ledger_export_each_format(tmp_path: Path, fmt: str) -> None:
    rows = ledger_rows(40)
    log = read_log(write_ledger_export(tmp_path / f"ledger.{fmt}", fmt, rows))
    assert log.resolution is not None and log.resolution.preset is not None
    assert log.resolution.preset.name is LogFormat.ledger and log.fmt == fmt
    col = {name: i for i, name in enumerate(REQUEST_COLUMNS)}

    def ns(text: str) -> int:
        seconds = int(np.datetime64(text[:19], "s").astype(np.int64))
        return seconds * 1_000_000_000 + int(text[20:29])

    arrival = [ns(r[col["arrival_ts"]]) for r in rows]
    assert log.ts_us.tolist() == [a // 1000 for a in arrival]  # ns truncated to µs
    assert log.prompt_tokens.tolist() == [r[col["prompt_tokens"]] for r in rows]
    assert log.output_tokens.tolist() == [r[col["output_tokens"]] for r in rows]
    assert log.tenant_names == ["acme", "globex", "initech"]
    assert log.lane_names == ["interactive", "batch"] and log.decision_names == ["admit"]
    waits = [
        (ns(r[col["exec_start_ts"]]) // 1000 - ns(r[col["queue_start_ts"]]) // 1000) / 1000
        for r in rows
    ]
    assert log.queue_wait_ms.tolist() == pytest.approx(waits)
    latency = [
        (ns(r[col["end_ts"]]) // 1000 - a // 1000) / 1000
        for r, a in zip(rows, arrival, strict=True)
    ]
    assert log.latency_ms.tolist() == pytest.approx(latency)
    assert log.bad_row_count == 0


# --------------------------------------------------------------------------- column options


def test_column_options_map_any_names(app: typer.Typer, tmp_path: Path) -> None:
    header = ("when_ms", "in_tok", "out_tok", "customer", "prio")
    rows = [(i * 100, 10 + i, 1, ("a", "b")[i % 2], ("hi", "lo")[i % 3 == 0]) for i in range(3000)]
    path = write_csv(tmp_path / "custom.csv", header, rows)
    code, _, err = run(app, "analyze", str(path))
    assert code == 2 and "no timestamp column" in err and "--time-col" in err
    args = [
        "--time-col",
        "when_ms",
        "--prompt-col",
        "in_tok",
        "--output-col",
        "OUT_TOK",
        "--tenant-col",
        "customer",
        "--lane-col",
        "prio",
    ]
    doc, err = analyze_json(app, str(path), *args)
    assert "timestamps: milliseconds since start (inferred from span/row count" in err
    assert doc["columns"] == {
        "timestamp": "when_ms",
        "prompt_tokens": "in_tok",
        "output_tokens": "out_tok",
        "tenant": "customer",
        "lane": "prio",
    }
    assert doc["span"]["seconds"] == 300 and doc["overall"]["rates"]["requests_per_s"]["mean"] == 10
    assert doc["overall"]["lanes"] == {"lo": 1000, "hi": 2000}
    assert {t["tenant"]: t["requests"] for t in doc["tenants"]} == {"a": 1500, "b": 1500}
    code, _, err = run(app, "analyze", str(path), *args, "--prompt-col", "input_len")
    assert code == 2 and "--prompt-col input_len: no such column (found when_ms, in_tok" in err


def test_format_option_must_fit(app: typer.Typer, tmp_path: Path) -> None:
    path = write_csv(tmp_path / "a.csv", AZURE_HEADER, [("1700000000", 1, 1)])
    code, _, err = run(app, "analyze", str(path), "--format", "mooncake")
    assert code == 2 and "--format mooncake: no column input_length, output_length" in err
    code, _, err = run(app, "analyze", str(path), "--format", "excel")
    assert code == 2 and "excel" in err  # typer lists the choices
    help_text = CliRunner().invoke(app, ["analyze", "--help"], env={"COLUMNS": "200"}).stdout
    assert "<auto|azure|mooncake|bailian|openai|ledger|burstgpt>" in help_text
    assert "<s|ms|us|ns>" in help_text and "--tenant-col" in help_text


def test_nested_json_column_option(tmp_path: Path) -> None:
    rows = [{"t": 1_700_000_000 + i, "meta": {"tok": {"in": i, "out": 2}}} for i in range(5)]
    options = ColumnOptions(
        mapping={"timestamp": "t", "prompt_tokens": "meta.tok.in", "output_tokens": "meta.tok.out"}
    )
    log = read_log(write_jsonl(tmp_path / "n.jsonl", rows), options=options)
    assert log.prompt_tokens.tolist() == [0, 1, 2, 3, 4] and log.output_tokens.tolist() == [2] * 5


# --------------------------------------------------------------------------- JSON fast path


def test_arrow_json_chunks_agree_with_row_by_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks with odd values fall back; every chunk gives what the row path gives."""
    assert arrowread.available()
    rows: list[Any] = []
    for i in range(60):
        row: dict[str, Any] = {
            "ts": 1_700_000_000 + i * 0.5,
            "tenant": f"t{i % 4}",
            "usage": {"prompt_tokens": i, "completion_tokens": 3},
        }
        if i == 17:
            row["usage"]["prompt_tokens"] = "x"  # bad row
        if i == 25:
            row["usage"]["prompt_tokens"] = 12.0  # fine, but not an int64
        if i == 33:
            del row["usage"]  # missing tokens count as 0
        if i == 41:
            row["tenant"] = 7  # interned as "7"
        rows.append(row)
    text = "\n".join(json.dumps(r) for r in rows) + "\n\n"
    path = tmp_path / "mixed.jsonl"
    path.write_text(text)
    monkeypatch.setattr("controlplane.analysis.reader.CHUNK_ROWS", 8)
    taken: list[int | None] = []
    original = arrowread.JsonChunks.add

    def spy(self: arrowread.JsonChunks, lines: list[bytes], builder: Any) -> int | None:
        result = original(self, lines, builder)
        taken.append(result)
        return result

    monkeypatch.setattr(arrowread.JsonChunks, "add", spy)
    options = ColumnOptions(
        mapping={"prompt_tokens": "usage.prompt_tokens", "output_tokens": "usage.completion_tokens"}
    )
    fast = read_log(path, options=options)
    assert any(n is not None for n in taken) and None in taken  # both paths ran
    monkeypatch.setenv("BURSTGATE_ANALYZE_ARROW", "0")
    taken.clear()
    slow = read_log(path, options=options)
    assert taken == []
    for name in ("ts_us", "prompt_tokens", "output_tokens", "tenant_codes", "lane_codes"):
        assert getattr(fast, name).tolist() == getattr(slow, name).tolist(), name
    assert fast.tenant_names == slow.tenant_names and "7" in fast.tenant_names
    assert [(b.line, b.reason) for b in fast.bad_rows] == [
        (b.line, b.reason) for b in slow.bad_rows
    ]
    assert [b.line for b in fast.bad_rows] == [18] and fast.rows_read == slow.rows_read == 60
    assert fast.prompt_tokens[24] == 12 and fast.prompt_tokens[32] == 0


def test_without_pyarrow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain install: JSON Lines row by row, Parquet refused with the extra to install."""
    parquet = write_ledger_export(tmp_path / "l.parquet", "parquet", ledger_rows(5))
    jsonl = write_ledger_export(tmp_path / "l.jsonl", "jsonl", ledger_rows(5))
    monkeypatch.setattr(arrowread, "available", lambda: False)
    monkeypatch.setattr(arrowread.JsonChunks, "build", None)  # must not be reached
    assert len(read_log(jsonl)) == 5
    with pytest.raises(
        LogReadError, match=r"Parquet needs pyarrow: pip install 'burstgate\[analysis\]'"
    ):
        read_log(parquet)
