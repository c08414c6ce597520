"""Accumulate parsed requests into compact typed columns.

Rows arrive either one at a time (the scalar path: JSON Lines, and CSV
chunks the fast path declined) or as whole CSV chunks parsed in NumPy. Both
end up as NumPy chunks in file order; string labels are interned to int32
codes shared by both paths.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Container, Mapping, Sequence
from operator import itemgetter
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from controlplane.analysis.blockids import BlockChunk, BlockColumn, csv_chunk, parse_block_ids
from controlplane.analysis.parsing import (
    fast_counts,
    fast_optional_floats,
    fast_optional_timestamps,
    fast_timestamps,
    parse_optional_float,
    parse_optional_ts,
    parse_timestamp_us,
    parse_tokens,
)
from controlplane.analysis.timeunits import TimeUnit

LABELS = ("tenant", "lane", "decision")
# A stage timestamp column: microseconds and whether each value was present.
OptionalStamps = tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]
US_PER_MS = 1000


# Column -> dtype. ts/prompt/output and labels are integers, waits floats.
_INT64 = ("ts", "prompt", "output")
_FLOAT = ("queue_wait", "latency")
_DTYPES: Mapping[str, type[np.generic]] = MappingProxyType(
    {
        **dict.fromkeys(_INT64, np.int64),
        **dict.fromkeys(_FLOAT, np.float64),
        **dict.fromkeys(LABELS, np.int32),
    }
)


class ColumnBuilder:
    """Typed columns for one log; ``columns()`` concatenates them at the end."""

    def __init__(self) -> None:
        # Unit of numeric timestamps (None: epoch seconds); set once the
        # reader has decided, before the first row is added.
        self.unit: TimeUnit | None = None
        self.labels: dict[str, dict[str, int]] = {name: {} for name in LABELS}
        self._chunks: dict[str, list[npt.NDArray[np.generic]]] = {name: [] for name in _DTYPES}
        self._ints, self._floats = self._fresh_rows()
        self.blocks = BlockColumn()  # block ids (blockids.py), kept when the log has them

    @staticmethod
    def _fresh_rows() -> tuple[dict[str, array[int]], dict[str, array[float]]]:
        ints = {name: array("q") for name in _INT64} | {name: array("i") for name in LABELS}
        return ints, {name: array("d") for name in _FLOAT}

    def intern(self, field: str, label: object) -> int:
        index = self.labels[field]
        text = "" if label is None else str(label).strip()
        code = index.get(text)
        if code is None:
            code = len(index)
            index[text] = code
        return code

    # ------------------------------------------------------------------ scalar path

    def add_row(self, get: Callable[[str], object], present: Mapping[str, object]) -> None:
        """Parse one row through ``get(canonical)``; raises ValueError if bad.

        Every field is parsed before anything is appended, so a bad row
        leaves the columns untouched.
        """
        unit = self.unit
        ts = parse_timestamp_us(get("timestamp"), unit)
        prompt = parse_tokens(get("prompt_tokens")) if "prompt_tokens" in present else 0
        output = parse_tokens(get("output_tokens")) if "output_tokens" in present else 0
        wait = latency = math.nan
        if "queue_wait_ms" in present:
            wait = parse_optional_float(get("queue_wait_ms"))
        if "latency_ms" in present:
            latency = parse_optional_float(get("latency_ms"))
        if math.isnan(wait) and "queue_start" in present and "exec_start" in present:
            q_start = parse_optional_ts(get("queue_start"), unit)
            x_start = parse_optional_ts(get("exec_start"), unit)
            if q_start is not None and x_start is not None:
                wait = max(0, x_start - q_start) / US_PER_MS
        if math.isnan(latency) and "end" in present:
            end = parse_optional_ts(get("end"), unit)
            if end is not None:
                latency = max(0, end - ts) / US_PER_MS  # arrival to completion
        ids = parse_block_ids(get("block_ids")) if "block_ids" in present else None
        codes = [self.intern(name, get(name)) if name in present else 0 for name in LABELS]
        ints, floats = self._ints, self._floats
        for name, value in zip((*_INT64, *LABELS), (ts, prompt, output, *codes), strict=True):
            ints[name].append(value)
        floats["queue_wait"].append(wait)
        floats["latency"].append(latency)
        self.blocks.add_row(ids)

    def _flush_rows(self) -> None:
        if not len(self._ints["ts"]):
            return
        buffers: dict[str, array[int] | array[float]] = {**self._ints, **self._floats}
        for name, values in buffers.items():
            self._chunks[name].append(np.frombuffer(values, dtype=_DTYPES[name]).copy())
        self._ints, self._floats = self._fresh_rows()
        self.blocks.flush_rows()

    # ------------------------------------------------------------------ vector path

    def add_csv_chunk(self, rows: list[list[str]], index: Mapping[str, int]) -> bool:
        """Parse a chunk of CSV rows in NumPy; False (nothing added) if unsure."""
        n = len(rows)

        def column(name: str) -> list[str]:
            return list(map(itemgetter(index[name]), rows))

        ts = fast_timestamps(column("timestamp"), self.unit)
        if ts is None:
            return False
        counts: dict[str, npt.NDArray[np.int64]] = {}
        for name, field in (("prompt", "prompt_tokens"), ("output", "output_tokens")):
            parsed = fast_counts(column(field)) if field in index else np.zeros(n, np.int64)
            if parsed is None:
                return False
            counts[name] = parsed
        floats: dict[str, npt.NDArray[np.float64]] = {}
        for name, field in (("queue_wait", "queue_wait_ms"), ("latency", "latency_ms")):
            values = fast_optional_floats(column(field)) if field in index else np.full(n, np.nan)
            if values is None:
                return False
            floats[name] = values
        unit = self.unit

        def stamps(name: str) -> OptionalStamps | None:
            return fast_optional_timestamps(column(name), unit)

        if not self.derive_chunk(floats, ts, stamps, index):
            return False
        blocks = None
        if "block_ids" in index:
            blocks = csv_chunk(column("block_ids"))
            if blocks is None:
                return False
        labels = {name: column(name) for name in LABELS if name in index}
        self.append_chunk(ts, counts, floats, labels, blocks)
        return True

    def append_chunk(
        self,
        ts: npt.NDArray[np.int64],
        counts: Mapping[str, npt.NDArray[np.int64]],
        floats: Mapping[str, npt.NDArray[np.float64]],
        labels: Mapping[str, Sequence[object]],
        blocks: BlockChunk | None = None,
    ) -> None:
        """Append a parsed chunk (every value already valid) in file order."""
        n = int(ts.size)
        self._flush_rows()  # keep file order: earlier scalar rows first
        self._chunks["ts"].append(ts)
        for name in ("prompt", "output"):
            self._chunks[name].append(counts.get(name, np.zeros(n, np.int64)))
        for name in _FLOAT:
            self._chunks[name].append(floats.get(name, np.full(n, np.nan)))
        for name in LABELS:
            self._chunks[name].append(
                self._label_codes(name, labels[name]) if name in labels else np.zeros(n, np.int32)
            )
        self.blocks.add_chunk(blocks, n)

    def derive_chunk(
        self,
        floats: dict[str, npt.NDArray[np.float64]],
        ts: npt.NDArray[np.int64],
        stamps: Callable[[str], OptionalStamps | None],
        present: Container[str],
    ) -> bool:
        """Queue wait and latency from stage timestamps where not given directly.

        ``stamps(field)`` parses one stage column as (microseconds, present),
        or None when unsure (the caller then takes the scalar path)."""
        wait = floats["queue_wait"]
        if "queue_start" in present and "exec_start" in present and np.isnan(wait).any():
            q_start = stamps("queue_start")
            x_start = stamps("exec_start")
            if q_start is None or x_start is None:
                return False
            fill = np.isnan(wait) & q_start[1] & x_start[1]
            wait[fill] = np.maximum(0, x_start[0][fill] - q_start[0][fill]) / US_PER_MS
        latency = floats["latency"]
        if "end" in present and np.isnan(latency).any():
            end = stamps("end")
            if end is None:
                return False
            fill = np.isnan(latency) & end[1]
            latency[fill] = np.maximum(0, end[0][fill] - ts[fill]) / US_PER_MS
        return True

    def _label_codes(self, field: str, values: Sequence[object]) -> npt.NDArray[np.int32]:
        # dict.fromkeys keeps first-appearance order, so codes match the scalar path.
        mapping = {raw: self.intern(field, raw) for raw in dict.fromkeys(values)}
        return np.fromiter(map(mapping.__getitem__, values), dtype=np.int32, count=len(values))

    # ------------------------------------------------------------------ result

    def columns(self) -> dict[str, npt.NDArray[np.generic]]:
        self._flush_rows()
        out: dict[str, npt.NDArray[np.generic]] = {}
        for name, chunks in self._chunks.items():
            dtype = _DTYPES[name]
            out[name] = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
            chunks.clear()  # release chunk memory as soon as it is copied
        return out

    def names(self, field: str) -> list[str]:
        ordered = sorted(self.labels[field].items(), key=lambda item: item[1])
        return [name for name, _ in ordered] or [""]
