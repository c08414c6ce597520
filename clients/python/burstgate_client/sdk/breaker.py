"""Is the control plane reachable? A circuit breaker over one gRPC channel.

*Unreachable* means the channel fails: a call ends UNAVAILABLE, or
DEADLINE_EXCEEDED while the channel is not connected; an AdmitStream breaks,
or reads nothing for a second while it owes a first result (which comes at
once from a working server: a server or network gone silent, whose
connection may look READY for the keepalive's 15 s); or the short connect
check before opening a stream fails. A unary call that is
merely slow on a connected channel fails alone (its Complete is buffered).

When it trips, the breaker remembers "down" and every call fails fast (the
FailPolicy, a buffered Complete) without touching the network, so a down
control plane costs a request at most about its deadline and the ones after
it nothing. A probe task meanwhile checks with exponential backoff and full
jitter (``probe_min_s`` doubling to ``probe_max_s``): the channel must be
READY and a grpc.health.v1 Check (no credentials needed) must be answered
within ``PROBE_TIMEOUT_S`` (any answer: NOT_SERVING still answers). Then the
breaker closes and its listeners run (the completion spool delivers; the
next Admit opens a new AdmitStream). A server that is only slow thus costs a
short fail-fast spell, not a long one.

The channel itself reconnects with grpc core's backoff; :data:`CHANNEL_OPTIONS`
caps that at ``MAX_RECONNECT_MS`` so a control plane that comes back is
seen within about that long (grpc core's default cap is 120 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from burstgate_client.protoclient import KEEPALIVE_OPTIONS
from burstgate_client.sdk.counters import Counters

# asyncio.timeout, never asyncio.wait_for, here and in the rest of the SDK:
# Python 3.11's wait_for can swallow a cancellation that arrives as the
# awaited thing finishes, and a task that ignores its cancel hangs aclose().

log = logging.getLogger("burstgate.sdk")

PROBE_TIMEOUT_S = 0.5
MIN_RECONNECT_MS = 100
MAX_RECONNECT_MS = 2_000
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    *KEEPALIVE_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", MIN_RECONNECT_MS),
    ("grpc.min_reconnect_backoff_ms", MIN_RECONNECT_MS),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_MS),
]

# Status codes that say the call did not reach a deciding server...
TRANSPORT_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
# ...unless the server itself answered so: burstgate's errors carry
# google.rpc.Status details (UNAVAILABLE with reason LEDGER_UNAVAILABLE or
# OVERLOADED: reachable, but not able to do this now), the transport's never.
STATUS_DETAILS = "grpc-status-details-bin"


def server_answered(exc: grpc.aio.AioRpcError) -> bool:
    md = exc.trailing_metadata()
    return md is not None and any(key == STATUS_DETAILS for key, _ in md)


def unreachable(exc: BaseException | None) -> bool:
    """A failed call (or stream end) that says the control plane was not
    reached (None, or not a gRPC status: a stream that just ended)."""
    if not isinstance(exc, grpc.aio.AioRpcError):
        return True
    return exc.code() in TRANSPORT_CODES and not server_answered(exc)


class Breaker:
    def __init__(
        self,
        channel: grpc.aio.Channel,
        counters: Counters,
        *,
        probe_min_s: float = 0.05,
        probe_max_s: float = 2.0,
        rng: random.Random | None = None,
    ) -> None:
        self._channel = channel
        self._health = health_pb2_grpc.HealthStub(channel)
        self._counters = counters
        self._probe_min_s, self._probe_max_s = probe_min_s, probe_max_s
        self._rng = rng or random.Random()
        self.up = True
        self._probe: asyncio.Task[None] | None = None
        self._next_probe_at = 0.0
        self._listeners: list[Callable[[], None]] = []
        self._closed = False

    def on_up(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (on the loop) each time the breaker closes again."""
        self._listeners.append(fn)

    def trip(self, why: str) -> None:
        """Remember "down" until a probe finds the channel READY."""
        if not self.up or self._closed:
            return
        self.up = False
        self._counters.breaker_trips += 1
        log.warning("burstgate control plane unreachable (%s); failing fast until it is back", why)
        self._probe = asyncio.get_running_loop().create_task(self._probe_loop())

    def connected(self) -> bool:
        return bool(self._channel.get_state(try_to_connect=False) == grpc.ChannelConnectivity.READY)

    def failed(self, exc: grpc.aio.AioRpcError, why: str) -> None:
        """A unary call failed: trip when that says the channel failed
        (UNAVAILABLE from the transport; DEADLINE_EXCEEDED while not
        connected). A slow answer on a connected channel (a metered Complete
        waiting for a slow ledger write), or the server's own UNAVAILABLE, is
        that call's failure alone."""
        code = exc.code()
        if not unreachable(exc):
            return
        if code == grpc.StatusCode.UNAVAILABLE or (
            code == grpc.StatusCode.DEADLINE_EXCEEDED and not self.connected()
        ):
            self.trip(f"{why}: {code.name}")

    def retry_hint_ms(self) -> int:
        """How long until the breaker may close: the next probe, in ms."""
        loop = asyncio.get_running_loop()
        return max(1, int((self._next_probe_at - loop.time()) * 1000) + 1) if not self.up else 0

    async def connect(self, timeout_s: float) -> bool:
        """The short connect check: True once the channel is READY, False
        when it fails to connect (TRANSIENT_FAILURE) or ``timeout_s`` passes."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        state = self._channel.get_state(try_to_connect=True)
        while state != grpc.ChannelConnectivity.READY:
            left = end - loop.time()
            if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE or left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._channel.wait_for_state_change(state)
            state = self._channel.get_state(try_to_connect=True)
        return True

    async def _probe_loop(self) -> None:
        # Watch the channel's state, nudging it to connect at the backoff's
        # times; once READY, one health Check must be answered.
        loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            ceiling = min(self._probe_max_s, self._probe_min_s * 2**attempt)
            delay = self._rng.uniform(self._probe_min_s / 2, ceiling)
            self._next_probe_at = loop.time() + delay
            attempt += 1
            state = self._channel.get_state(try_to_connect=True)
            if state == grpc.ChannelConnectivity.READY:
                if await self._answers():
                    break
                await asyncio.sleep(delay)
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._channel.wait_for_state_change(state)
        self.up = True
        self._probe = None
        log.warning("burstgate control plane reachable again")
        for fn in self._listeners:
            try:
                fn()
            except Exception:  # a listener's bug must not keep the breaker down
                log.exception("breaker listener failed")

    async def _answers(self) -> bool:
        try:
            await self._health.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return exc.code() not in TRANSPORT_CODES
        return True

    async def aclose(self) -> None:
        self._closed = True
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
