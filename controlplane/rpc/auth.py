"""Who may call what on the server's port, and who is calling: the rules
by service, the key checks, and the caller's identity in the call's
context. The interceptor (rpc/interceptor.py) applies them to each call.

Rules by service:

- health and reflection: public, untouched.
- ``AdmissionService``: a ``sidecar`` key when ``admission_auth`` is on,
  checked against an in-memory copy of the keys (no SQL per Admit). A key
  with a scope (its tenants and pools) gets the handler that sets
  :data:`admission_scope` for the call; the servicer checks the request
  against it.
- ``AdminService`` (and any other service): an ``admin`` or ``viewer`` key,
  checked against the same in-memory copy before anything touches the
  database (a revocation made through this server applies to the next call,
  one made by another process within the config poll interval); a key id the
  copy does not know yet makes it re-read the keys (:class:`UnknownKeys`),
  at most once per ``UNKNOWN_KEY_REFRESH_S``; the call waits for that
  re-read at most ``UNKNOWN_KEY_WAIT_S`` from its start, and not at all
  while the last re-read failed (the database is unreachable) or when a
  re-read since which the keys have not changed did not know the id either:
  then it is refused at once. An authentication never waits on the database
  longer. ``viewer`` may call Get*/List*/Export* only. Every call gets a
  request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from dataclasses import dataclass

from controlplane.aiotime import within
from controlplane.auth import KeyCache
from controlplane.domain.audit import Actor
from controlplane.domain.errors import PermissionDenied, Unauthenticated
from controlplane.domain.keys import Principal, Role, split_key
from controlplane.domain.scope import KeyScope
from controlplane.rpc.dbcall import DbCaller

ADMIN_SERVICE = "burstgate.v1.AdminService"
ADMISSION_SERVICE = "burstgate.v1.AdmissionService"
# Envoy's rate-limit service (controlplane/integrations/envoy) decides
# requests as Admit does: the same sidecar keys and scopes.
ENVOY_RLS_SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
ADMISSION_SERVICES = frozenset({ADMISSION_SERVICE, ENVOY_RLS_SERVICE})
PUBLIC_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)
# Methods a viewer may call (on AdminService and any other operator service,
# e.g. the ledger's ExportLedger); ListApiKeys stays admin-only.
READ_PREFIXES = ("Get", "List", "Export")
ADMIN_ONLY_READS = frozenset({"ListApiKeys"})
# Admission methods operators may call too (owner discovery, docs/ha.md).
OPERATOR_ADMISSION_READS = frozenset({"GetCellOwners"})
# Most one forced key refresh per this many seconds for unknown key ids: a
# caller guessing keys costs the database nothing more than the poll does.
UNKNOWN_KEY_REFRESH_S = 1.0
# The most an unknown key id's call waits for that re-read, from its start:
# UNKNOWN_KEY_WAIT_S, or longer on a database whose re-reads are slow (a
# loaded SQLite file): UNKNOWN_KEY_WAIT_TYPICAL x the re-reads' typical
# time, at most UNKNOWN_KEY_WAIT_MAX_S. A database that hangs has no slow
# re-reads to show beforehand, so it holds a call up at most the floor
# (such a call used to be refused only after 5 s).
UNKNOWN_KEY_WAIT_S = 0.5
UNKNOWN_KEY_WAIT_TYPICAL = 4.0
UNKNOWN_KEY_WAIT_MAX_S = 3.0

# Rule.kind: how the interceptor treats a method's calls.
PUBLIC_CALL, ADMISSION_CALL, OPERATOR_CALL = 0, 1, 2

# The caller of the admin RPC being handled (set by the interceptor).
current_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "burstgate_principal", default=None
)
current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar(
    "burstgate_request_id", default=""
)
# The scope of the sidecar key of the admission call being handled; None =
# not limited (admission auth off, or a key for every tenant and pool). Set
# by the handler the interceptor wraps around the servicer's method, in the
# call's own context (rpc/calltiming.py).
admission_scope: contextvars.ContextVar[KeyScope | None] = contextvars.ContextVar(
    "burstgate_admission_scope", default=None
)


@dataclass(frozen=True, slots=True)
class Rule:
    kind: int
    service: str
    method: str
    roles: frozenset[Role]


def rule_for(full_method: str) -> Rule:
    """Who may call ``/package.Service/Method``."""
    service, _, method = full_method.lstrip("/").partition("/")
    if service in PUBLIC_SERVICES:
        return Rule(PUBLIC_CALL, service, method, frozenset())
    if service in ADMISSION_SERVICES:
        roles = {Role.SIDECAR}
        if method in OPERATOR_ADMISSION_READS:
            roles |= {Role.ADMIN, Role.VIEWER}
        return Rule(ADMISSION_CALL, service, method, frozenset(roles))
    read = method.startswith(READ_PREFIXES) and method not in ADMIN_ONLY_READS
    roles = {Role.ADMIN, Role.VIEWER} if read else {Role.ADMIN}
    return Rule(OPERATOR_CALL, service, method, frozenset(roles))


def authorize(principal: Principal, rule: Rule) -> Principal:
    if principal.role not in rule.roles:
        raise PermissionDenied(
            f"role {principal.role.value!r} may not call {rule.service}/{rule.method}"
        )
    return principal


class UnknownKeys:
    """Operator keys whose id the key cache does not know (yet)."""

    def __init__(self, key_cache: KeyCache, db: DbCaller) -> None:
        self.key_cache = key_cache
        self.db = db
        self._refreshed_at = -UNKNOWN_KEY_REFRESH_S
        self._refreshing: asyncio.Future[None] | None = None

    async def lookup(self, token: str) -> Principal:
        """Re-read the keys (one re-read shared by concurrent callers, at
        most one per ``UNKNOWN_KEY_REFRESH_S``, none while the last one
        failed) and look again, waiting for it at most ``UNKNOWN_KEY_WAIT_S``
        from its start. An id a successful re-read did not know either (and
        the keys have not changed since) is refused without one. Unknown:
        UNAUTHENTICATED, and nothing about the database."""
        cache = self.key_cache
        key_id, _ = split_key(token)
        if cache.known_unknown(key_id):
            raise Unauthenticated("invalid or revoked API key")
        now = time.monotonic()
        if (
            self._refreshing is None
            and not cache.unreachable
            and now - self._refreshed_at >= UNKNOWN_KEY_REFRESH_S
        ):
            self._refreshed_at = now
            self._refreshing = asyncio.ensure_future(self._forced_refresh())
            self._refreshing.add_done_callback(_retrieved)
        refreshing = self._refreshing
        cap = min(UNKNOWN_KEY_WAIT_MAX_S,
                  max(UNKNOWN_KEY_WAIT_S, UNKNOWN_KEY_WAIT_TYPICAL * cache.typical_refresh_s))
        wait = self._refreshed_at + cap - now
        if refreshing is not None and not cache.unreachable and wait > 0:
            with contextlib.suppress(Exception):  # a timeout, or logged by the DbCaller
                await within(asyncio.shield(refreshing), wait)
        confirmed = (
            refreshing is not None
            and refreshing.done()
            and not refreshing.cancelled()
            and refreshing.exception() is None
        )
        generation = cache.refreshes
        principal = cache.lookup(token)
        if principal is None:
            if confirmed:
                cache.remember_unknown(key_id, generation)
            raise Unauthenticated("invalid or revoked API key")
        return principal

    async def _forced_refresh(self) -> None:
        """Re-read the keys for an unknown id (bounded like every operator
        database call); whether it reached the database is noted."""
        started = time.monotonic()
        try:
            await self.db.run(self.key_cache.refresh)
        except BaseException:
            self.key_cache.note_refresh(False)
            raise
        else:
            self.key_cache.note_refresh(True, time.monotonic() - started)
        finally:
            self._refreshing = None


def _retrieved(fut: asyncio.Future[None]) -> None:
    """A forced re-read's failure is logged by the DbCaller: mark it seen."""
    if not fut.cancelled():
        fut.exception()


def current_actor() -> Actor:
    """The caller of the operator RPC being handled, as the audit log names it
    (for other packages' servicers that write audit records)."""
    p = require_principal()
    return Actor(p.actor, p.role.value, current_request_id.get())


def require_principal() -> Principal:
    """The authenticated caller of the admin RPC being handled."""
    principal = current_principal.get()
    if principal is None:  # only if the servicer is mounted without the interceptor
        raise Unauthenticated("no authenticated caller")
    return principal
