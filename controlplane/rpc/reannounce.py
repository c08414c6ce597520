"""AdmissionService.Reannounce: a sidecar hands its open reservations to the
replica that became their pool's owner (docs/ha.md, "Re-announcing open
reservations"; the service side is controlplane/service/restore.py).

The whole request is checked first — each entry's fields (INVALID_ARGUMENT
naming ``reservations[i].field``) and a scoped key's tenants and pools
(PERMISSION_DENIED, the same naming) — so a bad call takes nothing. Then
each distinct pool is routed as Admit routes it (owned here, claimed on
demand, or owned elsewhere): an entry of a pool owned elsewhere is answered
NOT_OWNER with the owner's address, the others are restored in order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb

from controlplane.domain.errors import InvalidArgument, PermissionDenied
from controlplane.domain.scope import KeyScope
from controlplane.service import AdmissionService, OpenReservation
from controlplane.service.restore import KNOWN, RESTORED

if TYPE_CHECKING:
    from controlplane.ha.serving import Ownership, Redirect

FIELD = "reservations"
_OUTCOME = {
    RESTORED: pb.REANNOUNCE_OUTCOME_RESTORED,
    KNOWN: pb.REANNOUNCE_OUTCOME_KNOWN,
}


def open_reservation(e: pb.OpenReservation) -> OpenReservation:
    return OpenReservation(
        tenant_id=e.tenant_id, request_id=e.request_id, prompt_tokens=e.prompt_tokens,
        max_tokens=e.max_tokens, reserved_tokens=e.reserved_tokens,
        granted_max_tokens=e.granted_max_tokens, pricing_multiplier=e.pricing_multiplier,
        lane=e.lane, pool=e.pool, model=e.model, reservation_id=e.reservation_id,
        pricing_window=e.pricing_window, admitted_ns=e.admitted_unix_ns,
        admission_token=e.admission_token,
    )  # fmt: skip


def _named(i: int, exc: InvalidArgument | PermissionDenied) -> Exception:
    """``exc`` with its field named inside the request: ``reservations[i].field``."""
    field = f"{FIELD}[{i}].{exc.field}" if exc.field else f"{FIELD}[{i}]"
    if isinstance(exc, InvalidArgument):
        return InvalidArgument(field, exc.description)
    message = str(exc).removeprefix(f"{exc.field}: ") if exc.field else str(exc)
    return PermissionDenied(message, field=field)


async def reannounce(
    svc: AdmissionService,
    ownership: Ownership | None,
    scope: KeyScope | None,
    request: pb.ReannounceRequest,
) -> pb.ReannounceResponse:
    entries = [open_reservation(e) for e in request.reservations]
    most = svc.limits.max_batch
    if len(entries) > most:
        raise InvalidArgument(FIELD, f"{len(entries)} entries exceed max_batch {most}")
    pools = []
    for i, r in enumerate(entries):
        try:
            pools.append(svc.replicas.reannounce_pool(r, scope))
        except (InvalidArgument, PermissionDenied) as exc:
            raise _named(i, exc) from None
    routes: dict[str, Redirect | None] = {}
    if ownership is not None and not ownership.local:
        for pool in dict.fromkeys(pools):
            try:
                routes[pool] = await ownership.route(pool)
            except ValueError as exc:  # a pool named like an explicit cell it is not in
                i = pools.index(pool)
                raise InvalidArgument(f"{FIELD}[{i}].pool", str(exc)) from None
    out = pb.ReannounceResponse()
    owners: list[str] = []
    details: list[str] = []
    for i, r in enumerate(entries):
        where = routes.get(pools[i])
        owner = detail = ""
        if where is not None:
            outcome = pb.REANNOUNCE_OUTCOME_NOT_OWNER
            owner = where.address
            out.not_owner += 1
        else:
            try:
                done = svc.replicas.restore_reservation(r, scope)
            except (InvalidArgument, PermissionDenied) as exc:  # (checked above: config changed)
                raise _named(i, exc) from None
            outcome = _OUTCOME.get(done.outcome, pb.REANNOUNCE_OUTCOME_REFUSED)
            detail = done.detail
            if done.outcome == RESTORED:
                out.restored += 1
            elif done.outcome == KNOWN:
                out.already_known += 1
            else:
                out.refused += 1
        out.outcome.append(outcome)
        owners.append(owner)
        details.append(detail)
    if out.not_owner:
        out.owner.extend(owners)
    if out.refused:
        out.detail.extend(details)
    return out
