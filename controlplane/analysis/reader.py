"""Streaming reader for request logs (CSV or JSON Lines).

The file is read in chunks of ``CHUNK_ROWS`` rows and appended to compact
typed columns (columns.py), so memory grows by about 50 bytes per request and
never holds a Python object per row beyond the current chunk. The statistics
need every arrival time (inter-arrival percentiles, per-incident latency
percentiles), so the columns are kept rather than only per-second bins; see
docs/analysis.md for the bound.

CSV chunks are parsed column-wise in NumPy when every value has a plain
shape; otherwise, and for JSON Lines, row by row, which is also where bad
rows are found and reported with their line numbers.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
import numpy.typing as npt

from controlplane.analysis.columns import ColumnBuilder

BadRowPolicy = Literal["skip", "fail"]

# Bad rows kept verbatim for the report; the total is always counted.
MAX_BAD_ROWS_KEPT = 50
# Rows parsed together: large enough that NumPy's per-call overhead vanishes,
# small enough that the chunk's Python lists stay in cache and the cyclic GC's
# scans stay cheap (50,000 was measurably slower on a 1M-row log).
CHUNK_ROWS = 10_000

# Canonical field -> accepted column names (matched case-insensitively).
COLUMN_ALIASES: dict[str, tuple[str, ...]] = {
    "timestamp": ("timestamp", "arrival_time", "arrival_ts", "ts", "time"),
    "prompt_tokens": ("prompt_tokens", "contexttokens", "input_tokens"),
    "output_tokens": (
        "output_tokens",
        "generatedtokens",
        "generated_tokens",
        "completion_tokens",
    ),
    "tenant": ("tenant", "tenant_id"),
    "lane": ("lane",),
    "decision": ("decision",),
    "queue_wait_ms": ("queue_wait_ms",),
    "latency_ms": ("latency_ms",),
    "queue_start": ("queue_start", "queue_start_ts"),
    "exec_start": ("exec_start", "exec_start_ts"),
    "end": ("end", "end_ts"),
}


class LogReadError(Exception):
    """The log cannot be analysed (missing file, no timestamp column, bad row
    under ``--on-bad-row fail``). The CLI turns it into exit code 2."""


@dataclass(frozen=True, slots=True)
class BadRow:
    line: int  # 1-based physical line number in the file (header is line 1)
    reason: str


@dataclass(slots=True)
class RequestLog:
    """One request per index across all columns; codes index the name lists."""

    source: str
    fmt: str
    columns: dict[str, str]  # canonical field -> column name found in the file
    ts_us: npt.NDArray[np.int64]
    prompt_tokens: npt.NDArray[np.int64]
    output_tokens: npt.NDArray[np.int64]
    tenant_codes: npt.NDArray[np.int32]
    tenant_names: list[str]
    lane_codes: npt.NDArray[np.int32]
    lane_names: list[str]
    decision_codes: npt.NDArray[np.int32]
    decision_names: list[str]
    queue_wait_ms: npt.NDArray[np.float64]  # NaN where unknown
    latency_ms: npt.NDArray[np.float64]  # NaN where unknown
    rows_read: int = 0
    bad_rows: list[BadRow] = field(default_factory=list)
    bad_row_count: int = 0

    def __len__(self) -> int:
        return int(self.ts_us.size)

    @property
    def has_tenants(self) -> bool:
        return "tenant" in self.columns

    @property
    def has_tokens(self) -> bool:
        return "prompt_tokens" in self.columns or "output_tokens" in self.columns

    @property
    def has_decisions(self) -> bool:
        return "decision" in self.columns

    @property
    def has_lanes(self) -> bool:
        return "lane" in self.columns


def resolve_columns(names: list[str]) -> dict[str, str]:
    """Map canonical fields to the file's column names (first alias wins)."""
    lowered = {name.strip().lower(): name for name in names}
    found: dict[str, str] = {}
    for canonical, aliases in COLUMN_ALIASES.items():
        for alias in aliases:
            if alias in lowered:
                found[canonical] = lowered[alias]
                break
    return found


# --------------------------------------------------------------------------- formats


def detect_format(path: Path) -> str:
    """``csv`` or ``jsonl`` from the extension (``.gz`` stripped), else by sniffing."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    ext = suffixes[-1] if suffixes else ""
    if ext == ".csv":
        return "csv"
    if ext in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    with _open_text(path) as (handle, _):
        for line in handle:
            if line.strip():
                return "jsonl" if line.lstrip().startswith(("{", "[")) else "csv"
    return "csv"


@contextmanager
def _open_text(path: Path) -> Iterator[tuple[IO[str], IO[bytes]]]:
    """Text handle plus the raw byte handle whose position drives progress."""
    with open(path, "rb") as raw:
        binary: IO[bytes] = raw
        if path.suffix.lower() == ".gz":
            binary = gzip.GzipFile(fileobj=raw)  # type: ignore[assignment]  # an IO[bytes]
        # utf-8-sig swallows the BOM spreadsheet tools write; newline="" as csv requires.
        with io.TextIOWrapper(binary, encoding="utf-8-sig", newline="") as text:
            yield text, raw


class _Progress:
    """Byte-based progress on stderr via rich (a typer dependency), if enabled."""

    def __init__(self, raw: IO[bytes], total: int, enabled: bool) -> None:
        self._raw = raw
        self._bar: Any = None
        self._task: Any = None
        if not enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TimeRemainingColumn,
            )
        except ImportError:  # pragma: no cover - rich ships with typer
            return
        self._bar = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),  # stdout carries the report (or JSON)
            transient=True,
        )
        self._task = self._bar.add_task("reading log", total=total)
        self._bar.start()

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self._raw.tell())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def read_log(
    path: str | os.PathLike[str],
    *,
    on_bad_row: BadRowPolicy = "skip",
    progress: bool = False,
) -> RequestLog:
    """Read a CSV or JSON Lines request log into compact columns.

    Bad rows (unparseable timestamp or number, missing fields) are skipped and
    recorded with their line number, or raise ``LogReadError`` when
    ``on_bad_row == "fail"``. A file without a timestamp column raises
    ``LogReadError`` whatever the policy.
    """
    file_path = Path(path)
    if not file_path.is_file():
        raise LogReadError(f"{file_path}: no such file")
    fmt = detect_format(file_path)
    total = file_path.stat().st_size
    builder = ColumnBuilder()
    result_columns: dict[str, str] = {}
    bad: list[BadRow] = []
    bad_count = 0
    rows = 0

    def record_bad(line: int, reason: str) -> None:
        nonlocal bad_count
        if on_bad_row == "fail":
            raise LogReadError(f"{file_path}:{line}: bad row: {reason}")
        bad_count += 1
        if len(bad) < MAX_BAD_ROWS_KEPT:
            bad.append(BadRow(line, reason))

    try:
        with _open_text(file_path) as (text, raw):
            meter = _Progress(raw, total, progress)
            try:
                read = _read_csv if fmt == "csv" else _read_jsonl
                rows, result_columns = read(text, builder, record_bad, meter)
            finally:
                meter.close()
    except (UnicodeDecodeError, OSError, EOFError, csv.Error) as exc:
        raise LogReadError(f"{file_path}: cannot read: {exc}") from None
    data = builder.columns()
    return RequestLog(
        source=str(file_path),
        fmt=fmt,
        columns=result_columns,
        ts_us=data["ts"].astype(np.int64, copy=False),
        prompt_tokens=data["prompt"].astype(np.int64, copy=False),
        output_tokens=data["output"].astype(np.int64, copy=False),
        tenant_codes=data["tenant"].astype(np.int32, copy=False),
        tenant_names=builder.names("tenant"),
        lane_codes=data["lane"].astype(np.int32, copy=False),
        lane_names=builder.names("lane"),
        decision_codes=data["decision"].astype(np.int32, copy=False),
        decision_names=builder.names("decision"),
        queue_wait_ms=data["queue_wait"].astype(np.float64, copy=False),
        latency_ms=data["latency"].astype(np.float64, copy=False),
        rows_read=rows,
        bad_rows=bad,
        bad_row_count=bad_count,
    )


def _missing_timestamp(names: list[str]) -> LogReadError:
    wanted = ", ".join(COLUMN_ALIASES["timestamp"])
    shown = ", ".join(names[:12]) or "(none)"
    return LogReadError(f"no timestamp column (looked for {wanted}; found {shown})")


def _read_csv(
    text: IO[str],
    builder: ColumnBuilder,
    record_bad: Callable[[int, str], None],
    meter: _Progress,
) -> tuple[int, dict[str, str]]:
    reader = csv.reader(text)
    header = next(reader, None)
    if header is None:  # an empty file is an empty log, not a malformed one
        return 0, {}
    columns = resolve_columns(header)
    if "timestamp" not in columns:
        raise _missing_timestamp(header)
    position = {name: i for i, name in enumerate(header)}
    index = {canonical: position[name] for canonical, name in columns.items()}
    needed = max(index.values()) + 1
    rows = 0
    while True:
        first_line = reader.line_num + 1
        chunk = list(islice(reader, CHUNK_ROWS))  # C-speed; no per-row Python
        if not chunk:
            break
        # Blank lines come through as [] and short rows are bad: either way
        # the chunk takes the row-by-row path.
        if min(map(len, chunk)) >= needed and builder.add_csv_chunk(chunk, index):
            rows += len(chunk)
        else:
            rows += _add_rows_one_by_one(chunk, first_line, index, needed, builder, record_bad)
        meter.update()
    return rows, columns


def _add_rows_one_by_one(
    chunk: list[list[str]],
    first_line: int,
    index: dict[str, int],
    needed: int,
    builder: ColumnBuilder,
    record_bad: Callable[[int, str], None],
) -> int:
    """The scalar path: exact semantics and a message per bad row.

    Returns the number of non-blank rows. Line numbers are recovered from the
    chunk's first line plus the newlines inside earlier (quoted) fields.
    """
    row: list[str] = []

    def get(canonical: str) -> object:
        return row[index[canonical]]

    line = first_line
    rows = 0
    for row in chunk:
        this_line = line
        line += 1 + sum(value.count("\n") for value in row)
        if not row or (len(row) == 1 and not row[0].strip()):
            continue  # blank line
        rows += 1
        if len(row) < needed:
            record_bad(this_line, f"expected at least {needed} fields, got {len(row)}")
            continue
        try:
            builder.add_row(get, index)
        except (ValueError, OverflowError) as exc:
            record_bad(this_line, str(exc))
    return rows


def _read_jsonl(
    text: IO[str],
    builder: ColumnBuilder,
    record_bad: Callable[[int, str], None],
    meter: _Progress,
) -> tuple[int, dict[str, str]]:
    columns: dict[str, str] | None = None
    keys_seen: frozenset[str] = frozenset()
    rows = 0
    obj: dict[str, Any] = {}

    def get(canonical: str) -> object:
        assert columns is not None
        return obj.get(columns[canonical])

    for line_no, line in enumerate(text, start=1):
        stripped = line.strip()
        if not stripped:
            continue
        if columns is None and stripped.startswith("["):
            raise LogReadError(
                "JSON array files are not supported; convert to JSON Lines "
                "(one object per line, e.g. `jq -c '.[]'`)"
            )
        rows += 1
        try:
            parsed = json.loads(stripped)
        except json.JSONDecodeError as exc:
            record_bad(line_no, f"invalid JSON: {exc.msg}")
            continue
        if not isinstance(parsed, dict):
            record_bad(line_no, f"expected a JSON object, got {type(parsed).__name__}")
            continue
        obj = parsed
        if columns is None or obj.keys() != keys_seen:
            # Resolve aliases once per distinct key set; most logs have one.
            row_columns = resolve_columns(list(obj.keys()))
            if columns is None and "timestamp" not in row_columns:
                raise _missing_timestamp(list(obj.keys()))
            columns = {**(columns or {}), **row_columns}
            keys_seen = frozenset(obj.keys())
        try:
            builder.add_row(get, columns)
        except (ValueError, OverflowError) as exc:
            record_bad(line_no, str(exc))
        if rows % CHUNK_ROWS == 0:
            meter.update()
    return rows, columns or {}
