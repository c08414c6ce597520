"""The admission service: the public, in-process API of the decision plane.

Everything runs on one thread (the server's event loop) and touches only
memory; the database is read at start and on config changes, off this path,
and handed over through ``apply_config``. Time comes from the injected
``clock`` (wall-clock nanoseconds: quota windows are UTC hours and days), so
the gRPC adapter, the simulator, replays, benchmarks and tests all drive the
same code with real or simulated time.

The API (all times in the clock's nanoseconds):

- ``apply_config(tenants, lanes, policy)``: install a whole config, live.
- ``admit(...)``: decide one request now, never wait.
- ``admit_or_wait(..., deadline_ns=)``: decide, or queue the request when
  only waiting stands between it and admission. Returns an ``AdmitDecision``
  or a ``Waiter``; the waiter's ``on_done`` callback (set by the caller) is
  called once with the final decision, from within whichever later call
  releases or times it out.
- ``tick()``: time passed; answer waiters past their deadline and dispatch.
  Call it at ``next_wakeup_ns()`` (None = nothing waits on time).
- ``cancel(waiter)``: the caller went away.
- ``admit_batch(...)``: decide a whole AdmitStream batch now (never waits).
- ``complete(...)``, or ``prepare_complete`` + ``apply_complete`` around a
  durable ledger write: settle with real usage and refund.
- ``report_load(...)``: an engine's load report, in vLLM's terms
  (``queue_capacity`` 0 = unbounded; ``kv_cache_miss_rate`` None = not
  measured; keywords ``requests_running``, ``max_num_seqs``,
  ``kv_cache_usage``). It rescores the pool and may release held requests.
- ``expire()``: release reservations past their TTL (call periodically).
- Several replicas (docs/ha.md): ``restore_reservation(r)``, an open
  reservation another replica admitted, re-announced by its sidecar
  (restore.py); ``hold_pools(pools, seconds)``, the pool gate's takeover
  hold; ``reannounce_pool(r)``, the pool a re-announced reservation
  belongs to, changing nothing.
- ``prepare_gc_freeze()``: right before a process-wide ``gc.freeze()``.
- Read-only: ``tenant_ids``, ``tenant_ids_by_slot``, ``tenant_state``, ``tenant_queued``,
  ``queue_depths``, ``waiting``, ``pool_views``, ``pools``, ``lanes``,
  ``open_reservations``, ``remembered_requests``, ``inflight_tokens``, and
  the counters in ``stats``.

It is a façade over parts with one job each: ``TenantDirectory`` (config),
``PressureGate`` (load reports, backpressure), ``PoolGate`` (release only
while the pool has room; on by default), ``Decider`` (one decision
assembly for single requests and batches), ``Dispatcher`` (queues; the only
part that releases waiting requests), ``Settler`` (settlement and expiry),
``Outcomes`` (records and answers) and ``AdmissionStats``. Only the façade
and the dispatcher start a dispatch: a part that frees capacity returns what
it freed and the façade calls the dispatcher.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from controlplane.domain import (
    AdmitDecision,
    Decision,
    LaneConfig,
    LoadSample,
    Settlement,
    TenantConfig,
)
from controlplane.domain.autoscaler import engines_for
from controlplane.domain.errors import AlreadyExists, DomainError, excerpt
from controlplane.domain.policy import Policy
from controlplane.domain.scope import KeyScope
from controlplane.domain.units import NS_PER_MS, NS_PER_S
from controlplane.domain.validate import check_id
from controlplane.service import records as R
from controlplane.service.answers import BatchResult, Outcomes
from controlplane.service.deadlines import Deadlines
from controlplane.service.decider import Decider, early_reason
from controlplane.service.demand import (
    DESIRED_WINDOW_S,
    LaneBacklog,
    PoolDemand,
    counts_as_demand,
)
from controlplane.service.dispatcher import Dispatcher
from controlplane.service.edge import (
    check_admit,
    check_batch,
    check_max_wait,
    check_retries,
    check_retry,
)
from controlplane.service.gate import PoolGate
from controlplane.service.keyscope import check_scope
from controlplane.service.limits import TenantLimits
from controlplane.service.limits import describe as describe_limits
from controlplane.service.offline import Booking
from controlplane.service.pressure import (
    PressureGate,
    eviction_advice,
    load_sample,
)
from controlplane.service.pricing import FlatPricing, Pricing
from controlplane.service.queueing import Waiter, WaitQueues
from controlplane.service.records import Key, Record, RequestLog
from controlplane.service.restore import OpenReservation, Restore, Restorer
from controlplane.service.settlement import Settler
from controlplane.service.sharing import ShareControl
from controlplane.service.signing import AdmissionSigner
from controlplane.service.stats import QUEUE_WAIT_BUCKETS_NS, AdmissionStats
from controlplane.service.tenants import Tenant, TenantDirectory
from controlplane.settings import Settings
from fastpath import IMPLEMENTATION, Reason, TokenBucketTable

__all__ = ["QUEUE_WAIT_BUCKETS_NS", "AdmissionService", "BatchResult"]

_TOKEN_RATE = int(Reason.TOKEN_RATE)
_BACKPRESSURE = int(Reason.BACKPRESSURE)


class AdmissionService:
    """Per-request admission over an in-memory token-bucket table.

    ``pricing`` quotes the multiplier locked into each admission (the
    metering package's pricing windows; flat 1.0 when not given)."""

    implementation = IMPLEMENTATION

    def __init__(
        self,
        settings: Settings,
        clock: Callable[[], int] = time.time_ns,
        pricing: Pricing | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self._pricing: Pricing = pricing if pricing is not None else FlatPricing()
        self._table = TokenBucketTable()
        # Memory protection: every open reservation is remembered until settled or
        # expired, so their number is capped (refused OPEN_RESERVATIONS beyond).
        self._table.set_open_limits(
            settings.max_open_reservations, settings.max_open_reservations_per_tenant
        )
        self._log = RequestLog(
            ttl_ns=int(settings.reservation_ttl_s * NS_PER_S),
            replay_ns=int(settings.rejection_replay_s * NS_PER_S),
            settled_ns=int(settings.settled_id_window_s * NS_PER_S),
        )
        self.stats = AdmissionStats()
        self._tenants = TenantDirectory(self._table, settings.policy, settings.default_tenant)
        stale_ns = int(settings.load_report_stale_s * NS_PER_S)
        self._pressure = PressureGate(stale_ns=stale_ns)
        self._gate = PoolGate(stale_ns=stale_ns)
        queues = WaitQueues()
        self._deadlines = Deadlines(
            self._tenants, self._gate, self._pressure, queues, settings.retry_memory
        )
        # Signs every admission so that Reannounce restores only what this
        # deployment issued (signing.py); the server installs the
        # deployment's keys (store/signing.py) before serving.
        self.signer = AdmissionSigner()
        # ``BURSTGATE_LEDGER_UNPRICED=refuse``: the server sets this to the
        # ledger's price check (metering.check_priced), so an Admit for a
        # (tenant, model) the catalog cannot price is refused before anything
        # is reserved: no work is done that would be billed 0 (issue 30 item 5).
        self.price_check: Callable[[str, str], None] | None = None
        self._decider = Decider(
            self._table, self._tenants, self._pressure, self._gate, self._pricing,
            settings.concurrency_retry_ms * NS_PER_MS, self._deadlines, self.signer,
            first_reservation=max(1, clock() // 1000),  # microseconds: see Decider
        )  # fmt: skip
        self._outcomes = Outcomes(self._log, self.stats, self._tenants, self.signer)
        self._dispatcher = Dispatcher(
            self._tenants, self._decider, self._outcomes, self.stats, self._gate, queues,
            self._deadlines,
        )  # fmt: skip
        self._settler = Settler(self._table, self._log, settings.complete_max_overrun_ratio)
        # Several replicas deciding for one tenant: controlplane/ha/grants.py
        # drives this (service/shares.py); unused in process and on SQLite.
        self.shares = ShareControl(
            self._tenants, self._decider, self._dispatcher.queues, self.stats, self._table,
            clock, self._dispatcher.dispatch,
        )  # fmt: skip
        self._offline = Booking(
            self._tenants, self._log, self._dispatcher, self._decider, self._outcomes, self.stats,
            settings.complete_max_overrun_ratio,
        )  # fmt: skip
        self._restorer = Restorer(
            self._tenants, self._log, self._dispatcher, self._decider, self._gate, self.stats,
            int(settings.reservation_ttl_s * NS_PER_S), self.signer,
        )  # fmt: skip

    # ------------------------------------------------------------------ config

    def apply_config(
        self,
        tenants: Sequence[TenantConfig],
        lanes: Sequence[LaneConfig],
        policy: Policy | None = None,
    ) -> None:
        """Install a full config (``policy`` None = the settings' policy).
        Buckets of tenants that stay keep their level and counters (the fast
        path re-limits them to the new burst); tenants that disappear stop
        being admitted but their open reservations can still be settled."""
        now = self.clock()
        policy = policy if policy is not None else self.settings.policy
        directory = self._tenants
        directory.install(tenants, lanes, policy, now)
        self._table.set_global_inflight_limit(policy.global_inflight_tokens)
        self._table.set_bucket_debt(policy.bucket_debt)
        self._pressure.configure(directory.by_priority, policy, now)
        self._gate.configure(policy, [ln.name for ln in directory.by_priority if ln.fail_open])
        self._dispatcher.configured()
        self._dispatcher.dispatch(now)

    @property
    def policy(self) -> Policy:
        return self._tenants.policy

    @property
    def pricing(self) -> Pricing:
        return self._pricing

    def restore_usage(self, hour_tokens: dict[str, int], day_tokens: dict[str, int]) -> int:
        """Add tokens already used in the current UTC hour and day (from the
        ledger, at start) to the tenants' quota counters; returns how many
        tenants were restored. Unknown tenant ids are ignored."""
        return self._tenants.restore_usage(hour_tokens, day_tokens, self.clock())

    @property
    def lanes(self) -> dict[str, LaneConfig]:
        return dict(self._tenants.lanes)

    def tenant_ids(self) -> list[str]:
        return self._tenants.ids()

    def tenant_ids_by_slot(self) -> list[str]:
        """Every tenant id ever configured, by fast-path slot (the keys of
        ``stats``; deleted tenants included: a slot is never reused)."""
        return [entry.config.tenant_id for entry in list(self._tenants.by_slot)]

    def tenant_state(self, tenant_id: str) -> dict[str, int]:
        """The tenant's bucket, quotas and in-flight counts, refilled to now
        (under shares: its whole limits and tenant-wide quota use,
        ``TenantDirectory.reported_state``)."""
        return self._tenants.reported_state(tenant_id, self.clock())

    def tenant_limits(self, tenant_id: str) -> TenantLimits:
        """The tenant's limits and their state now (GetLimits); NotFound
        for a tenant that is not configured."""
        check_id("tenant_id", tenant_id)
        now = self.clock()
        return describe_limits(tenant_id, self._tenants.reported_state(tenant_id, now), now)

    def check_only(self, tenant_id: str) -> tuple[int, int, TenantLimits | None]:
        """A check that spends nothing (Envoy's ``hits_addend`` 0): the
        refusal the tenant alone would give a request now - unknown or
        disabled, an empty bucket, a used-up quota - as (reason,
        retry_after_ns, the limits of the tenant charged: the default tenant
        for an unknown id when configured); nothing changes. Concurrency and
        the pools' backpressure are for requests that reserve."""
        check_id("tenant_id", tenant_id)
        entry = self._tenants.resolve(tenant_id)
        early = early_reason(entry)
        if entry is None:
            return early, 0, None
        now = self.clock()
        charged = entry.config.tenant_id
        t = describe_limits(charged, self._tenants.reported_state(charged, now), now)
        if early:
            return early, 0, t
        if t.bucket_tokens <= 0:  # refills to one token after:
            need_ns = -(-(1 - t.bucket_tokens) * NS_PER_S * 1000 // int(t.token_rate * 1000))
            return int(Reason.TOKEN_RATE), need_ns, t
        if t.hourly_remaining == 0:
            return int(Reason.HOURLY_QUOTA), t.hour_resets_in_ms * NS_PER_MS, t
        if t.daily_remaining == 0:
            return int(Reason.DAILY_QUOTA), t.day_resets_in_ms * NS_PER_MS, t
        return 0, 0, t

    def fallback_model(self, tenant_id: str) -> str:
        """The model a degraded request of ``tenant_id`` is routed to ("" = none)."""
        return self._tenants.fallback_model(tenant_id)

    def inflight_tokens(self) -> int:
        """All tenants' reserved, unsettled tokens (the global watermark's measure)."""
        return int(self._table.total_inflight_tokens())

    # ------------------------------------------------------------------- admit

    def admit(
        self,
        tenant_id: str,
        request_id: str,
        lane: str,
        prompt_tokens: int,
        max_tokens: int,
        model: str = "",
        pool: str = "",
    ) -> AdmitDecision:
        """Decide now; never wait (waitable refusals are answered as refusals)."""
        out = self.admit_or_wait(
            tenant_id, request_id, lane, prompt_tokens, max_tokens, model, pool, wait=False
        )
        assert isinstance(out, AdmitDecision)
        return out

    def admit_or_wait(
        self,
        tenant_id: str,
        request_id: str,
        lane: str,
        prompt_tokens: int,
        max_tokens: int,
        model: str = "",
        pool: str = "",
        *,
        wait: bool = True,
        deadline_ns: int | None = None,
        wait_bound_ns: int | None = None,
        scope: KeyScope | None = None,
        retry_key: str = "",
        attempt: int = 0,
    ) -> AdmitDecision | Waiter:
        """Decide, or queue the request when only waiting stands between it
        and admission. A returned ``Waiter`` is resolved later through its
        ``on_done`` callback (or ``result`` when already decided).

        ``deadline_ns`` is the caller's own deadline (the gRPC deadline), on
        the service clock, the answer due a margin before it;
        ``wait_bound_ns`` the caller's own bound on the wait, no margin
        (AdmitBatch.max_wait_ms); the wait also ends at the lane's bound (with the
        pool gate, (1 - gate_release_headroom) x the lane's TTFT SLO, else
        its wait target) and the tenant's max wait, whichever is earliest.
        ``pool`` "" = the tenant's, else the lane's configured pool, else
        the default pool (``TenantDirectory.pool_for``).

        ``scope``: a scoped sidecar key's (the caller checked ``tenant_id``);
        the pool the request goes to, as resolved here, and the tenant it
        would be charged to (the default tenant for an unknown id) must be
        in it, else PermissionDenied and nothing changes.

        ``retry_key``: what stays the same across a request's retries (the
        client's idempotency key, the sidecar's digest of the request; ""
        = its ``request_id``); ``attempt``: 0 for a first attempt, the
        retries counted from 1 (the openai client's x-stainless-retry-count).
        A retry (``attempt`` > 0, or a request id seen before) whose earlier
        attempt under the same key was refused is due at that attempt's
        first arrival plus its lane's TTFT SLO, and is refused at once,
        flagged late, when it can no longer make it (service/retries.py)."""
        check_admit(tenant_id, request_id, prompt_tokens, max_tokens, model, pool, lane)
        check_retry(retry_key, attempt)
        self._tenants.check_pool(pool)
        if self.price_check is not None:
            self.price_check(tenant_id, model)
        now = self.clock()
        key = (tenant_id, request_id)
        prior = self._log.replay(key, now)
        if prior is not None:
            if scope is not None:  # an answer from another key's pool stays there
                scope.check_pool("pool", prior[R.POOL], "the pool this request was admitted to")
            return self._outcomes.answer(key, prior, duplicate=True)
        dispatcher = self._dispatcher
        if key in dispatcher.queues.by_key:
            raise AlreadyExists(f"request_id: {excerpt(request_id)} is already waiting in a queue")
        tenants = self._tenants
        entry = tenants.resolve(tenant_id)
        lane = tenants.lane_for("lane", lane, entry)
        early = early_reason(entry)
        if entry is None or early:
            slot = -1 if entry is None else entry.slot
            return self._outcomes.record(key, R.refused(early, 0, lane, slot, now, now))
        # When its first token is due: its first arrival plus the SLO of the
        # lane it asked for (placement below moves where it runs, not that).
        deadlines = self._deadlines
        slo = deadlines.slo_ns(lane)
        # a first attempt under a key of its own starts a new deadline
        retried = attempt > 0 or not retry_key
        retry_key = retry_key or request_id
        first = deadlines.retries.first(entry.slot, retry_key, now) if slo and retried else None
        due = (now if first is None else first) + slo if slo else 0
        lane = tenants.place(entry, lane, prompt_tokens, max_tokens)
        pool = tenants.pool_for(entry, lane, pool)  # after placement: the final lane's pool
        if scope is not None:
            check_scope(scope, tenant_id, entry, pool, "this request's")
        release_by = deadlines.release_by_ns(due, slo, pool, prompt_tokens) if due else 0
        if first is not None and now > release_by:
            # a retry of a request that can no longer meet its deadline:
            # engine time for it would be spent on work that has missed
            return self._late(key, entry, lane, pool, prompt_tokens, slo, now, retry_key, first)
        max_wait = (
            dispatcher.max_wait_ns(entry, lane, now, deadline_ns, wait_bound_ns, release_by)
            if wait
            else 0
        )
        # What users asked of the pool (service/demand.py): counted once, at
        # a request's first decision; a recognised retry is not asked again.
        fresh = first is None
        if max_wait > 0 and dispatcher.competes(entry.slot):
            # Join the backlog so the fair order decides who goes first; the
            # dispatch right after admits it at once if it can.
            if deadlines.hopeless(pool, lane, now, release_by):
                out: AdmitDecision | Waiter = self._late(
                    key, entry, lane, pool, prompt_tokens, slo, now, retry_key, due - slo
                )
                return self._asked(out, pool, prompt_tokens, now, fresh)
            out = dispatcher.enqueue(key, entry, lane, prompt_tokens, max_tokens, model, pool,
                                     now, now + max_wait, due=due, slo=slo,
                                     retry_key=retry_key)  # fmt: skip
            return self._asked(out, pool, prompt_tokens, now, fresh)
        rec = self._decider.decide(entry, lane, prompt_tokens, max_tokens, model, pool, now, now)
        if rec[R.STATE] == R.OPEN:
            dispatcher.admitted(lane, entry.slot, rec[R.RESERVED])
            return self._asked(self._outcomes.record(key, rec), pool, prompt_tokens, now, fresh)
        if (
            due
            and wait
            and rec[R.REASON] == _BACKPRESSURE
            and dispatcher.waitable(rec)
            and (release_by <= now or deadlines.hopeless(pool, lane, now, release_by))
        ):
            # Held by the pool, and it cannot be released in time for its
            # deadline: refused now, flagged late (a retry cannot help).
            out = self._late(key, entry, lane, pool, prompt_tokens, slo, now, retry_key,
                             due - slo)  # fmt: skip
            return self._asked(out, pool, prompt_tokens, now, fresh)
        if (
            max_wait <= 0
            or not dispatcher.waitable(rec)
            or (rec[R.REASON] == _TOKEN_RATE and rec[R.RETRY_NS] > max_wait)
        ):
            # Refused for good, or the bucket cannot refill before the wait
            # would end: answer now.
            if due:
                deadlines.retries.refused(entry.slot, retry_key, due - slo, now)
                rec = deadlines.late_if_past(rec, due, slo, pool, prompt_tokens, now)
            return self._asked(self._outcomes.record(key, rec), pool, prompt_tokens, now, fresh)
        out = dispatcher.enqueue(key, entry, lane, prompt_tokens, max_tokens, model, pool, now,
                                 now + max_wait, first_try=rec, due=due, slo=slo,
                                 retry_key=retry_key)  # fmt: skip
        # held for its tenant's own limits (its bucket, concurrency): demand
        # only once admitted
        own = not counts_as_demand(rec[R.REASON])
        return self._asked(out, pool, prompt_tokens, now, fresh, tenant_held=own)

    def _asked(
        self, out: AdmitDecision | Waiter, pool: str, prompt: int, now: int, fresh: bool,
        tenant_held: bool = False,
    ) -> AdmitDecision | Waiter:  # fmt: skip
        """Count a request's first decision as demand on ``pool`` when it
        is (service/demand.py): admitted, held, or refused for capacity;
        ``fresh`` false: a recognised retry, counted at its first attempt.
        ``tenant_held``: a held request's wait is for its tenant's own
        limits, counted only when admitted (Dispatcher._resolve)."""
        if not fresh:
            return out
        if isinstance(out, Waiter):
            if tenant_held:
                out.uncounted = True
            else:
                self.stats.demand.add(pool, now, prompt)
        elif counts_as_demand(int(out.reason)):
            self.stats.demand.add(pool, now, prompt)
        return out

    def _late(
        self, key: Key, entry: Tenant, lane: str, pool: str, prompt: int, slo: int, now: int,
        retry_key: str, first: int,
    ) -> AdmitDecision:  # fmt: skip
        """Refuse a request that cannot meet its deadline (BACKPRESSURE,
        flagged late), remembering its first arrival for its retries."""
        deadlines = self._deadlines
        deadlines.retries.refused(entry.slot, retry_key, first, now)
        rec = deadlines.late_refusal(
            int(Reason.BACKPRESSURE), lane, entry.slot, pool, prompt, slo, now, now
        )
        return self._outcomes.record(key, rec)

    def tick(self) -> None:
        """Time passed: time out waiters past their deadline, then dispatch.
        The asyncio layer calls this at ``next_wakeup_ns()``."""
        now = self.clock()
        for pool in self._gate.end_holds(now):  # a takeover hold ran out
            self._dispatcher.pool_reported(pool)
        self._dispatcher.expire(now)
        self._dispatcher.dispatch(now)

    def cancel(self, w: Waiter) -> None:
        """The caller went away: leave the queue at once (nothing is
        remembered). If it was admitted in the same moment but never learned
        it, the reservation is released: nobody will run or settle it."""
        now = self.clock()
        if not w.done:
            self._dispatcher.remove(w)
        elif isinstance(w.result, AdmitDecision) and w.result.decision == Decision.ADMIT:
            rec = self._settler.release_unseen(w.key, now)
            if rec is None:
                return  # settled or expired meanwhile: nothing to give back
            self._freed(rec)
        else:
            return  # it had its answer (a refusal): nothing to undo
        self.stats.cancelled_total += 1
        self._dispatcher.dispatch(now)

    def next_wakeup_ns(self) -> int | None:
        """When time alone may change something for the waiters: the next
        deadline, or the next refill of a tenant whose queue head waits, or
        the end of a pool's takeover hold while anything waits."""
        now = self.clock()
        wake = self._dispatcher.next_wakeup_ns(now)
        holds = self._gate.holds()
        if not holds or not self._dispatcher.queues.total:
            return wake
        end = min(holds.values())
        return end if wake is None else min(wake, end)

    def forget_pools(self, pools: Sequence[str]) -> int:
        """Another replica decides for ``pools`` now: their open
        reservations end here as at expiry (no refund; the tenants' slots
        and concurrency freed), and the pool gate forgets what it counted in
        flight there. The new owner counts them, as the sidecars re-announce
        them; a Complete that still comes here is booked once on its ledger
        key (offline). Kept, they held a tenant's concurrency here until
        their TTL, and a cell that came back was refused. Returns how many
        ended."""
        now = self.clock()
        released = self._settler.end(self._log.drop_open_in_pools(pools), now)
        for rec in released:
            self._freed(rec)
        for pool in pools:  # after _freed: what it counted there goes whole
            self._gate.forget(pool)
        if released:
            self._dispatcher.dispatch(now)
        return len(released)

    def pool_holds(self) -> dict[str, int]:
        """Pools whose gate is held after a takeover now -> when the hold
        ends (service clock, ns)."""
        now = self.clock()
        return {p: until for p, until in self._gate.holds().items() if until > now}

    @property
    def waiting(self) -> int:
        return self._dispatcher.queues.total

    def tenant_queued(self, tenant_id: str) -> int:
        """Admit calls of ``tenant_id`` waiting in any lane's queue."""
        entry = self._tenants.get(tenant_id)
        return 0 if entry is None else self._dispatcher.queues.per_tenant.get(entry.slot, 0)

    def queue_depths(self) -> dict[str, int]:
        return self._dispatcher.queues.lane_depths()

    def queue_footprint(self) -> dict[str, int]:
        """Sizes of the queues' internal indexes (benchmarks check for leaks)."""
        return self._dispatcher.queues.footprint()

    def declared_pools(self) -> frozenset[str]:
        """The pools the config declares (``tenants.declared_pools``): the
        only names a request may give."""
        return self._tenants.declared

    def _check_priced(self, tenant_ids: Sequence[str], model: str) -> None:
        """``price_check`` once per distinct tenant of a batch (model and
        pool are the batch's): one unpriced entry fails the whole batch, as
        any invalid entry does, before anything is decided."""
        if self.price_check is not None:
            for t in dict.fromkeys(tenant_ids):
                self.price_check(t, model)

    def check_pool(self, pool: str) -> None:
        """InvalidArgument naming ``pool`` unless it is "" or declared; for
        the doors that route a pool before the service sees it (several
        replicas: a cell is claimed for it)."""
        self._tenants.check_pool(pool)

    def pool_of(
        self, tenant_id: str, lane: str, prompt_tokens: int, max_tokens: int, pool: str = ""
    ) -> str:
        """The pool an Admit with these fields would be decided for (after
        length-aware placement, as :meth:`admit_or_wait` resolves it),
        without deciding or changing anything; "" when it would be refused
        before a pool is chosen or has none (the pool gate off). For the
        RPC layer's owner check (docs/ha.md)."""
        if pool:
            return pool
        tenants = self._tenants
        try:
            entry = tenants.resolve(tenant_id)
            lane = tenants.lane_for("lane", lane, entry)
            if entry is not None:
                lane = tenants.place(entry, lane, prompt_tokens, max_tokens)
            return tenants.pool_for(entry, lane, "")
        except DomainError:
            return ""  # a bad field: the decision names it

    def admit_batch(
        self,
        tenant_ids: Sequence[str],
        request_ids: Sequence[str],
        lanes: Sequence[str],
        prompt_tokens: Sequence[int],
        max_tokens: Sequence[int],
        model: str = "",
        pool: str = "",
        *,
        scope: KeyScope | None = None,
        retry_keys: Sequence[str] = (),
        attempts: Sequence[int] = (),
    ) -> BatchResult:
        """Decide a whole batch with one call into the fast path; never waits.

        The batch is validated in full before anything is decided: a bad
        entry fails the call (naming ``field[index]``) and changes no state.
        Callers holding protobuf repeated fields should pass lists (indexing
        a repeated field costs ~6x a list index). An empty ``pool`` is
        resolved per entry (``TenantDirectory.pool_for``). ``scope``: as in
        :meth:`admit_or_wait`, per entry (the caller checked the tenant
        column); an entry outside it fails the whole batch. ``retry_keys``
        and ``attempts``: as :meth:`admit_or_wait`'s, 0 or one per entry
        (``attempts``: or one for all); each entry is judged as a retry and
        remembered for its retries as a unary Admit is (an entry without a
        key is known by its request id)."""
        lane_of = check_batch(
            self._tenants, self.settings.max_batch, tenant_ids, request_ids, lanes,
            prompt_tokens, max_tokens, model, pool,
        )  # fmt: skip
        n = len(request_ids)
        keys, tries = check_retries(retry_keys, attempts, n)
        self._tenants.check_pool(pool)
        self._check_priced(tenant_ids, model)
        tenant_ids = tenant_ids if isinstance(tenant_ids, list) else list(tenant_ids)
        now = self.clock()
        request_ids = request_ids if isinstance(request_ids, list) else list(request_ids)
        deadlines = self._deadlines
        lanes_of = lane_of or [""] * n
        retries = deadlines.batch_retries(
            tenant_ids, request_ids, lanes_of, prompt_tokens, max_tokens, pool, keys, tries, now
        )  # fmt: skip
        result = self._decider.decide_batch(
            tenant_ids, request_ids, lane_of, prompt_tokens, max_tokens, model,
            pool, now, self._log, self.stats, scope, retries,
        )  # fmt: skip
        if any(result.reason):
            deadlines.remember_refused(
                tenant_ids, request_ids, lanes_of, keys, tries, result.reason,
                result.duplicate, now,
            )  # fmt: skip
        return result

    def admit_batch_waiting(
        self,
        tenant_ids: Sequence[str],
        request_ids: Sequence[str],
        lanes: Sequence[str],
        prompt_tokens: Sequence[int],
        max_tokens: Sequence[int],
        max_wait_ms: Sequence[int],
        model: str = "",
        pool: str = "",
        *,
        scope: KeyScope | None = None,
        retry_keys: Sequence[str] = (),
        attempts: Sequence[int] = (),
    ) -> list[AdmitDecision | Waiter]:
        """A batch whose entries may wait (AdmitBatch.max_wait_ms): each entry
        goes through :meth:`admit_or_wait` with its own deadline (now + its
        max wait; 0 = answered now), so it takes its place in the fair order
        as a unary Admit does. Validated in full first, as
        :meth:`admit_batch`; an entry already waiting for another call, or
        outside ``scope``, fails the batch before anything is decided. A
        returned ``Waiter`` is resolved through its ``on_done`` later (or is
        already ``done``). ``retry_keys``, ``attempts``: as :meth:`admit_batch`."""
        lane_of = check_batch(
            self._tenants, self.settings.max_batch, tenant_ids, request_ids, lanes,
            prompt_tokens, max_tokens, model, pool,
        )  # fmt: skip
        n = len(tenant_ids)
        waits = check_max_wait(max_wait_ms, n)
        keys, tries = check_retries(retry_keys, attempts, n)
        self._tenants.check_pool(pool)
        self._check_priced(tenant_ids, model)
        lane_of = lane_of or [""] * n
        queued = self._dispatcher.queues.by_key
        for i in range(n):
            if (tenant_ids[i], request_ids[i]) in queued:
                raise AlreadyExists(
                    f"request_id[{i}]: {excerpt(request_ids[i])} is already waiting in a queue"
                )
            if scope is not None:
                self._check_entry_scope(
                    scope, i, tenant_ids[i], lane_of[i], prompt_tokens[i], max_tokens[i], pool
                )
        out: list[AdmitDecision | Waiter] = []
        for i in range(n):
            out.append(self.admit_or_wait(
                tenant_ids[i], request_ids[i], lane_of[i], prompt_tokens[i], max_tokens[i],
                model, pool, wait=waits[i] > 0, wait_bound_ns=waits[i] * NS_PER_MS, scope=scope,
                retry_key=keys[i], attempt=tries[i],
            ))  # fmt: skip
        return out

    def _check_entry_scope(
        self, scope: KeyScope, i: int, tenant_id: str, lane: str, prompt: int, max_tokens: int,
        pool: str,
    ) -> None:  # fmt: skip
        """Entry ``i``'s fresh decision would stay in ``scope`` (the pool it
        would go to, after placement, as :meth:`admit_or_wait` resolves it)."""
        tenants = self._tenants
        entry = tenants.resolve(tenant_id)
        if entry is None or early_reason(entry):
            return  # refused before any pool is chosen
        lane = tenants.place(entry, tenants.lane_for(f"lane[{i}]", lane, entry), prompt, max_tokens)
        check_scope(
            scope,
            tenant_id,
            entry,
            tenants.pool_for(entry, lane, pool),
            f"entry {i}'s",
            f"tenant_id[{i}]",
        )

    # ---------------------------------------------------------------- complete

    def complete(
        self,
        tenant_id: str,
        request_id: str,
        reservation_id: int,
        prompt_tokens: int,
        generated_tokens: int,
        cached_prompt_tokens: int = 0,
        kv_cache_miss_rate: float = 0.0,
        *,
        first_token_ns: int = 0,
    ) -> Settlement:
        """Settle a reservation with real usage; refund the unused part.

        Idempotent: the second report of the same request returns the first
        settlement with ``duplicate=True`` and changes nothing. This is the
        in-memory settlement alone; the server goes through the metering
        package, which makes the ledger record durable between
        :meth:`prepare_complete` and :meth:`apply_complete`.
        ``first_token_ns``: when the request's first token came (the
        service clock; 0 = not measured), which teaches the pool gate how
        soon a released request gets its first token (service/pace.py)."""
        prepared = self.prepare_complete(
            tenant_id, request_id, reservation_id, prompt_tokens, generated_tokens,
            cached_prompt_tokens, kv_cache_miss_rate,
        )  # fmt: skip
        if isinstance(prepared, Settlement):
            return prepared
        actual = prompt_tokens + generated_tokens
        return self.apply_complete(
            (tenant_id, request_id), prepared, actual, first_token_ns=first_token_ns
        )

    @property
    def offline(self) -> Booking:
        """Booking the requests a sidecar admitted while this server was
        unreachable, from their Complete (CompleteRequest.offline)."""
        return self._offline

    def prepare_complete(
        self,
        tenant_id: str,
        request_id: str,
        reservation_id: int,
        prompt_tokens: int,
        generated_tokens: int,
        cached_prompt_tokens: int = 0,
        kv_cache_miss_rate: float = 0.0,
    ) -> Settlement | Record:
        """Validate a Complete against memory without changing anything.

        Returns the settlement with ``duplicate=True`` when the request is
        already settled, else the open record to pass to
        :meth:`apply_complete`. Raises InvalidArgument, NotFound (never
        admitted, or forgotten after the reservation TTL) or
        FailedPrecondition (refused)."""
        return self._settler.prepare(
            tenant_id, request_id, reservation_id, prompt_tokens, generated_tokens,
            cached_prompt_tokens, kv_cache_miss_rate,
        )  # fmt: skip

    def apply_complete(
        self, key: Key, rec: Record, actual: int, *, first_token_ns: int = 0
    ) -> Settlement:
        """Settle the record :meth:`prepare_complete` returned: refund the
        unused reservation, free the slot. If the reservation expired in the
        meantime (it was released without a refund) only the answer is built.
        ``first_token_ns``: as in :meth:`complete`."""
        now = self.clock()
        if first_token_ns and rec[R.POOL] and self._gate.enabled:
            released = rec[R.DECIDED_NS]
            if released < first_token_ns <= now:  # a time it could have been
                prompt = rec[R.RESERVED] - rec[R.GRANTED]  # what it was admitted with
                self._gate.observe_ttft(rec[R.POOL], prompt, first_token_ns - released)
        settlement, ended = self._settler.apply(key, rec, actual, now)
        self.stats.count_settled(rec, actual)
        if ended is not None:
            self._freed(ended)
            self._dispatcher.dispatch(now)
        return settlement

    def _freed(self, rec: Record) -> None:
        """A reservation ended: its tenant's slot, the shared in-flight
        tokens and its pool's gate may have room."""
        self._dispatcher.slot_freed(rec[R.SLOT])
        if self._gate.enabled and rec[R.POOL]:
            self._gate.completed(rec[R.POOL], self.clock())
            self._dispatcher.pool_reported(rec[R.POOL])

    def expire(self) -> int:
        """Release reservations older than the TTL and forget old refusals.
        Called periodically by the server; returns how many were released."""
        now = self.clock()
        released = self._settler.expire(now)
        for rec in released:
            self._freed(rec)
        self.stats.expired_total += len(released)
        if released:
            self._dispatcher.dispatch(now)
        return len(released)

    # ------------------------------------------------------ several replicas

    def reannounce_pool(self, r: OpenReservation, scope: KeyScope | None = None) -> str:
        """The pool the re-announced reservation ``r`` belongs to (its
        Admit's, resolved and placed as there), changing nothing; for the
        RPC layer's owner check. Raises InvalidArgument naming the field
        (``pool``, ``reserved_tokens``, ...), PermissionDenied outside ``scope``."""
        return self._restorer.plan(r, self.clock(), scope)[0]

    def restore_reservation(self, r: OpenReservation, scope: KeyScope | None = None) -> Restore:
        """Re-create an open reservation another replica admitted, as its
        sidecar re-announces it after the pool's cell moved here (docs/ha.md,
        "Re-announcing open reservations"). The tenant's bucket, hourly and
        daily counters are debited its reserved tokens by force (the bucket
        may go into debt, concurrency past its limit: the request runs
        already), it counts in the tenant's concurrency, the in-flight
        tokens and the pool gate's in-flight requests, and its Complete
        settles it as any other (refund of the unused part, billed at the
        multiplier ``r`` carries); the reservation TTL counts from now.

        Idempotent: a reservation known here (open or settled) is left
        alone, ``Restore(KNOWN)``. ``Restore(REFUSED, detail=...)`` when its
        tenant is not configured, the cap on open reservations binds, or the
        same id waits in a queue here; nothing changed. Raises as
        :meth:`reannounce_pool`."""
        return self._restorer.restore(r, self.clock(), scope)

    def hold_pools(self, pools: Sequence[str], seconds: float) -> None:
        """The pool gate releases nothing to ``pools`` for ``seconds`` or
        until their next load report, whichever is first: their cell was
        just taken over from another replica, whose requests still run
        (docs/ha.md, "The gate during a takeover"). Held requests wait in
        their lane queues as behind a closed gate. No effect on a pool while
        the gate is off."""
        now = self.clock()
        until = now + max(1, int(seconds * NS_PER_S))
        for pool in pools:
            self._gate.hold(pool, now, until)

    def gate_inflight(self, pool: str) -> int:
        """Requests the pool gate counts in flight in ``pool`` (released or
        restored here, not yet completed)."""
        return self._gate.inflight(pool)

    def ttft_samples(self, pool: str) -> int:
        """First tokens Completes reported for ``pool`` (docs/gate.md: they
        teach the gate the pool's time to first token)."""
        return self._gate.ttft_samples(pool)

    def reservation_pool(self, tenant_id: str, request_id: str) -> str:
        """The pool a remembered request was decided for ("" if none, or if
        the request is not remembered)."""
        rec = self._log.get((tenant_id, request_id))
        return "" if rec is None else str(rec[R.POOL])

    def record(self, tenant_id: str, request_id: str) -> Record | None:
        """What the plane remembers of a request (``records`` fields), if anything."""
        return self._log.get((tenant_id, request_id))

    @property
    def open_reservations(self) -> int:
        return self._log.open_count

    @property
    def remembered_requests(self) -> int:
        return len(self._log)

    # -------------------------------------------------------------------- load

    def prepare_gc_freeze(self) -> None:
        """Call right before ``gc.freeze()`` (the server does, once it is
        serving): the request log's dict, which grows to millions of entries,
        is then frozen out of the collector's sight with everything else
        built at start, and full collections no longer walk it."""
        self._log.prepare_gc_freeze()

    def report_load(
        self,
        pool: str,
        engine_id: str,
        batch_tokens: int,
        max_batch_tokens: int,
        queue_depth: int,
        queue_capacity: int,
        kv_cache_miss_rate: float | None,
        gpu_utilization: float,
        *,
        requests_running: int | None = None,
        max_num_seqs: int | None = None,
        kv_cache_usage: float | None = None,
    ) -> int:
        """Store an engine's load report; returns the pool's fresh engine count.
        ``queue_capacity`` 0 = the engine's queue is unbounded (vLLM's);
        ``kv_cache_miss_rate`` None = not measured. The keyword fields are
        vLLM's own (``num_requests_running``, its ``max_num_seqs``,
        ``kv_cache_usage_perc`` as a fraction); the gate and the score use
        them when given. InvalidArgument names a bad field; nothing is stored."""
        now = self.clock()
        sample = load_sample(
            pool, engine_id, batch_tokens, max_batch_tokens, queue_depth, queue_capacity,
            kv_cache_miss_rate, gpu_utilization, now, requests_running, max_num_seqs,
            kv_cache_usage,
        )  # fmt: skip
        self._tenants.check_pool(pool)
        fresh = self._pressure.report(sample)
        self._gate.report(sample)
        if kv_cache_miss_rate is not None:  # the pool's pricing window
            self.pricing.observe_load(pool, kv_cache_miss_rate, now)
        self._dispatcher.pool_reported(pool)
        self._dispatcher.dispatch(now)
        return fresh

    def eviction_advice(self, pool: str) -> tuple[float, float]:
        """(the pool's load, the KV-cache reuse rate per second under which its
        engines should evict), answered with each load report."""
        load = self._pressure.score(pool, self.clock())
        return load, eviction_advice(load)

    def pool_views(self) -> dict[str, tuple[float, int, bool]]:
        """pool -> (backpressure score, freshness, degraded), for operators."""
        return self._pressure.views(self.clock())

    @property
    def pools(self) -> dict[str, dict[str, LoadSample]]:
        """pool -> engine id -> latest load report."""
        return self._pressure.reports()

    def pool_demand(self, pool: str, now: int | None = None) -> PoolDemand:
        """What ``pool`` is asked and what it needs now (``now``: the service
        clock's, default its current time), for an autoscaler
        (docs/autoscaling.md, "Signals"; service/demand.py):

        - demand: prompt tokens and requests per second asked of the pool
          over the last ``DEMAND_WINDOW_S`` (admitted, held, or refused for
          capacity; not refusals for a tenant's own limits);
        - per lane, the requests and prompt tokens held for the pool in
          burstgate's queues, and the predicted wait of a new request: the
          held work ahead of it (``Deadlines.ahead_tokens``: premium first,
          the fair order's share of the others) at the pool's pace;
        - ``desired_engines``: with a learned work rate ``r`` per engine
          (prompt tokens one engine took per second in the seconds the gate
          held work for the pool, ``demand.WorkRate``; before any, the
          gate's pace over the engines reporting) and the target
          utilisation ``U`` (``autoscale_target_utilization``), the larger of
          ceil(demand / (r U)) and, for each lane with work held, ceil(work
          ahead of a new request / (T r U)), T its TTFT SLO less the
          engine's share of it (``Deadlines.engine_ns``), else its wait
          target: enough to take the demand, and to release what is held
          in time for each lane's SLO. Before any rate is learned: the engines
          reporting now (at least one while anything is asked or held): the
          plane cannot tell how many fewer would do;
        - ``desired_engines_predicted``: ceil(forecast demand at now +
          ``autoscale_engine_startup_s`` / (r U)), the forecast from the
          burst forecaster's model fed each second's demand; equal to
          ``desired_engines`` before a rate is learned.

        Any pool name may be asked (an unknown one is all zeros). Reads
        only; O(engines + lanes)."""
        now = self.clock() if now is None else now
        settings = self.settings
        util = settings.autoscale_target_utilization
        book = self._pressure.book.pools.get(pool)
        engines = len(book.fresh(now, self._pressure.book.stale_ns)) if book else 0
        # per engine: the work rate in gated seconds (demand.WorkRate); until
        # the pool has had one, the pace over the engines reporting now
        per_engine = self._gate.work_rate(pool, now)
        if per_engine is None:
            rate = self._gate.pace_rate(pool)
            per_engine = rate / engines if rate and engines else None
        meter = self.stats.demand.meters.get(pool)
        tokens_s, requests_s = meter.rates(now) if meter is not None else (0.0, 0.0)
        # the demand term's average is longer (demand.DESIRED_WINDOW_S)
        steady_s = meter.rates(now, DESIRED_WINDOW_S)[0] if meter is not None else 0.0
        horizon = settings.autoscale_engine_startup_s
        forecast = meter.forecast(now, horizon) if meter is not None else 0.0
        queues = self._dispatcher.queues
        held = queues.pool_waiting.get(pool)
        held_tokens = queues.pool_tokens.get(pool)
        deadlines = self._deadlines
        backlog: list[LaneBacklog] = []
        drain = 0  # engines to release each lane's held work within its SLO
        for lane_cfg in self._tenants.by_priority:
            idx = queues.lane_index(lane_cfg.name)
            n = held[idx] if held is not None and idx < len(held) else 0
            tokens = held_tokens[idx] if held_tokens is not None and idx < len(held_tokens) else 0
            ahead = deadlines.ahead_tokens(pool, idx) if held is not None else 0
            wait_ns = self._gate.wait_ns(pool, ahead) if ahead else 0
            backlog.append(LaneBacklog(
                lane_cfg.name, n, tokens, None if wait_ns is None else wait_ns / NS_PER_S
            ))  # fmt: skip
            # released in time: by its SLO less the engine's share of it
            # (Deadlines.engine_ns, for the held requests' mean prompt);
            # without an SLO, by the lane's wait target
            slo = deadlines.slo_ns(lane_cfg.name)
            if slo:
                bound_ns = slo - deadlines.engine_ns(slo, pool, tokens // max(1, n))
            else:
                bound_ns = lane_cfg.wait_target_ms * NS_PER_MS
            if ahead and per_engine is not None and bound_ns > 0:
                drain = max(drain, engines_for(ahead * NS_PER_S / bound_ns, per_engine, util))
        if per_engine is None:
            asked = steady_s > 0 or any(b.requests for b in backlog)
            desired = predicted = max(engines, 1 if asked else 0)
        else:
            desired = max(engines_for(steady_s, per_engine, util), drain)
            predicted = engines_for(forecast, per_engine, util)
        return PoolDemand(
            pool, engines, tokens_s, requests_s, per_engine, desired, predicted, forecast,
            tuple(backlog),
        )  # fmt: skip

    def demand_pools(self) -> list[str]:
        """The pools :meth:`pool_demand` has something to say about: the
        declared ones, and any that reported, was asked or holds work."""
        names = set(self._tenants.declared) | set(self._pressure.book.pools)
        names |= set(self.stats.demand.meters) | set(self._dispatcher.queues.pool_waiting)
        return sorted(names)
