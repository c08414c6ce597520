"""pyarrow paths (the optional ``parquet`` extra): Parquet logs, and a fast
path for JSON Lines chunks.

Like the NumPy CSV fast path, a chunk is converted here only when every
value has a type and range on which the result provably equals the
row-by-row parser's; otherwise ``None`` and the caller parses the chunk row
by row (which defines the semantics and reports bad rows). So pyarrow
changes speed, never results; tests/integration/analysis checks agreement.
``BURSTGATE_ANALYZE_ARROW=0`` turns the JSON fast path off (benchmarks).
"""

from __future__ import annotations

import importlib.util
import io
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from controlplane.analysis.blockids import BlockChunk
from controlplane.analysis.columns import LABELS, ColumnBuilder, OptionalStamps
from controlplane.analysis.parsing import (
    fast_counts,
    fast_optional_floats,
    fast_optional_timestamps,
    fast_timestamps,
    float_to_us,
    int_to_us,
)
from controlplane.analysis.timeunits import TimeUnit

# Imported on first use: pyarrow costs ~50 MiB of RSS and a fraction of a
# second, which a CSV run does not need.
pa: Any = None
pc: Any = None
pa_json: Any = None
pq: Any = None


def available() -> bool:
    """Whether pyarrow is installed (the optional ``parquet`` extra)."""
    return importlib.util.find_spec("pyarrow") is not None


def load() -> Any:
    """Import pyarrow and its submodules once; returns ``pyarrow``."""
    global pa, pc, pa_json, pq
    if pa is None:
        import pyarrow  # type: ignore[import-untyped,import-not-found,unused-ignore]
        import pyarrow.compute  # type: ignore[import-untyped,import-not-found,unused-ignore]
        import pyarrow.json  # type: ignore[import-untyped,import-not-found,unused-ignore]
        import pyarrow.parquet  # type: ignore[import-untyped,import-not-found,unused-ignore]

        pa, pc, pa_json, pq = pyarrow, pyarrow.compute, pyarrow.json, pyarrow.parquet
    return pa


def json_fast_path_enabled() -> bool:
    return os.environ.get("BURSTGATE_ANALYZE_ARROW", "1") != "0" and available()


# --------------------------------------------------------------------------- columns


def _field(table: Any, path: Sequence[str]) -> Any:
    """A (possibly nested) column as one array, null where any parent is null."""
    array = table.column(path[0])
    if hasattr(array, "combine_chunks"):
        array = array.combine_chunks()
    for key in path[1:]:
        valid = array.is_valid()
        array = array.field(key)
        if not pc.all(valid).as_py():
            array = pc.if_else(valid, array, pa.nulls(len(array), array.type))
    return array


def _strings(array: Any) -> list[Any]:
    return list(array.to_pylist())


def _timestamps(array: Any, unit: TimeUnit | None, floats_exact: bool) -> Any:
    """Arrival times in microseconds, or None (a null, or unsure)."""
    kind = array.type
    if array.null_count:
        return None
    if pa.types.is_timestamp(kind):
        return array.cast(pa.timestamp("us"), safe=False).cast(pa.int64()).to_numpy()
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return fast_timestamps(_strings(array), unit)
    if unit is None:  # numbers without a stated unit: the scalar path's legacy rule
        return None
    if pa.types.is_integer(kind):
        return int_to_us(array.cast(pa.int64()).to_numpy(), unit)
    if pa.types.is_floating(kind) and (floats_exact or unit is not TimeUnit.ns):
        return float_to_us(array.cast(pa.float64()).to_numpy(), unit)
    return None


def _optional_timestamps(array: Any, unit: TimeUnit | None) -> OptionalStamps | None:
    kind = array.type
    present = array.is_valid().to_numpy(zero_copy_only=False)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return fast_optional_timestamps(["" if v is None else v for v in _strings(array)], unit)
    if pa.types.is_timestamp(kind):
        values = array.cast(pa.timestamp("us"), safe=False).cast(pa.int64()).fill_null(0)
        return values.to_numpy(), present
    if unit is not None and pa.types.is_integer(kind):
        converted = int_to_us(array.cast(pa.int64()).fill_null(0).to_numpy(), unit)
        return None if converted is None else (converted, present)
    return None


def _counts(array: Any) -> npt.NDArray[np.int64] | None:
    kind = array.type
    if pa.types.is_integer(kind):
        values = array.cast(pa.int64()).fill_null(0).to_numpy()
        return None if values.size and values.min() < 0 else values
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return fast_counts(["" if v is None else v for v in _strings(array)])
    if pa.types.is_null(kind):
        return np.zeros(len(array), np.int64)
    return None


def _optional_floats(array: Any) -> npt.NDArray[np.float64] | None:
    kind = array.type
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        values = np.asarray(array.cast(pa.float64()).to_numpy(zero_copy_only=False))
        missing = np.isnan(values)
        if int(missing.sum()) != array.null_count:  # a NaN value is bad, not missing
            return None
        known = values[~missing]
        if known.size and (not np.isfinite(known).all() or known.min() < 0):
            return None
        return values
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return fast_optional_floats(["" if v is None else v for v in _strings(array)])
    if pa.types.is_null(kind):
        return np.full(len(array), np.nan)
    return None


def _labels(array: Any) -> list[Any] | None:
    kind = array.type
    if pa.types.is_dictionary(kind):
        array = array.cast(kind.value_type)
        kind = array.type
    if pa.types.is_integer(kind):
        array = array.cast(pa.string())  # str(5) == "5", as the scalar path interns it
    elif not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)):
        return None
    return _strings(array)


def add_table(
    table: Any,
    paths: Mapping[str, Sequence[str]],
    builder: ColumnBuilder,
    *,
    floats_exact: bool,
) -> bool:
    """Append ``table`` (a Table or RecordBatch) if every value is safe; else False."""
    load()
    unit = builder.unit
    ts = _timestamps(_field(table, paths["timestamp"]), unit, floats_exact)
    if ts is None:
        return False
    counts: dict[str, npt.NDArray[np.int64]] = {}
    for name, canonical in (("prompt", "prompt_tokens"), ("output", "output_tokens")):
        if canonical in paths:
            parsed = _counts(_field(table, paths[canonical]))
            if parsed is None:
                return False
            counts[name] = parsed
    n = int(ts.size)
    floats: dict[str, npt.NDArray[np.float64]] = {}
    for name, canonical in (("queue_wait", "queue_wait_ms"), ("latency", "latency_ms")):
        values = _optional_floats(_field(table, paths[canonical])) if canonical in paths else None
        if canonical in paths and values is None:
            return False
        floats[name] = np.full(n, np.nan) if values is None else values

    def stamps(name: str) -> OptionalStamps | None:
        return _optional_timestamps(_field(table, paths[name]), unit)

    if not builder.derive_chunk(floats, ts, stamps, paths):
        return False
    labels: dict[str, list[Any]] = {}
    for name in LABELS:
        if name in paths:
            values_list = _labels(_field(table, paths[name]))
            if values_list is None:
                return False
            labels[name] = values_list
    blocks = None
    if "block_ids" in paths:
        blocks = _block_ids(_field(table, paths["block_ids"]))
        if blocks is None:
            return False
    builder.append_chunk(ts, counts, floats, labels, blocks)
    return True


def _block_ids(array: Any) -> BlockChunk | None:
    """A list column of integer or string ids; None (row by row) for anything else."""
    kind = array.type
    if pa.types.is_null(kind):
        return BlockChunk(np.zeros(len(array), np.int64), np.zeros(0, np.int64), len(array))
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        return None
    values = pc.list_flatten(array)  # null lists contribute nothing
    if values.null_count:
        return None  # a null inside a list is a bad value: the scalar path names it
    lengths = pc.list_value_length(array).fill_null(0).cast(pa.int64()).to_numpy()
    missing = array.null_count
    item = values.type
    if pa.types.is_integer(item) and not pa.types.is_uint64(item):
        return BlockChunk(lengths, values.cast(pa.int64()).to_numpy(), missing)
    if pa.types.is_string(item) or pa.types.is_large_string(item):
        return BlockChunk(lengths, values.to_pylist(), missing)
    return None


# --------------------------------------------------------------------------- JSON Lines


def _json_type(values: Iterable[object]) -> Any:
    """The Arrow type for one field from sample values, or None if unsafe (``load()`` first)."""
    kinds = {type(v) for v in values if v is not None}
    if kinds == {list}:  # block ids: a list of integers or of strings
        items = {type(item) for ids in values if isinstance(ids, list) for item in ids}
        if items <= {int}:
            return pa.list_(pa.int64())
        return pa.list_(pa.string()) if items == {str} else None
    if kinds <= {int}:
        return pa.int64() if kinds else pa.string()
    if kinds <= {int, float}:
        return pa.float64()
    if kinds == {str}:
        return pa.string()
    return None  # booleans, objects, arrays: row by row


class JsonChunks:
    """Reads chunks of JSON Lines with an explicit schema built from a sample."""

    def __init__(self, paths: Mapping[str, Sequence[str]], schema: Any) -> None:
        self.paths = paths
        self._options = pa_json.ParseOptions(
            explicit_schema=schema, unexpected_field_behavior="ignore"
        )

    @classmethod
    def build(
        cls,
        paths: Mapping[str, Sequence[str]],
        samples: Mapping[str, list[object]],
    ) -> JsonChunks | None:
        load()
        tree: dict[str, Any] = {}
        for canonical, path in paths.items():
            kind = _json_type(samples.get(canonical, []))
            if kind is None:
                return None
            node = tree
            for key in path[:-1]:
                child = node.setdefault(key, {})
                if not isinstance(child, dict):
                    return None  # a key is both a value and an object
                node = child
            node[path[-1]] = kind

        def to_type(node: dict[str, Any]) -> Any:
            return pa.struct(
                [(k, to_type(v) if isinstance(v, dict) else v) for k, v in node.items()]
            )

        return cls(paths, pa.schema(list(to_type(tree))))

    def add(self, lines: list[bytes], builder: ColumnBuilder) -> int | None:
        """Rows added from ``lines``, or None (nothing added: parse them row by row)."""
        try:
            table = pa_json.read_json(io.BytesIO(b"".join(lines)), parse_options=self._options)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None
        if table.num_rows == 0:
            return 0
        # ns integers in a float column would round where the row-by-row path is exact.
        if not add_table(table, self.paths, builder, floats_exact=False):
            return None
        return int(table.num_rows)


# --------------------------------------------------------------------------- Parquet


def parquet_file(source: str | io.BytesIO) -> Any:
    """A ``pyarrow.parquet.ParquetFile`` (random access: a path, or bytes read from a pipe)."""
    load()
    return pq.ParquetFile(source)
