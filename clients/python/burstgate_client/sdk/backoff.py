"""Backoff for refused callers: exponential with full jitter.

Three promises (tests/unit/sdk/test_backoff.py checks them as properties):

1. never sooner than the refusal's ``retry_after_ms``: the delay is
   ``max(retry_after, uniform(0, min(cap_s, base_s * 2**attempt)))``;
2. never for a refusal that is not ``retryable`` (MAX_TOKENS, unknown or
   disabled tenant): ``next_delay`` says give up (None);
3. never past the caller's deadline: a retry that would start at or after
   ``deadline_s`` (from the Backoff's creation) is not made, and
   :meth:`Backoff.admit` gives each attempt only the time left.

Full jitter (a uniform draw between 0 and the exponential ceiling) spreads
the retries of many refused callers instead of bunching them at the same
instants, as the burst that got them refused did. One Backoff per request:
it counts that request's attempts and owns its deadline.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from burstgate_client.sdk.model import Admission

if TYPE_CHECKING:
    from burstgate_client.sdk.aio import AsyncAdmissionClient
    from burstgate_client.sdk.sync import AdmissionClient


class Backoff:
    def __init__(
        self, *, base_s: float = 0.05, cap_s: float = 5.0, deadline_s: float | None = None,
        rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        for name, value in (("base_s", base_s), ("cap_s", cap_s)):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name}: must be > 0 and finite, got {value}")
        if cap_s < base_s:
            raise ValueError(f"cap_s: must be >= base_s ({base_s}), got {cap_s}")
        if deadline_s is not None and not (deadline_s > 0 and math.isfinite(deadline_s)):
            raise ValueError(f"deadline_s: must be > 0 and finite, got {deadline_s}")
        self.base_s, self.cap_s = base_s, cap_s
        self._rng = rng or random.Random()
        self._clock = clock
        self.deadline = None if deadline_s is None else clock() + deadline_s
        self.attempts = 0  # retries handed out so far

    def time_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - self._clock()

    def next_delay(self, admission: Admission) -> float | None:
        """Seconds to wait before retrying ``admission``'s request, or None:
        give up (admitted, not retryable, or the deadline would pass)."""
        if admission.admitted or not admission.retryable:
            return None
        ceiling = min(self.cap_s, self.base_s * 2.0 ** min(self.attempts, 64))
        delay = max(admission.retry_after_ms / 1000, self._rng.uniform(0, ceiling))
        left = self.time_left()
        if left is not None and delay >= left:
            return None
        self.attempts += 1
        return delay

    async def admit(
        self, client: AsyncAdmissionClient, tenant_id: str, request_id: str, **kw: Any
    ) -> Admission:
        """``client.admit`` with the same request_id until admitted, not
        retryable, or the deadline: the last answer. Each attempt's deadline
        is its own (``deadline_s`` in ``kw``, else the client's) cut to the
        time left."""
        per_try = kw.pop("deadline_s", None) or client.deadline_s
        while True:
            a = await client.admit(tenant_id, request_id, deadline_s=self._try_s(per_try), **kw)
            delay = self.next_delay(a)
            if delay is None:
                return a
            await asyncio.sleep(delay)

    def admit_sync(
        self, client: AdmissionClient, tenant_id: str, request_id: str, **kw: Any
    ) -> Admission:
        """:meth:`admit` for the synchronous client (sleeps the calling thread)."""
        per_try = kw.pop("deadline_s", None) or client.deadline_s
        while True:
            a = client.admit(tenant_id, request_id, deadline_s=self._try_s(per_try), **kw)
            delay = self.next_delay(a)
            if delay is None:
                return a
            time.sleep(delay)

    def _try_s(self, per_try: float) -> float:
        left = self.time_left()
        return max(per_try if left is None else min(per_try, left), 0.001)
