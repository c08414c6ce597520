"""The vectorised fast path agrees with the scalar parsers wherever it accepts."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime
from typing import TypeVar

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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

T = TypeVar("T")


def _scalar(parse: Callable[[str], T], column: list[str]) -> list[T] | None:
    """The scalar parser over a column, or None if any value is bad."""
    try:
        return [parse(v) for v in column]
    except (ValueError, OverflowError):
        return None


ANY_SUFFIX = ("", "", "Z", "+00:00", "+01:00", "-05:30")


@st.composite
def iso_text(draw: st.DrawFn, max_digits: int = 10, suffixes: tuple[str, ...] = ANY_SUFFIX) -> str:
    moment = draw(st.datetimes(min_value=datetime(1971, 1, 1)))
    text = moment.strftime("%Y-%m-%d") + draw(st.sampled_from("T ")) + moment.strftime("%H:%M:%S")
    digits = draw(st.integers(min_value=0, max_value=max_digits))
    if digits:
        text += "." + draw(st.text("0123456789", min_size=digits, max_size=digits))
    return text + draw(st.sampled_from(suffixes))


# Plain shapes plus the odd values real logs contain.
noise = st.sampled_from(
    [
        "",
        " ",
        "nan",
        "NaT",
        "2023-11-16T18:15:46.",
        " 2023-11-16T18:15:46",
        "2023-02-30 00:00:00",
        "1700000000",
        "1700000000.25",
        "1e9",
        "-5",
        "+7",
        "1_000",
        "12.0",
        "abc",
        "2023-11-16",
        "99999999999999",
        "2023-11-16T18:15:46\x00",
    ]
)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(iso_text(), noise), min_size=1, max_size=8))
def test_timestamps_agree(column: list[str]) -> None:
    fast = fast_timestamps(column)
    if fast is not None:
        assert fast.tolist() == _scalar(parse_timestamp_us, column)
    optional = fast_optional_timestamps(column)
    if optional is not None:
        values, present = optional
        expected = _scalar(parse_optional_ts, column)
        assert expected is not None
        assert [int(v) if p else None for v, p in zip(values, present, strict=True)] == expected


@settings(max_examples=50, deadline=None)
@given(st.lists(iso_text(max_digits=9, suffixes=("", "Z", "+00:00")), min_size=1, max_size=20))
def test_plain_iso_columns_take_the_fast_path(column: list[str]) -> None:
    fast = fast_timestamps(column)
    assert fast is not None
    assert fast.tolist() == [parse_timestamp_us(v) for v in column]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.integers(-5, 10**20).map(str), noise), min_size=1, max_size=8))
def test_counts_agree(column: list[str]) -> None:
    fast = fast_counts(column)
    if fast is not None:
        assert fast.tolist() == _scalar(parse_tokens, column)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.floats(allow_nan=True).map(repr), noise), min_size=1, max_size=8))
def test_optional_floats_agree(column: list[str]) -> None:
    fast = fast_optional_floats(column)
    if fast is not None:
        expected = _scalar(parse_optional_float, column)
        assert expected is not None
        got = fast.tolist()
        assert all(
            (math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(got, expected, strict=True)
        )


def test_fast_path_is_taken_on_typical_columns() -> None:
    azure = ["2023-11-16 18:15:46.6805900", "2023-11-16 18:15:50.9951690"]
    ledger = ["2025-01-06T09:00:00.000001Z", "2025-01-06T09:00:01.5+00:00"]
    epoch = ["1700000000", "1700000000.125"]
    for column in (azure, ledger, epoch):
        fast = fast_timestamps(column)
        assert fast is not None and fast.tolist() == [parse_timestamp_us(v) for v in column]
    counts = fast_counts(["374", "", "0"])
    assert counts is not None and counts.tolist() == [374, 0, 0]
    floats = fast_optional_floats(["1.5", ""])
    assert floats is not None and floats[0] == 1.5 and np.isnan(floats[1])
    assert fast_timestamps([]) is not None


numeric_text = st.one_of(
    st.integers(min_value=0, max_value=10**20).map(str),
    st.floats(min_value=0, max_value=1e13, allow_nan=False).map(lambda f: f"{f:.6f}"),
    st.floats(min_value=0, max_value=1e6, allow_nan=False).map(lambda f: f"{f:.3f}"),
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.one_of(numeric_text, noise), min_size=1, max_size=8),
    st.sampled_from(list(TimeUnit)),
)
def test_timestamps_in_a_unit_agree(column: list[str], unit: TimeUnit) -> None:
    fast = fast_timestamps(column, unit)
    if fast is not None:
        assert fast.tolist() == _scalar(lambda v: parse_timestamp_us(v, unit), column)


def test_numeric_units_take_the_fast_path() -> None:
    cases = [
        (["0", "166", "1000"], TimeUnit.ms, [0, 166_000, 1_000_000]),
        (["1.5", "2.25"], TimeUnit.s, [1_500_000, 2_250_000]),
        (["1753780607550317897"], TimeUnit.ns, [1_753_780_607_550_317]),  # truncated
        (["1700000000000"], TimeUnit.ms, [1_700_000_000_000_000]),
    ]
    for column, unit, expected in cases:
        fast = fast_timestamps(column, unit)
        assert fast is not None and fast.tolist() == expected
        assert [parse_timestamp_us(v, unit) for v in column] == expected
    # Integers and decimals mixed: the scalar path decides each value.
    assert fast_timestamps(["1", "2.5"], TimeUnit.s) is None
    with pytest.raises(ValueError, match="out of range"):
        parse_timestamp_us(str(10**20), TimeUnit.s)
