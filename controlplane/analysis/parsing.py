"""Field parsers: scalar reference versions and vectorised fast paths.

The scalar parsers define the semantics and produce the bad-row messages.
The ``fast_*`` functions parse a whole column of CSV strings in C (NumPy);
they return ``None`` unless every value is of a shape on which they provably
agree with the scalar parser, and the caller then falls back to the scalar
path for that chunk. So the fast path changes speed, never results
(tests/integration/analysis/test_analysis_parsing.py checks the agreement).

Timestamps are integer microseconds since the Unix epoch (UTC): ``datetime``
resolves to the microsecond, and integers bin exactly where float seconds
near 1.7e9 would not. Numbers are read in a ``TimeUnit`` decided per log
(timeunits.py): integers exactly (nanoseconds truncated to the microsecond,
like ISO fractions), other numbers as ``round(value * factor)``; without a
unit they are epoch seconds, as before units existed.
"""

from __future__ import annotations

import math
import re
import warnings
from datetime import UTC, datetime, timedelta

import numpy as np
import numpy.typing as npt

from controlplane.analysis.timeunits import TimeUnit, to_us_factor

US_PER_S = 1_000_000
# Microseconds at 9999-12-31: anything later is an error, never a bin index.
MAX_TS_US = 253_402_300_799_999_999
# Epoch seconds above this (year 5138) are almost certainly milliseconds.
MAX_EPOCH_SECONDS = 1e11

_EPOCH_NAIVE = datetime(1970, 1, 1)
_EPOCH_AWARE = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_US = timedelta(microseconds=1)

Int64Array = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


def format_timestamp_us(ts_us: int) -> str:
    """Integer microseconds since the epoch -> ISO 8601 UTC with a ``Z``."""
    moment = _EPOCH_AWARE + timedelta(microseconds=ts_us)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# --------------------------------------------------------------------------- scalar


def parse_timestamp_us(value: object, unit: TimeUnit | None = None) -> int:
    """ISO 8601 (naive = UTC) or a number in ``unit`` -> integer microseconds.

    ``unit`` None: numbers are epoch seconds and values above 1e11 are refused
    as "looks like milliseconds" (the rule before units could be stated)."""
    if value is None:
        raise ValueError("missing timestamp")
    if isinstance(value, bool):
        raise ValueError("timestamp is a boolean")
    if isinstance(value, datetime):  # Parquet timestamps on the row-by-row path
        moment = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        return (moment - _EPOCH_AWARE) // _ONE_US
    if isinstance(value, int):
        return _int_to_us(value, unit) if unit is not None else _epoch_seconds_to_us(value)
    if isinstance(value, float):
        return _float_to_us(value, unit)
    if not isinstance(value, str):
        raise ValueError(f"timestamp has type {type(value).__name__}")
    text = value.strip()
    if not text:
        raise ValueError("empty timestamp")
    # "YYYY-..." is ISO; anything else is tried as a number first.
    if not (len(text) > 4 and text[4] == "-"):
        if unit is not None and _INTEGER.fullmatch(text):
            return _int_to_us(int(text), unit)
        try:
            return _float_to_us(float(text), unit)
        except ValueError:
            pass  # maybe ISO basic format (20231116T...); fromisoformat decides
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"unparseable timestamp {text[:40]!r}") from None
    if moment.tzinfo is None:
        return (moment - _EPOCH_NAIVE) // _ONE_US
    return (moment - _EPOCH_AWARE) // _ONE_US


_INTEGER = re.compile(r"[0-9]+")


def _checked(ts_us: int, value: object) -> int:
    if ts_us > MAX_TS_US:
        raise ValueError(f"timestamp {value!r} is out of range (after year 9999)")
    return ts_us


def _int_to_us(value: int, unit: TimeUnit) -> int:
    if value < 0:
        raise ValueError(f"timestamp {value!r} is negative")
    num, den = to_us_factor(unit)
    return _checked(value * num // den, value)


def _float_to_us(value: float, unit: TimeUnit | None) -> int:
    if unit is None:
        return _epoch_seconds_to_us(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"timestamp {value!r} is not a valid time")
    num, den = to_us_factor(unit)
    return _checked(round(value * (num / den)), value)


def _epoch_seconds_to_us(seconds: float) -> int:
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"timestamp {seconds!r} is not a valid epoch time")
    if seconds > MAX_EPOCH_SECONDS:
        raise ValueError(f"timestamp {seconds!r} looks like milliseconds; expected epoch seconds")
    return round(seconds * US_PER_S)


def parse_tokens(value: object) -> int:
    """Token count; empty/missing counts as 0 (e.g. a refused request)."""
    if value is None:
        return 0
    if isinstance(value, bool):
        raise ValueError("token count is a boolean")
    if isinstance(value, int):
        count = value
    elif isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"token count {value!r} is not an integer")
        count = int(value)
    elif isinstance(value, str):
        text = value.strip()
        if not text:
            return 0
        try:
            count = int(text)
        except ValueError:
            as_float = float(text)  # "374.0" from spreadsheet exports
            if not as_float.is_integer():
                raise ValueError(f"token count {text!r} is not an integer") from None
            count = int(as_float)
    else:
        raise ValueError(f"token count has type {type(value).__name__}")
    if count < 0:
        raise ValueError(f"negative token count {count}")
    return count


def parse_optional_float(value: object) -> float:
    """Non-negative number, or NaN when missing/empty."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return math.nan
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"expected a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"expected a non-negative number, got {value!r}")
    return number


def parse_optional_ts(value: object, unit: TimeUnit | None = None) -> int | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    return parse_timestamp_us(value, unit)


# --------------------------------------------------------------------------- vectorised

# ISO shape both datetime.fromisoformat and NumPy read identically:
# YYYY-MM-DD[T ]HH:MM:SS, optional .f (1-9 digits, truncated to microseconds),
# optional UTC suffix Z or +00:00. Checked on the UCS-4 code points of the
# whole column at once; the regex below is the same shape, for epoch columns.
_DIGITS_AT = (0, 1, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15, 17, 18)
_FIXED = 19  # len("YYYY-MM-DDTHH:MM:SS")
_MAX_FRACTION = 9
_EPOCH = r"[0-9]{1,11}(?:\.[0-9]*)?"
_EPOCH_COLUMN = re.compile(rf"(?:{_EPOCH}\n)*{_EPOCH}")


def _iso_column(column: list[str]) -> npt.NDArray[np.str_] | None:
    """The column as a fixed-width array with UTC suffixes removed, or None
    unless every value has the ISO shape above."""
    text = np.array(column)
    if text.dtype.kind != "U" or text.dtype.itemsize // 4 < _FIXED:
        return None
    width = text.dtype.itemsize // 4
    lengths = np.fromiter(map(len, column), dtype=np.int64, count=len(column))
    chars = text.view(np.uint32).reshape(len(column), width).copy()
    # NumPy drops trailing NULs; a length mismatch means the value had some.
    if (lengths != (chars != 0).sum(axis=1)).any() or lengths.min() < _FIXED:
        return None
    rows = np.arange(len(column))
    digit = (chars >= ord("0")) & (chars <= ord("9"))
    ok = digit[:, _DIGITS_AT].all(axis=1)
    ok &= (chars[:, 4] == ord("-")) & (chars[:, 7] == ord("-"))
    ok &= (chars[:, 10] == ord("T")) | (chars[:, 10] == ord(" "))
    ok &= (chars[:, 13] == ord(":")) & (chars[:, 16] == ord(":"))
    end = lengths.copy()
    zulu = chars[rows, end - 1] == ord("Z")
    end[zulu] -= 1
    offset = np.zeros(len(column), dtype=np.bool_)
    if width >= _FIXED + len("+00:00"):
        plus = np.array([ord(c) for c in "+00:00"], dtype=np.uint32)
        start = np.maximum(end - len(plus), 0)
        tail = chars[rows[:, None], start[:, None] + np.arange(len(plus))[None, :]]
        offset = ~zulu & (end - len(plus) >= _FIXED) & (tail == plus).all(axis=1)
        end[offset] -= len(plus)
    fraction = end - (_FIXED + 1)
    has_fraction = end > _FIXED
    ok &= ~has_fraction | (chars[:, min(_FIXED, width - 1)] == ord("."))
    ok &= ~has_fraction | ((fraction >= 1) & (fraction <= _MAX_FRACTION))
    position = np.arange(width)[None, :]
    in_fraction = (position > _FIXED) & (position < end[:, None])
    ok &= (digit | ~in_fraction).all(axis=1)
    if not ok.all():
        return None
    if zulu.any() or offset.any():
        chars[position >= end[:, None]] = 0  # cut the suffix: naive means UTC
    return chars.reshape(-1).view(text.dtype)


_INT_COLUMN = re.compile(r"(?:[0-9]{1,19}\n)*[0-9]{1,19}")
_FLOAT_COLUMN = re.compile(r"(?:[0-9]{1,19}\.[0-9]*\n)*[0-9]{1,19}\.[0-9]*")


def fast_numbers_to_us(column: list[str], unit: TimeUnit) -> Int64Array | None:
    """Numbers in ``unit``: all integers (exact) or all decimals; else None."""
    joined = "\n".join(column)
    if _INT_COLUMN.fullmatch(joined):
        try:
            values = np.array(column, dtype=np.int64)
        except OverflowError:
            return None
        return int_to_us(values, unit)
    if _FLOAT_COLUMN.fullmatch(joined):
        return float_to_us(np.array(column, dtype=np.float64), unit)
    return None


def int_to_us(values: Int64Array, unit: TimeUnit) -> Int64Array | None:
    """Exact, like the scalar path; None if any result would be out of range."""
    num, den = to_us_factor(unit)
    if values.size and (values.min() < 0 or values.max() > np.iinfo(np.int64).max // num):
        return None
    converted = values * num // den
    return None if converted.size and converted.max() > MAX_TS_US else converted


def float_to_us(values: npt.NDArray[np.float64], unit: TimeUnit) -> Int64Array | None:
    """Same product and round-half-even as ``round(value * factor)``."""
    num, den = to_us_factor(unit)
    if values.size and not (np.isfinite(values).all() and values.min() >= 0):
        return None
    scaled = np.rint(values * (num / den))
    if scaled.size and scaled.max() > MAX_TS_US:
        return None
    return scaled.astype(np.int64)


def fast_timestamps(column: list[str], unit: TimeUnit | None = None) -> Int64Array | None:
    """Microseconds for a column of ISO or numeric strings; None if unsure."""
    if not column:
        return np.zeros(0, dtype=np.int64)
    iso = _iso_column(column) if column[0][4:5] == "-" else None
    if iso is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # any doubt -> scalar path
            try:
                parsed = iso.astype("datetime64[us]")
            except (ValueError, Warning):
                return None
        return None if np.isnat(parsed).any() else parsed.astype(np.int64)
    if unit is not None:
        return fast_numbers_to_us(column, unit)
    if _EPOCH_COLUMN.fullmatch("\n".join(column)):
        seconds = np.array(column, dtype=np.float64)
        if seconds.max() > MAX_EPOCH_SECONDS:
            return None
        # Same product and round-half-even as round(seconds * 1e6).
        return np.rint(seconds * US_PER_S).astype(np.int64)
    return None


def fast_optional_timestamps(
    column: list[str], unit: TimeUnit | None = None
) -> tuple[Int64Array, BoolArray] | None:
    """(microseconds, present) where empty strings are missing."""
    present = np.fromiter((bool(v) for v in column), dtype=np.bool_, count=len(column))
    values = np.zeros(len(column), dtype=np.int64)
    if present.any():
        parsed = fast_timestamps([v for v in column if v], unit)
        if parsed is None:
            return None
        values[present] = parsed
    return values, present


def fast_counts(column: list[str]) -> Int64Array | None:
    """Non-negative integers; empty strings count as 0."""
    try:
        values = np.array([v or "0" for v in column], dtype=np.int64)
    except (ValueError, OverflowError):
        return None
    return None if values.size and values.min() < 0 else values


def fast_optional_floats(column: list[str]) -> npt.NDArray[np.float64] | None:
    """Non-negative finite numbers; empty strings are NaN."""
    try:
        values = np.array([v or "nan" for v in column], dtype=np.float64)
    except ValueError:
        return None
    missing = np.isnan(values)
    if int(missing.sum()) != column.count(""):  # a literal "nan" is a bad value
        return None
    known = values[~missing]
    if known.size and (not np.isfinite(known).all() or known.min() < 0):
        return None
    return values
