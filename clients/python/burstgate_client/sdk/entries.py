"""One Admit in flight (:class:`Entry`) and its callers (their futures).

An entry is keyed by (tenant_id, request_id): a second ``admit`` of the same
request while the first is in flight *joins* it (one entry, two waiters)
instead of sending the id twice, which the server would refuse inside one
AdmitBatch (``request_id[i]``) and, while the first waits in a queue, answer
with ALREADY_EXISTS. Each caller has its own deadline (deadlines.py); the entry lives
until the server answers it (or its stream fails), even when every waiter
has already been answered locally, so that a late server admission can be
recognised and released.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from burstgate_client.sdk.model import Admission

Key = tuple[str, str]


@dataclass(slots=True, eq=False)
class Entry:
    tenant_id: str
    request_id: str
    lane: str
    prompt_tokens: int
    max_tokens: int
    model: str
    pool: str
    deadline: float  # loop.time() by which the first caller wants its answer
    retry_key: str = ""  # the same on every attempt of one request (docs/gate.md)
    attempt: int = 0  # 0 the first, then 1, 2, ...
    waiters: list[asyncio.Future[Admission]] = field(default_factory=list)  # its callers
    sent: bool = False  # in an AdmitBatch (or a unary Admit) on the wire
    streamed: bool = False  # in an AdmitBatch: its first result comes at once
    queued: bool = False  # the server holds it in a queue; a release answers it
    queued_at: float = 0.0
    settled: bool = False  # the server answered, or its stream failed
    told_admitted: bool = False  # some caller was told "admitted" (by the server or fail-open)

    @property
    def key(self) -> Key:
        return (self.tenant_id, self.request_id)

    def live(self) -> bool:
        """Some caller still waits for this entry's answer."""
        for w in self.waiters:  # noqa: SIM110 - on the hot path: no generator
            if not w.done():
                return True
        return False

    def tell(self, admission: Admission) -> None:
        """Answer every caller still waiting."""
        for w in self.waiters:
            if not w.done():
                w.set_result(admission)
                if admission.admitted:
                    self.told_admitted = True

    def fail(self, exc: BaseException) -> None:
        for w in self.waiters:
            if not w.done():
                w.set_exception(exc)
