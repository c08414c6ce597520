"""Domain values <-> their burstgate.v1 wire forms, shared by the admission
RPCs (unary and streamed)."""

from __future__ import annotations

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb

from controlplane.domain import Degradation, Pressure
from controlplane.domain.units import NS_PER_MS


def ceil_ms(ns: int) -> int:
    """Nanoseconds as whole milliseconds, rounded up, as the batch's
    retry_after_ms column is (controlplane/service/decider.py): a client
    that waits the answer's retry_after_ms is never early."""
    return -(-ns // NS_PER_MS)


# The service's stale policy names (domain Policy.stale_policy; "" = fresh)
# and the ledger's miss-rate sources, as their wire enums.
STALE_POLICY = {
    "": pb.STALE_POLICY_UNSPECIFIED,
    "fail_open": pb.STALE_POLICY_FAIL_OPEN,
    "fail_closed": pb.STALE_POLICY_FAIL_CLOSED,
}
MISS_RATE_SOURCE = {
    "request": pb.MISS_RATE_SOURCE_REQUEST,
    "window": pb.MISS_RATE_SOURCE_WINDOW,
    "none": pb.MISS_RATE_SOURCE_NONE,
}


def pressure_pb(p: Pressure | None) -> pb.Pressure | None:
    return None if p is None else pressure_msg(p)


def pressure_msg(p: Pressure) -> pb.Pressure:
    return pb.Pressure(
        score=p.score,
        freshness=pb.PoolFreshness.ValueType(p.freshness),
        stale_policy=STALE_POLICY[p.stale_policy],
        shed=p.shed,
    )


def degradation_pb(g: Degradation | None) -> pb.Degradation | None:
    return None if g is None else degradation_msg(g)


def degradation_msg(g: Degradation) -> pb.Degradation:
    return pb.Degradation(
        active=True,
        max_tokens_cap=g.max_tokens_cap,
        page_after_tokens=g.page_after_tokens,
        fallback_model=g.fallback_model,
    )
