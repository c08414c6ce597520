"""One request's admission: answer it now, or queue it when only waiting
stands between it and admission.

This is the body of ``AdmissionService.admit_or_wait`` (the façade keeps
the signature and its contract): replay of an earlier answer, the route
(``TenantDirectory.route``), the request's deadline under its lane's TTFT
SLO and its retries, the decision, and the choice between answering and
joining the queue. It never starts a dispatch: the dispatcher's
``enqueue`` admits a queued request at once when it can."""

from __future__ import annotations

from collections.abc import Callable

from controlplane.domain import AdmitDecision
from controlplane.domain.errors import AlreadyExists, excerpt
from controlplane.domain.scope import KeyScope
from controlplane.service import records as R
from controlplane.service.answers import Outcomes
from controlplane.service.deadlines import Deadlines
from controlplane.service.decider import Decider
from controlplane.service.demand import counts_as_demand
from controlplane.service.dispatcher import Dispatcher
from controlplane.service.edge import check_admit, check_retry
from controlplane.service.keyscope import check_scope
from controlplane.service.queueing import Waiter
from controlplane.service.records import Key, RequestLog
from controlplane.service.stats import AdmissionStats
from controlplane.service.tenants import Route, Tenant, TenantDirectory, early_reason
from fastpath import Reason

_TOKEN_RATE = int(Reason.TOKEN_RATE)
_BACKPRESSURE = int(Reason.BACKPRESSURE)

# (tenant_id, model) -> None, or raises: the ledger's price check when the
# server refuses unpriced work (``AdmissionService.price_check``).
PriceCheck = Callable[[str, str], None]


class UnaryAdmission:
    """Decides single Admits (and each entry of a batch that may wait)."""

    def __init__(
        self, *, clock: Callable[[], int], tenants: TenantDirectory, log: RequestLog,
        outcomes: Outcomes, dispatcher: Dispatcher, deadlines: Deadlines, decider: Decider,
        stats: AdmissionStats,
    ) -> None:  # fmt: skip
        self._clock = clock
        self._tenants = tenants
        self._log = log
        self._outcomes = outcomes
        self._dispatcher = dispatcher
        self._deadlines = deadlines
        self._decider = decider
        self._stats = stats
        self.price_check: PriceCheck | None = None

    def admit_or_wait(
        self, tenant_id: str, request_id: str, lane: str, prompt_tokens: int, max_tokens: int,
        model: str, pool: str, wait: bool, deadline_ns: int | None, wait_bound_ns: int | None,
        scope: KeyScope | None, retry_key: str, attempt: int, route: Route | None,
    ) -> AdmitDecision | Waiter:  # fmt: skip
        """As ``AdmissionService.admit_or_wait``; ``route``: one the caller
        already computed for these fields (the owner check), used while the
        config it was computed under is still installed."""
        check_admit(tenant_id, request_id, prompt_tokens, max_tokens, model, pool, lane)
        check_retry(retry_key, attempt)
        tenants = self._tenants
        tenants.check_pool(pool)
        if self.price_check is not None:
            self.price_check(tenant_id, model)
        now = self._clock()
        key = (tenant_id, request_id)
        prior = self._log.replay(key, now)
        if prior is not None:
            if scope is not None:  # an answer from another key's pool stays there
                scope.check_pool("pool", prior[R.POOL], "the pool this request was admitted to")
            return self._outcomes.answer(key, prior, duplicate=True)
        dispatcher = self._dispatcher
        if key in dispatcher.queues.by_key:
            raise AlreadyExists(f"request_id: {excerpt(request_id)} is already waiting in a queue")
        if route is None or route.generation != tenants.generation:
            route = tenants.route(tenant_id, lane, prompt_tokens, max_tokens, pool)
        entry = route.entry
        early = early_reason(entry)
        if entry is None or early:
            slot = -1 if entry is None else entry.slot
            return self._outcomes.record(key, R.refused(early, 0, route.asked, slot, now, now))
        # When its first token is due: its first arrival plus the SLO of the
        # lane it asked for (placement moves where it runs, not that).
        deadlines = self._deadlines
        slo = deadlines.slo_ns(route.asked)
        # a first attempt under a key of its own starts a new deadline
        retried = attempt > 0 or not retry_key
        retry_key = retry_key or request_id
        first = deadlines.retries.first(entry.slot, retry_key, now) if slo and retried else None
        due = (now if first is None else first) + slo if slo else 0
        lane, pool = route.lane, route.pool
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
                self._stats.demand.add(pool, now, prompt)
        elif counts_as_demand(int(out.reason)):
            self._stats.demand.add(pool, now, prompt)
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
