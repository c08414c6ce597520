"""The dispatcher: requests that wait, and the only place that releases them.

A request whose refusal waiting can cure (its bucket refills, a concurrency
slot frees, the global watermark drains, its pool's load drops) joins a
bounded queue instead of being refused. ``dispatch`` tries the waiting
requests in fair order (``WaitQueues``: lanes by weighted fair queueing over
tokens, tenants inside a lane by virtual token counters) and admits each one
the decider now admits.

Why a queue head cannot go is remembered (``_block``) and forgotten by the
event that can change it: time (a refill), a settlement (a slot, in-flight
tokens), a load report (its pool), new config (everything). So a dispatch
costs nothing for heads that are still blocked.

The façade calls ``dispatch`` after anything that may free capacity; nothing
else does (parts that free capacity return, and the façade dispatches).
"""

from __future__ import annotations

from controlplane.domain import AdmitDecision
from controlplane.domain.units import NS_PER_MS
from controlplane.service import records as R
from controlplane.service.answers import Outcomes
from controlplane.service.deadlines import Deadlines
from controlplane.service.decider import WAITABLE, Decider
from controlplane.service.gate import PoolGate
from controlplane.service.queueing import Waiter, WaitQueues
from controlplane.service.records import Key, Record
from controlplane.service.stats import AdmissionStats
from controlplane.service.tenants import Tenant, TenantDirectory
from fastpath import Reason

# A waiting call is answered ahead of its gRPC deadline, so the answer can
# still reach the caller: a tenth of the time left, between these bounds.
DEADLINE_MARGIN_MIN_NS = 5 * NS_PER_MS
DEADLINE_MARGIN_MAX_NS = 100 * NS_PER_MS


class Dispatcher:
    def __init__(
        self,
        *,
        tenants: TenantDirectory,
        decider: Decider,
        outcomes: Outcomes,
        stats: AdmissionStats,
        gate: PoolGate,
        queues: WaitQueues,
        deadlines: Deadlines,
    ) -> None:
        self.queues = queues
        # When waiting requests are due, and whether they can still make it.
        self.deadlines = deadlines
        self._tenants = tenants
        self._gate = gate
        # Lanes served before all others while the pool gate is on (the
        # fail-open lanes: premium waits first in line, never behind the rest).
        self._first_lanes: frozenset[int] = frozenset()
        self._decider = decider
        self._outcomes = outcomes
        self._stats = stats
        # Why queue heads cannot go now (see _block).
        self._blocked_until: dict[int, int] = {}  # slot -> refill time
        self._concurrency_blocked: set[int] = set()
        self._shed_blocked: dict[tuple[int, int], str] = {}  # (lane, slot) -> pool
        self._watermark_blocked = False
        # Pools whose gate has held back a waiter since their backlog last
        # emptied: releases to them are the engines' pace (service/pace.py).
        self._gated_pools: set[str] = set()
        self._now = 0

    # ---------------------------------------------------------------- events

    def configured(self) -> None:
        """New lanes, limits or policy: every head may go again."""
        self.queues.set_lanes(self._tenants.by_priority)
        lanes = self._tenants.by_priority
        self._first_lanes = frozenset(
            self.queues.lane_index(lane.name) for lane in lanes if lane.fail_open
        )
        self._blocked_until.clear()
        self._concurrency_blocked.clear()
        self._shed_blocked.clear()
        self._watermark_blocked = False
        self.deadlines.configured()

    def slot_freed(self, slot: int) -> None:
        """A reservation of ``slot`` ended: its concurrency and the shared
        in-flight tokens may have room."""
        self._concurrency_blocked.discard(slot)
        self._watermark_blocked = False

    def reservation_ended(self, rec: Record, now: int) -> None:
        """A reservation ended (settled, expired, cancelled, forgotten): its
        tenant's slot, the shared in-flight tokens and its pool's gate may
        have room. The caller dispatches."""
        self.slot_freed(rec[R.SLOT])
        pool = rec[R.POOL]
        if pool and self._gate.enabled:
            self._gate.completed(pool, now)
            self.pool_reported(pool)

    def pool_reported(self, pool: str) -> None:
        """Lanes held back by this pool's backpressure may go now."""
        if self._shed_blocked:
            for k in [k for k, p in self._shed_blocked.items() if p == pool]:
                del self._shed_blocked[k]

    def admitted(self, lane: str, slot: int, reserved: int) -> None:
        """Count service for the fair order: an admission's reserved tokens."""
        self.queues.charge(self.queues.lane_index(lane), slot, reserved)

    # ------------------------------------------------------------- waiting

    def competes(self, slot: int) -> bool:
        """Whether a new request of ``slot`` must join the backlog rather
        than be decided directly: its own tenant's requests wait (per-tenant
        FIFO), or requests wait for capacity it would take (the watermark, a
        shed lane). Waiters blocked only on their own tenant's limits are not
        passed over by another tenant's request: it takes nothing of theirs."""
        q = self.queues
        return bool(
            q.total and (q.per_tenant.get(slot) or self._watermark_blocked or self._shed_blocked)
        )

    def max_wait_ns(
        self, entry: Tenant, lane: str, now: int, deadline_ns: int | None,
        bound_ns: int | None = None, release_by: int = 0,
    ) -> int:  # fmt: skip
        """How long a request may wait: until its latest release that can
        still meet its deadline (``release_by``, with the pool gate; else the
        lane's wait target), the tenant's max wait, the caller's own
        deadline (less a margin) and its own bound on the wait
        (``bound_ns``, no margin: AdmitBatch.max_wait_ms), whichever is
        earliest."""
        if release_by:
            wait = release_by - now
        else:
            wait = self._tenants.lanes[lane].wait_target_ms * NS_PER_MS
        if entry.config.max_wait_ms is not None:
            wait = min(wait, entry.config.max_wait_ms * NS_PER_MS)
        if deadline_ns is not None:
            left = deadline_ns - now
            margin = min(max(left // 10, DEADLINE_MARGIN_MIN_NS), DEADLINE_MARGIN_MAX_NS)
            wait = min(wait, left - margin)
        if bound_ns is not None:
            wait = min(wait, bound_ns)
        return wait

    def enqueue(
        self,
        key: Key,
        entry: Tenant,
        lane: str,
        prompt: int,
        max_tokens: int,
        model: str,
        pool: str,
        now: int,
        deadline: int,
        first_try: Record | None = None,
        due: int = 0,
        slo: int = 0,
        retry_key: str = "",
    ) -> AdmitDecision | Waiter:
        """Queue a request until ``deadline`` (or answer at once when the
        queues are full), then dispatch; ``first_try`` is the refusal it just
        got, if it was tried."""
        q = self.queues
        lanes = self._tenants.lanes
        policy = self._tenants.policy
        lane_cfg = lanes[lane]
        lane_idx = q.lane_index(lane)
        lane_limit = (
            lane_cfg.max_queued if lane_cfg.max_queued is not None else policy.lane_queue_limit
        )
        tenant_limit = (
            entry.config.max_queued
            if entry.config.max_queued is not None
            else policy.tenant_queue_limit
        )
        if (
            q.total >= policy.queue_limit
            or q.per_lane[lane_idx] >= lane_limit
            or q.per_tenant.get(entry.slot, 0) >= tenant_limit
        ):
            if first_try is None:
                # Full queues only refuse what would have to wait: a request
                # that fits now is admitted (nobody it passes could use it).
                rec = self._decider.decide(entry, lane, prompt, max_tokens, model, pool, now, now)
                if rec[R.STATE] == R.OPEN:
                    self.admitted(lane, entry.slot, rec[R.RESERVED])
                if rec[R.STATE] == R.OPEN:
                    return self._outcomes.record(key, rec)
                if not self.waitable(rec):
                    return self._refused(key, rec, entry.slot, pool, prompt, now, due, slo,
                                         retry_key)  # fmt: skip
            retry = lane_cfg.wait_target_ms * NS_PER_MS
            rec = R.refused(Reason.QUEUE_FULL, retry, lane, entry.slot, now, now)
            return self._refused(key, rec, entry.slot, pool, prompt, now, due, slo, retry_key)
        w = Waiter(key, entry.slot, lane, lane_idx, prompt, max_tokens, model, pool, now, deadline,
                   q.next_seq())  # fmt: skip
        w.due_ns, w.slo_ns, w.retry_key = due, slo, retry_key
        # its wait ends before its latest release for its deadline: bounded
        # by the tenant's max wait or the caller (deadline, max_wait_ms)
        w.bounded = not due or deadline < self.deadlines.release_by_ns(due, slo, pool, prompt)
        w.order = self._order(w, max_tokens)
        q.add(w)
        try:
            if first_try is not None:
                self._block(w, first_try, now)
            self.dispatch(now)
        except BaseException:
            # The call fails; its waiter must not stay behind in the queue.
            if not w.done:
                q.remove(w)
            raise
        if w.done:
            assert isinstance(w.result, AdmitDecision)
            return w.result
        return w

    def _emptied(self, pool: str, now: int) -> None:
        """Nothing waits for ``pool`` any more: its pace's stretch ends."""
        self._gated_pools.discard(pool)
        self._gate.idle(pool, now)

    def _refused(
        self, key: Key, rec: Record, slot: int, pool: str, prompt: int, now: int, due: int,
        slo: int, retry_key: str,
    ) -> AdmitDecision:  # fmt: skip
        """Answer a refusal of a request that never waited: remembered for
        its retries and flagged late when a retry could not make its
        deadline (service/deadlines.py)."""
        if due:
            self.deadlines.retries.refused(slot, retry_key, due - slo, now)
            rec = self.deadlines.late_if_past(rec, due, slo, pool, prompt, now)
        return self._outcomes.record(key, rec)

    @staticmethod
    def waitable(rec: Record) -> bool:
        """A refusal that waiting can cure (a shed request, not one above the
        hard backpressure threshold)."""
        reason = rec[R.REASON]
        if rec[R.SHED] & R.LATE_BIT:
            return False  # it can no longer meet its deadline: waiting cannot help
        if reason == Reason.BACKPRESSURE:
            return bool(rec[R.SHED] & R.SHED_BIT)
        return reason in WAITABLE

    @staticmethod
    def _order(w: Waiter, max_tokens: int) -> int:
        """Where a waiter goes in its tenant's queue: cheapest first, by its
        prompt and output tokens (what it costs the engines), ties in
        arrival order. Measured against FIFO, FIFO with aging and newest
        first, on the shared trace and the synthetic ones, cheapest first
        met the most SLOs in every lane (docs/gate.md). Nothing starves
        unseen: a request that waits until it can no longer meet its
        deadline is refused then (flagged late), and without a deadline its
        wait is bounded by its lane's wait target."""
        return w.prompt + max_tokens

    def remove(self, w: Waiter) -> None:
        """The caller went away: leave the queue (nothing is remembered)."""
        self.queues.remove(w)

    # ------------------------------------------------------------ dispatch

    def _block(self, w: Waiter, rec: Record, now: int) -> None:
        """Remember why the head of a tenant's queue could not go, so the
        dispatcher skips it until that changes."""
        reason = rec[R.REASON]
        if reason == Reason.TOKEN_RATE:
            # at least 1 ns, so the head is really skipped until later
            self._blocked_until[w.slot] = now + max(rec[R.RETRY_NS], 1)
        elif reason == Reason.CONCURRENCY:
            self._concurrency_blocked.add(w.slot)
        elif reason == Reason.GLOBAL_WATERMARK:
            self._watermark_blocked = True
        elif reason == Reason.BACKPRESSURE:
            self._shed_blocked[(w.lane_idx, w.slot)] = w.pool
            self._gated_pools.add(w.pool)
            self._gate.held(w.pool, now)

    def _eligible(self, w: Waiter) -> bool:
        slot = w.slot
        return (
            self._blocked_until.get(slot, 0) <= self._now
            and slot not in self._concurrency_blocked
            and (w.lane_idx, slot) not in self._shed_blocked
        )

    def _eligible_first(self, w: Waiter) -> bool:
        return w.lane_idx in self._first_lanes and self._eligible(w)

    def _pick(self) -> Waiter | None:
        q = self.queues
        if self._gate.enabled and self._first_lanes:
            w = q.pick(self._eligible_first)
            if w is not None:
                return w
        return q.pick(self._eligible)

    def _resolve(self, w: Waiter, rec: Record) -> None:
        self.queues.remove(w)
        if w.pool not in self.queues.pool_waiting:
            self._emptied(w.pool, rec[R.DECIDED_NS])
        if w.due_ns and rec[R.STATE] != R.OPEN:
            decided = rec[R.DECIDED_NS]
            self.deadlines.retries.refused(w.slot, w.retry_key, w.due_ns - w.slo_ns, decided)
            rec = self.deadlines.late_if_past(rec, w.due_ns, w.slo_ns, w.pool, w.prompt, decided)
        self._stats.observe_wait(w.lane, rec[R.DECIDED_NS] - w.arrived_ns)
        if w.uncounted and rec[R.STATE] == R.OPEN:  # held for its tenant's limits
            self._stats.demand.add(w.pool, rec[R.DECIDED_NS], w.prompt)
        w.result = self._outcomes.record(w.key, rec)
        if w.on_done is not None:
            w.on_done(w.result)

    def dispatch(self, now: int) -> None:
        """Admit waiting requests in fair order while capacity allows."""
        q = self.queues
        if not q.total or self._watermark_blocked:
            return
        self._now = now
        by_slot = self._tenants.by_slot
        while True:
            w = self._pick()
            if w is None:
                return
            entry = by_slot[w.slot]
            if entry.deleted or not entry.config.enabled:
                reason = Reason.UNKNOWN_TENANT if entry.deleted else Reason.TENANT_DISABLED
                self._resolve(w, R.refused(reason, 0, w.lane, w.slot, now, w.arrived_ns))
                continue
            rec = self._decider.decide(
                entry, w.lane, w.prompt, w.max_tokens, w.model, w.pool, now, w.arrived_ns
            )
            if rec[R.STATE] == R.OPEN:
                self.admitted(w.lane, w.slot, rec[R.RESERVED])
                if w.pool in self._gated_pools:
                    # the pool held its backlog back: its releases are its pace
                    self._gate.paced(w.pool, now, w.prompt)
                self._resolve(w, rec)
            elif not self.waitable(rec) or (
                rec[R.REASON] == Reason.TOKEN_RATE and now + rec[R.RETRY_NS] > w.deadline_ns
            ):
                self._resolve(w, rec)
            else:
                self._block(w, rec, now)
                if rec[R.REASON] == Reason.GLOBAL_WATERMARK:
                    # Nobody goes before the head of the fair order: a large
                    # request is not starved by smaller ones slipping past.
                    return

    def _still_due(self, w: Waiter) -> int:
        """A waiter whose wait ended at its latest release for its deadline,
        as predicted when it was queued, may wait on when the pool's pace
        now predicts a later one (and nothing else bounds its wait)."""
        if not w.due_ns or w.bounded:
            return 0
        return self.deadlines.release_by_ns(w.due_ns, w.slo_ns, w.pool, w.prompt)

    def expire(self, now: int) -> None:
        """Answer waiters whose wait ended with QUEUE_TIMEOUT: flagged late
        (not retryable) when it ended at their latest release for their
        deadline; ``retry_after`` when what held them may let a request
        like them through (a fresh one, for a late refusal)."""
        deadlines = self.deadlines
        for w in self.queues.expired(now, self._still_due):
            if w.pool not in self.queues.pool_waiting:
                self._emptied(w.pool, now)
            late = bool(w.due_ns) and (
                not w.bounded
                or now >= deadlines.release_by_ns(w.due_ns, w.slo_ns, w.pool, w.prompt)
            )
            if w.due_ns:  # a retry of it is judged against the same deadline
                deadlines.retries.refused(w.slot, w.retry_key, w.due_ns - w.slo_ns, now)
            blocked = self._blocked_until.get(w.slot, 0) - now
            held = (w.lane_idx, w.slot) in self._shed_blocked and self._gate.enabled
            if late and held:  # when the pool takes a fresh request like it in time
                rec = deadlines.late_refusal(
                    Reason.QUEUE_TIMEOUT, w.lane, w.slot, w.pool, w.prompt, w.slo_ns, now,
                    w.arrived_ns,
                )  # fmt: skip
            else:
                if blocked > 0:  # its bucket refills then
                    retry = blocked
                elif held:
                    retry = self._gate.retry_ns(w.pool, now)  # when its pool takes more
                else:
                    retry = self._tenants.lanes[w.lane].wait_target_ms * NS_PER_MS
                # the answer reports the pool as it is now (it may have
                # reported while the request waited), like any other decision
                v = self._decider.verdict(w.lane, w.pool, now)
                rec = R.refused(Reason.QUEUE_TIMEOUT, retry, w.lane, w.slot, now, w.arrived_ns,
                                score_ppm=v.score_ppm, freshness=v.freshness,
                                shed=R.LATE_BIT if late else 0)  # fmt: skip
            self._stats.observe_wait(w.lane, now - w.arrived_ns)
            w.done = True
            w.result = self._outcomes.record(w.key, rec)
            if w.on_done is not None:
                w.on_done(w.result)

    def next_wakeup_ns(self, now: int) -> int | None:
        """When time alone may change something for the waiters: the next
        deadline, or the next refill of a tenant whose queue head waits."""
        q = self.queues
        if not q.total:
            return None
        # only future refills: a passed one is either dispatched already or
        # the head is blocked for another reason, which time does not cure
        times = [t for slot, t in self._blocked_until.items() if t > now and slot in q.per_tenant]
        deadline = q.next_deadline()
        if deadline is not None:
            times.append(deadline)
        return min(times) if times else None
