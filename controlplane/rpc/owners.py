"""Owner gating of the admission RPCs, and owner discovery (docs/ha.md).
Here, not in the service core: the in-process API that simulate
and replay use knows nothing of replicas.

- Admit, ReportLoad, and Complete with ``pool`` set: a pool whose cell
  another replica owns is answered UNAVAILABLE with ErrorInfo reason
  ``NOT_OWNER`` (metadata ``owner`` = the owner's address, "" while
  unknown; ``cell``, ``epoch``, ``pool``) and RetryInfo (0 when the owner is
  known, ~100 ms otherwise).
- AdmitStream: such entries are refused one by one (reason NOT_OWNER,
  ``owner[i]`` the address), the rest of the batch decided as usual.
- GetCellOwners: every cell known here, its owner and lease, the live members.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import grpc
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb

from controlplane.domain import AdmitDecision, Decision
from controlplane.domain.errors import InvalidArgument
from controlplane.domain.scope import KeyScope
from controlplane.domain.validate import check_pool
from controlplane.ha.serving import Ownership, Redirect
from controlplane.rpc.errors import abort, rich_status
from controlplane.service import AdmissionService
from fastpath import AdmitBatchColumns, Reason

# The per-entry columns of an AdmitBatchResult (admitstream.py appends them too).
RESULT_COLUMNS = (
    "decision", "reason", "retry_after_ms", "reserved_tokens", "reservation_id",
    "granted_max_tokens", "bucket_remaining", "hourly_remaining", "daily_remaining",
    "duplicate", "shadow_reason", "degraded", "retryable",
)  # fmt: skip
NOT_OWNER = "NOT_OWNER"  # ErrorInfo.reason (docs/api.md, "Errors")
_NOT_OWNER = int(Reason.NOT_OWNER)
_REJECT = int(Decision.REJECT)


def not_owner_status(r: Redirect) -> grpc.Status:
    where = f"replica at {r.address}" if r.address else "replica not known yet; retry shortly"
    return rich_status(
        grpc.StatusCode.UNAVAILABLE,
        f"pool {r.pool!r} (cell {r.cell!r}) is owned by another {where}",
        NOT_OWNER,
        metadata={"owner": r.address, "cell": r.cell, "epoch": str(r.epoch), "pool": r.pool},
        retry_delay_s=r.retry_s,
    )


async def redirect_if_not_owner(
    ownership: Ownership | None, pool: str, context: grpc.aio.ServicerContext
) -> None:
    """End the call with NOT_OWNER when ``pool``'s cell is owned elsewhere."""
    if ownership is None or ownership.local:
        return
    if pool:
        check_pool(pool)  # a bad name never reaches the lease table
    try:
        where = await ownership.route(pool)
    except ValueError as exc:  # a pool named like an explicit cell it is not in
        raise InvalidArgument("pool", str(exc)) from None
    if where is not None:
        await abort(context, not_owner_status(where))


async def ensure_shares(
    ownership: Ownership | None,
    svc: AdmissionService,
    tenant_ids: Iterable[str],
    timeout_s: float | None = None,
    wait: bool = True,
    check: Callable[[], None] | None = None,
) -> None:
    """Several replicas: wait (bounded) until this replica holds a share of
    each configured tenant named (controlplane/ha/shares.py), or with
    ``wait`` false only ask for one at once; one dict lookup per tenant
    when it holds them. ``check``: the request's validation, run before
    anything is asked for (bad input asks for nothing), and only then: the
    service validates every request anyway."""
    shares = ownership.shares if ownership is not None else None
    if shares is None:
        return
    wanted = {t for t in map(svc.shares.resolve, set(tenant_ids)) if t is not None}
    if any(not shares.ready(t) for t in wanted):
        if check is not None:
            check()
        if wait:
            await shares.ensure(wanted, timeout_s)
        else:
            shares.ask_soon(wanted)


async def batch_redirects(
    ownership: Ownership | None,
    svc: AdmissionService,
    batch: AdmitBatchColumns | pb.AdmitBatch,
    scope: KeyScope | None = None,
) -> dict[int, Redirect] | None:
    """The entries of ``batch`` owned elsewhere, by index; None when all
    are decided here (the common case: one check when the batch names its
    pool, one per distinct pool otherwise). A scoped key's tenants and
    pools are checked before any pool is routed (PERMISSION_DENIED claims
    no cell), as is the batch's pool's declaration (INVALID_ARGUMENT)."""
    if ownership is None or ownership.local:
        return None
    n = len(batch.tenant_id)
    if scope is not None:
        scope.check_tenants("tenant_id", list(batch.tenant_id))
    if batch.pool:
        check_pool(batch.pool)
        svc.replicas.check_pool(batch.pool)
    if batch.pool:
        pools = [batch.pool] * n
    else:
        lanes = list(batch.lane) or [""] * n
        prompt, max_tokens = list(batch.prompt_tokens), list(batch.max_tokens)
        if len(lanes) != n or len(prompt) != n or len(max_tokens) != n:
            return None  # malformed: the decision names the column
        tenants = list(batch.tenant_id)
        pool_of = svc.replicas.pool_of
        pools = [pool_of(tenants[i], lanes[i], prompt[i], max_tokens[i]) for i in range(n)]
    if scope is not None:
        for pool in dict.fromkeys(pools):
            scope.check_pool("pool", pool, f"entry {pools.index(pool)}'s pool")  # as the service
    routes: dict[str, Redirect | None] = {}
    for pool in set(pools):
        if pool:
            check_pool(pool)
        try:
            routes[pool] = await ownership.route(pool)
        except ValueError as exc:
            raise InvalidArgument("pool", str(exc)) from None
    if not any(routes.values()):
        return None
    out = {i: r for i, p in enumerate(pools) if (r := routes[p]) is not None}
    ownership.redirects_total += len(out) - sum(1 for r in routes.values() if r is not None)
    return out


def refusal(request_id: str, r: Redirect) -> AdmitDecision:
    """An entry's NOT_OWNER answer (nothing taken; retryable)."""
    return AdmitDecision(
        request_id=request_id, decision=Decision.REJECT, reason=Reason.NOT_OWNER,
        retry_after_ns=round(r.retry_s * 1e9), reserved_tokens=0, reservation_id=0,
        granted_max_tokens=0, bucket_remaining=0, hourly_remaining=0, daily_remaining=0,
        lane="", message=f"owned by {r.address or 'an unknown replica'}", retryable=True,
    )  # fmt: skip


def subset(batch: AdmitBatchColumns | pb.AdmitBatch, keep: list[int]) -> pb.AdmitBatch:
    """The entries ``keep`` of ``batch`` (its batch-wide fields as they are)."""
    out = pb.AdmitBatch(batch_id=batch.batch_id, model=batch.model, pool=batch.pool)
    for name in ("tenant_id", "request_id", "lane", "prompt_tokens", "max_tokens", "max_wait_ms",
                 "retry_key", "attempt"):  # fmt: skip
        column = list(getattr(batch, name))
        if len(column) == len(batch.tenant_id):
            getattr(out, name).extend(column[i] for i in keep)
        else:  # absent, or malformed: kept as is for the validation to name
            getattr(out, name).extend(column)
    return out


def expand(
    res: pb.AdmitBatchResult, n: int, keep: list[int], refused: dict[int, Redirect]
) -> pb.AdmitBatchResult:
    """The result of the decided entries ``keep`` widened to the whole batch
    of ``n``, the ``refused`` entries answered NOT_OWNER in their places."""
    out = pb.AdmitBatchResult()
    out.CopyFrom(res)
    pos = {i: k for k, i in enumerate(keep)}
    fills: dict[str, object] = {
        "decision": _REJECT, "reason": _NOT_OWNER, "retryable": True, "fallback_model": "",
        "admission_token": b"",
    }  # fmt: skip
    for name in (*RESULT_COLUMNS, "fallback_model", "queued", "admission_token"):
        column = list(getattr(res, name))
        if not column:
            continue
        blank = fills.get(name, 0)
        values = []
        for i in range(n):
            if i in pos:
                values.append(column[pos[i]])
            elif name == "retry_after_ms":
                values.append(round(refused[i].retry_s * 1000))
            else:
                values.append(blank)
        target = getattr(out, name)
        del target[:]
        target.extend(cast("list[int]", values))
    add_owner_column(out, n, refused)
    return out


def add_owner_column(res: pb.AdmitBatchResult, n: int, refused: dict[int, Redirect]) -> None:
    del res.owner[:]
    res.owner.extend(refused[i].address if i in refused else "" for i in range(n))


def cell_owners(ownership: Ownership, pool: str) -> pb.CellOwners:
    try:
        views, members = ownership.cells_view(pool)
    except ValueError as exc:
        raise InvalidArgument("pool", str(exc)) from None
    coord = ownership.coordinator
    return pb.CellOwners(
        cells=[
            pb.CellOwner(
                cell=v.cell,
                pools=list(v.pools),
                owner=v.owner,
                owner_address=v.address,
                epoch=v.epoch,
                lease_left_ms=int(v.lease_left_s * 1000),
            )
            for v in views
        ],
        members=[pb.Member(member_id=m, address=a) for m, a in sorted(members.items())],
        answered_by=coord.member_id if coord is not None else "",
    )
