"""Streaming reader for request logs (CSV, JSON Lines, Parquet; a file or stdin).

The input is read in chunks of ``CHUNK_ROWS`` rows and appended to compact
typed columns (columns.py), so memory grows by about 50 bytes per request and
never holds a Python object per row beyond the current chunk. The statistics
need every arrival time (inter-arrival percentiles, per-incident latency
percentiles), so the columns are kept rather than only per-second bins; see
docs/analysis.md for the bound.

Which columns hold what (presets.py) and what the timestamps mean
(timeunits.py) are decided on the first chunk, so a pipe is read once.
CSV chunks are parsed column-wise in NumPy and JSON Lines chunks by pyarrow
(when installed) whenever every value has a plain shape; otherwise row by
row, which defines the semantics and is where bad rows are found and
reported with their line numbers.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from itertools import islice
from typing import IO, Any, Literal

import numpy as np

from controlplane.analysis import arrowread
from controlplane.analysis.columns import ColumnBuilder
from controlplane.analysis.logdata import BadRow, Finding, LogReadError, RequestLog
from controlplane.analysis.presets import (
    COLUMN_ALIASES,
    ColumnError,
    ColumnOptions,
    Resolution,
    json_paths,
    missing_timestamp,
    resolve,
)
from controlplane.analysis.progress import Phases
from controlplane.analysis.sources import Opened, SourceError, is_stdin, open_log
from controlplane.analysis.timeunits import SAMPLE_ROWS, TimeDecision, TimeUnit, decide

__all__ = [
    "COLUMN_ALIASES",
    "BadRow",
    "ColumnOptions",
    "Finding",
    "LogReadError",
    "RequestLog",
    "read_log",
    "resolve_columns",
]

BadRowPolicy = Literal["skip", "fail"]

# Bad rows kept verbatim for the report; the total is always counted.
MAX_BAD_ROWS_KEPT = 50
# Rows parsed together: large enough that NumPy's per-call overhead vanishes,
# small enough that the chunk's Python lists stay in cache and the cyclic GC's
# scans stay cheap (50,000 was measurably slower on a 1M-row log).
CHUNK_ROWS = 10_000
_BOM = b"\xef\xbb\xbf"


def resolve_columns(names: list[str]) -> dict[str, str]:
    """Map canonical fields to the file's column names (aliases and presets)."""
    return resolve(names, ColumnOptions()).columns


class _State:
    """What one read accumulates: columns, bad rows, and the input decisions."""

    def __init__(self, name: str, policy: BadRowPolicy, options: ColumnOptions) -> None:
        self.name = name
        self.policy = policy
        self.options = options
        self.builder = ColumnBuilder()
        self.bad: list[BadRow] = []
        self.bad_count = 0
        self.rows = 0
        self.resolution: Resolution | None = None
        self.time: TimeDecision | None = None
        self.column_names: list[str] = []

    @property
    def columns(self) -> dict[str, str]:
        return {} if self.resolution is None else self.resolution.columns

    def record_bad(self, line: int, reason: str) -> None:
        if self.policy == "fail":
            raise LogReadError(f"{self.name}:{line}: bad row: {reason}")
        self.bad_count += 1
        if len(self.bad) < MAX_BAD_ROWS_KEPT:
            self.bad.append(BadRow(line, reason))

    def resolve(self, names: list[str]) -> dict[str, str]:
        self.column_names = names
        self.resolution = resolve(names, self.options)
        if "timestamp" not in self.resolution.columns:
            raise missing_timestamp(names)
        return self.resolution.columns

    def decide(self, sample: Sequence[object], decision: TimeDecision | None = None) -> None:
        preset = None if self.resolution is None else self.resolution.preset
        self.time = decision or decide(
            [v for v in sample if v is not None and v != ""][:SAMPLE_ROWS],
            unit=self.options.time_unit,
            preset_unit=None if preset is None else preset.relative_unit,
            preset_name=None if preset is None else preset.name.value,
        )
        # Stray numbers in a log of dates keep the old rule (epoch seconds)
        # unless a unit was stated.
        legacy = self.time.kind in ("dates", "empty") and not self.time.explicit_unit
        self.builder.unit = None if legacy else self.time.unit

    def add_row(self, line: int, get: Callable[[str], object]) -> None:
        self.rows += 1
        try:
            self.builder.add_row(get, self.columns)
        except (ValueError, OverflowError) as exc:
            self.record_bad(line, str(exc))

    def result(self, fmt: str) -> RequestLog:
        data = self.builder.columns()
        builder = self.builder
        offsets, codes = builder.blocks.result()
        with_blocks = "block_ids" in self.columns
        return RequestLog(
            source=self.name,
            fmt=fmt,
            columns=self.columns,
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
            rows_read=self.rows,
            bad_rows=self.bad,
            bad_row_count=self.bad_count,
            resolution=self.resolution,
            time=self.time,
            column_names=self.column_names,
            block_offsets=offsets if with_blocks else None,
            block_codes=codes if with_blocks else None,
            blocks_missing=builder.blocks.missing if with_blocks else 0,
        )


def read_log(
    path: str | os.PathLike[str],
    *,
    on_bad_row: BadRowPolicy = "skip",
    progress: bool | Phases = False,
    options: ColumnOptions | None = None,
) -> RequestLog:
    """Read a CSV, JSON Lines or Parquet request log into compact columns.

    ``path`` ``-`` is stdin; FIFOs and ``/dev/stdin`` work too. Bad rows
    (unparseable timestamp or number, missing fields) are skipped and
    recorded with their line number, or raise ``LogReadError`` when
    ``on_bad_row == "fail"``. A log without a timestamp column, or a column
    option or ``--format`` that does not fit, raises ``LogReadError``
    whatever the policy. ``progress``: True for a bar of its own, or the
    run's ``Phases``.
    """
    options = options or ColumnOptions()
    phases = progress if isinstance(progress, Phases) else Phases(progress)
    name = "<stdin>" if is_stdin(path) else str(path)
    try:
        with open_log(path) as opened, nullcontext() if phases is progress else phases:
            state = _State(opened.name, on_bad_row, options)
            with phases.bytes_task(f"reading {opened.name}", opened.total) as update:

                def meter() -> None:
                    update(opened.counter.bytes_read)

                if opened.fmt == "parquet":
                    _read_parquet(opened, path, state, meter)
                elif opened.fmt == "csv":
                    _read_csv(opened.stream, state, meter)
                else:
                    _read_jsonl(opened.stream, state, meter)
            return state.result(opened.fmt)
    except (SourceError, ColumnError) as exc:
        raise LogReadError(str(exc)) from None
    except (UnicodeDecodeError, OSError, EOFError, csv.Error) as exc:
        raise LogReadError(f"{name}: cannot read: {exc}") from None


# --------------------------------------------------------------------------- CSV


def _read_csv(stream: IO[bytes], state: _State, meter: Callable[[], None]) -> None:
    # utf-8-sig swallows the BOM spreadsheet tools write; newline="" as csv requires.
    text = io.TextIOWrapper(stream, encoding="utf-8-sig", newline="")
    reader = csv.reader(text)
    header = next(reader, None)
    if header is None:  # an empty file is an empty log, not a malformed one
        state.decide([])
        return
    columns = state.resolve(header)
    position = {name: i for i, name in enumerate(header)}
    index = {canonical: position[name] for canonical, name in columns.items()}
    needed = max(index.values()) + 1
    ts_at = index["timestamp"]
    first = True
    while True:
        first_line = reader.line_num + 1
        chunk = list(islice(reader, CHUNK_ROWS))  # C-speed; no per-row Python
        if first:
            state.decide([row[ts_at] for row in chunk if len(row) > ts_at])
            first = False
        if not chunk:
            break
        # Blank lines come through as [] and short rows are bad: either way
        # the chunk takes the row-by-row path.
        if min(map(len, chunk)) >= needed and state.builder.add_csv_chunk(chunk, index):
            state.rows += len(chunk)
        else:
            _add_rows_one_by_one(chunk, first_line, index, needed, state)
        meter()


def _add_rows_one_by_one(
    chunk: list[list[str]],
    first_line: int,
    index: dict[str, int],
    needed: int,
    state: _State,
) -> None:
    """The scalar path: exact semantics and a message per bad row.

    Line numbers are recovered from the chunk's first line plus the newlines
    inside earlier (quoted) fields.
    """
    row: list[str] = []

    def get(canonical: str) -> object:
        return row[index[canonical]]

    line = first_line
    for row in chunk:
        this_line = line
        line += 1 + sum(value.count("\n") for value in row)
        if not row or (len(row) == 1 and not row[0].strip()):
            continue  # blank line
        if len(row) < needed:
            state.rows += 1
            state.record_bad(this_line, f"expected at least {needed} fields, got {len(row)}")
            continue
        state.add_row(this_line, get)


# --------------------------------------------------------------------------- JSON Lines


def _json_paths_of(objects: Iterable[dict[str, Any]]) -> tuple[list[str], set[str]]:
    """Column names (keys and nested paths) over the objects' distinct key sets,
    and the top-level keys (a key containing a dot is taken literally)."""
    names: dict[str, None] = {}
    top: set[str] = set()
    seen: set[tuple[str, ...]] = set()
    for obj in objects:
        keys = tuple(obj)
        if keys in seen:
            continue
        seen.add(keys)
        top.update(keys)
        names.update(dict.fromkeys(json_paths(obj)))
    return list(names), top


def _getter_paths(columns: Mapping[str, str], top: set[str]) -> dict[str, tuple[str, ...]]:
    return {c: (name,) if name in top else tuple(name.split(".")) for c, name in columns.items()}


def _lookup(obj: dict[str, Any], path: tuple[str, ...]) -> object:
    value: object = obj
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _getter(
    obj: dict[str, Any], paths: Mapping[str, tuple[str, ...]], flat: Mapping[str, str] | None
) -> Callable[[str], object]:
    """``get(canonical)`` for one object; ``flat`` (no nested paths) is the quick case."""
    if flat is not None:
        return lambda canonical: obj.get(flat[canonical])
    return lambda canonical: _lookup(obj, paths[canonical])


def _flat(paths: Mapping[str, tuple[str, ...]]) -> dict[str, str] | None:
    if all(len(path) == 1 for path in paths.values()):
        return {canonical: path[0] for canonical, path in paths.items()}
    return None


def _parse_line(raw: bytes) -> dict[str, Any] | str:
    """The object on a line, or the reason it is bad."""
    try:
        parsed = json.loads(raw.decode())
    except UnicodeDecodeError:
        return "invalid UTF-8"
    except json.JSONDecodeError as exc:
        return f"invalid JSON: {exc.msg}"
    if not isinstance(parsed, dict):
        return f"expected a JSON object, got {type(parsed).__name__}"
    return parsed


def _read_jsonl(stream: IO[bytes], state: _State, meter: Callable[[], None]) -> None:
    paths: dict[str, tuple[str, ...]] = {}
    flat: dict[str, str] | None = None
    fast: arrowread.JsonChunks | None = None
    line_no = 0
    first_content = True
    while True:
        chunk = list(islice(stream, CHUNK_ROWS))
        if not chunk:
            break
        start = line_no + 1
        line_no += len(chunk)
        if start == 1 and chunk[0].startswith(_BOM):
            chunk[0] = chunk[0][len(_BOM) :]
        if first_content:
            head = next((line.strip() for line in chunk if line.strip()), b"")
            if head.startswith(b"["):
                raise LogReadError(
                    "JSON array files are not supported; convert to JSON Lines "
                    "(one object per line, e.g. `jq -c '.[]'`)"
                )
            first_content = not head
        if fast is not None:
            added = fast.add(chunk, state.builder)
            if added is not None:
                state.rows += added
                meter()
                continue
        parsed = [(start + i, _parse_line(raw)) for i, raw in enumerate(chunk) if raw.strip()]
        if state.resolution is None:
            objects = [obj for _, obj in parsed if isinstance(obj, dict)]
            if objects:
                names, top = _json_paths_of(objects)
                paths = _getter_paths(state.resolve(names), top)
                flat = _flat(paths)
                sample = [_lookup(obj, paths["timestamp"]) for obj in objects[:SAMPLE_ROWS]]
                state.decide(sample)
                if arrowread.json_fast_path_enabled():
                    samples = {c: [_lookup(o, p) for o in objects] for c, p in paths.items()}
                    fast = arrowread.JsonChunks.build(paths, samples)
        for line, obj in parsed:
            if isinstance(obj, str):
                state.rows += 1
                state.record_bad(line, obj)
                continue
            state.add_row(line, _getter(obj, paths, flat))
        meter()
    if state.time is None:
        state.decide([])


# --------------------------------------------------------------------------- Parquet


def _read_parquet(
    opened: Opened, path: str | os.PathLike[str], state: _State, meter: Callable[[], None]
) -> None:
    if not arrowread.available():
        raise LogReadError(
            f"{opened.name}: reading Parquet needs pyarrow: pip install 'burstgate[analysis]'"
        )
    pa = arrowread.load()
    seekable = opened.total is not None and not is_stdin(path)
    try:
        parquet = arrowread.parquet_file(
            str(path) if seekable else io.BytesIO(opened.stream.read())
        )
    except (pa.ArrowInvalid, OSError) as exc:
        raise LogReadError(f"{opened.name}: not a readable Parquet file: {exc}") from None
    schema = parquet.schema_arrow
    names: list[str] = []
    for item in schema:
        names.append(item.name)
        if pa.types.is_struct(item.type):
            names.extend(f"{item.name}.{child.name}" for child in item.type)
    top = set(schema.names)
    paths = _getter_paths(state.resolve(names), top)
    done = 0
    total_rows = max(parquet.metadata.num_rows, 1)
    wanted = sorted({p[0] for p in paths.values()})
    for batch in parquet.iter_batches(batch_size=CHUNK_ROWS, columns=wanted):
        if state.time is None:
            ts = arrowread._field(batch, paths["timestamp"])
            if pa.types.is_timestamp(ts.type):
                typed = TimeDecision("dates", TimeUnit.s, "data", "Parquet timestamp column")
                state.decide([], typed)
            else:
                state.decide(ts.slice(0, SAMPLE_ROWS).to_pylist())
        if arrowread.add_table(batch, paths, state.builder, floats_exact=True):
            state.rows += batch.num_rows
        else:
            _parquet_rows_one_by_one(batch, done, paths, state)
        done += batch.num_rows
        if opened.total:
            opened.counter.bytes_read = opened.total * done // total_rows
        meter()
    if state.time is None:
        state.decide([])


def _parquet_rows_one_by_one(
    batch: Any, done: int, paths: Mapping[str, tuple[str, ...]], state: _State
) -> None:
    """Row by row, for bad-row messages; "line" is the 1-based row number."""
    pa = arrowread.load()
    # Nanosecond timestamps do not become datetime objects: truncate to µs first.
    arrays = [
        col.cast(pa.timestamp("us", tz=col.type.tz), safe=False)
        if pa.types.is_timestamp(col.type)
        else col
        for col in batch.columns
    ]
    rows = pa.RecordBatch.from_arrays(arrays, names=batch.schema.names).to_pylist()
    for offset, row in enumerate(rows):
        state.add_row(done + offset + 1, _getter(row, paths, None))
