"""The pool gate: release a request to an engine pool only while it has room.

An engine's waiting queue is FIFO: whatever is released into it waits there
where no lane or fairness rule can reach it. With ``Policy.pool_gate`` on,
burstgate holds the backlog itself instead and releases work only while the
pool is below its saturation point:

- **with fresh load reports**, a request may go when
  - it will start at the engines' next step: an engine that reports no
    waiting request, its running requests and ``max_num_seqs`` has a free
    sequence slot, and the prompts released into it since the reports have
    not used up the step's prefill budget (``max_batch_tokens`` less what
    the last step carried: ``batch_tokens``, or one token per running
    decode; and at most ``_step_tokens`` of it, the bound premium's SLO
    sets on slow engines): vLLM starts a request with a partial chunk when
    less is left than its prompt; or, for a fail-open lane (premium) only,
  - it will wait, but the engines' waiting requests (as last reported) plus
    the releases that will wait since the reports stay below
    ``gate_waiting_per_engine`` x the reporting engines;
  and no engine's KV cache is at or above ``gate_kv_usage_threshold``. So
  the engines' queues hold nothing premium waits behind (docs/gate.md).
  Counting its own releases between reports is what keeps a burst inside one
  report interval from overrunning the pool. An engine that reports no
  running count lets every lane go by the waiting target;
- **without** (no engine reported, or every report is stale): at most
  ``gate_fallback_inflight`` requests released and not completed — a
  conservative concurrency, never "unlimited";
- **held** (``hold``: a replica just took the pool's cell over from another
  one, docs/ha.md): nothing is released until the first load report that
  arrives after the hold began, or until the hold ends, so the old owner's
  requests still running are counted first — by the engines' reports, or by
  the reservations sidecars re-announce (``restored``: in flight here too).

The thresholds follow the Gateway API Inference Extension's saturation
detector (a waiting-queue threshold per engine, stale metrics treated as
saturated) and SPEC section 2 (engines' waiting queues under about two
requests). A held request waits in its lane queue; which one goes next when
the gate opens is the dispatcher's business.
"""

from __future__ import annotations

from collections.abc import Iterable

from controlplane.domain import LoadSample
from controlplane.domain.policy import Policy
from controlplane.domain.units import NS_PER_MS, NS_PER_S
from controlplane.service.poolstate import PoolState, Room

DEFAULT_POOL = "default"  # the pool of an Admit that names none


# Weight of each fail-open release in the average premium prompt (about the
# last 1/weight releases count).
FIRST_PROMPT_WEIGHT = 0.05
# Bounds of a predicted retry_after (ns).
MIN_RETRY_NS = 1_000_000
MAX_RETRY_NS = 30_000_000_000


_EMPTY = PoolState()  # read-only stand-in for a pool nobody released to yet
# Where a release goes (PoolGate._classify).
_START, _WAIT, _NO_ROOM = 0, 1, 2
_CLOSED = Room(-1)


class PoolGate:
    def __init__(self, stale_ns: int) -> None:
        self._stale_ns = stale_ns
        self._pools: dict[str, PoolState] = {}
        self.enabled = False
        self._per_engine = 2
        self._fallback = 64
        self._kv_threshold = 0.9
        self._first_slo_ns = 0  # the tightest fail-open lane's TTFT SLO (0 = none)

    def configure(self, policy: Policy, first_lanes: Iterable[str] = ()) -> None:
        """Install the policy; ``first_lanes`` are the fail-open lanes
        (premium), whose tightest TTFT SLO bounds how much prefill the other
        lanes may put into one engine step (``_step_tokens``)."""
        self.enabled = policy.pool_gate
        self._per_engine = policy.gate_waiting_per_engine
        self._fallback = policy.gate_fallback_inflight
        self._kv_threshold = policy.gate_kv_usage_threshold
        slos = [policy.lane_ttft_slo_ms[lane] for lane in first_lanes
                if policy.lane_ttft_slo_ms.get(lane)]  # fmt: skip
        self._first_slo_ns = min(slos) * NS_PER_MS if slos else 0
        for state in self._pools.values():
            state.room = None  # the thresholds changed

    def _pool(self, pool: str) -> PoolState:
        state = self._pools.get(pool)
        if state is None:
            state = self._pools[pool] = PoolState()
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
        state.room = None
        # a report after a takeover began counts everything the engines run,
        # the old owner's requests included: the hold has done its job
        state.held_until = 0
        # releases older than every fresh report are in those reports already
        fresh = [
            e.received_ns for e in state.engines.values() if now - e.received_ns <= self._stale_ns
        ]
        oldest = min(fresh, default=now)
        state.work.engines(now, len(fresh), load.queue_depth)
        starting, waiting = state.starting, state.waiting
        if starting and starting[-1] <= oldest:  # the usual case: all of them
            starting.clear()
            state.starting_prompts.clear()
            state.starting_tokens = 0
        while starting and starting[0] <= oldest:
            starting.popleft()
            state.starting_tokens -= state.starting_prompts.popleft()
        if waiting and waiting[-1] <= oldest:
            waiting.clear()
        while waiting and waiting[0] <= oldest:
            waiting.popleft()

    def released(self, pool: str, now: int, prompt: int, first: bool = False) -> None:
        """A request of ``prompt`` tokens was released to ``pool``;
        ``first``: a fail-open lane's."""
        self.released_many(pool, now, [prompt], first)

    def released_many(
        self, pool: str, now: int, prompts: list[int], first: bool | list[bool] = False
    ) -> None:
        """Requests of these prompt sizes were released to ``pool`` at once
        (an AdmitStream batch), in this order; ``first``: whether they are
        fail-open lanes' (one flag for all, or one each)."""
        state = self._pool(pool)
        state.inflight += len(prompts)
        state.work.released(now, sum(prompts))
        if first is True or (isinstance(first, list) and any(first)):
            flags = [first] * len(prompts) if isinstance(first, bool) else first
            mean = state.first_prompt
            for prompt, f in zip(prompts, flags, strict=True):
                if f:  # premium's typical prompt, for _step_tokens
                    mean += FIRST_PROMPT_WEIGHT * (prompt - mean)
            state.first_prompt = mean
        starts = self._classify(state, self._room(state, now), prompts)
        if starts is None:  # the usual case: all start at the next step
            state.starting.extend([now] * len(prompts))
            state.starting_prompts.extend(prompts)
            state.starting_tokens += sum(prompts)
            return
        for prompt, start in zip(prompts, starts, strict=True):
            if start == _START:
                state.starting.append(now)
                state.starting_prompts.append(prompt)
                state.starting_tokens += prompt
            else:  # released without room (the gate was off, or shadow mode): it waits
                state.waiting.append(now)

    def restored(self, pool: str) -> None:
        """A reservation another replica released to ``pool`` was handed
        over here (restore.py): in flight until its Complete, as a release.
        Not a release since the reports (those count it already)."""
        self._pool(pool).inflight += 1

    def hold(self, pool: str, now: int, until: int) -> None:
        """Release nothing to ``pool`` until ``until`` or its next load
        report, whichever is first: this replica just took the pool over and
        its view of the engines predates the old owner's releases, so what
        it knew of them is dropped (the next reports rebuild it)."""
        state = self._pool(pool)
        state.engines.clear()
        state.starting.clear()
        state.starting_prompts.clear()
        state.starting_tokens = 0
        state.waiting.clear()
        state.room = None
        state.held_until = max(until, now + 1)

    def forget(self, pool: str) -> None:
        """Drop what the gate knows of ``pool`` (its cell moved to another
        replica, whose gate counts the requests in flight now: the
        re-announced reservations). Kept, the releases not yet completed
        here would count against the pool if the cell came back, until
        their reservations' TTL."""
        self._pools.pop(pool, None)

    def holds(self) -> dict[str, int]:
        """Pools held now -> when their hold ends."""
        return {p: s.held_until for p, s in self._pools.items() if s.held_until}

    def end_holds(self, now: int) -> list[str]:
        """Lift the holds that ended by ``now``; the pools they held."""
        ended = [p for p, s in self._pools.items() if 0 < s.held_until <= now]
        for p in ended:
            state = self._pools[p]
            state.held_until = 0
            state.room = None
        return ended

    def completed(self, pool: str, now: int) -> None:
        state = self._pools.get(pool)
        if state is not None and state.inflight > 0:
            state.inflight -= 1
            state.done.append(now)

    def has_room(self, pool: str, now: int, prompt: int = 0, first: bool = True) -> bool:
        """Whether one more request of ``prompt`` tokens may be released to
        ``pool`` now (always, with the gate off). ``first``: a fail-open
        lane's (premium), which may wait in an engine's queue up to the
        target; any other lane's request goes only where it starts at the
        engines' next step, so the engines' queues hold nothing but premium
        and premium is never queued behind another lane's work. Asking
        creates nothing: only releases and reports make a pool's state."""
        if not self.enabled:
            return True
        state = self._pools.get(pool) or _EMPTY
        room = self._room(state, now)
        if first or room.fallback >= 0 or not room.steps_known:
            return self._fits(state, room)
        return self._starts(state, room, prompt)

    def plan(
        self, pool: str, now: int, prompts: list[int], first: list[bool] | None = None
    ) -> list[bool]:
        """Which of ``prompts``, released in this order, the pool would take
        now (all, with the gate off): a batch's share, before the fast path
        decides. One that does not fit does not stop a later, smaller one.
        ``first[i]``: entry i is a fail-open lane's (None = all are), which
        may wait in the engines' queues; the others take only what starts
        at the next step (:meth:`has_room`)."""
        if not self.enabled:
            return [True] * len(prompts)
        state = self._pools.get(pool) or _EMPTY
        room = self._room(state, now)
        if room.fallback >= 0:
            left = room.fallback - state.inflight
            return [i < left for i in range(len(prompts))]
        everyone_first = first is None or all(first) or not room.steps_known
        if everyone_first and len(state.waiting) + len(prompts) <= room.waiting:
            return [True] * len(prompts)  # room for all, wherever they go
        starts = self._classify(state, room, prompts)
        if starts is None:
            return [True] * len(prompts)
        if everyone_first:
            return [c != _NO_ROOM for c in starts]
        assert first is not None
        return [c == _START or (c == _WAIT and f) for c, f in zip(starts, first, strict=True)]

    def retry_ns(self, pool: str, now: int) -> int:
        """When the pool is predicted to take one more request: the requests
        it is over its target (at least one) over its measured drain rate
        (completions per second, the last ``DRAIN_WINDOW``); before any
        completion was seen, one load-report interval."""
        state = self._pools.get(pool) or _EMPTY
        if state.held_until > now:  # taken over just now: when the hold ends
            return min(max(state.held_until - now, MIN_RETRY_NS), MAX_RETRY_NS)
        room = self._room(state, now)
        if room.fallback >= 0:
            left = room.fallback - state.inflight
        else:
            left = room.waiting - len(state.waiting)
        over = max(1, 1 - left)
        done = state.done
        if len(done) >= 2 and done[-1] > done[0]:
            wait = over * (done[-1] - done[0]) // (len(done) - 1)
        else:
            wait = state.report_gap_ns or MIN_RETRY_NS * 100
        return min(max(wait, MIN_RETRY_NS), MAX_RETRY_NS)

    def _room(self, state: PoolState, now: int) -> Room:
        if state.held_until:
            if now < state.held_until:
                return _CLOSED
            state.held_until = 0
            state.room = None
        room = state.room
        if room is not None and now < state.room_until:
            return room
        if state is _EMPTY:  # shared by every gate: computed, never cached
            return Room(self._fallback)
        stale = self._stale_ns
        fresh = [e for e in state.engines.values() if now - e.received_ns <= stale]
        # valid until the first fresh report goes stale (or the next report)
        state.room_until = min((e.received_ns + stale + 1 for e in fresh), default=1 << 62)
        room = state.room = self._compute(fresh, self._step_tokens(state))
        return room

    def _step_tokens(self, state: PoolState) -> int:
        """How many prompt tokens other lanes' work may put into one engine
        step (0 = no bound beyond the engine's own budget), so that premium
        arriving at any moment gets its first token within its SLO.

        vLLM adds a new request between steps, so premium released while a
        step runs waits for that step, then shares the next one: about two
        steps' worth of other lanes' prefill ``X`` ahead of its own prompt
        ``p``. With the first-token fit ``a + b x tokens`` (service/pace.py:
        ``b`` an engine's time per prompt token, ``a`` what does not grow
        with it), premium's TTFT is about ``a + b (2X + p)``, plus up to a
        report interval before the gate can release it; keeping that within
        its SLO bounds ``X``. ``p`` is premium's recent mean prompt. Before
        the pool has a pace or a fit, and where the bound exceeds the
        engine's own budget (fast engines, loose SLOs), nothing is bounded."""
        slo = self._first_slo_ns
        if not slo:
            return 0
        fit = state.pace.fit()
        if fit is None or fit[1] <= 0:
            # Without measured first tokens, an engine's share of the pool's
            # pace stands in for its prefill rate: the pool takes new work no
            # faster than it prefills it, so the bound is stricter than it
            # needs to be, never looser.
            rate = state.pace.rate()
            if not rate:
                return 0
            fit = (0.0, max(1, len(state.engines)) / rate)
        a, b = fit
        left_s = (slo - state.report_gap_ns) / NS_PER_S - a
        if left_s <= 0:
            return 1  # nothing fits: one release at a time
        return max(1, int((left_s / b - state.first_prompt) / 2))

    def _compute(self, fresh: list[LoadSample], step_tokens: int = 0) -> Room:
        if not fresh:
            return Room(self._fallback)
        kv_full = self._kv_threshold
        if any(e.kv_cache_usage is not None and e.kv_cache_usage >= kv_full for e in fresh):
            return _CLOSED  # KV cache nearly full: more work now means preemptions
        slots = tokens = 0
        waiting = self._per_engine * len(fresh)
        known = False
        for e in fresh:
            waiting -= e.queue_depth
            running, seqs = e.requests_running, e.max_num_seqs
            known = known or (running is not None and bool(seqs))
            if e.queue_depth == 0 and running is not None and seqs and running < seqs:
                # it starts new requests at its next step, within the step's
                # token budget less what the engine's steps already carry:
                # one token per running decode, or the last step's tokens
                # (batch_tokens) when more, i.e. prefill chunks still running
                # (vLLM schedules running requests first); the budget is at
                # most step_tokens of prefill beyond the decodes
                budget = e.max_batch_tokens
                if step_tokens:
                    budget = min(budget, running + step_tokens)
                slots += seqs - running
                tokens += max(0, budget - max(running, e.batch_tokens))
        return Room(-1, slots, tokens, waiting, known)

    @staticmethod
    def _classify(state: PoolState, room: Room, prompts: list[int]) -> list[int] | None:
        """Where each of ``prompts``, released in this order, would go: it
        starts at the engines' next step (a free slot and prefill budget),
        waits within the target, or finds no room; None when all start.
        Starting counts only while the pool is under its waiting target:
        burstgate does not route, and a router may send the release to an
        engine without a free slot (least outstanding tokens does), so free
        slots elsewhere must not let the queue grow."""
        n_start, tokens, n_wait = len(state.starting), state.starting_tokens, len(state.waiting)
        if (
            n_wait < room.waiting
            and n_start + len(prompts) <= room.slots
            and tokens + sum(prompts) <= room.tokens
        ):
            return None
        out = []
        for prompt in prompts:
            if n_wait >= room.waiting:
                out.append(_NO_ROOM)
            elif n_start < room.slots and tokens < room.tokens:
                # vLLM starts it at the next step, with a partial chunk when
                # the budget left is smaller than its prompt
                n_start += 1
                tokens += prompt
                out.append(_START)
            else:
                n_wait += 1
                out.append(_WAIT)
        return out

    @staticmethod
    def _starts(state: PoolState, room: Room, prompt: int) -> bool:
        """One more release of ``prompt`` tokens would start at the engines'
        next step: a free sequence slot and prefill budget on an engine with
        nothing waiting, the pool under its waiting target."""
        return (
            len(state.waiting) < room.waiting
            and len(state.starting) < room.slots
            and state.starting_tokens < room.tokens
        )

    @staticmethod
    def _fits(state: PoolState, room: Room) -> bool:
        if room.fallback >= 0:
            return state.inflight < room.fallback
        # a release that would start needs the pool under its target too
        return len(state.waiting) < room.waiting

    # ------------------------------------------------------------- pace

    def paced(self, pool: str, now: int, prompt: int) -> None:
        """A request the gate had held was released to ``pool``: the
        engines' pace (service/pace.py)."""
        self._pool(pool).pace.paced(now, prompt)

    def idle(self, pool: str, now: int) -> None:
        """Nothing waits for ``pool`` any more."""
        state = self._pools.get(pool)
        if state is not None:
            state.pace.idle()
            state.work.emptied(now)

    def held(self, pool: str, now: int) -> None:
        """Work is held for ``pool`` for lack of room: its gated time starts
        (if it had not) and this second saw the gate find no room."""
        self._pool(pool).work.held(now)

    def work_rate(self, pool: str, now: int) -> float | None:
        """Prompt tokens per second one engine of ``pool`` took in the
        seconds the gate held work for it (service/demand.py WorkRate;
        None: no such second in its window)."""
        state = self._pools.get(pool)
        return None if state is None else state.work.rate(now)

    def pace_rate(self, pool: str) -> float | None:
        """Prompt tokens per second ``pool`` took while it had a backlog
        (service/pace.py; None: not measured yet)."""
        state = self._pools.get(pool)
        return None if state is None else state.pace.rate()

    def wait_ns(self, pool: str, tokens: int) -> int | None:
        """Predicted time to release ``tokens`` of held work to ``pool``
        (None: its pace is not known yet)."""
        state = self._pools.get(pool)
        return None if state is None else state.pace.wait_ns(tokens)

    def ttft_ns(self, pool: str, prompt: int) -> int | None:
        """Predicted time from release to first token of a request of
        ``prompt`` tokens in ``pool`` (None: no measured first tokens yet,
        service/pace.py)."""
        state = self._pools.get(pool)
        return None if state is None else state.pace.ttft_ns(prompt)

    def ttft_fit(self, pool: str) -> tuple[float, float] | None:
        """The pool's first-token fit (seconds, seconds per prompt token),
        service/pace.py; None without enough measured first tokens."""
        state = self._pools.get(pool)
        return None if state is None else state.pace.fit()

    def observe_ttft(self, pool: str, prompt: int, measured_ns: int) -> None:
        """A request released to ``pool`` got its first token
        ``measured_ns`` after its release."""
        state = self._pools.get(pool)
        if state is not None:
            state.pace.observe_ttft(prompt, measured_ns)

    def ttft_samples(self, pool: str) -> int:
        """First tokens measured in ``pool`` (what the first-token fit has seen)."""
        state = self._pools.get(pool)
        return 0 if state is None else state.pace.ttft_samples

    def inflight(self, pool: str) -> int:
        state = self._pools.get(pool)
        return 0 if state is None else state.inflight
