"""Bounded, fair wait queues: the data structures behind server-side waiting.

One queue per (lane, tenant), in each waiter's ``order`` (its arrival plus
the time its work would take the pool: cheapest first, aged by time waited;
service/dispatcher.py sets it). The order in which the queues' heads are
tried comes from two levels of virtual-time fair queueing in the fast path
(``fastpath.FairQueue``):

1. lanes, weighted by the lane weights (0.40 / 0.45 / 0.15 by default),
   charged with the tokens each admitted request reserves - weighted fair
   queueing over tokens, not requests, so no lane starves while it has work;
2. inside a lane, tenants with equal weight - the virtual token counter of
   Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024): the
   backlogged tenant that has received the fewest tokens goes next, and a
   tenant that was idle is lifted to the least counter of the backlogged ones
   so it cannot bank credit.

This module only keeps the queues and the ordering; deciding whether the
chosen request can be admitted is the admission service's job.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

from controlplane.domain import LaneConfig
from controlplane.domain.units import PPM
from fastpath import FairQueue


class Waiter:
    """One Admit call waiting in a queue."""

    __slots__ = (
        "arrived_ns",
        "bounded",
        "deadline_ns",
        "done",
        "due_ns",
        "key",
        "lane",
        "lane_idx",
        "max_tokens",
        "model",
        "on_done",
        "order",
        "pool",
        "prompt",
        "result",
        "retry_key",
        "seq",
        "slo_ns",
        "slot",
        "uncounted",
    )

    def __init__(
        self,
        key: tuple[str, str],
        slot: int,
        lane: str,
        lane_idx: int,
        prompt: int,
        max_tokens: int,
        model: str,
        pool: str,
        arrived_ns: int,
        deadline_ns: int,
        seq: int,
    ) -> None:
        self.key = key
        self.slot = slot
        self.lane = lane
        self.lane_idx = lane_idx
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.model = model
        self.pool = pool
        self.arrived_ns = arrived_ns
        self.deadline_ns = deadline_ns
        self.seq = seq
        self.order = arrived_ns  # its place in its tenant's queue (smallest first)
        self.done = False
        # When its first token is due (first arrival + its asked lane's TTFT
        # SLO, and that SLO; 0 = none): service/deadlines.py.
        self.due_ns = 0
        self.slo_ns = 0
        self.retry_key = ""  # service/retries.py
        self.bounded = True  # its wait ends before its deadline asks (dispatcher)
        # Held for its tenant's own limits: not demand until admitted
        # (service/demand.py; the dispatcher counts it then).
        self.uncounted = False
        self.result: Any = None
        # Called once with the final decision (set by the asyncio layer).
        self.on_done: Callable[[Any], None] | None = None


class WaitQueues:
    def __init__(self) -> None:
        self._lane_index: dict[str, int] = {}  # stable: a lane keeps its flow id
        self._lane_fq = FairQueue()
        self._tenant_fq: list[FairQueue] = []
        # queues[lane_idx][slot] -> heap of (order, seq, waiter)
        self._queues: list[dict[int, list[tuple[int, int, Waiter]]]] = []
        self.total = 0
        self.per_lane: list[int] = []
        self.per_tenant: dict[int, int] = {}
        self._deadlines: list[tuple[int, int, Waiter]] = []
        self._seq = 0
        self.by_key: dict[tuple[str, str], Waiter] = {}
        # pool -> per lane index, the waiters and their prompt tokens (what
        # a new arrival would wait behind: service/pace.py)
        self.pool_waiting: dict[str, list[int]] = {}
        self.pool_tokens: dict[str, list[int]] = {}
        # Eligibility masks must cover every flow that is active, eligible or
        # not: one past the highest tenant slot ever queued.
        self._mask_len = 0

    # ------------------------------------------------------------ lanes
    def set_lanes(self, lanes: Iterable[LaneConfig]) -> None:
        for lane in lanes:
            idx = self._lane_index.get(lane.name)
            if idx is None:
                idx = self._lane_index[lane.name] = len(self._lane_index)
                self._tenant_fq.append(FairQueue())
                self._queues.append({})
                self.per_lane.append(0)
            # weights are fractions of 1 with 4 decimals; the fast path wants ppm
            self._lane_fq.set_weight(idx, max(1, round(float(lane.weight) * PPM)))

    def lane_index(self, name: str) -> int:
        return self._lane_index[name]

    def lane_depths(self) -> dict[str, int]:
        return {name: self.per_lane[idx] for name, idx in self._lane_index.items()}

    # --------------------------------------------------------- waiters
    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def add(self, w: Waiter) -> None:
        if w.slot >= self._mask_len:
            self._mask_len = w.slot + 1
        lane_q = self._queues[w.lane_idx]
        q = lane_q.get(w.slot)
        if q is None:
            q = lane_q[w.slot] = []
        if not q:
            if self.per_lane[w.lane_idx] == 0:
                self._lane_fq.activate(w.lane_idx)
            self._tenant_fq[w.lane_idx].activate(w.slot)
        heapq.heappush(q, (w.order, w.seq, w))
        self.total += 1
        self.per_lane[w.lane_idx] += 1
        self.per_tenant[w.slot] = self.per_tenant.get(w.slot, 0) + 1
        self.by_key[w.key] = w
        heapq.heappush(self._deadlines, (w.deadline_ns, w.seq, w))
        counts = self.pool_waiting.get(w.pool)
        if counts is None:
            counts = self.pool_waiting[w.pool] = [0] * len(self.per_lane)
            self.pool_tokens[w.pool] = [0] * len(self.per_lane)
        elif len(counts) < len(self.per_lane):  # lanes added since
            grow = len(self.per_lane) - len(counts)
            counts.extend([0] * grow)
            self.pool_tokens[w.pool].extend([0] * grow)
        counts[w.lane_idx] += 1
        self.pool_tokens[w.pool][w.lane_idx] += w.prompt

    def remove(self, w: Waiter) -> None:
        """Take a waiter out wherever it is (admitted, timed out, cancelled)."""
        q = self._queues[w.lane_idx].get(w.slot)
        if q is None or w.done:
            return
        if q and q[0][2] is w:
            heapq.heappop(q)
        else:
            q.remove((w.order, w.seq, w))
            heapq.heapify(q)
        w.done = True
        self.total -= 1
        self.per_lane[w.lane_idx] -= 1
        left = self.per_tenant[w.slot] - 1
        if left:
            self.per_tenant[w.slot] = left
        else:
            del self.per_tenant[w.slot]
        if self.by_key.get(w.key) is w:
            del self.by_key[w.key]
        counts = self.pool_waiting[w.pool]
        counts[w.lane_idx] -= 1
        self.pool_tokens[w.pool][w.lane_idx] -= w.prompt
        if not any(counts):
            del self.pool_waiting[w.pool]
            del self.pool_tokens[w.pool]
        if not q:
            del self._queues[w.lane_idx][w.slot]
            self._tenant_fq[w.lane_idx].deactivate(w.slot)
            if self.per_lane[w.lane_idx] == 0:
                self._lane_fq.deactivate(w.lane_idx)

    def heads(self, lane_idx: int) -> Iterable[tuple[int, Waiter]]:
        """(slot, first waiter) of every tenant waiting in the lane."""
        for slot, q in self._queues[lane_idx].items():
            yield slot, q[0][2]

    def pick(self, eligible: Callable[[Waiter], bool]) -> Waiter | None:
        """The next waiter to try, in fair order, among heads ``eligible``
        accepts; None when no head is eligible."""
        if not self.total:
            return None
        n_lanes = len(self._queues)
        lane_mask = bytearray(n_lanes)
        chosen: dict[int, bytearray] = {}
        for idx in range(n_lanes):
            if not self.per_lane[idx]:
                continue
            slots = [slot for slot, head in self.heads(idx) if eligible(head)]
            if slots:
                mask = bytearray(self._mask_len)
                for slot in slots:
                    mask[slot] = 1
                chosen[idx] = mask
                lane_mask[idx] = 1
        lane = self._lane_fq.pick(lane_mask)
        if lane < 0:
            return None
        slot = self._tenant_fq[lane].pick(chosen[lane])
        return self._queues[lane][slot][0][2]

    def charge(self, lane_idx: int, slot: int, tokens: int) -> None:
        """Count service: an admitted request's reserved tokens."""
        self._lane_fq.charge(lane_idx, tokens)
        self._tenant_fq[lane_idx].charge(slot, tokens)

    def expired(
        self, now_ns: int, extend: Callable[[Waiter], int] | None = None
    ) -> list[Waiter]:
        """Waiters whose deadline has passed (removed from the queues).
        ``extend(w)`` may give a waiter a later deadline instead (> now;
        0 = none): it stays."""
        out: list[Waiter] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now_ns:
            deadline, _, w = heapq.heappop(heap)
            if w.done or deadline != w.deadline_ns:  # gone, or extended since
                continue
            later = extend(w) if extend is not None else 0
            if later > now_ns:
                w.deadline_ns = later
                heapq.heappush(heap, (later, w.seq, w))
                continue
            self.remove(w)
            out.append(w)
        # drop entries of waiters already gone, so the heap stays bounded
        while heap and heap[0][2].done:
            heapq.heappop(heap)
        return out

    def footprint(self) -> dict[str, int]:
        """Sizes of the internal indexes, for leak checks: with nobody
        waiting they drain back to zero."""
        return {
            "deadline_heap": len(self._deadlines),
            "waiters_by_key": len(self.by_key),
            "pools_waiting": len(self.pool_waiting),
        }

    def next_deadline(self) -> int | None:
        heap = self._deadlines
        while heap and heap[0][2].done:
            heapq.heappop(heap)
        return heap[0][0] if heap else None
