"""Completes made while the control plane is unreachable: buffered, then
delivered exactly once.

*Exactly once* rests on the server: Complete is idempotent per (tenant_id,
request_id) for the settled-id window (120 s by default; a replay answers
``duplicate=true`` and bills nothing), and with metering the ledger record is
durable before the answer, so redelivering a Complete whose answer was lost
never bills twice. The spool's part is to never lose one and never hold two
for the same request: it keeps one CompleteRequest per key (a second
``complete`` of a buffered request is answered ``duplicate=True`` locally),
removes it only when the server answered it (or refused it for good), and
delivers from one task, so a key is never in flight twice.

Bounded: at most ``max_items``. A Complete that does not fit is refused with
:class:`ControlPlaneUnavailable` (logged and counted in
``completes_spool_full``), never dropped silently. With a file
(spoolfile.py) every buffered Complete is durable before ``complete``
returns, and a restarted process delivers what the last one buffered.

Delivery runs in the background when the breaker closes (and on ``flush``),
up to ``CONCURRENCY`` Completes at once, oldest first. A transport failure
ends the round (the breaker trips; the next round starts when it closes, or
after a backoff with full jitter when the failure was not the channel's).
Answers that retrying cannot change (NOT_FOUND, FAILED_PRECONDITION,
INVALID_ARGUMENT) remove the Complete with an error line in the log and
``completes_undeliverable`` counted (see OFFLINE_RETRIES for the one
exception); anything else is retried. An UNAVAILABLE the server itself sent
(LEDGER_UNAVAILABLE, OVERLOADED) is retried without tripping the breaker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable

import grpc

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.sdk.breaker import Breaker
from burstgate_client.sdk.counters import Counters
from burstgate_client.sdk.model import ControlPlaneUnavailable
from burstgate_client.sdk.spoolfile import Key, SpoolFile, key_of

log = logging.getLogger("burstgate.sdk")

CONCURRENCY = 32
RETRY_MIN_S, RETRY_MAX_S = 0.1, 5.0
FINAL_CODES = frozenset(
    {
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
    }
)

# A Complete carrying ``offline`` that the server answers FAILED_PRECONDITION
# ("the request was refused"): the server still remembers a refusal of this
# id (a late answer the caller never saw, when its lane failed open), which
# it does for at most its rejection-replay time (1 s by default); after that
# it books the request. So it is retried, this many times, before it is
# given up like any final answer.
OFFLINE_RETRIES = 5

Send = Callable[[pb.CompleteRequest], Awaitable[pb.CompleteResponse]]


def offline_refused(exc: grpc.aio.AioRpcError, req: pb.CompleteRequest) -> bool:
    return exc.code() == grpc.StatusCode.FAILED_PRECONDITION and req.HasField("offline")


class CompletionSpool:
    def __init__(
        self, send: Send, breaker: Breaker, counters: Counters, *, max_items: int,
        file: SpoolFile | None = None, rng: random.Random | None = None,
    ) -> None:  # fmt: skip
        self._send, self._breaker, self._counters = send, breaker, counters
        self._max, self._file = max_items, file
        self._rng = rng or random.Random()
        self._items: dict[Key, pb.CompleteRequest] = {}
        self._refusals: dict[Key, int] = {}  # offline_refused answers so far
        self._wake = asyncio.Event()
        self._emptied = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        breaker.on_up(self.kick)

    def load(self) -> int:
        """Take in what the file holds from an earlier run; start delivering."""
        if self._file is not None:
            for req in self._file.load():
                self._items.setdefault(key_of(req), req)
        if self._items:
            log.warning("completion spool: %d Completes from an earlier run", len(self._items))
            self.kick()
        return len(self._items)

    @property
    def pending(self) -> int:
        return len(self._items)

    def __contains__(self, key: Key) -> bool:
        return key in self._items

    async def put(self, req: pb.CompleteRequest) -> bool:
        """Buffer ``req``; False when a Complete of the same request is
        already buffered (nothing is added). Raises ControlPlaneUnavailable
        when the spool is full."""
        key = key_of(req)
        if key in self._items:
            return False
        if len(self._items) >= self._max:
            self._counters.completes_spool_full += 1
            log.error(
                "completion spool full (%d pending): the Complete of tenant %r request %r is "
                "refused, not buffered", len(self._items), key[0], key[1],
            )  # fmt: skip
            raise ControlPlaneUnavailable(
                f"control plane unreachable and the completion spool is full ({self._max} "
                f"pending): the Complete of request {key[1]!r} was not buffered"
            )
        self._items[key] = req
        self._emptied.clear()
        if self._file is not None:
            with contextlib.suppress(OSError):  # logged by the file; it stays in memory
                await self._file.add(req)
        else:
            await asyncio.sleep(0)  # as every fail-fast path: never an await that never yields
        self.kick()
        return True

    def kick(self) -> None:
        """Deliver now (if the breaker is closed)."""
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._deliver_loop())

    async def flush(self, timeout_s: float | None) -> int:
        """Deliver what is buffered now; wait until it is all delivered or
        ``timeout_s`` passes. Returns how many were delivered meanwhile."""
        before = self._counters.completes_delivered_late + self._counters.completes_undeliverable
        if self._items:
            self.kick()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._emptied.wait()
        after = self._counters.completes_delivered_late + self._counters.completes_undeliverable
        return after - before

    async def _deliver_loop(self) -> None:
        failures = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._items and self._breaker.up:
                if await self._round():
                    failures = 0
                    continue
                failures += 1
                if not self._breaker.up:
                    break  # the breaker's on_up kicks the next round
                ceiling = min(RETRY_MAX_S, RETRY_MIN_S * 2**failures)
                await asyncio.sleep(self._rng.uniform(0, ceiling))
            if not self._items:
                self._emptied.set()

    async def _round(self) -> bool:
        """Deliver what is pending now, CONCURRENCY at a time; False when a
        delivery failed in a way worth retrying."""
        ok = True
        keys = list(self._items)
        for i in range(0, len(keys), CONCURRENCY):
            chunk = [k for k in keys[i : i + CONCURRENCY] if k in self._items]
            results = await asyncio.gather(*(self._deliver(k) for k in chunk))
            ok = all(results)
            if not ok:
                break
        return ok

    async def _deliver(self, key: Key) -> bool:
        req = self._items[key]
        try:
            await self._send(req)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            refused = offline_refused(exc, req)
            if refused:
                self._refusals[key] = self._refusals.get(key, 0) + 1
            if code not in FINAL_CODES or (refused and self._refusals[key] <= OFFLINE_RETRIES):
                self._breaker.failed(exc, "Complete (spooled)")
                log.info("completion spool: delivery failed (%s), will retry", code.name)
                return False
            self._counters.completes_undeliverable += 1
            log.error(
                "completion spool: the Complete of tenant %r request %r was refused for good "
                "(%s: %s); removed", key[0], key[1], code.name, exc.details(),
            )  # fmt: skip
        else:
            self._counters.completes_delivered_late += 1  # (late releases too)
        self._remove(key)
        return True

    def _remove(self, key: Key) -> None:
        self._refusals.pop(key, None)
        if self._items.pop(key, None) is not None and self._file is not None:
            self._file.done(key)
        if not self._items:
            self._emptied.set()

    async def aclose(self) -> None:
        if self._items:
            where = (
                f"kept in {self._file.path}" if self._file is not None else "LOST (no spool_path)"
            )
            log.error("completion spool: %d Completes undelivered at close, %s",
                      len(self._items), where)  # fmt: skip
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._file is not None:
            await asyncio.to_thread(self._file.close)
