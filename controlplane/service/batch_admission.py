"""Batch admission, the AdmitStream and AdmitBatch doors: ``service.batches``.

``admit`` decides a whole batch in one call into the fast path and never
waits (``Decider.decide_batch``); ``admit_waiting`` takes each entry through
the unary path with its own wait bound, so a waiting entry joins the fair
order as a unary Admit does. Both validate the whole batch before anything
is decided: one bad entry fails the call and changes nothing."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from controlplane.domain import AdmitDecision
from controlplane.domain.errors import AlreadyExists, excerpt
from controlplane.domain.scope import KeyScope
from controlplane.domain.units import NS_PER_MS
from controlplane.service.answers import BatchResult
from controlplane.service.deadlines import Deadlines
from controlplane.service.decider import Decider
from controlplane.service.edge import check_batch, check_max_wait, check_retries
from controlplane.service.keyscope import check_scope
from controlplane.service.queueing import Waiter, WaitQueues
from controlplane.service.records import RequestLog
from controlplane.service.stats import AdmissionStats
from controlplane.service.tenants import TenantDirectory, early_reason
from controlplane.service.unary import UnaryAdmission


class BatchAdmission:
    """The two batch doors of the admission service."""

    def __init__(
        self, *, clock: Callable[[], int], tenants: TenantDirectory, log: RequestLog,
        queues: WaitQueues, deadlines: Deadlines, decider: Decider, stats: AdmissionStats,
        unary: UnaryAdmission, max_batch: int,
    ) -> None:  # fmt: skip
        self._clock = clock
        self._tenants = tenants
        self._log = log
        self._queues = queues
        self._deadlines = deadlines
        self._decider = decider
        self._stats = stats
        self._unary = unary
        self._max_batch = max_batch

    def admit(
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
        ``AdmissionService.admit_or_wait``, per entry (the caller checked the
        tenant column); an entry outside it fails the whole batch.
        ``retry_keys`` and ``attempts``: as ``admit_or_wait``'s, 0 or one per
        entry (``attempts``: or one for all); each entry is judged as a retry
        and remembered for its retries as a unary Admit is (an entry without
        a key is known by its request id)."""
        lane_of = check_batch(
            self._tenants, self._max_batch, tenant_ids, request_ids, lanes,
            prompt_tokens, max_tokens, model, pool,
        )  # fmt: skip
        n = len(request_ids)
        keys, tries = check_retries(retry_keys, attempts, n)
        self._tenants.check_pool(pool)
        self._check_priced(tenant_ids, model)
        tenant_ids = tenant_ids if isinstance(tenant_ids, list) else list(tenant_ids)
        now = self._clock()
        request_ids = request_ids if isinstance(request_ids, list) else list(request_ids)
        deadlines = self._deadlines
        lanes_of = lane_of or [""] * n
        retries = deadlines.batch_retries(
            tenant_ids, request_ids, lanes_of, prompt_tokens, max_tokens, pool, keys, tries, now
        )  # fmt: skip
        result = self._decider.decide_batch(
            tenant_ids, request_ids, lane_of, prompt_tokens, max_tokens, model,
            pool, now, self._log, self._stats, scope, retries,
        )  # fmt: skip
        if any(result.reason):
            deadlines.remember_refused(
                tenant_ids, request_ids, lanes_of, keys, tries, result.reason,
                result.duplicate, now,
            )  # fmt: skip
        return result

    def admit_waiting(
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
        goes through ``admit_or_wait`` with its own deadline (now + its max
        wait; 0 = answered now), so it takes its place in the fair order as
        a unary Admit does. Validated in full first, as :meth:`admit`; an
        entry already waiting for another call, or outside ``scope``, fails
        the batch before anything is decided. A returned ``Waiter`` is
        resolved through its ``on_done`` later (or is already ``done``).
        ``retry_keys``, ``attempts``: as :meth:`admit`."""
        lane_of = check_batch(
            self._tenants, self._max_batch, tenant_ids, request_ids, lanes,
            prompt_tokens, max_tokens, model, pool,
        )  # fmt: skip
        n = len(tenant_ids)
        waits = check_max_wait(max_wait_ms, n)
        keys, tries = check_retries(retry_keys, attempts, n)
        self._tenants.check_pool(pool)
        self._check_priced(tenant_ids, model)
        lane_of = lane_of or [""] * n
        queued = self._queues.by_key
        for i in range(n):
            if (tenant_ids[i], request_ids[i]) in queued:
                raise AlreadyExists(
                    f"request_id[{i}]: {excerpt(request_ids[i])} is already waiting in a queue"
                )
            if scope is not None:
                self._check_entry_scope(
                    scope, i, tenant_ids[i], lane_of[i], prompt_tokens[i], max_tokens[i], pool
                )
        admit = self._unary.admit_or_wait
        return [
            admit(
                tenant_ids[i], request_ids[i], lane_of[i], prompt_tokens[i], max_tokens[i],
                model, pool, waits[i] > 0, None, waits[i] * NS_PER_MS, scope, keys[i], tries[i],
                None,
            )
            for i in range(n)
        ]  # fmt: skip

    def _check_priced(self, tenant_ids: Sequence[str], model: str) -> None:
        """The price check once per distinct tenant of a batch (model and
        pool are the batch's): one unpriced entry fails the whole batch, as
        any invalid entry does, before anything is decided."""
        price_check = self._unary.price_check
        if price_check is not None:
            for t in dict.fromkeys(tenant_ids):
                price_check(t, model)

    def _check_entry_scope(
        self, scope: KeyScope, i: int, tenant_id: str, lane: str, prompt: int, max_tokens: int,
        pool: str,
    ) -> None:  # fmt: skip
        """Entry ``i``'s fresh decision would stay in ``scope`` (the pool it
        would go to, after placement, as ``admit_or_wait`` resolves it)."""
        route = self._tenants.route(tenant_id, lane, prompt, max_tokens, pool, f"lane[{i}]")
        entry = route.entry
        if entry is None or early_reason(entry):
            return  # refused before any pool is chosen
        check_scope(scope, tenant_id, entry, route.pool, f"entry {i}'s", f"tenant_id[{i}]")
