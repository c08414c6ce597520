"""Who gets which answer: the Admits in flight (by request), their callers'
deadlines, the lane's FailPolicy when the control plane did not answer, and
the release of an admission that came after its caller was refused.

- The server's answer (:meth:`Answers.settle`) goes to every caller still
  waiting. If it admits and no caller was told "admitted" (each was refused
  locally at its deadline, or left), ``on_release`` settles the reservation
  (a 0-token Complete, in the background) rather than leave the tenant's
  tokens held until the TTL.
- A caller's deadline (deadlines.py) with no answer yet: ``queue_timeout``
  if the server said it holds the request in its queue (the server is
  reachable, so FailPolicy does not apply), else the lane's FailPolicy; and
  ``on_silent(entry)`` for an entry sent on the stream whose batch's first
  result (which comes at once) is missing: the batcher checks whether the
  stream went silent.
- No answer will come (a broken stream): the lane's FailPolicy
  (:meth:`Answers.settle_offline`), for every caller still waiting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from burstgate_client.sdk.breaker import Breaker
from burstgate_client.sdk.counters import Counters
from burstgate_client.sdk.deadlines import Deadlines
from burstgate_client.sdk.entries import Entry, Key
from burstgate_client.sdk.model import (
    Admission,
    FailPolicy,
    gate_timeout_admission,
    offline_admission,
)


class Answers:
    def __init__(
        self, loop: asyncio.AbstractEventLoop, breaker: Breaker, counters: Counters,
        policy_of: Callable[[str], FailPolicy], on_release: Callable[[Entry], None],
        on_silent: Callable[[Entry], None],
    ) -> None:  # fmt: skip
        self._loop, self._breaker, self._counters = loop, breaker, counters
        self._policy_of, self._on_release, self._on_silent = policy_of, on_release, on_silent
        self.inflight: dict[Key, Entry] = {}
        self._deadlines = Deadlines(loop, self._expire)

    def wait(self, e: Entry, fut: asyncio.Future[Admission], at: float) -> None:
        """``fut`` is a caller of ``e`` who wants an answer by ``at``."""
        self._deadlines.add(at, e, fut)
        e.waiters.append(fut)

    def offline(self, e: Entry) -> Admission:
        """The lane's FailPolicy's answer for ``e``."""
        hint = self._breaker.retry_hint_ms() or 50
        a = offline_admission(e.request_id, self._policy_of(e.lane), e.max_tokens, hint)
        if a.admitted:
            self._counters.offline_admits += 1
        else:
            self._counters.offline_refusals += 1
        return a

    def _expire(self, e: Entry, fut: asyncio.Future[Admission]) -> None:
        if fut.done():
            return
        if e.queued:
            self._counters.gate_timeouts += 1
            waited = int((self._loop.time() - e.queued_at) * 1000)
            a = gate_timeout_admission(e.request_id, waited)
        else:
            if e.streamed and not e.settled:
                self._on_silent(e)
            a = self.offline(e)
        fut.set_result(a)
        if a.admitted:
            e.told_admitted = True
        if not e.sent and not e.live():
            self.forget(e)  # never left this process: nothing to wait for

    def forget(self, e: Entry) -> None:
        if self.inflight.get(e.key) is e:
            del self.inflight[e.key]

    def settle(self, e: Entry, a: Admission) -> None:
        """The server's answer for ``e``."""
        e.settled = True
        self.forget(e)
        e.tell(a)
        if a.admitted and not e.told_admitted:
            self._counters.late_releases += 1
            self._on_release(e)

    def settle_many(self, entries: list[Entry], answers: list[Admission]) -> None:
        """The server's answers, as :meth:`settle` each, inlined: once per
        decision on the stream's hot path."""
        inflight = self.inflight
        for e, a in zip(entries, answers, strict=True):
            e.settled = True
            key = (e.tenant_id, e.request_id)
            if inflight.get(key) is e:
                del inflight[key]
            told = e.told_admitted
            for w in e.waiters:
                if not w.done():
                    w.set_result(a)
                    told = told or a.admitted
            if a.admitted and not e.told_admitted:
                e.told_admitted = told
                if not told:
                    self._counters.late_releases += 1
                    self._on_release(e)

    def settle_offline(self, e: Entry) -> None:
        """No answer will come for ``e``: the lane's FailPolicy."""
        e.settled = True
        self.forget(e)
        if e.live():
            e.tell(self.offline(e))

    def waiting(self) -> list[asyncio.Future[Admission]]:
        return [w for e in list(self.inflight.values()) for w in e.waiters if not w.done()]

    def close(self) -> None:
        self._deadlines.close()
