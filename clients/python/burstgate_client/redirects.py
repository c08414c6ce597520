"""Following NOT_OWNER redirects (several replicas, docs/ha.md): shared by
the unary client and the SDK.

A replica that does not own a pool's cell answers UNAVAILABLE with an
ErrorInfo reason ``NOT_OWNER`` (metadata ``owner``: the owner's address, ""
while unknown) and a RetryInfo; an AdmitStream entry gets reason NOT_OWNER
and ``owner[i]``. Clients cache the owner per pool, resend there (request
ids make it idempotent), and stop after ``MAX_HOPS`` resends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

MAX_HOPS = 2  # resends after a NOT_OWNER (a cell moving twice meanwhile is rare)
NOT_OWNER = "NOT_OWNER"
UNKNOWN_OWNER_WAIT_S = 0.1  # the server's hint when the owner is not known yet


@dataclass(frozen=True, slots=True)
class NotOwner:
    """A NOT_OWNER answer: where to go ("" = unknown) and after how long."""

    owner: str
    cell: str
    pool: str
    retry_s: float


def targets(target: str | Sequence[str]) -> list[str]:
    """One or more control-plane addresses: a list, or comma-separated text
    ("cp-0:50051,cp-1:50051"); ValueError when none is given."""
    parts = target.split(",") if isinstance(target, str) else list(target)
    out = []
    for p in parts:
        p = p.strip()
        if p and p not in out:
            out.append(p)
    if not out:
        raise ValueError(f"target: at least one control-plane address is required, got {target!r}")
    return out


def owner_address(owners: Any) -> str:
    """The first owner address a GetCellOwners answer (``CellOwners``) names,
    "" when none is known yet."""
    for cell in owners.cells:
        if cell.owner_address:
            return str(cell.owner_address)
    return ""


def not_owner(exc: BaseException) -> NotOwner | None:
    """The redirect an RPC error carries, else None."""
    if not isinstance(exc, grpc.RpcError) or not hasattr(exc, "code"):
        return None
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    status = _status_details(exc)
    if status is None:
        return None
    info: error_details_pb2.ErrorInfo | None = None
    retry_s = UNKNOWN_OWNER_WAIT_S
    for detail in status.details:
        found = error_details_pb2.ErrorInfo()
        if detail.Unpack(found):  # False: another detail type
            info = found
            continue
        retry = error_details_pb2.RetryInfo()
        if detail.Unpack(retry):
            retry_s = retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9
    if info is None or info.reason != NOT_OWNER:
        return None
    md = info.metadata
    return NotOwner(md.get("owner", ""), md.get("cell", ""), md.get("pool", ""), retry_s)


def _status_details(exc: grpc.RpcError) -> status_pb2.Status | None:
    """The google.rpc.Status trailer of a sync or asyncio call's error."""
    try:
        trailers = exc.trailing_metadata()
        for key, value in trailers or ():
            if key == "grpc-status-details-bin":
                return status_pb2.Status.FromString(value)
    except Exception:  # a trailer that does not parse: not ours
        return None
    return None
