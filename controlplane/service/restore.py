"""Restoring an open reservation that a sidecar re-announces to this
replica after its pool's cell moved here (docs/ha.md, "Re-announcing open
reservations"; AdmissionService.Reannounce).

Reservations live only in the memory of the cell's owner. When the owner
dies or hands the cell over, the requests it admitted are still running on
the engines and their sidecars still hold them open.

Only what a replica of this deployment admitted is restored: an entry must
carry the admission token of its Admit answer (signing.py), which vouches
for its tenant, id, model, sizes and reservation id and carries the lane,
pool, multiplier, pricing window and admission time the restore uses. An
entry without one, or altered, or admitted longer ago than the reservation
TTL (its old owner had released it by then), is refused. Without this a
sidecar key could restore ids never admitted, at a multiplier of its
choosing.

Re-created here, each one is counted as if this replica had admitted it:

- its concurrency slot: refused when the tenant already holds its
  concurrency cap here (a restore never takes a tenant past its cap; its
  Complete is then booked as offline). Counting it by force instead let a
  concurrency-1 tenant reach 51 in flight with replayed tokens;
- the tenant's bucket, hourly and daily counters are debited its reserved
  tokens **by force** (as shadow mode and offline booking charge: the
  bucket may go into debt): the request runs already, the tokens were
  granted by the replica that signed them, and the refund its Complete
  brings must give back only what was taken here, never tokens this replica
  never debited (that would let the tenant pass its quota);
- its in-flight tokens (the global watermark);
- the pool gate's in-flight count (the fallback limit without load reports);
- the multiplier and pricing window the old owner locked at admission (the
  signed ones), so its Complete is billed at them.

It is then settled by its Complete like any other reservation (refund of the
unused part), or released at the reservation TTL, counted from the
re-announce. A reservation known here already (open or settled) is left
alone: re-announcing is idempotent.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from controlplane.domain.errors import InvalidArgument, excerpt
from controlplane.domain.money import parse_decimal
from controlplane.domain.scope import KeyScope
from controlplane.domain.units import NS_PER_S
from controlplane.domain.validate import MAX_POOL_LEN, check_id, check_optional_name, check_tokens
from controlplane.service import records as R
from controlplane.service.decider import Decider
from controlplane.service.dispatcher import Dispatcher
from controlplane.service.gate import PoolGate
from controlplane.service.keyscope import check_scope
from controlplane.service.records import RequestLog
from controlplane.service.signing import MAX_TOKEN_BYTES, AdmissionSigner, Signed
from controlplane.service.stats import AdmissionStats
from controlplane.service.tenants import Tenant, TenantDirectory

RESTORED = "restored"
KNOWN = "known"
REFUSED = "refused"
# A pricing multiplier as the Admit answer writes it: > 0, below this, <= 6 places.
MAX_MULTIPLIER = Decimal(1000)
MULTIPLIER_DECIMALS = 6
MAX_MULTIPLIER_TEXT = 32
# An admission time must lie within the window Complete's exec times may
# (controlplane/domain/validate.py): a TTL plus a day before now, an hour after.
PAST_SLACK_NS = 86_400 * 10**9
FUTURE_NS = 3_600 * 10**9
# A pricing window starts at most one window before its admission; windows
# are minutes (Settings.pricing_window_s), a day covers any sane one.
WINDOW_SLACK_S = 86_400


@dataclass(frozen=True, slots=True)
class OpenReservation:
    """An open reservation as the sidecar knows it from its Admit answer.
    ``lane`` and ``pool`` as the Admit named them ("" = resolved and placed
    as Admit does); ``pricing_multiplier`` the answer's decimal text;
    ``pricing_window`` Unix seconds (0 = unknown); ``admitted_ns`` the
    admission's wall-clock time (0 = unknown); ``admission_token`` the
    answer's signature (signing.py). With a valid token the restore uses
    its lane, pool, multiplier, window and time; ``pricing_multiplier``,
    ``pricing_window`` and ``pool``, when given, must equal the signed ones."""

    tenant_id: str
    request_id: str
    prompt_tokens: int
    max_tokens: int
    reserved_tokens: int
    granted_max_tokens: int
    pricing_multiplier: str | Decimal
    lane: str = ""
    pool: str = ""
    model: str = ""
    reservation_id: int = 0
    pricing_window: int = 0
    admitted_ns: int = 0
    admission_token: bytes = b""


@dataclass(frozen=True, slots=True)
class Restore:
    """What :meth:`AdmissionService.replicas.restore_reservation` did: ``outcome``
    one of RESTORED, KNOWN, REFUSED (``detail`` says why), and the pool the
    reservation belongs to."""

    outcome: str
    pool: str = ""
    detail: str = ""


@dataclass(frozen=True, slots=True)
class _Plan:
    entry: Tenant
    lane: str
    pool: str
    signed: Signed


def check_fields(r: OpenReservation, now: int, ttl_ns: int) -> Decimal | None:
    """The reservation's own fields; its multiplier (None: not given)."""
    check_id("tenant_id", r.tenant_id)
    check_id("request_id", r.request_id)
    check_optional_name("pool", r.pool, max_len=MAX_POOL_LEN)
    check_optional_name("model", r.model)
    for name in ("prompt_tokens", "max_tokens", "reserved_tokens", "granted_max_tokens"):
        check_tokens(name, getattr(r, name))
    if r.granted_max_tokens > r.max_tokens:
        raise InvalidArgument(
            "granted_max_tokens", f"{r.granted_max_tokens} exceeds max_tokens {r.max_tokens}"
        )
    if r.reserved_tokens != r.prompt_tokens + r.granted_max_tokens:
        raise InvalidArgument(
            "reserved_tokens",
            f"{r.reserved_tokens} is not prompt_tokens + granted_max_tokens "
            f"({r.prompt_tokens} + {r.granted_max_tokens})",
        )
    if not 0 <= r.reservation_id < 2**63:
        raise InvalidArgument("reservation_id", f"must be below 2^63, got {r.reservation_id}")
    if r.pricing_window:
        # a window starts before its admission: within the admission time's
        # own bounds (below), in Unix seconds; a window far in the future
        # would be billed and exported as a date no export can write
        low_s = (now - ttl_ns - PAST_SLACK_NS) // NS_PER_S - WINDOW_SLACK_S
        high_s = (now + FUTURE_NS) // NS_PER_S
        if not low_s <= r.pricing_window <= high_s:
            raise InvalidArgument(
                "pricing_window",
                f"{r.pricing_window} is outside [{low_s}, {high_s}]: Unix seconds from the "
                "reservation TTL plus one day before the server's clock to one hour after it "
                "(0 = unknown)",
            )
    if len(r.admission_token) > MAX_TOKEN_BYTES:
        raise InvalidArgument(
            "admission_token",
            f"longer than {MAX_TOKEN_BYTES} bytes ({len(r.admission_token)}): not an Admit "
            "answer's token",
        )
    text = r.pricing_multiplier
    if isinstance(text, str) and len(text) > MAX_MULTIPLIER_TEXT:
        raise InvalidArgument(
            "pricing_multiplier", f"longer than {MAX_MULTIPLIER_TEXT} characters ({len(text)})"
        )
    multiplier = None
    if not isinstance(text, str) or text:  # optional: the signed one is used
        multiplier = parse_decimal(
            "pricing_multiplier", text, decimals=MULTIPLIER_DECIMALS, maximum=MAX_MULTIPLIER,
            allow_equal_min=False,
        )  # fmt: skip
    if r.admitted_ns:
        low, high = now - ttl_ns - PAST_SLACK_NS, now + FUTURE_NS
        if not low <= r.admitted_ns <= high:
            raise InvalidArgument(
                "admitted_unix_ns",
                f"{r.admitted_ns} is outside [{low}, {high}]: from the reservation "
                "TTL plus one day before the server's clock to one hour after it (0 = unset)",
            )
    return multiplier


def altered(r: OpenReservation, stated: Decimal | None, signed: Signed) -> str | None:
    """Why a validly signed entry is refused: a billing fact it states that
    is not the signed one (None: it states none, or the same)."""
    if r.pool and r.pool != signed.pool:
        return (
            f"signature does not match: pool {excerpt(r.pool)} is not the pool it was "
            f"admitted to ({excerpt(signed.pool)})"
        )
    if stated is not None and stated != signed.multiplier:
        return (
            f"signature does not match: pricing_multiplier {stated} is not the one locked "
            f"at admission ({signed.multiplier:f})"
        )
    if r.pricing_window and r.pricing_window != signed.pricing_window:
        return (
            f"signature does not match: pricing_window {r.pricing_window} is not the "
            f"admission's ({signed.pricing_window})"
        )
    return None


class Restorer:
    def __init__(
        self,
        *,
        tenants: TenantDirectory,
        log: RequestLog,
        dispatcher: Dispatcher,
        decider: Decider,
        gate: PoolGate,
        stats: AdmissionStats,
        ttl_ns: int,
        signer: AdmissionSigner,
    ) -> None:
        self._tenants, self._log, self._dispatcher = tenants, log, dispatcher
        self._decider, self._gate, self.stats = decider, gate, stats
        self._ttl_ns = ttl_ns
        self._signer = signer

    def plan(
        self, r: OpenReservation, now: int, scope: KeyScope | None
    ) -> tuple[str, _Plan | str]:
        """Check ``r``, its signature, and resolve its lane and pool (the
        signed ones; for an entry refused, as its Admit would resolve its
        fields, placement included), changing nothing: (its pool, the plan,
        or why it is refused: unsigned or altered, expired, an unknown
        tenant). Raises InvalidArgument naming the field, PermissionDenied
        outside ``scope`` (the signed pool's, when signed)."""
        stated = check_fields(r, now, self._ttl_ns)
        tenants = self._tenants
        if scope is not None:
            scope.check_tenant("tenant_id", r.tenant_id)
        signed = self._signer.verify(
            r.admission_token, r.tenant_id, r.request_id, r.model, r.prompt_tokens,
            r.granted_max_tokens, r.reservation_id,
        )  # fmt: skip
        refusal = signed if isinstance(signed, str) else altered(r, stated, signed)
        if refusal is None and isinstance(signed, Signed):
            age_ns = now - signed.issued_ns
            if age_ns > self._ttl_ns:
                refusal = (
                    f"expired: admitted {age_ns // NS_PER_S} s ago, longer than the "
                    f"reservation TTL ({self._ttl_ns // NS_PER_S} s)"
                )
        route = tenants.route(r.tenant_id, r.lane, r.prompt_tokens, r.max_tokens, r.pool)
        tenants.check_pool(r.pool)
        entry = route.entry
        if entry is None:
            return r.pool, refusal or f"unknown tenant {excerpt(r.tenant_id)}"
        lane, pool = route.lane, route.pool
        if refusal is None and isinstance(signed, Signed):
            # the lane it was placed in and the pool it was resolved to at
            # admission (placement and pools may have been configured since)
            lane, pool = signed.lane, signed.pool
            if lane not in tenants.lanes:
                refusal = f"its lane {excerpt(lane)} is no longer configured"
        if scope is not None:
            check_scope(scope, r.tenant_id, entry, pool, "this reservation's")
        if refusal is not None or not isinstance(signed, Signed):
            return pool, refusal or "unsigned"
        return pool, _Plan(entry, lane, pool, signed)

    def restore(self, r: OpenReservation, now: int, scope: KeyScope | None) -> Restore:
        pool, plan = self.plan(r, now, scope)
        if isinstance(plan, str):  # unsigned, altered, expired, unknown tenant
            return Restore(REFUSED, pool, plan)
        key = (r.tenant_id, r.request_id)
        known = self._log.get(key)
        if known is not None and known[R.STATE] != R.REJECTED:
            return Restore(KNOWN, str(known[R.POOL]))
        # (a remembered refusal is replaced: the sidecar holds an admission
        # from the old owner, which this replica's answer never reached)
        if key in self._dispatcher.queues.by_key:
            return Restore(REFUSED, pool, "the same request id waits in a queue here")
        state = self._decider.table.snapshot(plan.entry.slot)
        cap = state["max_concurrency"]
        if cap and state["inflight"] >= cap:
            # Refused rather than counted past the cap: the tenant holds its
            # cap here already. Its Complete is booked as offline (billed).
            return Restore(
                REFUSED, pool,
                f"concurrency cap: the tenant has {state['inflight']} of its {cap} requests "
                "in flight here",
            )  # fmt: skip
        s = plan.signed
        # the admission time as the admitting replica's clock signed it (the
        # ledger's arrival); not after now, whatever the clocks' skew
        arrived = min(s.issued_ns, now)
        rec = self._decider.restore(
            plan.entry, plan.lane, r.prompt_tokens, r.granted_max_tokens, r.model, plan.pool,
            float(s.multiplier), s.pricing_window, r.reservation_id, arrived, now,
        )  # fmt: skip
        if rec is None:
            return Restore(REFUSED, pool, "open reservations are at their cap")
        self._log.add_admitted(key, rec)
        if self._gate.enabled and plan.pool:
            self._gate.restored(plan.pool)
        self.stats.restored_total += 1
        return Restore(RESTORED, plan.pool)
