"""Open admissions, and handing them to a pool's new owner (docs/ha.md,
"Re-announcing open reservations").

Every request the client admitted and has not completed is remembered
(:class:`OpenAdmissions`, bounded, oldest forgotten first) with what its
Admit answer said and the replica that admitted it. Reservations live only
in the memory of their pool's owner: when the owner changes (a NOT_OWNER
answer, or a failover from an unreachable replica), the new owner knows
nothing of them, so its gate would release new work on top of them and
their Completes would be booked as offline instead of refunded.

So before a call for a routing key goes to a replica other than the one
holding the key's open admissions, they are sent to it with
``Reannounce`` (batches of ``CHUNK``), and those it takes (RESTORED, or
KNOWN already) are moved to it: their Complete goes there. Entries it
answers NOT_OWNER are sent on to the owner it names (one hop); REFUSED ones
are moved too (their Complete will be booked as offline there, exactly once
by its ledger key). A failed call leaves them where they were: the next
call for the key tries again. The check on the hot path is two dict
lookups: the addresses the key's open admissions are at.

A crash: the client fails over from the dead owner while its lease still
runs, so the replica it reaches answers NOT_OWNER naming the dead one; it
takes the cell over when the lease runs out (on its tick, or claimed by the
next Admit). The entries still held by a replica known down are then sent
again every ``CHASE_EVERY_S``, in the background, for at most ``CHASE_S``
(beyond any lease TTL worth running), so they reach the new owner within
``CHASE_EVERY_S`` of its takeover — inside its gate's hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import grpc

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.sdk.breaker import TRANSPORT_CODES
from burstgate_client.sdk.counters import Counters
from burstgate_client.sdk.entries import Key

log = logging.getLogger("burstgate.sdk")

CHUNK = 1000  # entries per Reannounce call (the server takes up to its max batch)
CHASE_EVERY_S = 0.1
CHASE_S = 15.0
_TAKEN = frozenset({pb.REANNOUNCE_OUTCOME_RESTORED, pb.REANNOUNCE_OUTCOME_KNOWN})


class Admitted(NamedTuple):
    lane: str
    model: str
    pool: str
    offline: bool
    at_ns: int  # wall clock when admitted
    address: str = ""  # the replica that holds it ("" offline)
    route: str = ""  # the routing key it was admitted under
    prompt_tokens: int = 0
    max_tokens: int = 0
    reserved_tokens: int = 0
    granted_max_tokens: int = 0
    reservation_id: int = 0
    pricing_multiplier: str = ""
    admission_token: bytes = b""


def entry_of(key: Key, a: Admitted) -> pb.OpenReservation:
    """The entry re-announcing ``a``. Its multiplier, pricing window and
    admission time go in the server's signed token, not in the clear: an
    AdmitStream answer's pricing_multiplier is the batch's first pool's, and
    this process's clock is not the server's."""
    return pb.OpenReservation(
        tenant_id=key[0], request_id=key[1], lane=a.lane, pool=a.pool, model=a.model,
        prompt_tokens=a.prompt_tokens, max_tokens=a.max_tokens,
        reserved_tokens=a.reserved_tokens, granted_max_tokens=a.granted_max_tokens,
        reservation_id=a.reservation_id, admission_token=a.admission_token,
    )  # fmt: skip


class OpenAdmissions:
    """Admitted, not completed: by key, and per routing key the replicas
    they are at (how many at each)."""

    def __init__(self, max_items: int) -> None:
        self.items: dict[Key, Admitted] = {}
        self._max = max_items
        self._by_route: dict[str, dict[Key, None]] = {}
        self._where: dict[str, dict[str, int]] = {}
        self.completing: set[Key] = set()  # a Complete is on its way: not re-announced

    def __len__(self) -> int:
        return len(self.items)

    def get(self, key: Key) -> Admitted | None:
        return self.items.get(key)

    def add(self, key: Key, a: Admitted) -> None:
        # once per admission: the common case (a new key) without calls
        items = self.items
        if key in items:
            self.pop(key)  # (re)inserted last: a dict keeps insertion order
        items[key] = a
        address = a.address
        if address:
            route = a.route
            by_route = self._by_route.get(route)
            if by_route is None:
                by_route = self._by_route[route] = {}
            by_route[key] = None
            where = self._where.get(route)
            if where is None:
                where = self._where[route] = {}
            where[address] = where.get(address, 0) + 1
        if len(items) > self._max:  # never completed: forget the oldest
            self.pop(next(iter(items)))

    def pop(self, key: Key) -> Admitted | None:
        a = self.items.pop(key, None)
        if a is not None and a.address:
            self._by_route.get(a.route, {}).pop(key, None)
            where = self._where.get(a.route)
            if where is not None:
                left = where.get(a.address, 0) - 1
                if left > 0:
                    where[a.address] = left
                else:
                    where.pop(a.address, None)
                if not where:
                    del self._where[a.route]
                    self._by_route.pop(a.route, None)
        return a

    def elsewhere(self, route: str, address: str) -> bool:
        """Some open admission of ``route`` is held by another replica."""
        where = self._where.get(route)
        return where is not None and (len(where) > 1 or address not in where)

    def held_elsewhere(self, route: str, address: str) -> list[tuple[Key, Admitted]]:
        out = []
        for key in self._by_route.get(route, {}):
            a = self.items[key]
            if a.address != address and key not in self.completing:
                out.append((key, a))
        return out

    def move(self, key: Key, address: str) -> None:
        a = self.items.get(key)
        if a is not None and a.address and a.address != address:
            self.add(key, a._replace(address=address))


# (None: the replica is known down, nothing was sent)
Send = Callable[[str, pb.ReannounceRequest], Awaitable[pb.ReannounceResponse | None]]


class Reannouncer:
    """Sends a routing key's open admissions to the replica a call for it
    is about to go to, once per (key, replica) at a time."""

    def __init__(
        self, admissions: OpenAdmissions, send: Send, counters: Counters,
        down: Callable[[str], bool],
    ) -> None:  # fmt: skip
        """``down(address)``: that replica is known unreachable now."""
        self._open = admissions
        self._send = send
        self._counters = counters
        self._down = down
        self._running: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._chasing: dict[str, asyncio.Task[None]] = {}
        self._unsupported: set[str] = set()  # replicas without the RPC (older servers)

    def needed(self, route: str, address: str) -> bool:
        return self._open.elsewhere(route, address) and address not in self._unsupported

    async def before(self, route: str, address: str, budget_s: float) -> None:
        """Hand ``route``'s open admissions held elsewhere to ``address``,
        waiting at most ``budget_s`` (the rest goes on in the background)."""
        task = self._running.get((route, address))
        if task is None:
            task = asyncio.ensure_future(self._run(route, address))
            self._running[(route, address)] = task
            task.add_done_callback(lambda _: self._running.pop((route, address), None))
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            async with asyncio.timeout(max(0.0, budget_s)):
                await asyncio.shield(task)

    async def restore(self, key: Key, a: Admitted, address: str) -> bool:
        """Re-announce one admission to ``address``, which has just answered
        its Complete NOT_FOUND: the Complete overtook the hand-over (a
        background chase, or no Admit for the pool since the owner changed).
        True when ``address`` took it (RESTORED, or KNOWN): the Complete sent
        again is then refunded at the multiplier locked at admission, not
        booked as offline at the new owner's current one."""
        if not a.admission_token or address in self._unsupported or key not in self._open.items:
            return False
        taken: set[Key] = set()
        await self._call(address, [(key, a)], taken)  # NOT_OWNER: not followed here,
        return key in taken  # the Complete's own routing follows the owner named

    async def _run(self, route: str, address: str) -> None:
        await self._pass(route, address)
        if route not in self._chasing and self._stuck(route, address):
            task = asyncio.ensure_future(self._chase(route, address))
            self._chasing[route] = task
            task.add_done_callback(lambda _: self._chasing.pop(route, None))

    async def aclose(self) -> None:
        """Stop re-announcing (the client closes)."""
        tasks = [*self._running.values(), *self._chasing.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _stuck(self, route: str, address: str) -> bool:
        """Entries of ``route`` still held by a replica known down."""
        return any(self._down(a.address) for _, a in self._open.held_elsewhere(route, address))

    async def _chase(self, route: str, address: str) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + CHASE_S
        while loop.time() < end and self._stuck(route, address) and not self._down(address):
            await asyncio.sleep(CHASE_EVERY_S)
            await self._pass(route, address)

    async def _pass(self, route: str, address: str) -> None:
        entries = self._open.held_elsewhere(route, address)
        onward: dict[str, list[tuple[Key, Admitted]]] = {}
        for at in range(0, len(entries), CHUNK):
            part = entries[at : at + CHUNK]
            for owner, moved in (await self._call(address, part)).items():
                onward.setdefault(owner, []).extend(moved)
        for owner, part in onward.items():  # NOT_OWNER: one hop to the owner named
            if owner != address and owner not in self._unsupported:
                for at in range(0, len(part), CHUNK):
                    await self._call(owner, part[at : at + CHUNK])

    async def _call(
        self, address: str, part: list[tuple[Key, Admitted]], taken: set[Key] | None = None
    ) -> dict[str, list[tuple[Key, Admitted]]]:
        """One Reannounce; the entries answered NOT_OWNER, by the owner named
        (and into ``taken``, the keys ``address`` took)."""
        req = pb.ReannounceRequest(reservations=[entry_of(k, a) for k, a in part])
        try:
            res = await self._send(address, req)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._unsupported.add(address)
            elif exc.code() not in TRANSPORT_CODES:
                log.warning("re-announcing %d open reservations to %s failed: %s",
                            len(part), address, exc.details())  # fmt: skip
            self._counters.reannounce_failures += 1
            return {}
        if res is None:
            self._counters.reannounce_failures += 1
            return {}
        self._counters.reannounced += len(part)
        onward: dict[str, list[tuple[Key, Admitted]]] = {}
        owners = list(res.owner) if len(res.owner) == len(part) else [""] * len(part)
        for (key, a), outcome, owner in zip(part, res.outcome, owners, strict=False):
            if outcome == pb.REANNOUNCE_OUTCOME_NOT_OWNER:
                if owner and owner != a.address:
                    onward.setdefault(owner, []).append((key, a))
                continue
            if outcome in _TAKEN:
                self._counters.reannounce_restored += outcome == pb.REANNOUNCE_OUTCOME_RESTORED
                if taken is not None:
                    taken.add(key)
            self._open.move(key, address)  # its Complete goes there now
        return onward
