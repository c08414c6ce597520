"""Several control-plane replicas (docs/ha.md): a channel, breaker and
AdmitStream batcher per replica address, the owner of each pool as last
learned, and the routing every call goes through.

A call for a pool goes to its cached owner (else the first seed that is
up). A NOT_OWNER answer names the owner (else it is asked for with
GetCellOwners); the call is resent there, at most ``MAX_HOPS`` times. A
replica found unreachable is skipped for the next one that is up (a
failover), so losing one replica costs its callers one hop, not the
FailPolicy, once another one answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from burstgate_client.redirects import MAX_HOPS, not_owner, owner_address
from burstgate_client.sdk.batcher import Batcher
from burstgate_client.sdk.breaker import TRANSPORT_CODES, Breaker
from burstgate_client.sdk.counters import Counters

T = TypeVar("T")


@dataclass(eq=False)
class Replica:
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.AdmissionServiceStub
    breaker: Breaker
    batcher: Batcher


class AnyUp:
    """The breaker face of the whole set, for the completion spool: up
    while any replica is; ``on_up`` when one comes back; ``failed`` is a
    no-op (each call already told its own replica's breaker)."""

    def __init__(self, replicas: Replicas) -> None:
        self._replicas = replicas
        self.listeners: list[Callable[[], None]] = []

    @property
    def up(self) -> bool:
        # A seed not met yet counts as up, as a new breaker starts: with the
        # first replica down, a Complete must try the next seed, not go
        # straight to the spool.
        replicas = self._replicas
        return any(r.breaker.up for r in replicas.all()) or not replicas.seeds_met()

    def on_up(self, fn: Callable[[], None]) -> None:
        self.listeners.append(fn)
        for r in self._replicas.all():
            r.breaker.on_up(fn)

    def failed(self, exc: grpc.aio.AioRpcError, why: str) -> None:
        del exc, why

    def retry_hint_ms(self) -> int:
        return min((r.breaker.retry_hint_ms() for r in self._replicas.all()), default=0)


class Replicas:
    def __init__(
        self,
        seeds: list[str],
        make: Callable[[str], Replica],
        counters: Counters,
        metadata: tuple[tuple[str, str], ...] | None,
    ) -> None:
        self.seeds = seeds
        self._make = make
        self._counters = counters
        self._meta = metadata
        self._by_address: dict[str, Replica] = {}
        self.owners: dict[str, str] = {}  # routing key (pool) -> owner address
        # told (routing key, address) when a NOT_OWNER names a new owner
        self.on_moved: Callable[[str, str], None] | None = None
        self.any_up = AnyUp(self)
        self.home = self.get(seeds[0])

    def all(self) -> list[Replica]:
        return list(self._by_address.values())

    def seeds_met(self) -> bool:
        """Every seed address has its replica (channel, breaker) made."""
        return all(a in self._by_address for a in self.seeds)

    def get(self, address: str) -> Replica:
        r = self._by_address.get(address)
        if r is None:
            r = self._by_address[address] = self._make(address)
            for fn in self.any_up.listeners:
                r.breaker.on_up(fn)
        return r

    def first_up(self, skip: frozenset[str] | set[str] = frozenset()) -> Replica | None:
        for address in [*self.seeds, *self._by_address]:
            if address not in skip and self.get(address).breaker.up:
                return self.get(address)
        return None

    def for_key(self, key: str, prefer: str = "") -> Replica:
        """Where a call for ``key`` goes first."""
        address = prefer or self.owners.get(key)
        if address:
            r = self.get(address)
            if r.breaker.up:
                return r
        return self.first_up() or self.home

    async def discover(self, pool: str, skip: set[str]) -> str:
        """The owner of ``pool``'s cell, asked of the replicas up (GetCellOwners)."""
        if not pool:
            return ""
        for r in self.all():
            if r.address in skip or not r.breaker.up:
                continue
            try:
                owners = await r.stub.GetCellOwners(
                    pb.GetCellOwnersRequest(pool=pool), timeout=1.0, metadata=self._meta
                )
            except grpc.aio.AioRpcError:
                continue
            if address := owner_address(owners):
                self.owners[pool] = address
                return address
        return ""

    async def next_after(self, key: str, pool: str, r: Replica, exc: BaseException,
                         tried: set[str]) -> Replica | None:  # fmt: skip
        """Where to resend after ``exc`` from ``r`` (None: give up). A
        NOT_OWNER names (or lets us find) the owner; an unreachable replica
        is skipped for the next one up."""
        where = not_owner(exc)
        if where is not None:
            self._counters.redirects += 1
            address = where.owner or await self.discover(where.pool or pool, {r.address})
            if address:
                self.owners[key] = address
                if self.on_moved is not None:
                    self.on_moved(key, address)
                return self.get(address)
            self.owners.pop(key, None)
            await asyncio.sleep(where.retry_s)
            return self.first_up()
        if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in TRANSPORT_CODES:
            r.breaker.failed(exc, "routed call")
            tried.add(r.address)
            self.owners.pop(key, None)
            nxt = self.first_up(tried)
            if nxt is not None:
                self._counters.failovers += 1
            return nxt
        return None

    async def call(
        self, key: str, pool: str, fn: Callable[[Replica], Awaitable[T]], prefer: str = ""
    ) -> T:
        """``fn(replica)`` routed for ``key``, following NOT_OWNER and failing
        over at most MAX_HOPS times; the last error is raised."""
        r = self.for_key(key, prefer)
        tried: set[str] = set()
        for hop in range(MAX_HOPS + 1):
            try:
                return await fn(r)
            except grpc.aio.AioRpcError as exc:
                nxt = await self.next_after(key, pool, r, exc, tried) if hop < MAX_HOPS else None
                if nxt is None:
                    raise
                r = nxt
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        for r in self.all():
            await r.batcher.aclose()
        for r in self.all():
            await r.breaker.aclose()
            await r.channel.close()


def routing_key(pool: str, tenant_id: str, lane: str) -> str:
    """The owner cache's key: the pool when the caller names it, else the
    (tenant, lane) whose pool the server resolves."""
    return pool if pool else f"\0{tenant_id}\0{lane}"
