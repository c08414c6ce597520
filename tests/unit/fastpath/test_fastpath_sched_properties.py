"""Property tests of the scheduling primitives: both builds agree, and queueing is fair.

* ``test_*_builds_agree``: random arguments, valid and not, give identical results or
  identical exception types from the reference and the compiled functions.
* ``FairQueueMachine`` drives random operation sequences (weights, activation,
  deactivation, reset, pick with and without eligibility masks, charges, growth, invalid
  arguments, renormalisation at small thresholds) through both builds, asserting
  identical results and snapshots after every step.
* ``test_backlogged_flows_stay_within_one_request``: the start-time fair queueing bound,
  at every step, for k always-backlogged flows with random weights and costs.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from types import ModuleType
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from fastpath import _sched_py
from fastpath.codes import MAX_BACKPRESSURE_CAPACITY, MAX_FLOWS, MAX_REQUEST_TOKENS, PPM, VT_MAX

from .conftest import compiled

I64_MAX = 2**63 - 1


def _call(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return ("ok", fn())
    except (ValueError, KeyError, TypeError, OverflowError) as exc:
        return ("raised", type(exc))


def _agree(name: str, *args: Any) -> Any:
    c = compiled("_sched_c")
    expected = _call(lambda: getattr(_sched_py, name)(*args))
    actual = _call(lambda: getattr(c, name)(*args))
    assert actual == expected, (name, args)
    return expected


def odd(valid: st.SearchStrategy[int]) -> st.SearchStrategy[Any]:
    """Mostly ``valid``; sometimes an edge or an out-of-range or non-integer value."""
    return st.one_of(
        *[valid] * 6,
        st.sampled_from([-1, 0, 1, PPM, PPM + 1, I64_MAX]),
        st.just(2**63),
        st.just(1.0),
    )


ppm = st.integers(0, PPM)
sizes = st.one_of(st.integers(1, 10_000), st.integers(1, MAX_BACKPRESSURE_CAPACITY))
loads = st.one_of(st.integers(0, 20_000), st.integers(0, 2 * MAX_BACKPRESSURE_CAPACITY))


@st.composite
def score_weights(draw: st.DrawFn) -> tuple[int, int, int, int]:
    """SPEC weights (alpha + beta + gamma = 1) and any delta."""
    alpha = draw(ppm)
    beta = draw(st.integers(0, PPM - alpha))
    return alpha, beta, PPM - alpha - beta, draw(ppm)


signal = st.one_of(st.just(-1), ppm)  # a miss rate or KV usage, -1 = not reported


@settings(max_examples=300, deadline=None)
@given(
    batch=odd(loads),
    max_batch=odd(sizes),
    depth=odd(loads),
    capacity=odd(sizes),
    miss=odd(signal),
    kv=odd(signal),
    weights=st.one_of(score_weights(), st.tuples(odd(ppm), odd(ppm), odd(ppm), odd(ppm))),
)
def test_backpressure_score_builds_agree(
    batch: int, max_batch: int, depth: int, capacity: int, miss: int, kv: int,
    weights: tuple[int, ...],
) -> None:  # fmt: skip
    outcome, score = _agree("backpressure_score_ppm", batch, max_batch, depth, capacity, miss,
                            kv, *weights)  # fmt: skip
    if outcome == "ok":
        assert 0 <= score <= PPM
        full = batch >= max_batch and depth >= capacity and miss in (-1, PPM) and kv in (-1, PPM)
        present = weights[0] + weights[1] + weights[2] * (miss >= 0) + weights[3] * (kv >= 0)
        if full and present > 0:
            assert score == PPM
        if kv == -1 and miss >= 0 and sum(weights[:3]) == PPM:  # the SPEC's formula
            r_batch = min(batch, max_batch) * PPM // max_batch
            r_queue = min(depth, capacity) * PPM // capacity
            spec = (weights[0] * r_batch + weights[1] * r_queue + weights[2] * miss) // PPM
            assert score == spec


@settings(max_examples=300, deadline=None)
@given(
    score=odd(ppm),
    target=odd(ppm),
    drain=st.one_of(st.integers(-10, 10), st.integers(-I64_MAX, I64_MAX), odd(ppm)),
    cap=odd(st.one_of(st.integers(0, 60 * 10**9), st.integers(0, I64_MAX))),
)
def test_backpressure_retry_builds_agree(score: int, target: int, drain: int, cap: int) -> None:
    outcome, wait = _agree("backpressure_retry_ns", score, target, drain, cap)
    if outcome == "ok":
        assert 0 <= wait <= cap
        if 0 < wait < cap:  # exact: the score reaches the target at wait, not 1 ns before
            assert (score - target) * 10**9 <= wait * drain
            assert (score - target) * 10**9 > (wait - 1) * drain


@settings(max_examples=300, deadline=None)
@given(
    rank=odd(st.integers(0, 8)),
    sheddable=odd(st.one_of(st.integers(1, 8), st.integers(1, MAX_FLOWS))),
    soft=odd(ppm),
    hard=odd(ppm),
)
def test_shed_threshold_builds_agree(rank: int, sheddable: int, soft: int, hard: int) -> None:
    outcome, threshold = _agree("shed_threshold_ppm", rank, sheddable, soft, hard)
    if outcome == "ok":
        assert soft <= threshold <= hard
        assert threshold < hard or soft == hard
        if rank + 1 < sheddable:
            assert threshold <= _sched_py.shed_threshold_ppm(rank + 1, sheddable, soft, hard)


# --- FairQueue differential state machine --------------------------------------------

# Mostly valid values (st.one_of picks a branch uniformly), sometimes bad ones.
flows = st.one_of(
    *[st.integers(0, 5)] * 4,
    st.integers(0, 40),  # past the initial capacity: the queue grows
    st.sampled_from([-1, MAX_FLOWS, 2**63, 1.5]),
)
weights = st.one_of(
    *[st.sampled_from([PPM, 400_000, 450_000, 150_000, 666_667, 1])] * 3,
    *[st.integers(1, PPM)] * 2,
    st.sampled_from([0, -1, PPM + 1, 2.0]),
)
costs = st.one_of(
    *[st.integers(0, 100)] * 3,
    st.integers(0, 5_000),
    st.integers(0, 2 * MAX_REQUEST_TOKENS),
    st.sampled_from([-1, 2 * MAX_REQUEST_TOKENS + 1]),
)


@st.composite
def masks(draw: st.DrawFn) -> Any:
    """None, or an eligibility mask of some length in one of the accepted (or a bad) type."""
    if draw(st.integers(0, 4)) == 0:
        return None
    bit = st.sampled_from([0, 0, 1, 1, 7, 255])
    # Usually long enough for every active flow (flows go up to 40), sometimes not.
    bits = draw(st.one_of(st.lists(bit, min_size=41, max_size=45), st.lists(bit, max_size=8)))
    kind = draw(st.sampled_from(["bytearray", "bytes", "int8", "uint8", "strided", "bool",
                                 "list"]))  # fmt: skip
    if kind == "bytearray":
        return bytearray(bits)
    if kind == "bytes":
        return bytes(bits)
    if kind == "int8":
        return np.array(bits, dtype=np.uint8).view(np.int8)
    if kind == "uint8":
        return np.array(bits, dtype=np.uint8)
    if kind == "strided":
        return np.repeat(np.array(bits, dtype=np.uint8), 2)[::2]
    if kind == "bool":
        return np.array(bits, dtype=np.bool_)  # rejected: not int8/uint8
    return bits  # a list: not a buffer


class FairQueueMachine(RuleBasedStateMachine):
    compiled: ClassVar[ModuleType]  # set on a subclass by the test

    def __init__(self) -> None:
        super().__init__()
        self.py: Any = None
        self.c: Any = None

    @initialize(
        capacity=st.integers(1, 4),
        above=st.one_of(st.sampled_from([1, 50, 1_000, 10**6, VT_MAX]), st.integers(1, 10**5)),
    )
    def start(self, capacity: int, above: int) -> None:
        self.py = _sched_py.FairQueue(capacity, above)
        self.c = self.compiled.FairQueue(capacity, renormalize_above=above)

    def both(self, name: str, *args: Any) -> Any:
        expected = _call(lambda: getattr(self.py, name)(*args))
        actual = _call(lambda: getattr(self.c, name)(*args))
        assert actual == expected, (name, args)
        return expected[1] if expected[0] == "ok" else None

    @rule(flow=flows, weight=weights)
    def set_weight(self, flow: int, weight: int) -> None:
        self.both("set_weight", flow, weight)

    @rule(flow=flows)
    def activate(self, flow: int) -> None:
        self.both("activate", flow)

    @rule(flow=flows)
    def deactivate(self, flow: int) -> None:
        self.both("deactivate", flow)

    @rule(flow=flows)
    def reset(self, flow: int) -> None:
        self.both("reset", flow)

    @rule(flow=flows, cost=costs)
    def charge(self, flow: int, cost: int) -> None:
        self.both("charge", flow, cost)

    @rule(mask=masks())
    def pick(self, mask: Any) -> None:
        self.both("pick", mask)

    @precondition(lambda self: self.py.active_count() > 0)
    @rule(mask=masks(), cost=costs, times=st.integers(1, 6))
    def serve(self, mask: Any, cost: int, times: int) -> None:
        """The scheduler's loop: pick a flow and charge what its request costs."""
        for _ in range(times):
            flow = self.both("pick", mask)
            if flow is None or flow < 0:
                return
            self.both("charge", flow, cost)

    @rule(flow=flows)
    def read(self, flow: int) -> None:
        self.both("weight", flow)
        self.both("vt", flow)
        self.both("is_active", flow)

    @invariant()
    def same_state(self) -> None:
        if self.py is None:
            return
        snap = self.py.snapshot()
        assert self.c.snapshot() == snap
        assert (self.c.capacity, self.c.last_vt, self.c.active_count()) == (
            self.py.capacity, self.py.last_vt, self.py.active_count(),
        )  # fmt: skip
        assert 0 <= snap["last_vt"] <= VT_MAX
        assert snap["active_count"] == sum(s["active"] for s in snap["flows"].values())
        for state in snap["flows"].values():
            assert 0 <= state["vt"] <= VT_MAX
            assert 0 <= state["rem"] < state["weight_ppm"] <= PPM


def test_fair_queue_random_operation_sequences() -> None:
    class Machine(FairQueueMachine):
        compiled = compiled("_sched_c")

    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=150,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


# --- fairness ------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["python", "cython"])
@settings(max_examples=60, deadline=None)
@given(
    flow_weights=st.lists(
        st.one_of(
            st.sampled_from([PPM, 400_000, 450_000, 150_000, 666_667]),
            st.integers(1_000, PPM),
            st.integers(1, PPM),
        ),
        min_size=2,
        max_size=5,
    ),
    biggest=st.one_of(st.integers(1, 50), st.integers(1, 5_000), st.just(2 * MAX_REQUEST_TOKENS)),
    seed=st.integers(0, 2**32 - 1),
    above=st.sampled_from([VT_MAX, 10**4, 10**9]),
)
def test_backlogged_flows_stay_within_one_request(
    which: str, flow_weights: list[int], biggest: int, seed: int, above: int
) -> None:
    """Start-time fair queueing bound for flows that are backlogged throughout.

    With every request costing at most U tokens, serving the smallest vt keeps
    ``max vt - min vt <= max_f ceil(U * PPM / w_f)`` at every step: the served flow had
    the smallest vt and moves by at most one maximal request.  (The ceiling, not U * PPM /
    w: a vt is an integer and a carried remainder can add one unit to a step.)  Tokens
    served, divided by weight, then differ by less than that plus one vt unit, i.e. by
    less than one maximal request plus one unit -- the carried remainders make the vt
    exact, so this holds however small the costs.  Renormalisation (here at small
    thresholds too) shifts all backlogged flows alike and changes none of it.
    """
    module = _sched_py if which == "python" else compiled("_sched_c")
    queue = module.FairQueue(2, renormalize_above=above)
    for flow, weight in enumerate(flow_weights):
        queue.set_weight(flow, weight)
        queue.activate(flow)
    gap_bound = max(-(-biggest * PPM // w) for w in flow_weights)  # ceil
    served = [0] * len(flow_weights)
    rng = np.random.default_rng(seed)
    for cost in rng.integers(0, biggest, 300, endpoint=True).tolist():
        flow = queue.pick()
        assert flow >= 0
        queue.charge(flow, cost)
        served[flow] += cost
        vts = [queue.vt(f) for f in range(len(flow_weights))]
        assert max(vts) - min(vts) <= gap_bound
    normalised = [Fraction(s * PPM, w) for s, w in zip(served, flow_weights, strict=True)]
    assert max(normalised) - min(normalised) < gap_bound + 1


@pytest.mark.parametrize("which", ["python", "cython"])
def test_a_flooding_tenant_cannot_take_a_backlogged_tenants_share(which: str) -> None:
    """VTC: tenant 0 floods with long requests, tenant 1 is backlogged with short ones."""
    module = _sched_py if which == "python" else compiled("_sched_c")
    queue = module.FairQueue()
    queue.activate(0)
    queue.activate(1)
    served = [0, 0]
    for _ in range(5_000):
        flow = queue.pick()
        cost = 4_000 if flow == 0 else 50
        queue.charge(flow, cost)
        served[flow] += cost
        assert abs(served[0] - served[1]) <= 4_000  # never more than one long request apart
    assert served[1] > 0.45 * sum(served)
