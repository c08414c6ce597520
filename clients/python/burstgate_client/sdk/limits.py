"""GetLimits, cached per tenant for ``ttl_s`` (the proto asks clients to
cache it for a few seconds: a sidecar fills rate-limit headers from it on
every response). Concurrent lookups of one tenant share one call."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.sdk.breaker import TRANSPORT_CODES, Breaker
from burstgate_client.sdk.checks import check_tenant_id
from burstgate_client.sdk.counters import Counters
from burstgate_client.sdk.model import Limits, limits_of

# Answers that mean "no limits to show" rather than a caller's mistake: the
# tenant does not exist, or the server predates GetLimits.
_NONE_CODES = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED})
MAX_CACHED = 10_000  # tenants; beyond it the expired entries are dropped


class LimitsCache:
    def __init__(
        self, stub: Any, metadata: tuple[tuple[str, str], ...] | None, breaker: Breaker,
        counters: Counters, *, ttl_s: float,
    ) -> None:  # fmt: skip
        if not ttl_s >= 0:
            raise ValueError(f"limits_ttl_s: must be >= 0, got {ttl_s}")
        self._stub, self._meta, self._breaker = stub, metadata, breaker
        self._counters, self._ttl_s = counters, ttl_s
        self._cache: dict[str, tuple[float, Limits | None]] = {}
        self._calls: dict[str, asyncio.Future[Limits | None]] = {}

    async def get(self, tenant_id: str, timeout_s: float) -> Limits | None:
        """The tenant's limits; None when unreachable, unknown, or the server
        has no GetLimits. Unknown tenants are cached too (as None)."""
        check_tenant_id(tenant_id)
        loop = asyncio.get_running_loop()
        hit = self._cache.get(tenant_id)
        if hit is not None and hit[0] > loop.time():
            return hit[1]
        if not self._breaker.up:
            self._counters.limits_failures += 1
            await asyncio.sleep(0)  # fail fast, but yield (see Batcher.admit)
            return None
        call = self._calls.get(tenant_id)
        if call is None:
            call = loop.create_future()
            self._calls[tenant_id] = call
            try:
                call.set_result(await self._fetch(tenant_id, timeout_s))
            except BaseException as exc:
                call.set_exception(exc)
                call.exception()  # retrieved: only this caller raises it
                raise
            finally:
                del self._calls[tenant_id]
            return call.result()
        return await asyncio.shield(call)

    async def _fetch(self, tenant_id: str, timeout_s: float) -> Limits | None:
        try:
            msg = await self._stub.GetLimits(
                pb.GetLimitsRequest(tenant_id=tenant_id), timeout=timeout_s,
                metadata=self._meta,
            )  # fmt: skip
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in TRANSPORT_CODES:
                self._breaker.failed(exc, "GetLimits")
                self._counters.limits_failures += 1
                return None
            if code in _NONE_CODES:
                self._remember(tenant_id, None)
                return None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(exc.details()) from None
            raise
        limits = limits_of(msg)
        self._remember(tenant_id, limits)
        return limits

    def _remember(self, tenant_id: str, limits: Limits | None) -> None:
        now = asyncio.get_running_loop().time()
        if len(self._cache) >= MAX_CACHED:  # many tenants: drop the expired ones
            self._cache = {t: v for t, v in self._cache.items() if v[0] > now}
        self._cache[tenant_id] = (now + self._ttl_s, limits)
