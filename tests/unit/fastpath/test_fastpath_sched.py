"""Hand-computed behaviour of the scheduling primitives, run against both builds (``sched``)."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from fastpath.codes import (
    MAX_BACKPRESSURE_CAPACITY,
    MAX_FLOWS,
    MAX_REQUEST_TOKENS,
    NS_PER_S,
    PPM,
    VT_MAX,
)

# SPEC section 2 defaults: alpha, beta, gamma = 0.4, 0.3, 0.3; delta (KV usage) 0.4.
WEIGHTS = (400_000, 300_000, 300_000, 400_000)
CAP_NS = 30 * NS_PER_S


# --- backpressure_score_ppm --------------------------------------------------------


# miss/kv of -1: not reported; weights (alpha, beta, gamma, delta).
@pytest.mark.parametrize(
    ("batch", "max_batch", "depth", "capacity", "miss", "kv", "weights", "score"),
    [
        # SPEC section 2 exactly: every SPEC signal present, no KV usage
        (500, 1_000, 10, 100, 300_000, -1, WEIGHTS, 200_000 + 30_000 + 90_000),
        (0, 1_000, 0, 100, 0, -1, WEIGHTS, 0),
        # Past nominal size counts as full: every ratio clamps at 1.0.
        (5_000, 1_000, 10**12, 100, PPM, PPM, WEIGHTS, PPM),
        (MAX_BACKPRESSURE_CAPACITY, MAX_BACKPRESSURE_CAPACITY, 2**63 - 1,
         MAX_BACKPRESSURE_CAPACITY, PPM, PPM, WEIGHTS, PPM),
        (1, 3, 0, 1, 0, -1, (PPM, 0, 0, 0), 333_333),  # ratios floor to whole ppm
        (1, 3, 2, 3, 0, -1, (0, PPM, 0, 0), 666_666),
        (0, 1, 0, 1, 123_456, -1, (0, 0, PPM, 0), 123_456),
        # The sum is floored once: 0.5 * 1 ppm + 0.5 * 1 ppm is 1 ppm, not 0 + 0.
        (1, PPM, 1, PPM, 0, -1, (500_000, 500_000, 0, 0), 1),
        # (1 * 285_714 + 2 * 272_727 + 999_997 * 999_999) // 1e6
        (2, 7, 3, 11, 999_999, -1, (1, 2, 999_997, 0), 999_996),
        # Renormalised over what is present: a full batch and queue without a
        # miss rate is 1.0, not alpha + beta = 0.7 ...
        (1_000, 1_000, 100, 100, -1, -1, WEIGHTS, PPM),
        # ... and with KV usage: (0.4 * 0.5 + 0.3 * 1.0 + 0.4 * 0.9) / 1.1
        (500, 1_000, 100, 100, -1, 900_000, WEIGHTS, 860_000 * PPM // 1_100_000),
        # every term: (0.4 * 0.5 + 0.3 * 0.5 + 0.3 * 0.2 + 0.4 * 0.8) / 1.4
        (5, 10, 5, 10, 200_000, 800_000, WEIGHTS, 730_000 * PPM // 1_400_000),
        # a present signal with weight 0 changes nothing
        (5, 10, 5, 10, 200_000, 800_000, (400_000, 300_000, 300_000, 0), 410_000),
        # no weight among the present terms: no signal
        (5, 10, 5, 10, -1, -1, (0, 0, PPM, PPM), 0),
    ],
)  # fmt: skip
def test_backpressure_score(
    sched: ModuleType,
    batch: int,
    max_batch: int,
    depth: int,
    capacity: int,
    miss: int,
    kv: int,
    weights: tuple[int, int, int, int],
    score: int,
) -> None:
    result = sched.backpressure_score_ppm(batch, max_batch, depth, capacity, miss, kv, *weights)
    assert result == score
    assert type(result) is int


SCORE_ARGS = {
    "batch_tokens": 1, "max_batch_tokens": 10, "queue_depth": 1, "queue_capacity": 10,
    "miss_ppm": 0, "kv_ppm": -1, "alpha_ppm": 400_000, "beta_ppm": 300_000,
    "gamma_ppm": 300_000, "delta_ppm": 400_000,
}  # fmt: skip


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("batch_tokens", -1),
        ("max_batch_tokens", 0),
        ("max_batch_tokens", MAX_BACKPRESSURE_CAPACITY + 1),
        ("queue_depth", -1),
        ("queue_capacity", 0),
        ("queue_capacity", MAX_BACKPRESSURE_CAPACITY + 1),
        ("miss_ppm", -2),
        ("miss_ppm", PPM + 1),
        ("kv_ppm", -2),
        ("kv_ppm", PPM + 1),
        ("alpha_ppm", -1),
        ("beta_ppm", PPM + 1),
        ("gamma_ppm", -300_000),
        ("delta_ppm", PPM + 1),
    ],
)
def test_backpressure_score_names_the_bad_argument(
    sched: ModuleType, name: str, value: int
) -> None:
    with pytest.raises(ValueError, match=name):
        sched.backpressure_score_ppm(**(SCORE_ARGS | {name: value}))


@pytest.mark.parametrize(("bad", "error"), [(1.0, TypeError), ("1", TypeError),
                                            (2**63, OverflowError)])  # fmt: skip
def test_backpressure_score_argument_types(sched: ModuleType, bad: Any, error: type) -> None:
    for name in SCORE_ARGS:
        with pytest.raises(error):
            sched.backpressure_score_ppm(**(SCORE_ARGS | {name: bad}))
    assert sched.backpressure_score_ppm(*map(np.int64, SCORE_ARGS.values())) == 70_000


# --- backpressure_retry_ns ---------------------------------------------------------


@pytest.mark.parametrize(
    ("score", "target", "drain", "cap", "wait"),
    [
        (800_000, 850_000, 0, CAP_NS, 0),  # already below target, draining or not
        (850_000, 850_000, -5, CAP_NS, 0),
        (900_000, 850_000, 0, CAP_NS, CAP_NS),  # not draining: the cap
        (900_000, 850_000, -1_000, CAP_NS, CAP_NS),
        (900_000, 850_000, 10_000, CAP_NS, 5 * NS_PER_S),  # 50_000 ppm at 10_000 ppm/s
        (900_000, 850_000, 3, 10**18, 16_666_666_666_667),  # rounded up
        (900_000, 850_000, 3, CAP_NS, CAP_NS),
        (PPM, 0, 2**63 - 1, CAP_NS, 1),  # a sliver still waits 1 ns
        (PPM, 0, 1, 2**63 - 1, PPM * NS_PER_S),
        (900_000, 850_000, 10_000, 0, 0),
    ],
)
def test_backpressure_retry(
    sched: ModuleType, score: int, target: int, drain: int, cap: int, wait: int
) -> None:
    assert sched.backpressure_retry_ns(score, target, drain, cap) == wait


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((-1, 0, 1, 1), "score_ppm"),
        ((PPM + 1, 0, 1, 1), "score_ppm"),
        ((0, -1, 1, 1), "target_ppm"),
        ((0, PPM + 1, 1, 1), "target_ppm"),
        ((0, 0, 1, -1), "cap_ns"),
    ],
)
def test_backpressure_retry_names_the_bad_argument(
    sched: ModuleType, args: tuple[int, int, int, int], name: str
) -> None:
    with pytest.raises(ValueError, match=name):
        sched.backpressure_retry_ns(*args)
    with pytest.raises(TypeError):
        sched.backpressure_retry_ns(0, 0, 1.5, 1)


# --- shed_threshold_ppm ------------------------------------------------------------


def test_shed_thresholds_step_from_soft_towards_hard(sched: ModuleType) -> None:
    assert [sched.shed_threshold_ppm(r, 2, 600_000, 850_000) for r in range(2)] == [
        600_000, 725_000,
    ]  # fmt: skip
    assert [sched.shed_threshold_ppm(r, 3, 600_000, 850_000) for r in range(3)] == [
        600_000, 683_333, 766_666,
    ]  # fmt: skip
    assert sched.shed_threshold_ppm(0, 1, 700_000, 850_000) == 700_000
    assert [sched.shed_threshold_ppm(r, 4, 850_000, 850_000) for r in range(4)] == [850_000] * 4
    assert sched.shed_threshold_ppm(MAX_FLOWS - 1, MAX_FLOWS, 0, PPM) == PPM - 1


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((0, 0, 0, 0), "sheddable"),
        ((0, MAX_FLOWS + 1, 0, 0), "sheddable"),
        ((-1, 2, 0, 0), "rank"),
        ((2, 2, 0, 0), "rank"),
        ((0, 2, -1, 0), "soft_ppm"),
        ((0, 2, PPM + 1, PPM + 1), "soft_ppm"),
        ((0, 2, 600_000, 599_999), "hard_ppm"),
        ((0, 2, 0, PPM + 1), "hard_ppm"),
    ],
)
def test_shed_threshold_names_the_bad_argument(
    sched: ModuleType, args: tuple[int, int, int, int], name: str
) -> None:
    with pytest.raises(ValueError, match=name):
        sched.shed_threshold_ppm(*args)


# --- FairQueue: construction and flows ----------------------------------------------


def lanes(sched: ModuleType, weights: list[int], **kwargs: int) -> Any:
    """A queue with flows 0..len(weights)-1 weighted and active."""
    queue = sched.FairQueue(**kwargs)
    for flow, weight in enumerate(weights):
        queue.set_weight(flow, weight)
        queue.activate(flow)
    return queue


def test_new_queue_defaults(sched: ModuleType) -> None:
    queue = sched.FairQueue()
    assert (queue.capacity, queue.renormalize_above, queue.last_vt) == (16, VT_MAX, 0)
    assert (queue.weight(3), queue.vt(3), queue.is_active(3)) == (PPM, 0, False)
    assert queue.active_count() == 0
    assert queue.pick() == -1
    assert queue.snapshot() == {
        "capacity": 16,
        "renormalize_above": VT_MAX,
        "last_vt": 0,
        "renormalizations": 0,
        "active_count": 0,
        "flows": {},
    }


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"capacity": 0}, "capacity"),
        ({"capacity": MAX_FLOWS + 1}, "capacity"),
        ({"renormalize_above": 0}, "renormalize_above"),
        ({"renormalize_above": VT_MAX + 1}, "renormalize_above"),
    ],
)
def test_bad_construction(sched: ModuleType, kwargs: dict[str, int], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        sched.FairQueue(**kwargs)


def test_flows_grow_like_bucket_slots_and_reads_do_not_grow(sched: ModuleType) -> None:
    queue = sched.FairQueue(4)
    assert (queue.vt(1_000), queue.weight(1_000), queue.is_active(1_000)) == (0, PPM, False)
    queue.deactivate(1_000)
    queue.reset(1_000)
    assert queue.capacity == 4
    queue.set_weight(5, 500_000)  # doubles
    assert queue.capacity == 8
    queue.activate(9)  # doubles
    assert queue.capacity == 16
    queue.charge(100, 3)  # jumps straight to flow + 1
    assert queue.capacity == 101
    assert (queue.weight(5), queue.is_active(9), queue.vt(100)) == (500_000, True, 3)
    queue.activate(MAX_FLOWS - 1)
    assert queue.capacity == MAX_FLOWS
    assert queue.pick() == 9


def test_every_method_checks_the_flow(sched: ModuleType) -> None:
    queue = sched.FairQueue(4)
    calls: list[Callable[[int], object]] = [
        lambda flow: queue.set_weight(flow, PPM),
        queue.weight,
        queue.vt,
        queue.is_active,
        queue.activate,
        queue.deactivate,
        queue.reset,
        lambda flow: queue.charge(flow, 1),
    ]
    for flow in (-1, MAX_FLOWS):
        for call in calls:
            with pytest.raises(ValueError, match="flow"):
                call(flow)
    with pytest.raises(TypeError):
        queue.activate(1.0)
    with pytest.raises(OverflowError):
        queue.vt(2**63)
    assert queue.snapshot()["flows"] == {}


@pytest.mark.parametrize("weight", [0, -1, PPM + 1])
def test_weight_range(sched: ModuleType, weight: int) -> None:
    queue = sched.FairQueue(4)
    with pytest.raises(ValueError, match="weight_ppm"):
        queue.set_weight(1, weight)
    assert queue.weight(1) == PPM
    queue.set_weight(1, 1)
    assert queue.weight(1) == 1


@pytest.mark.parametrize("cost", [-1, 2 * MAX_REQUEST_TOKENS + 1])
def test_cost_range(sched: ModuleType, cost: int) -> None:
    queue = sched.FairQueue(4)
    with pytest.raises(ValueError, match="cost_tokens"):
        queue.charge(1, cost)
    assert (queue.vt(1), queue.last_vt) == (0, 0)
    queue.set_weight(1, 1)
    queue.charge(1, 2 * MAX_REQUEST_TOKENS)  # the largest charge at the smallest weight
    assert queue.vt(1) == 2 * MAX_REQUEST_TOKENS * PPM


# --- FairQueue: ordering -------------------------------------------------------------


def test_lanes_are_served_by_weight_over_tokens(sched: ModuleType) -> None:
    queue = lanes(sched, [400_000, 450_000, 150_000])  # SPEC's premium/standard/batch
    order = []
    for _ in range(9):
        flow = queue.pick()
        order.append(flow)
        queue.charge(flow, 100)
    # vt steps per 100 tokens: 250, 222.2 and 666.7 (remainders carried); ties go to the
    # lowest flow.
    assert order == [0, 1, 2, 1, 0, 1, 0, 1, 2]
    assert [queue.vt(f) for f in range(3)] == [750, 888, 1_333]
    assert queue.last_vt == 666
    served = [0, 0, 0]
    for _ in range(20_000):
        flow = queue.pick()
        served[flow] += 100
        queue.charge(flow, 100)
    total = sum(served)
    # Shares within one request of the weights.
    for share, weight in zip(served, [400_000, 450_000, 150_000], strict=True):
        assert abs(share * PPM - weight * total) <= 100 * PPM


def test_costs_not_requests_are_shared(sched: ModuleType) -> None:
    """Equal weights, one flow sends 10x longer requests: it gets 1/10 of the picks."""
    queue = lanes(sched, [PPM, PPM])
    picks = [0, 0]
    for _ in range(1_100):
        flow = queue.pick()
        picks[flow] += 1
        queue.charge(flow, 1_000 if flow == 0 else 100)
    assert picks == [100, 1_000]


def test_remainders_make_the_division_exact(sched: ModuleType) -> None:
    queue = sched.FairQueue(2)
    queue.set_weight(0, 666_667)  # PPM / weight = 1.4999993
    for _ in range(3):
        queue.charge(0, 1)
    # Floors of 1.5, 3.0 and 4.5 (nearly): without the remainder each step would be 1.
    assert queue.vt(0) == 4 == 3 * PPM // 666_667
    assert queue.snapshot()["flows"][0] == {
        "weight_ppm": 666_667, "vt": 4, "rem": 3 * PPM - 4 * 666_667, "active": False,
    }  # fmt: skip
    queue.set_weight(0, 666_667)  # unchanged: the remainder stays
    assert queue.snapshot()["flows"][0]["rem"] == 333_332
    queue.set_weight(0, 500_000)  # changed: the old remainder is dropped
    assert queue.snapshot()["flows"][0]["rem"] == 0
    # With the remainder, shares follow the weights even for 1-token requests.
    queue = lanes(sched, [PPM, 666_667])
    picks = [0, 0]
    for _ in range(3_000):
        flow = queue.pick()
        picks[flow] += 1
        queue.charge(flow, 1)
    assert picks == [1_800, 1_200]


def test_ties_go_to_the_lowest_flow(sched: ModuleType) -> None:
    queue = sched.FairQueue(8)
    for flow in (5, 2, 7):
        queue.activate(flow)
    assert queue.pick() == 2
    queue.charge(2, 10)
    assert queue.pick() == 5
    queue.deactivate(5)
    assert queue.pick() == 7


def test_activation_lifts_an_idle_flow_to_the_floor(sched: ModuleType) -> None:
    queue = lanes(sched, [PPM, PPM])
    for _ in range(10):
        flow = queue.pick()
        queue.charge(flow, 100)
    assert (queue.vt(0), queue.vt(1)) == (500, 500)
    queue.charge(0, 300)  # 800; the floor (smallest active vt) is flow 1's 500
    # Flow 2 was idle all along: it is not owed 500 tokens of service, it starts level.
    queue.activate(2)
    assert queue.vt(2) == 500
    assert queue.snapshot()["flows"][2] == {"weight_ppm": PPM, "vt": 500, "rem": 0, "active": True}
    order = []
    for _ in range(4):
        flow = queue.pick()
        order.append(flow)
        queue.charge(flow, 100)
    assert order == [1, 2, 1, 2]
    # Already active: a no-op, even below the floor.
    queue.activate(2)
    assert queue.vt(2) == 700
    # A flow ahead of the floor keeps its vt: it cannot shed what it used.
    queue.deactivate(0)
    queue.activate(0)
    assert queue.vt(0) == 800


def test_with_nothing_active_the_floor_is_the_last_start_tag(sched: ModuleType) -> None:
    queue = lanes(sched, [PPM, PPM])
    queue.charge(0, 100)
    queue.charge(1, 250)  # last_vt = 0, flow 1's start tag
    queue.charge(0, 100)  # last_vt = 100
    assert queue.last_vt == 100
    queue.deactivate(0)
    queue.deactivate(1)
    assert (queue.active_count(), queue.pick()) == (0, -1)
    queue.activate(3)
    assert queue.vt(3) == 100
    queue.activate(1)  # 250 is above the floor (flow 3's 100): kept
    assert queue.vt(1) == 250


def test_charging_an_inactive_flow_counts(sched: ModuleType) -> None:
    queue = lanes(sched, [PPM])
    queue.charge(0, 50)
    queue.charge(1, 400)  # admitted without queueing
    assert (queue.vt(1), queue.last_vt, queue.is_active(1)) == (400, 0, False)
    queue.activate(1)
    assert queue.vt(1) == 400  # its usage still counts when it starts queueing
    assert queue.pick() == 0


def test_deactivate_and_reset(sched: ModuleType) -> None:
    queue = lanes(sched, [300_000, PPM, PPM])
    queue.charge(0, 10)
    queue.deactivate(1)
    queue.deactivate(1)  # no-op
    assert (queue.active_count(), queue.is_active(1)) == (2, False)
    queue.reset(0)
    assert (queue.weight(0), queue.vt(0), queue.is_active(0)) == (PPM, 0, False)
    assert queue.active_count() == 1
    assert queue.pick() == 2
    assert set(queue.snapshot()["flows"]) == {2}


# --- FairQueue: eligibility masks ----------------------------------------------------


@pytest.mark.parametrize(
    "make_mask",
    [
        lambda bits: bytearray(bits),
        lambda bits: bytes(bits),
        lambda bits: array("b", bits),
        lambda bits: array("B", bits),
        lambda bits: np.array(bits, dtype=np.int8),
        lambda bits: np.array(bits, dtype=np.uint8),
        lambda bits: np.array([b * 255 for b in bits], dtype=np.uint8),
        lambda bits: np.array([-b for b in bits], dtype=np.int8),
        lambda bits: np.repeat(np.array(bits, dtype=np.int8), 2)[::2],  # strided
        lambda bits: np.array(bits[::-1], dtype=np.uint8)[::-1],  # negative stride
    ],
)
def test_pick_among_eligible_flows(sched: ModuleType, make_mask: Any) -> None:
    queue = lanes(sched, [PPM, PPM, PPM, PPM])
    queue.deactivate(3)
    queue.charge(0, 10)
    queue.charge(1, 20)
    queue.charge(2, 30)
    assert queue.pick(make_mask([1, 1, 1, 0])) == 0
    assert queue.pick(make_mask([0, 1, 1, 1])) == 1
    assert queue.pick(make_mask([0, 0, 1, 1, 1])) == 2  # longer than needed is fine
    assert queue.pick(make_mask([0, 0, 0, 1])) == -1  # flow 3 is not active
    assert queue.pick(None) == 0


def test_pick_rejects_bad_masks(sched: ModuleType) -> None:
    queue = lanes(sched, [PPM, PPM, PPM])
    with pytest.raises(ValueError, match="eligible"):
        queue.pick(bytearray(2))  # flow 2 is active but has no entry
    for bad in (
        np.ones(3, dtype=np.bool_),
        np.ones(3, dtype=np.int16),
        np.ones(3, dtype=np.int64),
        np.ones((3, 1), dtype=np.int8),
        array("h", [1, 1, 1]),
    ):
        with pytest.raises(ValueError, match="eligible"):
            queue.pick(bad)
    for not_a_buffer in ([1, 1, 1], "abc", 3):
        with pytest.raises(TypeError, match="eligible"):
            queue.pick(not_a_buffer)
    empty = sched.FairQueue(2)
    assert empty.pick(bytearray()) == -1
    with pytest.raises(TypeError):
        empty.pick([1])  # checked even when nothing is active


# --- FairQueue: renormalisation ------------------------------------------------------


def test_renormalisation_shifts_everything_by_the_floor(sched: ModuleType) -> None:
    queue = lanes(sched, [PPM, PPM], renormalize_above=1_000)
    queue.charge(2, 300)  # inactive, behind the active flows after the next charges
    queue.charge(0, 600)
    queue.charge(1, 500)
    assert queue.snapshot()["renormalizations"] == 0
    queue.charge(1, 600)  # 1_100 > 1_000: shift by the floor, flow 0's 600
    snap = queue.snapshot()
    assert snap["renormalizations"] == 1
    assert snap["last_vt"] == 0  # 500 - 600, clamped
    assert {f: s["vt"] for f, s in snap["flows"].items()} == {0: 0, 1: 500}  # 2: 300 -> 0
    assert queue.pick() == 0  # differences between active flows are kept
    # None active: the floor is last_vt, the start tag of the charge that crossed.
    queue.deactivate(0)
    queue.deactivate(1)
    queue.charge(1, 700)  # 500 -> 1_200, last_vt 500
    assert (queue.vt(0), queue.vt(1), queue.last_vt) == (0, 700, 0)
    assert queue.snapshot()["renormalizations"] == 2


def test_renormalisation_keeps_decisions(sched: ModuleType) -> None:
    small = lanes(sched, [400_000, 450_000, 150_000], renormalize_above=5_000)
    big = lanes(sched, [400_000, 450_000, 150_000])
    rng = np.random.default_rng(3)
    for cost in rng.integers(0, 3_000, 2_000).tolist():
        flow = small.pick()
        assert big.pick() == flow
        small.charge(flow, cost)
        big.charge(flow, cost)
    assert small.snapshot()["renormalizations"] > 100
    assert big.snapshot()["renormalizations"] == 0
    shift = big.vt(0) - small.vt(0)
    assert [big.vt(f) - small.vt(f) for f in range(3)] == [shift] * 3


def test_a_starved_flow_cannot_push_others_past_vt_max(sched: ModuleType) -> None:
    """Flow 0 active but never eligible, so the floor stays 0: flow 1 saturates."""
    queue = lanes(sched, [PPM, 1])
    only_flow_1 = bytearray([0, 1])
    step = 2 * MAX_REQUEST_TOKENS * PPM  # one maximal charge at weight 1 ppm
    charges = VT_MAX // step + 1
    for _ in range(charges + 2):
        assert queue.pick(only_flow_1) == 1
        queue.charge(1, 2 * MAX_REQUEST_TOKENS)
    snap = queue.snapshot()
    assert snap["flows"][1]["vt"] == VT_MAX
    assert snap["flows"][0]["vt"] == 0
    assert snap["renormalizations"] == 3
    assert queue.pick() == 0
