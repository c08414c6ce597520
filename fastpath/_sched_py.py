"""Pure-Python reference of the scheduling primitives: backpressure and fair queueing.

This module defines the semantics; ``_sched_c.pyx`` is the compiled copy and must give
bit-identical results (the property tests drive both with the same inputs and operation
sequences).  Everything is integer: ratios in parts per million (``PPM`` = 1.0), time in
nanoseconds, virtual time in units of tokens * PPM / weight_ppm.  Integer arguments are
converted as the compiled build converts them (``operator.index``: ``TypeError`` for
floats and other non-integers, ``OverflowError`` outside int64), all of them before any
range check; then each is validated, in the same order in both builds, with a
``ValueError`` that names it.  Every division has a non-negative dividend and a positive
divisor, where C's truncating division equals Python's flooring one.

* ``backpressure_score_ppm``: SPEC section 2's score B from an engine pool's load report,
  renormalised over the signals the report carries.
* ``backpressure_retry_ns``: how long until a draining pool's score is back at a target.
* ``shed_threshold_ppm``: the score at which a sheddable lane starts being held.
* ``FairQueue``: virtual-time fair queueing over small-integer flows (lanes by weight,
  or the tenants of one lane: the virtual token counter of Sheng et al., "Fairness in
  Serving Large Language Models", OSDI 2024).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, TypedDict, cast

from fastpath._ints import check_range as _check_range
from fastpath._ints import i64 as _i64
from fastpath.codes import (
    MAX_BACKPRESSURE_CAPACITY,
    MAX_FLOWS,
    MAX_REQUEST_TOKENS,
    NS_PER_S,
    PPM,
    VT_MAX,
)

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np
    import numpy.typing as npt
    from typing_extensions import Buffer

    # What pick takes as an eligibility mask: a 1-D buffer of 1-byte integers.
    ByteMask: TypeAlias = Buffer | bytearray | bytes | npt.NDArray[np.int8] | npt.NDArray[np.uint8]

__all__ = [
    "FairQueue",
    "FairQueueSnapshot",
    "FlowState",
    "backpressure_retry_ns",
    "backpressure_score_ppm",
    "shed_threshold_ppm",
]

_MAX_CHARGE_TOKENS: Final = 2 * MAX_REQUEST_TOKENS  # prompt + generation of one request
_DEFAULT_RENORMALIZE_ABOVE: Final = VT_MAX
# 1-byte integer buffer formats (the byte-order prefix means nothing for one byte).
_BYTE_FORMATS: Final = frozenset(p + c for p in ("", "@", "=", "<", ">", "!") for c in ("b", "B"))


# --- backpressure ------------------------------------------------------------------


def backpressure_score_ppm(
    batch_tokens: int,
    max_batch_tokens: int,
    queue_depth: int,
    queue_capacity: int,
    miss_ppm: int,
    kv_ppm: int,
    alpha_ppm: int,
    beta_ppm: int,
    gamma_ppm: int,
    delta_ppm: int,
) -> int:
    """The weighted mean of the load signals present, in ppm:

    ``B = (alpha*batch/max_batch + beta*depth/capacity + gamma*miss + delta*kv)
    / (the weights of the terms present)``.

    ``miss_ppm`` (prefix-cache miss rate) and ``kv_ppm`` (KV-cache usage) may be -1 for
    "not reported": their weights then leave the denominator, so the score reaches 1.0
    with the signals an engine really has. With every weight 0 among the present terms
    the score is 0 (no signal). With SPEC section 2's weights (alpha + beta + gamma = 1),
    a miss rate and no KV usage, this is the SPEC's ``alpha*batch + beta*queue +
    gamma*miss`` exactly. Each ratio is clamped to [0, PPM] (a batch or queue past its
    nominal size counts as full) and floored to whole ppm; the mean is floored once.
    """
    batch_tokens = _i64(batch_tokens)
    max_batch_tokens = _i64(max_batch_tokens)
    queue_depth = _i64(queue_depth)
    queue_capacity = _i64(queue_capacity)
    miss_ppm = _i64(miss_ppm)
    kv_ppm = _i64(kv_ppm)
    alpha_ppm = _i64(alpha_ppm)
    beta_ppm = _i64(beta_ppm)
    gamma_ppm = _i64(gamma_ppm)
    delta_ppm = _i64(delta_ppm)
    if batch_tokens < 0:
        raise ValueError(f"batch_tokens must be >= 0, got {batch_tokens}")
    _check_range("max_batch_tokens", max_batch_tokens, 1, MAX_BACKPRESSURE_CAPACITY)
    if queue_depth < 0:
        raise ValueError(f"queue_depth must be >= 0, got {queue_depth}")
    _check_range("queue_capacity", queue_capacity, 1, MAX_BACKPRESSURE_CAPACITY)
    _check_range("miss_ppm", miss_ppm, -1, PPM)
    _check_range("kv_ppm", kv_ppm, -1, PPM)
    _check_range("alpha_ppm", alpha_ppm, 0, PPM)
    _check_range("beta_ppm", beta_ppm, 0, PPM)
    _check_range("gamma_ppm", gamma_ppm, 0, PPM)
    _check_range("delta_ppm", delta_ppm, 0, PPM)
    # min(x, cap) * PPM <= 1e18: in int64 for caps up to MAX_BACKPRESSURE_CAPACITY.
    r_batch = min(batch_tokens, max_batch_tokens) * PPM // max_batch_tokens
    r_queue = min(queue_depth, queue_capacity) * PPM // queue_capacity
    total = alpha_ppm * r_batch + beta_ppm * r_queue  # every sum <= 4e12
    weights = alpha_ppm + beta_ppm
    if miss_ppm >= 0:
        total += gamma_ppm * miss_ppm
        weights += gamma_ppm
    if kv_ppm >= 0:
        total += delta_ppm * kv_ppm
        weights += delta_ppm
    if weights == 0:
        return 0
    return total // weights


def backpressure_retry_ns(
    score_ppm: int, target_ppm: int, drain_ppm_per_s: int, cap_ns: int
) -> int:
    """Nanoseconds until a pool at ``score_ppm`` losing ``drain_ppm_per_s`` gets to target.

    0 when already at or below the target; ``cap_ns`` when not draining
    (``drain_ppm_per_s <= 0``); else ``ceil((score - target) * 1e9 / drain)``, at most
    ``cap_ns``.
    """
    score_ppm = _i64(score_ppm)
    target_ppm = _i64(target_ppm)
    drain_ppm_per_s = _i64(drain_ppm_per_s)
    cap_ns = _i64(cap_ns)
    _check_range("score_ppm", score_ppm, 0, PPM)
    _check_range("target_ppm", target_ppm, 0, PPM)
    if cap_ns < 0:
        raise ValueError(f"cap_ns must be >= 0, got {cap_ns}")
    if score_ppm <= target_ppm:
        return 0
    if drain_ppm_per_s <= 0:
        return cap_ns
    excess = (score_ppm - target_ppm) * NS_PER_S  # <= 1e15
    wait = excess // drain_ppm_per_s
    if wait * drain_ppm_per_s != excess:  # ceil, without excess + drain - 1 overflowing
        wait += 1
    return wait if wait < cap_ns else cap_ns


def shed_threshold_ppm(rank: int, sheddable: int, soft_ppm: int, hard_ppm: int) -> int:
    """Backpressure score at which sheddable lane ``rank`` (0 = lowest) starts being held.

    ``soft + (hard - soft) * rank // sheddable``: the lowest lane at ``soft``, each
    higher one a step later, all below ``hard`` (unless soft == hard).
    """
    rank = _i64(rank)
    sheddable = _i64(sheddable)
    soft_ppm = _i64(soft_ppm)
    hard_ppm = _i64(hard_ppm)
    _check_range("sheddable", sheddable, 1, MAX_FLOWS)
    _check_range("rank", rank, 0, sheddable - 1)
    _check_range("soft_ppm", soft_ppm, 0, PPM)
    _check_range("hard_ppm", hard_ppm, soft_ppm, PPM)
    return soft_ppm + (hard_ppm - soft_ppm) * rank // sheddable  # <= 1e6 * 2**20


# --- fair queueing -----------------------------------------------------------------


class FlowState(TypedDict):
    weight_ppm: int
    vt: int
    rem: int  # the charge remainder, token-ppm below one vt unit, in [0, weight_ppm)
    active: bool


class FairQueueSnapshot(TypedDict):
    capacity: int
    renormalize_above: int
    last_vt: int
    renormalizations: int
    active_count: int
    # Flows whose state differs from the default (weight PPM, vt 0, rem 0, inactive).
    flows: dict[int, FlowState]


def _check_flow(flow: int) -> None:
    if not 0 <= flow < MAX_FLOWS:
        raise ValueError(f"flow must be in [0, {MAX_FLOWS}), got {flow}")


def _byte_view(obj: ByteMask) -> memoryview:
    try:
        view = memoryview(cast("Buffer", obj))
    except TypeError as exc:
        raise TypeError("eligible must be a 1-D int8/uint8 buffer (or bytearray)") from exc
    if view.ndim != 1:
        raise ValueError(f"eligible must be 1-D, got {view.ndim} dimensions")
    if view.itemsize != 1 or view.format not in _BYTE_FORMATS:
        raise ValueError(f"eligible must hold int8/uint8 items, got format {view.format!r}")
    return view


class FairQueue:
    """Virtual-time fair queueing over small-integer flows (start-time fair queueing).

    Each flow has a weight (ppm, default PPM), a virtual time ``vt`` and an *active*
    (backlogged) flag.  ``pick`` serves the active flow with the smallest vt; ``charge``
    advances the served flow's vt by ``cost * PPM / weight``, so backlogged flows receive
    tokens in proportion to their weights, and no backlogged flow falls more than one
    maximal request behind another.  ``activate`` lifts a flow that becomes backlogged to
    the smallest vt among active flows (or to ``last_vt``, the start tag of the last
    charge, when none is active): an idle flow cannot bank credit (the VTC counter lift).

    The division is exact over time: each flow carries the remainder of its charges
    (``rem``, in [0, weight)), as the token buckets carry their refill remainder, so after
    charges of S tokens a flow's vt has grown by exactly ``S * PPM // weight``.  Without
    it a flow whose weight does not divide PPM would lose up to one vt unit per charge
    and, with small costs, get far more than its share.  The remainder is dropped when
    the weight changes and when the vt is lifted or clamped.

    Virtual times stay in [0, VT_MAX].  When a charge takes a vt past
    ``renormalize_above``, every vt and ``last_vt`` are shifted down by the floor (the
    smallest active vt, or ``last_vt`` when none is active), clamping at 0; that keeps
    the differences between active flows, so it changes no decision.  A flow still above
    VT_MAX after that (ahead of a flow starved by ``eligible`` by more than 2**61) is held
    at VT_MAX.

    Flows grow automatically (like the bucket table's slots) when a flow at or past the
    capacity is set, activated or charged; reading one returns the defaults.  Not
    thread-safe: one event loop owns it.
    """

    __slots__ = (
        "_active",
        "_is_active",
        "_last_vt",
        "_rem",
        "_renormalizations",
        "_renormalize_above",
        "_vt",
        "_weight",
    )

    def __init__(
        self, capacity: int = 16, renormalize_above: int = _DEFAULT_RENORMALIZE_ABOVE
    ) -> None:
        capacity = _i64(capacity)
        renormalize_above = _i64(renormalize_above)
        _check_range("capacity", capacity, 1, MAX_FLOWS)
        _check_range("renormalize_above", renormalize_above, 1, VT_MAX)
        self._weight: list[int] = [PPM] * capacity
        self._vt: list[int] = [0] * capacity
        self._rem: list[int] = [0] * capacity
        self._is_active: list[bool] = [False] * capacity
        self._active: set[int] = set()
        self._last_vt = 0
        self._renormalize_above = renormalize_above
        self._renormalizations = 0

    @property
    def capacity(self) -> int:
        """Number of flows allocated."""
        return len(self._vt)

    @property
    def renormalize_above(self) -> int:
        return self._renormalize_above

    @property
    def last_vt(self) -> int:
        """Virtual time of the last service start (the start tag of the last charge)."""
        return self._last_vt

    def _grow(self, flow: int) -> None:
        if flow >= len(self._vt):
            new_capacity = max(flow + 1, min(2 * len(self._vt), MAX_FLOWS))
            extra = new_capacity - len(self._vt)
            self._weight.extend([PPM] * extra)
            self._vt.extend([0] * extra)
            self._rem.extend([0] * extra)
            self._is_active.extend([False] * extra)

    def _floor(self) -> int:
        """Smallest vt over active flows, or ``last_vt`` when none is active."""
        return min((self._vt[f] for f in self._active), default=self._last_vt)

    def set_weight(self, flow: int, weight_ppm: int) -> None:
        """Set a flow's weight (ppm, 1..PPM); it applies to later charges."""
        flow = _i64(flow)
        weight_ppm = _i64(weight_ppm)
        _check_flow(flow)
        _check_range("weight_ppm", weight_ppm, 1, PPM)
        self._grow(flow)
        if self._weight[flow] != weight_ppm:
            self._weight[flow] = weight_ppm
            self._rem[flow] = 0  # a remainder of the old weight means nothing for the new

    def weight(self, flow: int) -> int:
        flow = _i64(flow)
        _check_flow(flow)
        return self._weight[flow] if flow < len(self._weight) else PPM

    def vt(self, flow: int) -> int:
        flow = _i64(flow)
        _check_flow(flow)
        return self._vt[flow] if flow < len(self._vt) else 0

    def is_active(self, flow: int) -> bool:
        flow = _i64(flow)
        _check_flow(flow)
        return flow < len(self._is_active) and self._is_active[flow]

    def active_count(self) -> int:
        return len(self._active)

    def activate(self, flow: int) -> None:
        """``flow`` became backlogged: lift its vt to the floor; no-op if already active."""
        flow = _i64(flow)
        _check_flow(flow)
        self._grow(flow)
        if self._is_active[flow]:
            return
        floor = self._floor()
        if self._vt[flow] < floor:
            self._vt[flow] = floor
            self._rem[flow] = 0
        self._is_active[flow] = True
        self._active.add(flow)

    def deactivate(self, flow: int) -> None:
        """``flow``'s queue emptied; no-op if not active."""
        flow = _i64(flow)
        _check_flow(flow)
        if flow < len(self._is_active) and self._is_active[flow]:
            self._is_active[flow] = False
            self._active.discard(flow)

    def reset(self, flow: int) -> None:
        """Forget ``flow`` (e.g. its tenant was removed): inactive, weight PPM, vt 0."""
        flow = _i64(flow)
        _check_flow(flow)
        if flow < len(self._vt):
            self._is_active[flow] = False
            self._active.discard(flow)
            self._weight[flow] = PPM
            self._vt[flow] = 0
            self._rem[flow] = 0

    def pick(self, eligible: ByteMask | None = None) -> int:
        """The active flow with the smallest vt (ties: smallest index), or -1.

        With ``eligible`` (a 1-D int8/uint8 buffer or bytearray, longer than the highest
        active flow), only flows with ``eligible[flow] != 0`` are considered.
        """
        if eligible is None:
            return min(self._active, key=lambda f: (self._vt[f], f), default=-1)
        view = _byte_view(eligible)
        n = len(view)
        if self._active and max(self._active) >= n:
            raise ValueError(f"eligible has {n} entries but flow {max(self._active)} is active")
        best = -1
        best_vt = 0
        for f in self._active:
            if view[f] != 0:
                v = self._vt[f]
                if best < 0 or v < best_vt or (v == best_vt and f < best):
                    best = f
                    best_vt = v
        return best

    def charge(self, flow: int, cost_tokens: int) -> None:
        """Account ``cost_tokens`` served to ``flow`` (active or not).

        ``last_vt`` becomes the flow's vt before the charge (its start tag), then the vt
        advances by ``cost_tokens * PPM / weight_ppm``, the remainder carried.
        """
        flow = _i64(flow)
        cost_tokens = _i64(cost_tokens)
        _check_flow(flow)
        _check_range("cost_tokens", cost_tokens, 0, _MAX_CHARGE_TOKENS)
        self._grow(flow)
        weight = self._weight[flow]
        start = self._vt[flow]
        acc = cost_tokens * PPM + self._rem[flow]  # < 2e13 + 1e6
        vt = start + acc // weight  # <= VT_MAX + 2e13 + 1e6 < 2**62
        self._rem[flow] = acc % weight
        self._last_vt = start
        self._vt[flow] = vt
        if vt > self._renormalize_above:
            self._renormalize()

    def _renormalize(self) -> None:
        floor = self._floor()
        vts = self._vt
        for f in range(len(vts)):
            v = vts[f] - floor
            if v > VT_MAX:
                vts[f] = VT_MAX
                self._rem[f] = 0
            elif v < 0:
                vts[f] = 0
                self._rem[f] = 0
            else:
                vts[f] = v
        v = self._last_vt - floor
        self._last_vt = v if v > 0 else 0
        self._renormalizations += 1

    def snapshot(self) -> FairQueueSnapshot:
        """The queue's state and every flow that is not in its default state."""
        flows: dict[int, FlowState] = {}
        for f in range(len(self._vt)):
            if self._is_active[f] or self._vt[f] or self._rem[f] or self._weight[f] != PPM:
                flows[f] = {
                    "weight_ppm": self._weight[f],
                    "vt": self._vt[f],
                    "rem": self._rem[f],
                    "active": self._is_active[f],
                }
        return {
            "capacity": len(self._vt),
            "renormalize_above": self._renormalize_above,
            "last_vt": self._last_vt,
            "renormalizations": self._renormalizations,
            "active_count": len(self._active),
            "flows": flows,
        }
