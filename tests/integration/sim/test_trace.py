"""Request traces for ``burstgate simulate``: loading, scaling, tenants, bursts."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from controlplane.sim.trace import (
    ColumnMap,
    TraceError,
    TraceRequest,
    assign_tenants,
    inject_burst,
    load_trace,
    scale_to_rate,
    summary,
)

# ../shared/ beside the repository (read-only input on every machine and CI)
AZURE = Path(__file__).resolve().parents[4] / "shared/traces/AzureLLMInferenceTrace_conv.csv"
MOONCAKE = ColumnMap(
    time="timestamp", prompt="input_length", output="output_length", time_unit="ms"
)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def uniform(n: int, span_s: float, tenant: str = "") -> list[TraceRequest]:
    step = round(span_s * 1e9) // n
    return [TraceRequest(i * step, 100 + i, 10, tenant, i) for i in range(n)]


# -- loading --------------------------------------------------------------------------------


def test_azure_csv_seven_digit_fractions_are_exact_and_sorted_from_zero(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "azure.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:46.6805901,10,1\n"
        "2023-11-16 18:15:46.6805900,5,5\n",
    )
    reqs = load_trace(path)
    # ties keep file order (row 1 before row 3); 100 ns apart is below float resolution
    assert [(r.row, r.t_ns) for r in reqs] == [(1, 0), (3, 0), (2, 100), (0, 4_314_579_000)]
    assert reqs[0] == TraceRequest(0, 374, 44, "", 1)
    assert reqs[-1] == TraceRequest(4_314_579_000, 396, 109, "", 0)


def test_datetime_variants_and_utc_offsets(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "t.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16T18:00:00Z,1,1\n"
        "2023-11-16 18:00:01,1,1\n"
        "2023-11-16 18:00:01.000000001,1,1\n"
        "2023-11-16T20:00:02+02:00,1,1\n"  # 18:00:02 UTC
        "2023-11-16 18:00,1,1\n",  # no seconds: ties with row 0
    )
    assert [(r.row, r.t_ns) for r in load_trace(path)] == [
        (0, 0),
        (4, 0),
        (1, 1_000_000_000),
        (2, 1_000_000_001),
        (3, 2_000_000_000),
    ]


def test_mooncake_jsonl_in_milliseconds(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [1, 2]},
        {"timestamp": 0, "input_length": 100, "output_length": 7, "hash_ids": []},
        {"timestamp": 1500.5, "input_length": 12, "output_length": 3, "hash_ids": [9]},
    ]
    text = "\n".join(json.dumps(x) for x in lines) + "\n\n"
    for name, fmt in (("m.jsonl", "auto"), ("m.json", "auto"), ("m.txt", "auto"), ("m", "jsonl")):
        reqs = load_trace(write(tmp_path, name, text), MOONCAKE, fmt=fmt)
        assert [(r.row, r.t_ns) for r in reqs] == [(1, 0), (2, 1_500_500_000), (0, 27_482_000_000)]
        assert (reqs[-1].prompt_tokens, reqs[-1].output_tokens) == (6955, 52)


@pytest.mark.parametrize(("unit", "scale"), [("s", 10**9), ("ms", 10**6), ("us", 10**3), ("ns", 1)])
def test_numeric_csv_times_in_each_unit(tmp_path: Path, unit: str, scale: int) -> None:
    path = write(tmp_path, "n.csv", "t,p,o\n10,1,1\n12.5,1,1\n")
    reqs = load_trace(path, ColumnMap(time="t", prompt="p", output="o", time_unit=unit))
    assert [r.t_ns for r in reqs] == [0, round(2.5 * scale)]


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("m.jsonl", '{"timestamp": 27482, "input_length": 1, "output_length": 1}\n'),
        ("m.csv", "timestamp,input_length,output_length\n27482,1,1\n"),
    ],
)
def test_auto_refuses_numeric_times(tmp_path: Path, name: str, text: str) -> None:
    path = write(tmp_path, name, text)
    auto = ColumnMap(time="timestamp", prompt="input_length", output="output_length")
    with pytest.raises(TraceError) as err:
        load_trace(path, auto)
    msg = str(err.value)
    assert f"{name}:" in msg and "'timestamp'" in msg and "27482" in msg
    assert "time_unit" in msg and "'ms'" in msg


def test_unit_and_value_kind_must_agree(tmp_path: Path) -> None:
    dated = write(
        tmp_path, "d.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00,1,1\n"
    )
    with pytest.raises(TraceError, match=r"d\.csv:2: column 'TIMESTAMP': expected a number in s"):
        load_trace(dated, ColumnMap(time_unit="s"))
    numeric = write(tmp_path, "n.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n5,1,1\n")
    with pytest.raises(TraceError, match=r"n\.csv:2: column 'TIMESTAMP': expected a datetime"):
        load_trace(numeric, ColumnMap(time_unit="datetime"))
    with pytest.raises(ValueError, match="time_unit"):
        load_trace(numeric, ColumnMap(time_unit="minutes"))


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            "2023-11-16 18:00:02,abc,3",
            "column 'ContextTokens': expected a non-negative integer, got 'abc'",
        ),
        (
            "2023-11-16 18:00:02,5,-3",
            "column 'GeneratedTokens': expected a non-negative integer, got '-3'",
        ),
        (
            "2023-11-16 18:00:02,5.5,3",
            "column 'ContextTokens': expected a non-negative integer, got '5.5'",
        ),
        ("yesterday,5,3", "column 'TIMESTAMP': expected a datetime"),
        ("2023-13-16 18:00:02,5,3", "column 'TIMESTAMP': expected a datetime"),
    ],
)
def test_bad_csv_row_names_file_line_and_column(tmp_path: Path, row: str, message: str) -> None:
    # the blank line counts: the bad row is line 4 of the file but data row 2
    text = f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:01,1,1\n\n{row}\n"
    with pytest.raises(TraceError) as err:
        load_trace(write(tmp_path, "trace.csv", text))
    assert str(err.value).startswith(f"{tmp_path / 'trace.csv'}:4: {message}")


def test_bad_jsonl_rows(tmp_path: Path) -> None:
    good = '{"timestamp": 1, "input_length": 1, "output_length": 1}\n'
    cases = {
        '{"timestamp": 2, "input_length": 1.5, "output_length": 1}': (
            "t.jsonl:2: column 'input_length': expected a non-negative integer, got 1.5"
        ),
        '{"timestamp": 2, "input_length": true, "output_length": 1}': "got True",
        "[1, 2, 3]": "t.jsonl:2: expected a JSON object",
        "{not json": "t.jsonl:2: not valid JSON",
        '{"timestamp": 2, "input": 1, "output_length": 1}': (
            "t.jsonl:2: missing column 'input_length'; available columns: "
            "'timestamp', 'input', 'output_length'"
        ),
    }
    for line, message in cases.items():
        with pytest.raises(TraceError) as err:
            load_trace(write(tmp_path, "t.jsonl", good + line + "\n"), MOONCAKE)
        assert message in str(err.value)


def test_missing_csv_column_lists_available(tmp_path: Path) -> None:
    path = write(tmp_path, "trace.csv", "TIMESTAMP,Prompt,GeneratedTokens\n2023-11-16 18:00,1,1\n")
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert str(err.value) == (
        f"{path}:1: missing column 'ContextTokens'; "
        "available columns: 'TIMESTAMP', 'Prompt', 'GeneratedTokens'"
    )


def test_empty_and_header_only_files_are_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="empty"):
        load_trace(write(tmp_path, "e.csv", ""))
    with pytest.raises(TraceError, match="empty"):
        load_trace(write(tmp_path, "e.jsonl", "\n  \n"), MOONCAKE)
    with pytest.raises(TraceError, match="empty"):
        load_trace(write(tmp_path, "h.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"))
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "absent.csv")


def test_limit_keeps_the_first_rows_of_the_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "t.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:00:09,1,1\n"
        "2023-11-16 18:00:05,2,2\n"
        "2023-11-16 18:00:01,3,3\n"
        "2023-11-16 18:00:02,oops,3\n",  # beyond the limit, never parsed
    )
    reqs = load_trace(path, limit=2)
    assert [(r.row, r.t_ns) for r in reqs] == [(1, 0), (0, 4_000_000_000)]
    sniffed = tmp_path / "t.trace"  # unknown suffix, not '{': read as CSV
    sniffed.write_bytes(path.read_bytes())
    assert load_trace(sniffed, limit=3)[0].row == 2


def test_tenant_column_is_loaded_and_kept(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "t.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens,org\n"
        "2023-11-16 18:00:01,1,1,acme\n"
        "2023-11-16 18:00:02,1,1,globex\n",
    )
    reqs = load_trace(path, ColumnMap(tenant="org"))
    assert [r.tenant for r in reqs] == ["acme", "globex"]
    assert assign_tenants(reqs, {}, column=True) == reqs
    with pytest.raises(TraceError, match="no tenant"):
        assign_tenants(load_trace(path), {"a": 1.0}, column=True)
    blank = write(
        tmp_path, "b.csv", "TIMESTAMP,ContextTokens,GeneratedTokens,org\n2023-11-16 18:00,1,1,\n"
    )
    with pytest.raises(TraceError, match=r"b\.csv:2: column 'org': expected a tenant id"):
        load_trace(blank, ColumnMap(tenant="org"))


# -- scale_to_rate --------------------------------------------------------------------------


def mean_rps(reqs: list[TraceRequest]) -> float:
    return (len(reqs) - 1) * 1e9 / (reqs[-1].t_ns - reqs[0].t_ns)


def test_scale_to_rate_hits_target_and_keeps_order() -> None:
    reqs = [TraceRequest(t, 1, 1, "", i) for i, t in enumerate([0, 7, 7, 1_000, 3_000_000_001])]
    for target in (0.5, 3.0, 1.0 / 3.0):
        out = scale_to_rate(reqs, target)
        assert mean_rps(out) == pytest.approx(target, rel=1e-9)
        assert [r.row for r in out] == [0, 1, 2, 3, 4]
        assert [r.t_ns for r in out] == sorted(r.t_ns for r in out)
    assert [r.t_ns for r in scale_to_rate(reqs, 4 / 6)] == [0, 14, 14, 2_000, 6_000_000_000]


def test_scale_to_rate_rejects_degenerate_input() -> None:
    with pytest.raises(TraceError, match="at least 2"):
        scale_to_rate([TraceRequest(0, 1, 1, "", 0)], 1.0)
    with pytest.raises(TraceError, match="zero span"):
        scale_to_rate([TraceRequest(5, 1, 1, "", 0), TraceRequest(5, 1, 1, "", 1)], 1.0)
    with pytest.raises(ValueError, match="positive"):
        scale_to_rate(uniform(3, 1.0), 0.0)


@settings(max_examples=200, deadline=None)
@given(
    times=st.lists(st.integers(0, 10**13), min_size=2, max_size=200),
    target=st.floats(min_value=1e-3, max_value=1e4, allow_nan=False),
)
def test_scale_to_rate_property(times: list[int], target: float) -> None:
    times.sort()
    assume(times[-1] > times[0] and (len(times) - 1) / target >= 1.0)  # new span >= 1 s
    reqs = [TraceRequest(t, 1, 1, "", i) for i, t in enumerate(times)]
    out = scale_to_rate(reqs, target)
    assert abs(mean_rps(out) - target) <= 1e-9 * target
    assert [r.row for r in out] == list(range(len(times)))
    assert all(a.t_ns <= b.t_ns for a, b in pairwise(out))
    assert out[0].t_ns == times[0]


# -- assign_tenants -------------------------------------------------------------------------


def test_assign_tenants_follows_documented_hash_rule() -> None:
    shares = {"a": 1.0, "b": 3.0}  # a: u < 0.25, b: otherwise
    out = assign_tenants(uniform(200, 10.0), shares, seed=7)
    for r in out:
        digest = hashlib.blake2b(f"7:{r.row}".encode("ascii"), digest_size=8).digest()
        u = int.from_bytes(digest, "big") / 2**64
        assert r.tenant == ("a" if u < 0.25 else "b")


def test_assign_tenants_is_deterministic_and_seeded() -> None:
    reqs = uniform(1_000, 100.0)
    shares = {"a": 0.5, "b": 0.3, "c": 0.2}
    first = assign_tenants(reqs, shares, seed=1)
    assert assign_tenants(reqs, shares, seed=1) == first
    other = assign_tenants(reqs, shares, seed=2)
    assert sum(x.tenant != y.tenant for x, y in zip(first, other, strict=True)) > 300
    # identity is the row, not the position in the list
    reversed_out = assign_tenants(reqs[::-1], shares, seed=1)
    assert {r.row: r.tenant for r in reversed_out} == {r.row: r.tenant for r in first}
    assert [(r.t_ns, r.row) for r in first] == [(r.t_ns, r.row) for r in reqs]


def test_assign_tenants_respects_shares() -> None:
    out = assign_tenants(uniform(20_000, 100.0), {"big": 6.0, "mid": 3.0, "small": 1.0}, seed=3)
    counts = Counter(r.tenant for r in out)
    for name, share in (("big", 0.6), ("mid", 0.3), ("small", 0.1)):
        assert abs(counts[name] / 20_000 - share) < 0.02


def test_assign_tenants_rejects_bad_shares() -> None:
    for shares in ({}, {"a": 1.0, "b": 0.0}, {"a": -1.0}, {"a": float("nan")}):
        with pytest.raises(ValueError):
            assign_tenants(uniform(3, 1.0), shares)


# -- inject_burst ---------------------------------------------------------------------------


def two_tenants() -> list[TraceRequest]:
    # 100 s, one request every 100 ms, alternating tenants a and b
    return [TraceRequest(i * 100_000_000, 10, 5, "ab"[i % 2], i) for i in range(1_000)]


def test_inject_burst_adds_copies_only_in_window_for_tenant() -> None:
    base = two_tenants()
    out = inject_burst(base, "a", 3.0, start_s=20.0, duration_s=10.0, seed=5)
    lo, hi = 20_000_000_000, 30_000_000_000
    in_window_a = sum(1 for r in base if r.tenant == "a" and lo <= r.t_ns < hi)
    assert in_window_a == 50
    added = [r for r in out if r.row >= 1_000]
    assert len(added) == 2 * in_window_a
    assert sorted(r.row for r in added) == list(range(1_000, 1_100))
    assert all(r.tenant == "a" and lo <= r.t_ns < hi for r in added)
    assert sorted((r for r in out if r.row < 1_000), key=lambda r: r.row) == base
    assert [(r.t_ns, r.row) for r in out] == sorted((r.t_ns, r.row) for r in out)
    # the tenant's rate in the window is tripled, elsewhere untouched
    a_in = sum(1 for r in out if r.tenant == "a" and lo <= r.t_ns < hi)
    assert a_in == 3 * in_window_a


def test_inject_burst_is_deterministic_and_fractional() -> None:
    base = two_tenants()
    one = inject_burst(base, "b", 1.5, 50.0, 20.0, seed=9)
    assert inject_burst(base, "b", 1.5, 50.0, 20.0, seed=9) == one
    assert inject_burst(base, "b", 1.5, 50.0, 20.0, seed=10) != one
    assert len(one) - len(base) == 50  # round(0.5 * 100)
    assert inject_burst(base, "b", 1.0, 50.0, 20.0) == base
    assert inject_burst(base, "nobody", 4.0, 50.0, 20.0) == base
    with pytest.raises(ValueError, match=">= 1"):
        inject_burst(base, "b", 0.5, 50.0, 20.0)


def test_summary_counts_tenants() -> None:
    s = summary(two_tenants())
    assert s["n"] == 1_000
    assert s["duration_s"] == pytest.approx(99.9)
    assert s["mean_rps"] == pytest.approx(10.0)
    assert s["mean_prompt_tokens"] == 10 and s["median_output_tokens"] == 5
    assert (s["tenant:a"], s["tenant:b"]) == (500, 500)


# -- the real Azure trace -------------------------------------------------------------------


def test_real_azure_conversation_trace() -> None:
    reqs = load_trace(AZURE)
    s = summary(reqs)
    assert len(reqs) == 19_366 and reqs[0].t_ns == 0
    assert 3_500 <= s["duration_s"] <= 3_700
    assert 5.3 <= s["mean_rps"] <= 5.6
    assert s["median_prompt_tokens"] == 1_020
    assert s["median_output_tokens"] == 129
    assert sorted(r.row for r in reqs) == list(range(19_366))
    scaled = scale_to_rate(assign_tenants(reqs, {"a": 0.7, "b": 0.3}), 20.0)
    assert summary(scaled)["mean_rps"] == pytest.approx(20.0, rel=1e-9)
