"""admit_batch: same decisions as admit, in order, over numpy or array('q') buffers."""

from __future__ import annotations

from array import array
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from fastpath.codes import NS_PER_S, Reason

T0 = 20_000 * 86_400 * NS_PER_S
SENTINEL = -7


def outputs(n: int) -> list[np.ndarray[Any, np.dtype[np.int64]]]:
    return [np.full(n, SENTINEL, dtype=np.int64) for _ in range(6)]


def table_with_two_tenants(impl: ModuleType) -> Any:
    table = impl.TokenBucketTable(4)
    table.configure(0, T0, 1_000, 10_000, 0, 0, 0, 0)  # 10 tokens
    table.configure(2, T0, 1_000, 100_000, 50, 0, 1, 0)  # 100 tokens, 50/h, 1 in flight
    return table


def test_batch_sees_earlier_entries_and_skips_negative_slots(impl: ModuleType) -> None:
    table = table_with_two_tenants(impl)
    slots = np.array([0, 0, -1, 2, 0, 2], dtype=np.int64)
    prompt = np.array([4, 4, 99, 10, 4, 10], dtype=np.int64)
    max_tokens = np.array([0, 0, 99, 5, 0, 5], dtype=np.int64)
    outs = outputs(6)
    assert table.admit_batch(T0, slots, prompt, max_tokens, *outs) == 3
    columns = np.stack(outs, axis=1).tolist()
    assert columns == [
        [Reason.OK, 4, 0, 6, -1, -1],
        [Reason.OK, 4, 0, 2, -1, -1],
        [SENTINEL] * 6,  # skipped: left untouched
        [Reason.OK, 15, 0, 85, 35, -1],
        [Reason.TOKEN_RATE, 0, 2 * NS_PER_S, 2, -1, -1],
        [Reason.CONCURRENCY, 0, 0, 85, 35, -1],
    ]
    assert table.inflight(0) == 2
    assert table.total_inflight_tokens() == 23


def test_batch_equals_one_admit_per_entry(impl: ModuleType) -> None:
    rng = np.random.default_rng(7)
    n = 300
    slots = rng.integers(-1, 3, n).astype(np.int64)
    slots[slots == 1] = 0
    prompt = rng.integers(0, 30, n).astype(np.int64)
    max_tokens = rng.integers(0, 30, n).astype(np.int64)
    batched, single = table_with_two_tenants(impl), table_with_two_tenants(impl)
    outs = outputs(n)
    admitted = batched.admit_batch(T0 + 3 * NS_PER_S, slots, prompt, max_tokens, *outs)
    expected = [
        single.admit(int(s), T0 + 3 * NS_PER_S, int(p), int(m)) if s >= 0 else (SENTINEL,) * 6
        for s, p, m in zip(slots, prompt, max_tokens, strict=True)
    ]
    assert np.stack(outs, axis=1).tolist() == [list(e) for e in expected]
    assert admitted == sum(e[0] == Reason.OK for e in expected)
    for slot in (0, 2):
        assert batched.snapshot(slot) == single.snapshot(slot)
    assert batched.total_inflight_tokens() == single.total_inflight_tokens()


def test_batch_accepts_array_q_and_strided_views(impl: ModuleType) -> None:
    table = table_with_two_tenants(impl)
    outs = [array("q", [SENTINEL, SENTINEL]) for _ in range(6)]
    n = table.admit_batch(T0, array("q", [0, 2]), array("q", [1, 1]), array("q", [1, 1]), *outs)
    assert n == 2
    assert [o.tolist() for o in outs] == [[0, 0], [2, 2], [0, 0], [8, 98], [-1, 48], [-1, -1]]
    wide = np.zeros((6, 4), dtype=np.int64)
    strided = np.array([0, 9, -1, 9], dtype=np.int64)[::2]  # [0, -1]
    assert table.admit_batch(T0, strided, strided + 1, strided + 1, *wide[:, ::2]) == 1
    assert wide[:, 0].tolist() == [0, 2, 0, 6, -1, -1]
    assert wide[:, 1:].tolist() == [[0, 0, 0]] * 6


def test_batch_accepts_read_only_inputs(impl: ModuleType) -> None:
    table = table_with_two_tenants(impl)
    ro = np.zeros(1, dtype=np.int64)
    ro.flags.writeable = False
    assert table.admit_batch(T0, ro, ro, ro, *outputs(1)) == 1


def test_empty_batch(impl: ModuleType) -> None:
    table = table_with_two_tenants(impl)
    empty = np.zeros(0, dtype=np.int64)
    assert table.admit_batch(T0, empty, empty, empty, *outputs(0)) == 0


def test_batch_rejects_mismatched_lengths(impl: ModuleType) -> None:
    table = table_with_two_tenants(impl)
    three = np.zeros(3, dtype=np.int64)
    for position in range(9):
        arrays = [three] * 3 + outputs(3)
        arrays[position] = np.zeros(2, dtype=np.int64)
        with pytest.raises(ValueError, match="same length"):
            table.admit_batch(T0, *arrays)


@pytest.mark.parametrize(
    "make_bad",
    [
        lambda: np.zeros(2, dtype=np.int32),
        lambda: np.zeros(2, dtype=np.uint64),
        lambda: np.zeros(2, dtype=np.float64),
        lambda: np.zeros((2, 1), dtype=np.int64),
        lambda: array("i", [0, 0]),
    ],
)
def test_batch_rejects_non_int64_buffers(impl: ModuleType, make_bad: Any) -> None:
    table = table_with_two_tenants(impl)
    good = np.zeros(2, dtype=np.int64)
    with pytest.raises(ValueError):
        table.admit_batch(T0, make_bad(), good, good, *outputs(2))
    with pytest.raises(ValueError):
        table.admit_batch(T0, good, good, good, make_bad(), *outputs(2)[1:])


def test_batch_rejects_non_buffers_and_read_only_outputs(impl: ModuleType) -> None:
    table = table_with_two_tenants(impl)
    good = np.zeros(2, dtype=np.int64)
    with pytest.raises(TypeError):
        table.admit_batch(T0, [0, 0], good, good, *outputs(2))
    ro = np.zeros(2, dtype=np.int64)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        table.admit_batch(T0, good, good, good, *outputs(2)[:5], ro)


@pytest.mark.parametrize(
    ("slots", "prompt", "max_tokens", "error"),
    [
        ([0, 0, 2], [1, -1, 1], [1, 1, 1], ValueError),
        ([0, 0, 2], [1, 1, 1], [1, 1, -5], ValueError),
        ([0, 2, 1], [1, 1, 1], [1, 1, 1], KeyError),
        ([0, 2, 99], [1, 1, 1], [1, 1, 1], KeyError),
    ],
)
def test_bad_entry_fails_the_whole_batch_before_any_decision(
    impl: ModuleType,
    slots: list[int],
    prompt: list[int],
    max_tokens: list[int],
    error: type[Exception],
) -> None:
    table = table_with_two_tenants(impl)
    before = (table.snapshot(0), table.snapshot(2))
    outs = outputs(3)
    with pytest.raises(error):
        table.admit_batch(
            T0,
            np.array(slots, dtype=np.int64),
            np.array(prompt, dtype=np.int64),
            np.array(max_tokens, dtype=np.int64),
            *outs,
        )
    assert (table.snapshot(0), table.snapshot(2)) == before
    assert all((o == SENTINEL).all() for o in outs)


def test_negative_tokens_in_a_skipped_entry_are_ignored(impl: ModuleType) -> None:
    table = table_with_two_tenants(impl)
    slots = np.array([-1, 0], dtype=np.int64)
    tokens = np.array([-5, 1], dtype=np.int64)
    assert table.admit_batch(T0, slots, tokens, tokens, *outputs(2)) == 1


@pytest.mark.parametrize("now", [-1, 2**62 + 1])
def test_batch_checks_now(impl: ModuleType, now: int) -> None:
    table = table_with_two_tenants(impl)
    z = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match="now_ns"):
        table.admit_batch(now, z, z, z, *outputs(1))


# --- global watermark and shadow entries ---------------------------------------------


def test_batch_watermark_sees_earlier_entries(impl: ModuleType) -> None:
    table = table_with_two_tenants(impl)
    table.set_global_inflight_limit(12)
    slots = np.array([0, 2, 0, 0], dtype=np.int64)
    prompt = np.array([5, 5, 3, 2], dtype=np.int64)
    zeros = np.zeros(4, dtype=np.int64)
    outs = outputs(4)
    assert table.admit_batch(T0, slots, prompt, zeros, *outs) == 3
    assert outs[0].tolist() == [Reason.OK, Reason.OK, Reason.GLOBAL_WATERMARK, Reason.OK]
    assert outs[1].tolist() == [5, 5, 0, 2]
    assert table.total_inflight_tokens() == 12


def test_batch_shadow_entries_are_charged(impl: ModuleType) -> None:
    table = table_with_two_tenants(impl)  # slot 0: 10 tokens; slot 2: 100 tokens, 1 in flight
    slots = np.array([0, 0, 2, 2, 0, -1], dtype=np.int64)
    prompt = np.array([8, 4, 10, 10, 21, 99], dtype=np.int64)
    zeros = np.zeros(6, dtype=np.int64)
    shadow = np.array([0, 1, 0, 7, 1, 1], dtype=np.int64)  # any nonzero value means shadow
    outs = outputs(6)
    assert table.admit_batch(T0, slots, prompt, zeros, *outs, shadow=shadow) == 2
    assert np.stack(outs, axis=1).tolist() == [
        [Reason.OK, 8, 0, 2, -1, -1],
        [Reason.TOKEN_RATE, 4, 2 * NS_PER_S, 0, -1, -1],  # would wait 2 s; taken anyway
        [Reason.OK, 10, 0, 90, 40, -1],
        [Reason.CONCURRENCY, 10, 0, 80, 30, -1],
        [Reason.MAX_TOKENS, 21, 0, 0, -1, -1],  # over two bursts: floored at -burst
        [SENTINEL] * 6,
    ]
    assert table.snapshot(0)["level_mtok"] == -10_000
    assert (table.inflight(0), table.inflight(2)) == (3, 2)
    assert table.total_inflight_tokens() == 53


def test_batch_all_zero_shadow_is_no_shadow(impl: ModuleType) -> None:
    with_mask, without = table_with_two_tenants(impl), table_with_two_tenants(impl)
    slots = np.array([0, 2, 0, 2, 0], dtype=np.int64)
    tokens = np.array([4, 9, 4, 9, 4], dtype=np.int64)
    outs_a, outs_b = outputs(5), outputs(5)
    shadow = np.zeros(5, dtype=np.int64)
    a = with_mask.admit_batch(T0, slots, tokens, tokens, *outs_a, shadow=shadow)
    b = without.admit_batch(T0, slots, tokens, tokens, *outs_b, None)
    assert a == b == 2
    assert [o.tolist() for o in outs_a] == [o.tolist() for o in outs_b]
    for slot in (0, 2):
        assert with_mask.snapshot(slot) == without.snapshot(slot)


@pytest.mark.parametrize("limit", [0, 40])
def test_batch_with_shadow_equals_one_admit_or_charge_per_entry(
    impl: ModuleType, limit: int
) -> None:
    rng = np.random.default_rng(11)
    n = 300
    slots = rng.integers(-1, 3, n).astype(np.int64)
    slots[slots == 1] = 0
    prompt = rng.integers(0, 30, n).astype(np.int64)
    max_tokens = rng.integers(0, 30, n).astype(np.int64)
    shadow = (rng.random(n) < 0.3).astype(np.int64)
    batched, single = table_with_two_tenants(impl), table_with_two_tenants(impl)
    for table in (batched, single):
        table.set_global_inflight_limit(limit)
    now = T0 + 3 * NS_PER_S
    outs = outputs(n)
    admitted = batched.admit_batch(now, slots, prompt, max_tokens, *outs, shadow=shadow)
    expected = [
        (single.charge if sh else single.admit)(int(s), now, int(p), int(m))
        if s >= 0
        else (SENTINEL,) * 6
        for s, p, m, sh in zip(slots, prompt, max_tokens, shadow, strict=True)
    ]
    assert np.stack(outs, axis=1).tolist() == [list(e) for e in expected]
    assert admitted == sum(e[0] == Reason.OK for e in expected)
    for slot in (0, 2):
        assert batched.snapshot(slot) == single.snapshot(slot)
    assert batched.total_inflight_tokens() == single.total_inflight_tokens()


def test_batch_rejects_bad_shadow_buffers(impl: ModuleType) -> None:
    table = table_with_two_tenants(impl)
    good = np.zeros(2, dtype=np.int64)
    before = table.snapshot(0)
    with pytest.raises(ValueError, match="same length"):
        table.admit_batch(T0, good, good, good, *outputs(2), shadow=np.ones(3, dtype=np.int64))
    with pytest.raises(ValueError):
        table.admit_batch(T0, good, good, good, *outputs(2), shadow=np.ones(2, dtype=np.int8))
    with pytest.raises(TypeError):
        table.admit_batch(T0, good, good, good, *outputs(2), shadow=[1, 1])
    assert table.snapshot(0) == before


@pytest.mark.parametrize("position", range(9))
def test_batch_rejects_none_for_a_required_buffer(impl: ModuleType, position: int) -> None:
    table = table_with_two_tenants(impl)
    arrays: list[Any] = [np.zeros(0, dtype=np.int64)] * 3 + outputs(0)
    arrays[position] = None
    with pytest.raises(TypeError):
        table.admit_batch(T0, *arrays)
