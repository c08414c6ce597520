"""The admission service: the façade of the decision plane.

Everything runs on one thread (the server's event loop) and touches only
memory; the database is read at start and on config changes, off this path,
and handed over through ``apply_config``. Time comes from the injected
``clock`` (wall-clock nanoseconds: quota windows are UTC hours and days), so
the gRPC adapter, the simulator, replays, benchmarks and tests all drive the
same code with real or simulated time.

The façade keeps the API that decides and moves time (admit, admit_or_wait,
tick, cancel, complete, report_load, expire, apply_config); the other doors
are parts reached as attributes: ``views`` (read-only, for metrics and
status), ``batches`` (AdmitStream and AdmitBatch), ``settlement`` (a
Complete in two steps around the ledger's durable write), ``replicas``
(several replicas), ``shares`` and ``offline``; assembly.py builds them.
controlplane/service/__init__.py lists the whole API. Only the façade and
the dispatcher start a dispatch: a part that frees capacity returns what it
freed and the façade dispatches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from controlplane.domain import AdmitDecision, Decision, LaneConfig, Settlement, TenantConfig
from controlplane.domain.policy import Policy
from controlplane.domain.scope import KeyScope
from controlplane.service.assembly import assemble
from controlplane.service.pressure import load_sample
from controlplane.service.pricing import FlatPricing, Pricing
from controlplane.service.queueing import Waiter
from controlplane.service.records import Record
from controlplane.service.service_limits import ServiceLimits
from controlplane.service.tenants import Route
from controlplane.service.unary import PriceCheck
from fastpath import IMPLEMENTATION

__all__ = ["AdmissionService"]


class AdmissionService:
    """Per-request admission over an in-memory token-bucket table.

    ``pricing`` quotes the multiplier locked into each admission (the
    metering package's pricing windows; flat 1.0 when not given)."""

    implementation = IMPLEMENTATION

    def __init__(
        self, limits: ServiceLimits, clock: Callable[[], int] = time.time_ns,
        pricing: Pricing | None = None,
    ) -> None:  # fmt: skip
        self.limits = limits
        self.clock = clock
        self.pricing: Pricing = pricing if pricing is not None else FlatPricing()
        p = assemble(limits, clock, self.pricing, self._released)
        self._table, self._log, self._tenants = p.table, p.log, p.tenants
        self._pressure, self._gate, self._deadlines = p.pressure, p.gate, p.deadlines
        self._dispatcher, self._settler, self._unary = p.dispatcher, p.settler, p.unary
        self.stats, self.signer = p.stats, p.signer
        self.shares, self.offline = p.shares, p.offline
        self.batches, self.replicas, self.views = p.batches, p.replicas, p.views
        self.settlement = p.settlement

    @property
    def price_check(self) -> PriceCheck | None:
        """``BURSTGATE_LEDGER_UNPRICED=refuse``: the server sets this to the
        ledger's price check, so an Admit for a (tenant, model) the catalog
        cannot price is refused before anything is reserved: no work is done
        that would be billed 0."""
        return self._unary.price_check

    @price_check.setter
    def price_check(self, check: PriceCheck | None) -> None:
        self._unary.price_check = check

    # ------------------------------------------------------------------ config

    def apply_config(
        self, tenants: Sequence[TenantConfig], lanes: Sequence[LaneConfig],
        policy: Policy | None = None,
    ) -> None:  # fmt: skip
        """Install a full config (``policy`` None = the limits' policy).
        Buckets of tenants that stay keep their level and counters (the fast
        path re-limits them to the new burst); tenants that disappear stop
        being admitted but their open reservations can still be settled."""
        now = self.clock()
        policy = policy if policy is not None else self.limits.policy
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

    def restore_usage(self, hour_tokens: dict[str, int], day_tokens: dict[str, int]) -> int:
        """Add tokens already used in the current UTC hour and day (from the
        ledger, at start) to the tenants' quota counters; returns how many
        tenants were restored. Unknown tenant ids are ignored."""
        return self._tenants.restore_usage(hour_tokens, day_tokens, self.clock())

    # ------------------------------------------------------------------- admit

    def admit(
        self, tenant_id: str, request_id: str, lane: str, prompt_tokens: int, max_tokens: int,
        model: str = "", pool: str = "",
    ) -> AdmitDecision:  # fmt: skip
        """Decide now; never wait (waitable refusals are answered as refusals)."""
        out = self.admit_or_wait(
            tenant_id, request_id, lane, prompt_tokens, max_tokens, model, pool, wait=False
        )
        assert isinstance(out, AdmitDecision)
        return out

    def admit_or_wait(
        self, tenant_id: str, request_id: str, lane: str, prompt_tokens: int, max_tokens: int,
        model: str = "", pool: str = "", *, wait: bool = True, deadline_ns: int | None = None,
        wait_bound_ns: int | None = None, scope: KeyScope | None = None, retry_key: str = "",
        attempt: int = 0, route: Route | None = None,
    ) -> AdmitDecision | Waiter:  # fmt: skip
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
        the default pool (``TenantDirectory.route``); ``route``: the one
        ``replicas.route`` gave for these fields (the owner check), so it
        is computed once.

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
        return self._unary.admit_or_wait(
            tenant_id, request_id, lane, prompt_tokens, max_tokens, model, pool, wait,
            deadline_ns, wait_bound_ns, scope, retry_key, attempt, route,
        )  # fmt: skip

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
            self._dispatcher.reservation_ended(rec, now)
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

    @property
    def waiting(self) -> int:
        """Admit calls waiting in any queue."""
        return self._dispatcher.queues.total

    # ---------------------------------------------------------------- complete

    def complete(
        self, tenant_id: str, request_id: str, reservation_id: int, prompt_tokens: int,
        generated_tokens: int, cached_prompt_tokens: int = 0, kv_cache_miss_rate: float = 0.0,
        *, first_token_ns: int = 0,
    ) -> Settlement:  # fmt: skip
        """Settle a reservation with real usage; refund the unused part.

        Idempotent: the second report of the same request returns the first
        settlement with ``duplicate=True`` and changes nothing. This is the
        in-memory settlement alone; the server goes through the metering
        package, which makes the ledger record durable between
        ``settlement.prepare`` and ``settlement.apply``.
        ``first_token_ns``: when the request's first token came (the
        service clock; 0 = not measured), which teaches the pool gate how
        soon a released request gets its first token (service/pace.py)."""
        settlement = self.settlement
        prepared = settlement.prepare(
            tenant_id, request_id, reservation_id, prompt_tokens, generated_tokens,
            cached_prompt_tokens, kv_cache_miss_rate,
        )  # fmt: skip
        if isinstance(prepared, Settlement):
            return prepared
        actual = prompt_tokens + generated_tokens
        return settlement.apply(
            (tenant_id, request_id), prepared, actual, first_token_ns=first_token_ns
        )

    def expire(self) -> int:
        """Release reservations older than the TTL and forget old refusals.
        Called periodically by the server; returns how many were released."""
        now = self.clock()
        released = self._settler.expire(now)
        self.stats.expired_total += len(released)
        self._released(released, now)
        return len(released)

    def _released(self, ended: list[Record], now: int, forget: Sequence[str] = ()) -> None:
        """Reservations ended: free what they held, make the gate forget
        ``forget``'s pools (after: what it counted there goes whole), and
        dispatch when anything was freed."""
        for rec in ended:
            self._dispatcher.reservation_ended(rec, now)
        for pool in forget:
            self._gate.forget(pool)
        if ended:
            self._dispatcher.dispatch(now)

    # -------------------------------------------------------------------- load

    def report_load(
        self, pool: str, engine_id: str, batch_tokens: int, max_batch_tokens: int,
        queue_depth: int, queue_capacity: int, kv_cache_miss_rate: float | None,
        gpu_utilization: float, *, requests_running: int | None = None,
        max_num_seqs: int | None = None, kv_cache_usage: float | None = None,
    ) -> int:  # fmt: skip
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

    def prepare_gc_freeze(self) -> None:
        """Call right before ``gc.freeze()`` (the server does, once it is
        serving): the request log's dict, which grows to millions of entries,
        is then frozen out of the collector's sight with everything else
        built at start, and full collections no longer walk it."""
        self._log.prepare_gc_freeze()
