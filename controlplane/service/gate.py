"""The pool gate: release a request to an engine pool only while it has room.

An engine's waiting queue is FIFO: whatever is released into it waits there
where no lane or fairness rule can reach it. With ``Policy.pool_gate`` on,
burstgate holds the backlog itself instead and releases work only while the
pool is below its saturation point:

- **with fresh load reports**: the engines' waiting requests (as last
  reported) plus the requests burstgate released since the oldest of those
  reports stay below ``gate_waiting_per_engine`` x the reporting engines,
  where an engine that reports its running requests and ``max_num_seqs``
  absorbs up to its free sequence slots first; and no engine's KV cache is
  above ``gate_kv_usage_threshold``. Counting its own releases between
  reports is what keeps a burst inside one report interval from overrunning
  the pool;
- **without** (no engine reported, or every report is stale): at most
  ``gate_fallback_inflight`` requests released and not completed — a
  conservative concurrency, never "unlimited".

The thresholds follow the Gateway API Inference Extension's saturation
detector (a waiting-queue threshold per engine, stale metrics treated as
saturated) and SPEC section 2 (engines' waiting queues under about two
requests). A held request waits in its lane queue; which one goes next when
the gate opens is the dispatcher's business.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from controlplane.domain import LoadSample
from controlplane.domain.policy import Policy

DEFAULT_POOL = "default"  # the pool of an Admit that names none


# Completions remembered per pool to measure its drain rate.
DRAIN_WINDOW = 64
# Bounds of a predicted retry_after (ns).
MIN_RETRY_NS = 1_000_000
MAX_RETRY_NS = 30_000_000_000


@dataclass(slots=True)
class _PoolState:
    engines: dict[str, LoadSample] = field(default_factory=dict)
    releases: deque[int] = field(default_factory=deque)  # release times, newest last
    inflight: int = 0  # released and not yet completed
    done: deque[int] = field(default_factory=lambda: deque(maxlen=DRAIN_WINDOW))
    report_gap_ns: int = 0  # typical time between two reports of one engine


_EMPTY = _PoolState()  # read-only stand-in for a pool nobody released to yet


class PoolGate:
    def __init__(self, stale_ns: int) -> None:
        self._stale_ns = stale_ns
        self._pools: dict[str, _PoolState] = {}
        self.enabled = False
        self._per_engine = 2
        self._fallback = 64
        self._kv_threshold = 0.9

    def configure(self, policy: Policy) -> None:
        self.enabled = policy.pool_gate
        self._per_engine = policy.gate_waiting_per_engine
        self._fallback = policy.gate_fallback_inflight
        self._kv_threshold = policy.gate_kv_usage_threshold

    def _pool(self, pool: str) -> _PoolState:
        state = self._pools.get(pool)
        if state is None:
            state = self._pools[pool] = _PoolState()
        return state

    def report(self, load: LoadSample) -> None:
        state = self._pool(load.pool)
        prev = state.engines.get(load.engine_id)
        now = load.received_ns
        if prev is not None and now > prev.received_ns:
            gap = now - prev.received_ns
            old = state.report_gap_ns
            state.report_gap_ns = gap if not old else (old + gap) // 2
        state.engines[load.engine_id] = load
        # releases older than every fresh report are in those reports already
        fresh = [
            e.received_ns for e in state.engines.values() if now - e.received_ns <= self._stale_ns
        ]
        oldest = min(fresh, default=now)
        while state.releases and state.releases[0] <= oldest:
            state.releases.popleft()

    def released(self, pool: str, now: int) -> None:
        state = self._pool(pool)
        state.inflight += 1
        state.releases.append(now)

    def completed(self, pool: str, now: int) -> None:
        state = self._pools.get(pool)
        if state is not None and state.inflight > 0:
            state.inflight -= 1
            state.done.append(now)

    def has_room(self, pool: str, now: int) -> bool:
        """Whether one more request may be released to ``pool`` now."""
        room = self.room(pool, now)
        return room is None or room > 0

    def room(self, pool: str, now: int) -> int | None:
        """How many more requests may be released to ``pool`` now (None: the
        gate is off, no limit)."""
        if not self.enabled:
            return None
        # asking creates nothing: only releases and reports make a pool's state
        return max(0, self._room(self._pools.get(pool) or _EMPTY, now))

    def retry_ns(self, pool: str, now: int) -> int:
        """When the pool is predicted to take one more request: the requests
        it is over its target (at least one) over its measured drain rate
        (completions per second, the last ``DRAIN_WINDOW``); before any
        completion was seen, one load-report interval."""
        state = self._pools.get(pool) or _EMPTY
        over = max(1, 1 - self._room(state, now))
        done = state.done
        if len(done) >= 2 and done[-1] > done[0]:
            wait = over * (done[-1] - done[0]) // (len(done) - 1)
        else:
            wait = state.report_gap_ns or MIN_RETRY_NS * 100
        return min(max(wait, MIN_RETRY_NS), MAX_RETRY_NS)

    def _room(self, state: _PoolState, now: int) -> int:
        """``room`` before clamping at 0: negative = over the target by that many."""
        fresh = [e for e in state.engines.values() if now - e.received_ns <= self._stale_ns]
        if not fresh:
            return self._fallback - state.inflight
        kv_full = self._kv_threshold
        if any(e.kv_cache_usage is not None and e.kv_cache_usage >= kv_full for e in fresh):
            return 0  # KV cache nearly full: more work now means preemptions
        # How many more may go before the engines' waiting queues reach the
        # target. An engine that reports its running requests and its
        # max_num_seqs starts what it has room for at its next step, so only
        # what exceeds that room will wait; otherwise every release counts.
        room = self._per_engine * len(fresh)
        for e in fresh:
            room -= e.queue_depth
            if e.queue_depth == 0 and e.requests_running is not None and e.max_num_seqs:
                room += max(0, e.max_num_seqs - e.requests_running)
        return room - len(state.releases)

    def inflight(self, pool: str) -> int:
        state = self._pools.get(pool)
        return 0 if state is None else state.inflight
