"""Reader: formats, column aliases, timestamps, bad rows."""

from __future__ import annotations

import gzip
import math
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.analysis.parsing import format_timestamp_us, parse_timestamp_us, parse_tokens
from controlplane.analysis.reader import LogReadError, read_log
from tests.integration.analysis.synth import (
    AZURE_HEADER,
    LEDGER_HEADER,
    T0_US,
    iso,
    write_csv,
    write_jsonl,
)


def test_azure_format_with_aliases(tmp_path: Path) -> None:
    path = write_csv(
        tmp_path / "a.csv",
        AZURE_HEADER,
        [("2023-11-16 18:15:46.6805900", 374, 44), ("2023-11-16 18:15:50.9951690", 396, 109)],
    )
    log = read_log(path)
    assert log.columns == {
        "timestamp": "TIMESTAMP",
        "prompt_tokens": "ContextTokens",
        "output_tokens": "GeneratedTokens",
    }
    # Naive timestamps are UTC; the 7th fractional digit is below datetime's resolution.
    expected = datetime(2023, 11, 16, 18, 15, 46, 680590, tzinfo=UTC)
    assert log.ts_us[0] == (expected - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(
        microseconds=1
    )
    assert log.ts_us[1] - log.ts_us[0] == 4_314_579
    assert log.prompt_tokens.tolist() == [374, 396]
    assert log.output_tokens.tolist() == [44, 109]
    assert not log.has_tenants and log.has_tokens
    assert log.rows_read == 2 and log.bad_row_count == 0


@pytest.mark.parametrize(
    ("ts_col", "prompt_col", "output_col"),
    [
        ("timestamp", "prompt_tokens", "output_tokens"),
        ("arrival_time", "input_tokens", "completion_tokens"),
        ("TS", "Prompt_Tokens", "generated_tokens"),
        ("time", "contexttokens", "GENERATEDTOKENS"),
    ],
)
def test_column_aliases_are_case_insensitive(
    tmp_path: Path, ts_col: str, prompt_col: str, output_col: str
) -> None:
    path = write_csv(tmp_path / "a.csv", (ts_col, prompt_col, output_col), [(1700000000.5, 7, 3)])
    log = read_log(path)
    assert log.ts_us.tolist() == [1_700_000_000_500_000]
    assert log.prompt_tokens.tolist() == [7] and log.output_tokens.tolist() == [3]


def test_ledger_export_with_derived_wait_and_latency(tmp_path: Path) -> None:
    arrival = T0_US
    rows = [
        (
            "acme",
            "r1",
            "interactive",
            "m",
            "p",
            iso(arrival, zone=True),
            iso(arrival + 1_000, zone=True),
            iso(arrival + 251_000, zone=True),
            iso(arrival + 2_001_000, zone=True),
            100,
            20,
            50,
            "admitted",
        ),
        (
            "beta",
            "r2",
            "batch",
            "m",
            "p",
            iso(arrival + 500_000, zone=True),
            "",
            "",
            "",
            80,
            0,
            "",
            "rejected",
        ),
    ]
    log = read_log(write_csv(tmp_path / "ledger.csv", LEDGER_HEADER, rows))
    assert log.columns["timestamp"] == "arrival_ts"
    assert log.tenant_names == ["acme", "beta"] and log.tenant_codes.tolist() == [0, 1]
    assert log.lane_names == ["interactive", "batch"]
    assert log.decision_names == ["admitted", "rejected"]
    assert log.queue_wait_ms[0] == pytest.approx(250.0)  # exec_start - queue_start
    assert log.latency_ms[0] == pytest.approx(2001.0)  # end - arrival
    assert math.isnan(log.queue_wait_ms[1]) and math.isnan(log.latency_ms[1])
    assert log.output_tokens.tolist() == [50, 0]  # empty = 0 for a refused request
    assert log.bad_row_count == 0


def test_jsonl_and_explicit_wait_columns(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "log.jsonl",
        [
            {
                "ts": 1700000000.0,
                "prompt_tokens": 10,
                "output_tokens": 2,
                "tenant": "a",
                "queue_wait_ms": 5.5,
                "latency_ms": 120,
            },
            {
                "ts": "2023-11-14T23:13:21+01:00",
                "prompt_tokens": 11,
                "output_tokens": 3,
                "tenant": "b",
            },
        ],
    )
    log = read_log(path)
    assert log.fmt == "jsonl"
    # +01:00 is converted to UTC: 22:13:21Z = 1700000001.
    assert log.ts_us.tolist() == [1_700_000_000_000_000, 1_700_000_001_000_000]
    assert log.queue_wait_ms[0] == 5.5 and math.isnan(log.queue_wait_ms[1])
    assert log.tenant_names == ["a", "b"]


def test_format_sniffed_without_extension_and_gzip(tmp_path: Path) -> None:
    jsonl = tmp_path / "requests.log"
    jsonl.write_text('{"timestamp": 1700000000, "prompt_tokens": 1, "output_tokens": 1}\n')
    assert read_log(jsonl).fmt == "jsonl"
    packed = tmp_path / "trace.csv.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as handle:
        handle.write("TIMESTAMP,ContextTokens,GeneratedTokens\n1700000000,5,6\n1700000001,7,8\n")
    log = read_log(packed)
    assert log.fmt == "csv" and len(log) == 2 and log.prompt_tokens.tolist() == [5, 7]


def test_empty_file_and_header_only(tmp_path: Path) -> None:
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    assert len(read_log(empty)) == 0
    header_only = write_csv(tmp_path / "h.csv", AZURE_HEADER, [])
    log = read_log(header_only)
    assert len(log) == 0 and log.rows_read == 0 and log.has_tokens


def test_bad_rows_are_skipped_with_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.0,10,1\n"  # line 2: fine
        "not a time,10,1\n"  # line 3
        "\n"  # line 4: blank, ignored
        "2023-11-16 18:15:47.0,ten,1\n"  # line 5
        "2023-11-16 18:15:48.0,10\n"  # line 6: short
        "2023-11-16 18:15:49.0,-4,1\n"  # line 7: negative
        "2023-11-16 18:15:50.0,12.0,3\n"  # line 8: fine ("12.0" is an integer)
    )
    log = read_log(path)
    assert len(log) == 2 and log.prompt_tokens.tolist() == [10, 12]
    assert [b.line for b in log.bad_rows] == [3, 5, 6, 7]
    assert log.bad_row_count == 4 and log.rows_read == 6
    assert "unparseable timestamp" in log.bad_rows[0].reason
    assert "expected at least 3 fields" in log.bad_rows[2].reason
    assert "negative" in log.bad_rows[3].reason


def test_bad_row_fails_with_line_number(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"ts": 1700000000, "prompt_tokens": 1}\n\n{"ts": "soon"}\n')
    with pytest.raises(LogReadError, match=r"bad\.jsonl:3: bad row: unparseable timestamp"):
        read_log(path, on_bad_row="fail")
    log = read_log(path, on_bad_row="skip")
    assert [(b.line, len(log)) for b in log.bad_rows] == [(3, 1)]


def test_jsonl_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "x.ndjson"
    path.write_text('{"ts": 1700000000}\n{oops\n[1, 2]\n{"other": 1}\n')
    log = read_log(path)
    assert [b.line for b in log.bad_rows] == [2, 3, 4]
    assert "invalid JSON" in log.bad_rows[0].reason
    assert "expected a JSON object" in log.bad_rows[1].reason
    assert "missing timestamp" in log.bad_rows[2].reason


def test_missing_timestamp_column_and_missing_file(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "x.csv", ("when", "prompt_tokens"), [("1", "2")])
    with pytest.raises(LogReadError, match="no timestamp column"):
        read_log(path)
    with pytest.raises(LogReadError, match="no such file"):
        read_log(tmp_path / "nope.csv")
    array_file = tmp_path / "a.json"
    array_file.write_text('[{"ts": 1}]')
    with pytest.raises(LogReadError, match="JSON array files are not supported"):
        read_log(array_file)


def test_timestamp_parsing_rules() -> None:
    assert parse_timestamp_us("1700000000.25") == 1_700_000_000_250_000
    assert parse_timestamp_us(1700000000) == 1_700_000_000_000_000
    assert parse_timestamp_us("2023-11-14T22:13:20Z") == 1_700_000_000_000_000
    assert parse_timestamp_us("2023-11-14 22:13:20") == 1_700_000_000_000_000  # naive = UTC
    assert parse_timestamp_us("20231114T221320") == 1_700_000_000_000_000  # ISO basic
    for bad in ("", "yesterday", "1700000000000", "-5", "nan"):
        with pytest.raises(ValueError):
            parse_timestamp_us(bad)
    assert parse_tokens("") == 0 and parse_tokens(None) == 0 and parse_tokens(7.0) == 7
    for bad_tokens in ("1.5", "x", -1, True):
        with pytest.raises(ValueError):
            parse_tokens(bad_tokens)


@given(
    st.datetimes(
        min_value=datetime(1971, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.none()
    ),
    st.integers(min_value=-14 * 60, max_value=14 * 60),
)
def test_iso_round_trip(moment: datetime, offset_min: int) -> None:
    as_us = parse_timestamp_us(moment.isoformat())
    assert format_timestamp_us(as_us) == moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    zoned = moment.replace(tzinfo=timezone(timedelta(minutes=offset_min)))
    expected = as_us - offset_min * 60 * 1_000_000
    assert parse_timestamp_us(zoned.isoformat()) == expected


def test_columns_are_compact(tmp_path: Path) -> None:
    path = write_csv(
        tmp_path / "a.csv", ("ts", "tenant"), [(1700000000 + i, "t") for i in range(5)]
    )
    log = read_log(path)
    assert log.ts_us.dtype == np.int64 and log.tenant_codes.dtype == np.int32
    assert not log.has_tokens and log.prompt_tokens.tolist() == [0] * 5


def test_progress_bar_goes_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_csv(tmp_path / "a.csv", AZURE_HEADER, [("1700000000", 1, 1)] * 3)
    assert len(read_log(path, progress=True)) == 3
    assert capsys.readouterr().out == ""
