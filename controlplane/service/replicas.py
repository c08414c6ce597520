"""The doors several replicas use (docs/ha.md): ``service.replicas``.

When the pools are split into cells owned by different replicas, the
server asks where a request goes before deciding it (the owner check),
re-creates the open reservations a sidecar re-announces after a takeover,
holds the gate of a pool just taken over, and forgets the pools another
replica took. In one process none of this is called. Reservations that
end here are handed to the façade (``released``), which frees their
capacity, makes the gate forget the pools and dispatches: a part never
starts a dispatch itself."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from controlplane.domain.errors import DomainError
from controlplane.domain.scope import KeyScope
from controlplane.domain.units import NS_PER_S
from controlplane.service import records as R
from controlplane.service.gate import PoolGate
from controlplane.service.records import Record, RequestLog
from controlplane.service.restore import OpenReservation, Restore, Restorer
from controlplane.service.settlement import Settler
from controlplane.service.tenants import Route, TenantDirectory


class ReplicaDoors:
    """Routing questions and takeover steps for the server's replica wiring."""

    def __init__(
        self, *, clock: Callable[[], int], tenants: TenantDirectory, log: RequestLog,
        gate: PoolGate, settler: Settler, restorer: Restorer,
        released: Callable[[list[Record], int, Sequence[str]], None],
    ) -> None:  # fmt: skip
        self._clock = clock
        self._tenants = tenants
        self._log = log
        self._gate = gate
        self._settler = settler
        self._restorer = restorer
        self._released = released

    def check_pool(self, pool: str) -> None:
        """InvalidArgument naming ``pool`` unless it is "" or declared; for
        the doors that route a pool before the service sees it (a cell is
        claimed for it)."""
        self._tenants.check_pool(pool)

    def route(
        self, tenant_id: str, lane: str, prompt_tokens: int, max_tokens: int, pool: str = ""
    ) -> Route | None:
        """Where an Admit with these fields would go (``TenantDirectory.route``),
        without deciding or changing anything; None when a field is bad (the
        decision names it). Pass it on to ``admit_or_wait(route=...)`` so the
        route is computed once per Admit."""
        try:
            return self._tenants.route(tenant_id, lane, prompt_tokens, max_tokens, pool)
        except DomainError:
            return None

    def pool_of(
        self, tenant_id: str, lane: str, prompt_tokens: int, max_tokens: int, pool: str = ""
    ) -> str:
        """The pool an Admit with these fields would be decided for (after
        length-aware placement, as ``admit_or_wait`` resolves it), without
        deciding or changing anything; "" when it would be refused before a
        pool is chosen or has none (the pool gate off). For the RPC layer's
        owner check (docs/ha.md)."""
        if pool:
            return pool
        route = self.route(tenant_id, lane, prompt_tokens, max_tokens)
        return "" if route is None else route.pool

    def reservation_pool(self, tenant_id: str, request_id: str) -> str:
        """The pool a remembered request was decided for ("" if none, or if
        the request is not remembered)."""
        rec = self._log.get((tenant_id, request_id))
        return "" if rec is None else str(rec[R.POOL])

    def reannounce_pool(self, r: OpenReservation, scope: KeyScope | None = None) -> str:
        """The pool the re-announced reservation ``r`` belongs to (its
        Admit's, resolved and placed as there), changing nothing; for the
        RPC layer's owner check. Raises InvalidArgument naming the field
        (``pool``, ``reserved_tokens``, ...), PermissionDenied outside ``scope``."""
        return self._restorer.plan(r, self._clock(), scope)[0]

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
        return self._restorer.restore(r, self._clock(), scope)

    def hold_pools(self, pools: Sequence[str], seconds: float) -> None:
        """The pool gate releases nothing to ``pools`` for ``seconds`` or
        until their next load report, whichever is first: their cell was
        just taken over from another replica, whose requests still run
        (docs/ha.md, "The gate during a takeover"). Held requests wait in
        their lane queues as behind a closed gate. No effect on a pool while
        the gate is off."""
        now = self._clock()
        until = now + max(1, int(seconds * NS_PER_S))
        for pool in pools:
            self._gate.hold(pool, now, until)

    def forget_pools(self, pools: Sequence[str]) -> int:
        """Another replica decides for ``pools`` now: their open
        reservations end here as at expiry (no refund; the tenants' slots
        and concurrency freed), and the pool gate forgets what it counted in
        flight there. The new owner counts them, as the sidecars re-announce
        them; a Complete that still comes here is booked once on its ledger
        key (offline). Kept, they held a tenant's concurrency here until
        their TTL, and a cell that came back was refused. Returns how many
        ended."""
        now = self._clock()
        ended = self._settler.end(self._log.drop_open_in_pools(pools), now)
        self._released(ended, now, pools)
        return len(ended)
