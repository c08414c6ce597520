"""Request traces for ``burstgate simulate``: loading, time scaling, tenants, bursts.

Loading (:func:`load_trace`) reads CSV (the Azure LLM inference trace layout by
default) or JSON Lines (e.g. Mooncake: ``ColumnMap(time="timestamp",
prompt="input_length", output="output_length", time_unit="ms")``). Requests come
back sorted by arrival (ties keep file order) and shifted so the first arrival
is at 0 ns; ``row`` is the 0-based index of the data row in the file.

Time-unit rule. ``ColumnMap.time_unit`` is ``"s"``, ``"ms"``, ``"us"``, ``"ns"``
(numbers in that unit, converted exactly with decimal arithmetic and rounded to
the nearest ns), ``"datetime"`` (``YYYY-MM-DD[ T]HH:MM[:SS[.fffffffff]]`` with up
to nine fractional digits parsed as integers, so seven-digit Azure stamps are
exact to the ns; optional ``Z`` or ``+HH:MM``; no zone means UTC) or ``"auto"``.
``auto`` accepts datetimes only: a numeric time is refused with an error asking
for an explicit unit, because guessing (ms read as s) has bitten us before.

Tenant-assignment rule (:func:`assign_tenants`). With ``column=True`` every
request keeps the tenant read from ``ColumnMap.tenant`` (missing is an error).
Otherwise request ``row`` goes to the tenant whose cumulative normalised share
first exceeds ``u = int.from_bytes(blake2b(f"{seed}:{row}".encode("ascii"),
digest_size=8).digest(), "big") / 2**64``, walking ``shares`` in dict order (the
last tenant takes any rounding remainder). This depends only on seed and row,
so it is identical across runs, processes and platforms. A request of a
multi-turn session (``session`` >= 0, synthetic traces) hashes
``f"{seed}:s{session}"`` instead, so a whole conversation has one tenant.

Block ids (prefix caching). A row may carry ``hash_ids`` (``ColumnMap.blocks``),
as the Mooncake traces do: one id per fixed-size block of the prompt, equal ids
meaning equal content and equal prefix. The column is optional: when the first
row has it every row must (a JSON list of integers, in a CSV cell too, no id
twice in a row); when it does not, no request has block ids and the prefix
cache has nothing to work with. The block size is not in the file: ``simulate
--block-tokens`` (512, Mooncake's, by default) says it. (``burstgate analyze``
has its own reader; this one is the simulator's, kept small.)
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import random
import re
import statistics
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, date, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from itertools import accumulate
from pathlib import Path
from typing import Any

from controlplane.domain.errors import excerpt
from controlplane.domain.units import NS_PER_S

_UNIT_NS = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}
_TIME_UNITS = frozenset({*_UNIT_NS, "datetime", "auto"})
_EPOCH_ORDINAL = date(1970, 1, 1).toordinal()
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_INTEGER = re.compile(r"\+?\d+")
_DATETIME = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[T ](\d{2}):(\d{2})(?::(\d{2})(?:\.(\d{1,9}))?)?"
    r"\s*(Z|[+-]\d{2}(?::?\d{2})?)?",
    re.IGNORECASE,
)


class TraceError(ValueError):
    """A trace that cannot be read or used; the message names file, line and column."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    t_ns: int  # arrival, nanoseconds from the start of the trace (first row = 0 after loading)
    prompt_tokens: int
    output_tokens: int
    tenant: str  # assigned by assign_tenants (default "" when loaded)
    row: int  # 0-based index of the row in the input, stable identity
    # The prompt's block ids (a trace's hash_ids; synthetic sessions make
    # their own); () = unknown, nothing to cache by.
    blocks: tuple[int, ...] = ()
    # A multi-turn conversation (synthetic traces); -1 = none.
    session: int = -1
    # Leading blocks shared beyond this request's own conversation (its
    # tenant's system prompt): what a burst's copy keeps (inject_burst).
    shared_blocks: int = 0


@dataclass(frozen=True, slots=True)
class ColumnMap:
    time: str = "TIMESTAMP"
    prompt: str = "ContextTokens"
    output: str = "GeneratedTokens"
    tenant: str | None = None  # optional column holding a tenant id
    time_unit: str = "auto"  # "s", "ms", "us", "ns", "datetime", or "auto"
    # Optional column of prompt block ids, read when the first row has it.
    blocks: str | None = "hash_ids"


# -- parsing ------------------------------------------------------------------------------


def parse_datetime_ns(text: str) -> int | None:
    """Nanoseconds since the Unix epoch for an ISO-like stamp, or None if it is not one."""
    m = _DATETIME.fullmatch(text.strip())
    if m is None:
        return None
    y, mo, d, h, mi = (int(g) for g in m.group(1, 2, 3, 4, 5))
    s = int(m.group(6) or 0)
    try:
        datetime(y, mo, d, h, mi, s, tzinfo=UTC)  # range check only
    except ValueError:
        return None
    zone, offset_s = (m.group(8) or "Z").upper().replace(":", ""), 0
    if zone != "Z":
        offset_s = int(zone[:3]) * 3600 + int(zone[0] + (zone[3:5] or "0")) * 60
    secs = (date(y, mo, d).toordinal() - _EPOCH_ORDINAL) * 86400 + h * 3600 + mi * 60 + s
    frac = (m.group(7) or "").ljust(9, "0")
    return (secs - offset_s) * NS_PER_S + int(frac)


class _Source:
    """Where the value being parsed came from, for error messages."""

    def __init__(self, path: str, columns: ColumnMap) -> None:
        self.path, self.columns, self.line = path, columns, 0
        self.with_blocks: bool | None = None  # decided by the first row

    def block_ids(self, get: Mapping[str, object]) -> tuple[int, ...]:
        col = self.columns.blocks
        if col is None:
            return ()
        if self.with_blocks is None:
            self.with_blocks = col in get
        if not self.with_blocks:
            return ()
        if col not in get:
            raise TraceError(
                f"{self.path}:{self.line}: missing column {col!r} (the first row has block ids, "
                "so every row must)"
            )
        value = get[col]
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise self.error(col, "expected a JSON list of integer block ids", value) from None
        if not isinstance(value, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) for b in value
        ):
            raise self.error(col, "expected a list of integer block ids", excerpt(value))
        ids = tuple(value)
        if len(set(ids)) != len(ids):
            raise self.error(col, "a block id repeats within one request", excerpt(value))
        return ids

    def error(self, column: str, what: str, got: object) -> TraceError:
        return TraceError(f"{self.path}:{self.line}: column {column!r}: {what}, got {got!r}")

    def time_ns(self, value: object) -> int:
        col, unit = self.columns.time, self.columns.time_unit
        if isinstance(value, str) and not _NUMBER.fullmatch(value.strip()):
            if unit not in ("auto", "datetime"):
                raise self.error(col, f"expected a number in {unit} (time_unit={unit!r})", value)
            ns = parse_datetime_ns(value)
            if ns is None:
                raise self.error(col, "expected a datetime like 2023-11-16 18:15:46.6805900", value)
            return ns
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise self.error(col, "expected a time", value)
        if unit == "auto":
            raise TraceError(
                f"{self.path}:{self.line}: column {col!r}: numeric time {value!r} has no unit; "
                "set ColumnMap(time_unit=...) to 's', 'ms', 'us' or 'ns' "
                "(auto only accepts datetimes and never guesses a unit)"
            )
        if unit == "datetime":
            raise self.error(col, "expected a datetime", value)
        number = Decimal(repr(value) if isinstance(value, float) else str(value).strip())
        if not number.is_finite():
            raise self.error(col, f"expected a finite number in {unit}", value)
        return int((number * _UNIT_NS[unit]).quantize(Decimal(1), ROUND_HALF_EVEN))

    def tokens(self, column: str, value: object) -> int:
        if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
            return int(value.strip())
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        if isinstance(value, float) and value.is_integer() and value >= 0:
            return int(value)
        raise self.error(column, "expected a non-negative integer", value)

    def tenant(self, value: object) -> str:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value.strip():
            raise self.error(self.columns.tenant or "", "expected a tenant id", value)
        return value.strip()

    def request(self, row: int, get: Mapping[str, object]) -> TraceRequest:
        c = self.columns
        return TraceRequest(
            t_ns=self.time_ns(get[c.time]),
            prompt_tokens=self.tokens(c.prompt, get[c.prompt]),
            output_tokens=self.tokens(c.output, get[c.output]),
            tenant=self.tenant(get[c.tenant]) if c.tenant is not None else "",
            row=row,
            blocks=self.block_ids(get),
        )


def _wanted(columns: ColumnMap) -> list[str]:
    names = [columns.time, columns.prompt, columns.output]
    return names + ([columns.tenant] if columns.tenant is not None else [])


def _missing(src: _Source, available: Sequence[str]) -> None:
    absent = [n for n in _wanted(src.columns) if n not in available]
    if absent:
        raise TraceError(
            f"{src.path}:{src.line}: missing column {', '.join(map(repr, absent))}; "
            f"available columns: {', '.join(map(repr, available)) or '(none)'}"
        )


def _read_csv(f: Iterator[str], src: _Source) -> Iterator[TraceRequest]:
    reader = csv.reader(f)
    lines = ((reader.line_num, x) for x in reader if any(v.strip() for v in x))
    src.line, first = next(lines, (0, None))
    if first is None:
        raise TraceError(f"{src.path}: empty trace (no header row)")
    header = [h.strip() for h in first]
    _missing(src, header)
    index = {n: header.index(n) for n in _wanted(src.columns)}
    if src.columns.blocks is not None and src.columns.blocks in header:
        index[src.columns.blocks] = header.index(src.columns.blocks)
    for row, (src.line, fields) in enumerate(lines):
        if len(fields) != len(header):
            raise TraceError(f"{src.path}:{src.line}: {len(fields)} fields, header {len(header)}")
        yield src.request(row, {n: fields[i] for n, i in index.items()})


def _read_jsonl(f: Iterator[str], src: _Source) -> Iterator[TraceRequest]:
    row = 0
    for src.line, text in enumerate(f, start=1):
        if not text.strip():
            continue
        try:
            obj: Any = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceError(f"{src.path}:{src.line}: not valid JSON: {e.msg}") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{src.path}:{src.line}: expected a JSON object per line")
        _missing(src, list(obj))
        yield src.request(row, obj)
        row += 1


def _detect_format(path: Path, fmt: str) -> str:
    if fmt not in ("csv", "jsonl", "auto"):
        raise ValueError(f"fmt must be 'csv', 'jsonl' or 'auto', got {fmt!r}")
    suffix = path.suffix.lower()
    if fmt != "auto" or suffix in (".csv", ".jsonl", ".json"):
        return fmt if fmt != "auto" else ("csv" if suffix == ".csv" else "jsonl")
    with path.open(encoding="utf-8-sig") as f:
        return "jsonl" if f.read(4096).lstrip().startswith("{") else "csv"


def load_trace(
    path: str | Path,
    columns: ColumnMap | None = None,
    *,
    fmt: str = "auto",
    limit: int | None = None,
) -> list[TraceRequest]:
    """Read a CSV or JSON Lines trace; sorted by arrival, first arrival at 0 ns.

    ``limit`` keeps the first N data rows of the file (before sorting).
    """
    columns = columns or ColumnMap()
    if columns.time_unit not in _TIME_UNITS:
        raise ValueError(f"time_unit must be one of {sorted(_TIME_UNITS)}: {columns.time_unit!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of rows, got {limit}")
    p = Path(path)
    src = _Source(str(path), columns)
    try:
        kind = _detect_format(p, fmt)
        reqs: list[TraceRequest] = []
        with p.open(encoding="utf-8-sig", newline="") as f:
            rows = _read_csv(f, src) if kind == "csv" else _read_jsonl(f, src)
            for req in rows:
                reqs.append(req)
                if limit is not None and len(reqs) >= limit:
                    break
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        where = f"{src.path}:{src.line}" if src.line else src.path
        raise TraceError(f"{where}: cannot read trace: {e}") from e
    if not reqs:
        raise TraceError(f"{src.path}: empty trace (no requests)")
    reqs.sort(key=lambda r: (r.t_ns, r.row))
    t0 = reqs[0].t_ns
    return [replace(r, t_ns=r.t_ns - t0) for r in reqs]


# -- transformations ----------------------------------------------------------------------


def scale_to_rate(reqs: Sequence[TraceRequest], target_rps: float) -> list[TraceRequest]:
    """Stretch or compress arrivals about the first one so (n-1)/span equals ``target_rps``.

    The new span is ``round((n-1) * 1e9 / target_rps)`` ns and each offset is scaled
    with exact integer arithmetic (round half up), so order is preserved.
    """
    if len(reqs) < 2:
        raise TraceError(f"scale_to_rate needs at least 2 requests, got {len(reqs)}")
    if not (math.isfinite(target_rps) and target_rps > 0):
        raise ValueError(f"target_rps must be a positive finite number, got {target_rps}")
    t0 = min(r.t_ns for r in reqs)
    span = max(r.t_ns for r in reqs) - t0
    if span == 0:
        raise TraceError("scale_to_rate: all requests arrive at the same instant (zero span)")
    new_span = round(Decimal(len(reqs) - 1) * NS_PER_S / Decimal(repr(target_rps)))
    if new_span == 0:
        raise TraceError(f"scale_to_rate: {target_rps} req/s rounds the span to 0 ns")
    return [replace(r, t_ns=t0 + (2 * (r.t_ns - t0) * new_span + span) // (2 * span)) for r in reqs]


def _unit_hash(seed: int, row: int | str) -> float:
    digest = hashlib.blake2b(f"{seed}:{row}".encode("ascii"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def assign_tenants(
    reqs: Sequence[TraceRequest],
    shares: dict[str, float],
    *,
    seed: int = 0,
    column: bool = False,
) -> list[TraceRequest]:
    """Give every request a tenant (see the module docstring for the rule).

    ``shares`` is not used with ``column=True``.
    """
    if column:
        missing = [r.row for r in reqs if not r.tenant]
        if missing:
            raise TraceError(
                f"assign_tenants(column=True): {len(missing)} request(s) have no tenant "
                f"(first row {missing[0]}); load with ColumnMap(tenant=...)"
            )
        return list(reqs)
    if not shares:
        raise ValueError("assign_tenants needs at least one tenant share")
    bad = {t: s for t, s in shares.items() if not (math.isfinite(s) and s > 0)}
    if bad:
        raise ValueError(f"tenant shares must be positive and finite, got {bad}")
    total = math.fsum(shares.values())
    names, cumulative = list(shares), list(accumulate(s / total for s in shares.values()))

    def pick(r: TraceRequest) -> str:
        u = _unit_hash(seed, r.row) if r.session < 0 else _unit_hash(seed, f"s{r.session}")
        return next((n for n, c in zip(names, cumulative, strict=True) if u < c), names[-1])

    return [replace(r, tenant=pick(r)) for r in reqs]


def inject_burst(
    reqs: Sequence[TraceRequest],
    tenant: str,
    factor: float,
    start_s: float,
    duration_s: float,
    *,
    seed: int = 0,
) -> list[TraceRequest]:
    """Multiply ``tenant``'s arrival rate by ``factor`` in [start_s, start_s + duration_s).

    ``round((factor - 1) * m)`` copies are added, m being the tenant's requests in the
    window: each in-window request is copied ``k // m`` times and ``k % m`` of them (drawn
    with ``random.Random(seed)``) once more. A copy lands at its source's time plus a
    uniform jitter of up to one mean gap (duration / m) either way, reflected back into
    the window, so the burst follows the tenant's own shape. Copies get rows after the
    current maximum. Result sorted by time (then row); when nothing is added (factor 1,
    or no such requests in the window) the input comes back unchanged.

    A copy is a new user, not a replay: it keeps its source's first
    ``shared_blocks`` block ids (the tenant's system prompt) and gets new
    ids, never used before, for the rest of its prompt (a trace read from a
    file has no shared blocks, so a copy's whole prompt is new content), and
    belongs to no session.
    """
    if not (math.isfinite(factor) and factor >= 1):
        raise ValueError(f"burst factor must be >= 1, got {factor}")
    if not (math.isfinite(duration_s) and duration_s > 0 and math.isfinite(start_s)):
        raise ValueError(f"burst window must be finite with duration > 0, got {duration_s}")
    if factor == 1:
        return list(reqs)
    lo = round(start_s * NS_PER_S)
    hi = lo + max(1, round(duration_s * NS_PER_S))  # exclusive
    inside = [r for r in reqs if r.tenant == tenant and lo <= r.t_ns < hi]
    m = len(inside)
    k = round((factor - 1) * m)
    if k == 0:
        return list(reqs)
    rng = random.Random(seed)
    sources = inside * (k // m) + rng.sample(inside, k % m)
    width = hi - lo
    gap = width // m
    next_row = max(r.row for r in reqs) + 1
    next_id = 1 + max((max(r.blocks) for r in reqs if r.blocks), default=-1)
    copies = []
    for i, src in enumerate(sources):
        off = src.t_ns - lo + rng.randint(-gap, gap)
        off %= 2 * width  # reflect into [0, width)
        off = off if off < width else 2 * width - 1 - off
        keep = src.blocks[: src.shared_blocks]
        fresh = tuple(range(next_id, next_id + len(src.blocks) - len(keep)))
        next_id += len(fresh)
        copies.append(
            replace(src, t_ns=lo + off, row=next_row + i, blocks=keep + fresh, session=-1)
        )
    return sorted([*reqs, *copies], key=lambda r: (r.t_ns, r.row))


def summary(reqs: Sequence[TraceRequest]) -> dict[str, float]:
    """n, duration_s, mean_rps ((n-1)/span, as scale_to_rate), token means and
    medians, and ``tenant:<name>`` counts for requests that have a tenant."""
    n = len(reqs)
    out: dict[str, float] = {"n": float(n)}
    if n == 0:
        return out | {"duration_s": 0.0, "mean_rps": 0.0}
    span = max(r.t_ns for r in reqs) - min(r.t_ns for r in reqs)
    out["duration_s"] = span / NS_PER_S
    out["mean_rps"] = (n - 1) * NS_PER_S / span if span > 0 else 0.0
    for kind, values in (
        ("prompt", [r.prompt_tokens for r in reqs]),
        ("output", [r.output_tokens for r in reqs]),
    ):
        out[f"mean_{kind}_tokens"] = statistics.fmean(values)
        out[f"median_{kind}_tokens"] = float(statistics.median(values))
    for name, count in sorted(Counter(r.tenant for r in reqs if r.tenant).items()):
        out[f"tenant:{name}"] = float(count)
    return out
