"""Per-request prefix-block ids (``hash_ids``): parsing and a compact column.

Public KV-cache traces give each request a list of block ids, one per
fixed-size block of its prompt (Mooncake: ``"hash_ids": [46, 47]``, 512 tokens
a block; Alibaba's Bailian traces: 16). An id is an integer or a string and is
opaque: two blocks are the same block when their ids are equal as JSON values
(``5`` and ``"5"`` differ). In CSV the column holds a JSON list (``"[1, 2]"``).

The reader keeps them as a ragged column: per request the number of ids, and
all ids back to back as int64 *codes* (the ids themselves while they are all
int64 integers, else interned: ``BlockColumn``). A missing value (absent key, null, empty
cell) is a request without block ids; it counts as zero blocks, and is
counted.

As for the other columns, the scalar parser defines the semantics and names
the bad value; the column parsers return ``None`` when unsure and the caller
parses that chunk row by row.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Int64Array = npt.NDArray[np.int64]


def parse_block_ids(value: object) -> list[Hashable] | None:
    """A request's block ids, or None when missing; ValueError names what is wrong."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return None
        if not text.startswith("["):
            raise ValueError(f"block ids must be a JSON list such as [1, 2, 3], got {text[:40]!r}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"block ids are not a valid JSON list: {exc.msg}") from None
    if not isinstance(value, list | tuple):
        raise ValueError(f"block ids must be a list, got {type(value).__name__}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int | str):
            raise ValueError(
                f"block id {item!r} is a {type(item).__name__}; expected integers or strings"
            )
    return list(value)


def _plain_ids(lists: Sequence[object]) -> bool:
    """Every value a list of ints (not bools) or of strings: the scalar parser would agree."""
    for ids in lists:
        if not isinstance(ids, list):
            return False
        for item in ids:
            kind = type(item)
            if kind is not int and kind is not str:
                return False
    return True


@dataclass(frozen=True, slots=True)
class BlockChunk:
    """Parsed block ids of consecutive rows, not yet interned."""

    lengths: Int64Array  # ids per row (0 where missing)
    ids: Int64Array | list[Hashable]  # every id, row after row
    missing: int  # rows without block ids


def csv_chunk(column: list[str]) -> BlockChunk | None:
    """A CSV column of JSON lists, parsed at once; None unless every cell is one."""
    if not column or any(not cell.startswith("[") for cell in column):
        return None
    try:
        lists = json.loads("[" + ",".join(column) + "]")
    except json.JSONDecodeError:
        return None
    if len(lists) != len(column) or not _plain_ids(lists):
        return None
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    return BlockChunk(lengths, [item for ids in lists for item in ids], 0)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _int64s(ids: Sequence[Hashable]) -> bool:
    return all(type(item) is int and INT64_MIN <= item <= INT64_MAX for item in ids)


class BlockColumn:
    """The ragged column the reader appends to, in file order.

    While every id is an integer that fits int64 (Mooncake's, Bailian's) the
    ids are kept as they are: no per-id Python object, which on a million
    requests of twenty ids is the difference between 150 MB and 1 GB. The
    first other id (a string, a larger integer) turns the column into codes:
    every id so far, then every id after, interned in order of first
    appearance (so the same file gives the same codes whichever parser path
    read it). Either way equal codes mean equal ids.
    """

    def __init__(self) -> None:
        self.index: dict[Hashable, int] | None = None  # None: the codes are the ids
        self.missing = 0
        self._lengths: list[Int64Array] = []
        self._codes: list[Int64Array] = []
        self._row_lengths = array("q")
        self._row_codes = array("q")

    def intern(self, ids: Sequence[Hashable]) -> list[int]:
        if self.index is None:
            self._to_codes()
        index = self.index
        assert index is not None
        setdefault = index.setdefault
        return [setdefault(item, len(index)) for item in ids]

    def _to_codes(self) -> None:
        """Switch from raw integers to interned codes, converting what is stored."""
        self.flush_rows()
        self.index = {}
        raw, self._codes = self._codes, []
        for chunk in raw:
            self._codes.append(np.array(self.intern(chunk.tolist()), dtype=np.int64))

    def add_row(self, ids: list[Hashable] | None) -> None:
        """One scalar row (already parsed: this cannot fail)."""
        if ids is None:
            self.missing += 1
            self._row_lengths.append(0)
            return
        if self.index is None and not _int64s(ids):
            self._to_codes()
        self._row_lengths.append(len(ids))
        self._row_codes.extend(ids if self.index is None else self.intern(ids))  # type: ignore[arg-type]

    def flush_rows(self) -> None:
        if len(self._row_lengths):
            self._lengths.append(np.frombuffer(self._row_lengths, dtype=np.int64).copy())
            self._codes.append(np.frombuffer(self._row_codes, dtype=np.int64).copy())
            self._row_lengths, self._row_codes = array("q"), array("q")

    def add_chunk(self, chunk: BlockChunk | None, rows: int) -> None:
        """A parsed chunk of ``rows`` rows (None: the chunk has no block-id column)."""
        self.flush_rows()  # keep file order: earlier scalar rows first
        if chunk is None:
            self.missing += rows
            self._lengths.append(np.zeros(rows, np.int64))
            return
        ids = chunk.ids
        if isinstance(ids, list) and self.index is None and _int64s(ids):
            ids = np.array(ids, dtype=np.int64)
        self.missing += chunk.missing
        self._lengths.append(chunk.lengths)
        self._codes.append(self._chunk_codes(ids))

    def _chunk_codes(self, ids: Int64Array | list[Hashable]) -> Int64Array:
        if isinstance(ids, list):
            return np.array(self.intern(ids), dtype=np.int64)
        if self.index is None or not ids.size:
            return ids
        # Intern each distinct id once, in order of first appearance.
        distinct, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")
        codes = np.empty(distinct.size, dtype=np.int64)
        codes[order] = self.intern(distinct[order].tolist())
        return codes[inverse.reshape(-1)]

    def result(self) -> tuple[Int64Array, Int64Array]:
        """(offsets, codes): request ``r``'s codes are ``codes[offsets[r]:offsets[r + 1]]``."""
        self.flush_rows()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        codes = np.concatenate(self._codes) if self._codes else np.zeros(0, np.int64)
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        self._lengths, self._codes = [], []
        return offsets, codes
